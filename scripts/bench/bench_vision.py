#!/usr/bin/env python3
"""Vision-tower training-step speed of qwen35-jax against transformers' `Qwen3_5VisionModel` on this CPU.

    python scripts/bench/bench_vision.py [--rounds 3] [--steps 5] [--json out.json]
    python scripts/bench/bench_vision.py --preset 0.8B --grid 1x32x32 --rounds 1 --steps 2

One step is the forward and backward pass of sum(tower(patches) * W) with respect to every parameter
of the tower, W a fixed random [P / merge_unit, out_hidden] array, float32. Both stacks hold the same
random weights (transformers' own initialisation, seed 0; ours copied from its state dict by
`qwen35_jax.vision.hf_weights.load_hf_state`) and see the same random patches. Ours is
`jax.jit(jax.value_and_grad(...))` of `qwen35_jax.vision.VisionTower` with our train step's compiler
options; theirs is eager PyTorch, `Qwen3_5VisionModel` with attn_implementation="sdpa" (what its users
get by default), `zero_grad()` and `backward()`, torch's thread count left at its default.

Default case: a small tower (4 blocks of 256, 4 heads, MLP 1024, 16 x 16 patches over 2 frames,
2 x 2 merge into 512, the published 48 x 48 position grid) on two images of 32 x 32 and 24 x 40
patches (1,984 patch rows); --preset NAME takes a published tower instead (`VisionConfig.preset`),
the size flags override either. Each stack runs in a child process of its own, ours first, then
theirs (in one process each library's spinning CPU threads slow the other one down); --rounds
repeats the pair, each stack's time is the median of its rounds' medians, and the ratio (theirs /
ours in time: above 1, ours is faster) the median of the rounds' paired ratios. Each child times
--steps steps after one warm-up step; ours also reports its compile time, timed alone before the
warm-up. Every round also times `qwen35_bench/plain_vision.py` (the same step, written as a
transformers user writes it: torch and transformers only, nothing of ours) beside the harness's
transformers child, alternating which goes first, and compares the two as bench_train's anchor check
does (`qwen35_bench.anchor`). Both stacks' loss values are printed side by side as a check that
they computed the same thing.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
PLAIN_SCRIPT = os.path.join(HERE, "qwen35_bench", "plain_vision.py")
# the small default tower: about 0.1-1 s a step on 2 vCPUs
SMALL = dict(depth=4, hidden_size=256, num_heads=4, intermediate_size=1024, patch_size=16, spatial_merge_size=2,
             out_hidden_size=512)
SMALL_GRID = ["1x32x32", "1x24x40"]
SIZE_FLAGS = {"depth": "depth", "hidden": "hidden_size", "heads": "num_heads", "intermediate": "intermediate_size",
              "patch": "patch_size", "merge": "spatial_merge_size", "out": "out_hidden_size",
              "positions": "num_position_embeddings"}


def parse_grid(text: str) -> list[int]:
    try:
        t, h, w = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--grid {text!r}: expected FRAMESxROWSxCOLS of patches, "
                                         "e.g. 1x32x32") from None
    if min(t, h, w) < 1:
        raise argparse.ArgumentTypeError(f"--grid {text!r}: every size must be >= 1")
    return [t, h, w]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default=None, help="a published tower (VisionConfig.preset, e.g. 0.8B) instead of "
                                                  "the small one")
    for flag, field in SIZE_FLAGS.items():
        p.add_argument(f"--{flag}", type=int, default=None, help=f"override the tower's {field}")
    p.add_argument("--grid", action="append", type=parse_grid, default=None,
                   help=f"an image's FRAMESxROWSxCOLS of patches, repeatable (default: {' '.join(SMALL_GRID)})")
    p.add_argument("--steps", type=int, default=5,
                   help="timed steps per stack and round, after one warm-up (default 5)")
    p.add_argument("--rounds", type=int, default=1, help="times the pair of child processes is run, ours then "
                                                         "theirs (default 1)")
    p.add_argument("--anchor-check", choices=["warn", "fail", "off"], default="warn",
                   help="each round also times a plain transformers process (qwen35_bench/plain_vision.py) and "
                        "compares the harness's transformers time with it; outside --anchor-tolerance warn "
                        "(default) or exit 3 (fail); off: skip it")
    p.add_argument("--anchor-tolerance", type=float, default=0.10,
                   help="largest |harness / plain - 1| of the anchor check, median over rounds (default 0.10)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--stack", choices=["both", "ours", "transformers"], default="both", help=argparse.SUPPRESS)
    p.add_argument("--inputs", default=None, help=argparse.SUPPRESS)  # a child's weights and inputs (.npz)
    args = p.parse_args(argv)
    for name in ("steps", "rounds", *SIZE_FLAGS):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name} must be >= 1, got {value}")
    if not 0 < args.anchor_tolerance < 1:
        p.error(f"--anchor-tolerance must be in (0, 1), got {args.anchor_tolerance}")
    if args.stack != "both" and not args.inputs:
        p.error("--stack ours / transformers are the child processes: they need --inputs")
    args.grid = args.grid or [parse_grid(g) for g in SMALL_GRID]
    try:
        from qwen35_jax.vision.layout import check_grid_thw

        args.config = build_config(args)
        check_grid_thw(args.grid, args.config)
    except ValueError as err:
        p.error(str(err))
    return args


def build_config(args: argparse.Namespace):
    """The VisionConfig to time: the preset or the small tower, with the size flags applied."""
    from qwen35_jax.vision.config import VisionConfig

    overrides = {field: getattr(args, flag) for flag, field in SIZE_FLAGS.items() if getattr(args, flag) is not None}
    if args.preset is not None:
        return VisionConfig.preset(args.preset, **overrides)
    return VisionConfig.preset("0.8B", **{**SMALL, **overrides})


def case_name(args: argparse.Namespace) -> str:
    return args.preset or "small"


def write_inputs(config, grid: list[list[int]], tmp: str) -> tuple[str, str, str, int]:
    """transformers' randomly initialised tower (seed 0), random patches and output weights, written once
    for every child: as .npz (the harness's children) and torch.save'd (the plain process). Returns the
    paths (npz, pt, config json) and the patch count."""
    import numpy as np
    import torch
    import transformers

    from qwen35_jax.vision.layout import count_patches

    num = count_patches(grid, config)
    raw = config.to_hf_dict()
    config_path = os.path.join(tmp, "vision_config.json")
    with open(config_path, "w") as f:
        json.dump(raw, f)
    raw.pop("model_type")
    torch.manual_seed(0)
    model = transformers.Qwen3_5VisionModel(transformers.Qwen3_5VisionConfig(**raw))
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    rng = np.random.default_rng(1)
    patches = rng.standard_normal((num, config.patch_dim), dtype=np.float32)
    weights = rng.standard_normal((num // config.merge_unit, config.out_hidden_size), dtype=np.float32)
    grid_thw = np.asarray(grid, np.int64)
    npz_path, pt_path = os.path.join(tmp, "inputs.npz"), os.path.join(tmp, "inputs.pt")
    np.savez(npz_path, patches=patches, weights=weights, grid_thw=grid_thw,
             **{f"state/{k}": v.numpy() for k, v in state.items()})
    torch.save({"state": state, "patches": torch.from_numpy(patches), "weights": torch.from_numpy(weights),
                "grid_thw": torch.from_numpy(grid_thw)}, pt_path)
    return npz_path, pt_path, config_path, num


def read_inputs(path: str) -> dict:
    import numpy as np

    with np.load(path) as z:
        data = {k: z[k] for k in z.files}
    data["state"] = {k[len("state/"):]: data.pop(k) for k in list(data) if k.startswith("state/")}
    return data


def time_ours(config, data: dict, steps: int) -> dict:
    """Our tower's jitted value_and_grad: compile time alone, then `time_side_by_side`."""
    import time

    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx
    from qwen35_bench.timing import jit_tuned, time_side_by_side

    from qwen35_jax.vision.hf_weights import load_hf_state
    from qwen35_jax.vision.layout import vision_layout
    from qwen35_jax.vision.tower import VisionTower

    tower = VisionTower(config, "float32", "float32", rngs=nnx.Rngs(0))
    load_hf_state(tower, data["state"])
    graphdef, params = nnx.split(tower)
    layout = [jnp.asarray(a, jnp.float32 if a.dtype == np.float64 else None)
              for a in vision_layout(data["grid_thw"], config)[:4]]
    patches, weights = jnp.asarray(data["patches"]), jnp.asarray(data["weights"])

    def loss(params, patches, weights, *layout):
        return jnp.sum(nnx.merge(graphdef, params)(patches, *layout) * weights)

    step = jit_tuned(jax.value_and_grad(loss))
    start = time.perf_counter()
    compiled = step.lower(params, patches, weights, *layout).compile()
    compile_s = time.perf_counter() - start
    result = time_side_by_side({"ours": lambda: jax.block_until_ready(compiled(params, patches, weights, *layout))},
                               steps)["ours"]
    value, grads = compiled(params, patches, weights, *layout)
    grad_norm = float(np.sqrt(sum(np.sum(np.square(np.asarray(g, np.float64))) for g in jax.tree.leaves(grads))))
    return {**result, "compile_s": compile_s, "loss": float(value), "grad_norm": grad_norm,
            "jax": jax.__version__, "backend": jax.default_backend()}


def time_theirs(config, data: dict, steps: int) -> dict:
    """transformers' tower, eager, sdpa: zero_grad, forward, backward of sum(pooler_output * W)."""
    import torch
    import transformers
    from qwen35_bench.timing import time_side_by_side

    raw = config.to_hf_dict()
    raw.pop("model_type")
    model = transformers.Qwen3_5VisionModel(transformers.Qwen3_5VisionConfig(**raw, attn_implementation="sdpa"))
    model.load_state_dict({k: torch.from_numpy(v) for k, v in data["state"].items()})
    model.train()
    patches, weights = torch.from_numpy(data["patches"]), torch.from_numpy(data["weights"])
    grid_thw = torch.from_numpy(data["grid_thw"])
    losses = []

    def step() -> None:
        model.zero_grad()
        out = model(patches, grid_thw=grid_thw).pooler_output
        total = (out * weights).sum()
        total.backward()
        losses[:] = [total.detach()]

    result = time_side_by_side({"transformers": step}, steps)["transformers"]
    grad_norm = float(sum(p.grad.double().square().sum() for p in model.parameters() if p.grad is not None) ** 0.5)
    return {**result, "loss": float(losses[-1]), "grad_norm": grad_norm, "threads": torch.get_num_threads(),
            "attn_implementation": model.config._attn_implementation, "torch": torch.__version__,
            "transformers": transformers.__version__}


def run_child(args: argparse.Namespace) -> int:
    """One stack, in this process: its timing dict to --json."""
    config, data = args.config, read_inputs(args.inputs)
    result = time_ours(config, data, args.steps) if args.stack == "ours" else time_theirs(config, data, args.steps)
    result["glibc_tunables"] = os.environ.get("GLIBC_TUNABLES")
    with open(args.json, "w") as f:
        json.dump(result, f)
    return 0


def run_plain(config_path: str, pt_path: str, steps: int, out: str) -> dict | None:
    """plain_vision.py in a process of its own (`-P`: its folder stays off sys.path); None if it failed."""
    cmd = [sys.executable, "-P", PLAIN_SCRIPT, config_path, pt_path, "--steps", str(steps), "--json", out]
    if subprocess.run(cmd, stdout=subprocess.DEVNULL).returncode != 0:  # its error went to stderr
        print("bench_vision: the plain transformers process failed: no anchor check this round", file=sys.stderr)
        return None
    with open(out) as f:
        return {**json.load(f), "load_average": os.getloadavg()[0]}


def run_rounds(args: argparse.Namespace, argv: list[str]) -> dict:
    """Every round: our child, then theirs and the plain process (theirs first in rounds 1, 3, ...)."""
    from qwen35_bench import anchor
    from qwen35_bench.report import merge_rounds

    grid = args.grid
    per_round, plain = [], []
    with tempfile.TemporaryDirectory() as tmp:
        npz_path, pt_path, config_path, num = write_inputs(args.config, grid, tmp)
        for r in range(args.rounds):
            results = {}
            for stack in ("ours", "plain", "transformers") if r % 2 else ("ours", "transformers", "plain"):
                out = os.path.join(tmp, f"{stack}{r}.json")
                if stack == "plain":
                    if args.anchor_check != "off":
                        plain.append(run_plain(config_path, pt_path, args.steps, out))
                    continue
                cmd = [sys.executable, os.path.abspath(__file__), *argv, "--stack", stack, "--rounds", "1",
                       "--inputs", npz_path, "--json", out]
                if subprocess.run(cmd).returncode != 0:  # the child printed its error
                    raise SystemExit(f"bench_vision: the {stack} child process failed")
                with open(out) as f:
                    results[stack] = json.load(f)
            per_round.append(results)
            ours, theirs = results["ours"]["median_s"], results["transformers"]["median_s"]
            print(f"round {r + 1}: ours {ours:.3f} s, transformers {theirs:.3f} s, {theirs / ours:.2f}x"
                  + (f", plain transformers {plain[-1]['median_s']:.3f} s" if plain and plain[-1] else "")
                  + f" (load {os.getloadavg()[0]:.2f})", flush=True)
    by_round = [{"config": case_name(args), "batch": len(grid), "seq": num, **res} for res in per_round]
    row = merge_rounds(by_round)
    if len(by_round) == 1:
        row["ours"]["round_ratios"] = [row["transformers"]["median_s"] / row["ours"]["median_s"]]
        row["ours"]["ratio"] = row["ours"]["round_ratios"][0]
    row["ours"]["compile_s"] = statistics.median(res["ours"]["compile_s"] for res in per_round)
    if plain and all(p is not None for p in plain):
        anchor.attach([row], [[r] for r in by_round], [[p] for p in plain])
    return row


def anchor_lines(row: dict, tolerance: float) -> tuple[list[str], bool]:
    """The anchor check's lines (harness / plain transformers, paired by round) and whether it passed."""
    a = row.get("anchor")
    if a is None:
        return [], True
    ok = abs(a["ratio"] - 1) <= tolerance
    t = row["transformers"]
    lines = [f"\nanchor check: transformers in the harness's child / in a plain transformers process "
             f"({os.path.basename(PLAIN_SCRIPT)}), paired by round, tolerance {tolerance:.0%}:",
             f"  harness {t['median_s']:.3f} s ({t['min_s']:.3f}-{t['max_s']:.3f}), plain {a['plain_median_s']:.3f} s "
             f"({a['plain_min_s']:.3f}-{a['plain_max_s']:.3f}), {a['plain_threads']} threads: {a['ratio']:.2f}x "
             f"(rounds: {', '.join(f'{x:.2f}' for x in a['round_ratios'])}) {'ok' if ok else 'OUTSIDE TOLERANCE'}"]
    if not ok:
        lines.append("WARNING: the harness's transformers time is not a plain transformers process's: on a loaded "
                     "machine torch's spinning threads slow down far more than XLA's; re-run at a load average near "
                     "0 before quoting the ratio.")
    return lines, ok


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.stack != "both":
        return run_child(args)
    load_before = open("/proc/loadavg").read().strip() if os.path.exists("/proc/loadavg") else None
    cfg = args.config
    print(f"vision tower {case_name(args)}: depth {cfg.depth}, hidden {cfg.hidden_size}, {cfg.num_heads} heads, "
          f"MLP {cfg.intermediate_size}, patch {cfg.patch_size}, merge {cfg.spatial_merge_size}, out "
          f"{cfg.out_hidden_size}; images {' '.join('x'.join(map(str, g)) for g in args.grid)}; float32; "
          f"{os.cpu_count()} CPUs; load average {load_before}", flush=True)
    row = run_rounds(args, argv)
    load_after = open("/proc/loadavg").read().strip() if os.path.exists("/proc/loadavg") else None
    ours, theirs = row["ours"], row["transformers"]
    rounds = ", ".join(f"{x:.2f}" for x in ours["round_ratios"])
    print(f"\n{row['batch']} images, {row['seq']} patches; median of {args.steps} steps after a warm-up, median "
          f"over {args.rounds} round(s); torch {theirs['torch']} with {theirs['threads']} threads "
          f"({theirs['attn_implementation']}), jax {ours['jax']} ({ours['backend']})")
    print(f"  ours          {ours['median_s']:.3f} s ({ours['min_s']:.3f}-{ours['max_s']:.3f}); compile "
          f"{ours['compile_s']:.1f} s")
    print(f"  transformers  {theirs['median_s']:.3f} s ({theirs['min_s']:.3f}-{theirs['max_s']:.3f})")
    print(f"  transformers / ours: {ours['ratio']:.2f}x (rounds: {rounds}); above 1, ours is faster")
    rel = abs(ours["loss"] - theirs["loss"]) / max(abs(theirs["loss"]), 1e-30)
    grad_rel = abs(ours["grad_norm"] - theirs["grad_norm"]) / max(theirs["grad_norm"], 1e-30)
    print(f"  same step: loss {ours['loss']:.6g} (ours) vs {theirs['loss']:.6g} (transformers), rel diff {rel:.1e}; "
          f"gradient norm {ours['grad_norm']:.6g} vs {theirs['grad_norm']:.6g}, rel diff {grad_rel:.1e}")
    lines, anchor_ok = anchor_lines(row, args.anchor_tolerance)
    for line in lines:
        print(line)
    print(f"load average before {load_before}, after {load_after}")
    if args.json:
        result = {"case": case_name(args), "config": cfg.to_hf_dict(), "grid_thw": args.grid, "patches": row["seq"],
                  "steps": args.steps, "rounds": args.rounds, "cpus": os.cpu_count(), "ours": ours,
                  "transformers": theirs, "ratio": ours["ratio"], "round_ratios": ours["round_ratios"],
                  "loss_rel_diff": rel, "grad_norm_rel_diff": grad_rel, "anchor": row.get("anchor"),
                  "anchor_ok": anchor_ok, "load_average_before": load_before, "load_average_after": load_after}
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if not anchor_ok:
        print("bench_vision: the anchor check failed (see above)", file=sys.stderr)
    return 3 if not anchor_ok and args.anchor_check == "fail" else 0


if __name__ == "__main__":
    sys.path.insert(0, HERE)
    if sys.argv[sys.argv.index("--stack") + 1:][:1] == ["ours"] if "--stack" in sys.argv else False:
        # our child: in the trainer's start-up environment (huge-page malloc, as scripts/train.py)
        from qwen35_jax.host_memory import restart_with_huge_pages

        restart_with_huge_pages()
    sys.exit(main())
