#!/usr/bin/env python3
"""Train a Qwen3.5 model (SFT or PPO/GRPO) on an (fsdp, sp) device mesh; resumable run directories.

    python scripts/train.py                                   # the demo: tiny model, bundled corpus, runs/demo
    python scripts/train.py --demo grpo                       # online RL demo: digit reversal, runs/demo-grpo
    python scripts/train.py --demo vision                     # a tiny VLM names shapes: SFT + GRPO, runs/demo-vision
    python scripts/train.py (--model DIR | --preset NAME) (--data PATH... | --synthetic) --out RUN [options]
    python scripts/train.py --config RUN/config.yaml          # resume RUN (or any YAML/JSON options file)

RUN is the run directory: a new one starts the run; one holding this run resumes it from its newest
complete checkpoint (settings that define the run must match; how it runs - mesh, kernels, steps,
checkpoint cadence - may change). It holds config.yaml, checkpoints/<step>/, metrics.jsonl,
TensorBoard events and loss.png. SIGTERM or Ctrl-C finishes the current step and saves.
Every option is below; docs/training.md explains them.
"""

import sys


def main(argv: list[str] | None = None) -> int:
    from qwen35_jax.train.signals import StopRequest

    argv = sys.argv[1:] if argv is None else list(argv)
    with StopRequest() as stop:  # before jax loads: a SIGTERM during set-up is a clean stop too
        if argv[:1] == ["--demo"]:
            if argv[1:] not in (["sft"], ["grpo"], ["vision"]):
                print("error: --demo takes sft (the default demo), grpo or vision, and nothing else", file=sys.stderr)
                return 2
            if argv[1] in ("grpo", "vision"):
                from importlib import import_module

                run_demo = import_module(f"qwen35_jax.demos.{argv[1]}").run_demo
                try:
                    return run_demo(stop)
                except ValueError as err:
                    print(f"error: {err}", file=sys.stderr)
                    return 2
            argv = []
        from qwen35_jax.demos import sft as demo
        from qwen35_jax.train.options import TrainOptions, build_parser, given_values

        parser = build_parser(description=__doc__.split("\n\n")[0], epilog=__doc__.split("\n\n", 1)[1])
        try:
            values = given_values(argv, parser)
            is_demo = demo.is_demo(values)
            options = TrainOptions(**({**demo.demo_defaults(), **values} if is_demo else values))
            from qwen35_jax.objectives import objective_for
            from qwen35_jax.train.loop import train
            code = train(options, stop, objective_for(options.objective))  # --objective picks what is trained
            if is_demo and code == 0 and stop.signal_name is None:
                demo.report(options)
            return code
        except ValueError as err:
            print(f"error: {err}", file=sys.stderr)
            return 2


if __name__ == "__main__":
    from qwen35_jax.host_memory import restart_with_huge_pages

    restart_with_huge_pages()  # once, before anything starts: glibc reads its tunables at start-up
    sys.exit(main())
