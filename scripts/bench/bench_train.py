#!/usr/bin/env python3
"""Train-step speed of qwen35-jax against transformers' PyTorch model (logic: `qwen35_bench`).

    python scripts/bench/bench_train.py [--config small|large|long ...] [--steps 5] [--remat REMAT]
                                  [--cores [gdn attention]] [--breakdown] [--json out.json]
    python scripts/bench/bench_train.py --preset 0.8B --dtype bfloat16 --seq 8192 --skip-torch --peak-tflops 989

Both stacks train the same architecture (random weights) on the same batch of random tokens, one
document per row, with AdamW (lr 1e-4, betas 0.9/0.95, gradient clipping at norm 1), float32. Ours is
the jitted `qwen35_jax.train.make_train_step` (SFT loss, fused log-prob kernel); theirs is
transformers' `Qwen3_5ForCausalLM` on its default path (eager, default attention implementation)
with `labels=`, `loss.backward()`, `clip_grad_norm_` and `torch.optim.AdamW`. Each time is the
median of --steps steps after one warm-up step (ours compiles in it). Each stack runs every row in a
child process of its own, ours first, then theirs: in one process each library's spinning CPU
threads slow the other one down. The ratio is theirs / ours in time, i.e. ours / theirs in tokens
per second: above 1 means we are faster. Each round also times a plain transformers process
(`qwen35_bench/plain_transformers.py`: a user's loop, torch and transformers only) on every train
step beside theirs, and warns when the harness's transformers time is more than --anchor-tolerance
off it (`qwen35_bench/anchor.py`): the ratios are meant against transformers as its users run it.

--cores adds the sequence mixers alone, forward+backward at S = --core-seq: the GDN core
(`chunked_gated_delta_rule` vs transformers' `torch_chunk_gated_delta_rule`, H = 8, d = 128) and the
causal document-masked attention core (`attention_core` vs `scaled_dot_product_attention` with the
same boolean mask, 4 query / 2 kv heads of 64, 2 documents); `--cores gdn_local` the GDN rule's
chunk-local part alone (ours only: the Pallas kernels against the XLA ops). --peak-tflops adds the model FLOPs
utilisation of our step, with the model FLOPs the trainer logs (`qwen35_jax.train.flops.train_flops`:
every matmul of the forward pass, attention scores over the full S^2, times 3).
Each stack runs with what its users get by default: ours restarts with
GLIBC_TUNABLES=glibc.malloc.hugetlb=1 as scripts/train.py does (huge pages for XLA:CPU's scratch
buffers, `qwen35_jax/host_memory.py`), transformers runs in the environment it was given. Launch with
that variable set to give it to both; the header prints each stack's GLIBC_TUNABLES.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from qwen35_bench.train_step import CONFIGS, SETTINGS, SMALL
from qwen35_jax.config import PRESETS, SCAN_LAYERS_FLAGS
from qwen35_jax.train.options import CHOICES


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", nargs="+", choices=sorted(CONFIGS), default=["small"],
                   help="named configs to run, in order (default small); the flags below override the "
                        "first one's settings")
    p.add_argument("--preset", default=None,
                   help="instead of --config: a Qwen35Config preset (e.g. 0.8B), all its layers")
    for name in SETTINGS:
        p.add_argument(f"--{name.replace('_', '-')}", type=int, default=None,
                       help=f"override {name} (small: {SMALL[name]})")
    p.add_argument("--batch", type=int, default=None, help="rows per step (overrides the config's)")
    p.add_argument("--seq", type=int, default=None, help="tokens per row (overrides the config's)")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="our compute dtype, parameters float32 (default float32; transformers runs float32 only)")
    p.add_argument("--steps", type=int, default=5, help="timed steps per stack, after one warm-up (default 5)")
    p.add_argument("--remat", default=None,
                   help="Qwen35Config.remat of our model (default: the config's, auto): true/false or a "
                        "policy name")
    p.add_argument("--attention", choices=CHOICES["attention"], default="auto",
                   help="our attention kernel, as scripts/train.py's --attention (default auto: Pallas on GPU/TPU; "
                        "cudnn: GPU, bfloat16)")
    p.add_argument("--logprob-backend", choices=[b for b in CHOICES["logprob_backend"] if b != "reference"],
                   default="auto",
                   help="our fused log-prob backend, as scripts/train.py's (default auto: Pallas on TPU, XLA elsewhere)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="after the timed steps, trace one more step of ours with jax.profiler into DIR")
    p.add_argument("--scan-layers", choices=list(SCAN_LAYERS_FLAGS), default="auto",
                   help="Qwen35Config.scan_layers of our model: the blocks as one lax.scan (true) or one after "
                        "another (false); default auto: false on GPU unless whole blocks are recomputed, "
                        "true elsewhere")
    p.add_argument("--gdn-remat", default=None,
                   help="what our GDN mixers keep for the backward: auto, none or states (default auto: states "
                        "with the Pallas chunk scan, none otherwise)")
    p.add_argument("--gdn-precision", default=None,
                   help="matmul precision of our GDN core: auto, highest, high, default or bf16 (default: auto, "
                        "highest on CPU, default elsewhere)")
    p.add_argument("--gdn-chunk-scan", default=None,
                   help="how our GDN core carries its state over chunks: auto, sequential or associative "
                        "(default: auto, sequential on CPU, associative elsewhere)")
    p.add_argument("--cores", nargs="*", choices=["gdn", "attention", "gdn_local"], default=None,
                   help="also time the sequence mixers alone (no names: gdn and attention); gdn_local: the GDN "
                        "rule's chunk-local part, Pallas kernels against XLA ops, at each --core-precisions")
    p.add_argument("--cores-only", action="store_true", help="time --cores alone, no train step")
    p.add_argument("--core-seq", type=int, default=4096, help="sequence length of --cores (default 4096)")
    p.add_argument("--core-heads", type=int, default=8, help="GDN heads of --cores (default 8)")
    p.add_argument("--core-dim", type=int, default=128, help="GDN head dim of --cores (default 128)")
    p.add_argument("--core-precisions", nargs="+", default=None,
                   help="time the GDN core at each of these precisions, errors against the first")
    p.add_argument("--core-scans", nargs="+", default=None,
                   help="time the GDN core with each of these chunk scans (with every --core-precisions), "
                        "errors against the first variant")
    p.add_argument("--core-kernel-blocks", nargs="+", default=None, metavar="BV:WARPS",
                   help="time the GDN core's Pallas chunk-state kernels with each of these (state columns per "
                        "program, warps), e.g. 32:4 64:4 64:8 (with --core-scans pallas)")
    p.add_argument("--breakdown", action="store_true",
                   help="also time our pieces alone (each layer kind, mixer, MLP, delta rule, loss, model "
                        "body) on the first config's shapes")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="the device's peak TFLOP/s for our step's model FLOPs utilisation (MFU); default: the "
                        "trainer's table for known GPUs/TPUs (qwen35_jax.train.flops), none on CPU")
    p.add_argument("--skip-torch", action="store_true", help="time ours only (no ratios)")
    p.add_argument("--stack", choices=["both", "ours", "transformers"], default="both",
                   help="both (default): each stack in a child process of its own, ours first (in one "
                        "process the stack timed second runs slower: the other's CPU threads "
                        "keep spinning); ours / transformers: time that stack only, in this process")
    p.add_argument("--rounds", type=int, default=1,
                   help="with --stack both: time the two stacks' child processes this many times in turn "
                        "(ours, theirs, ours, theirs, ...) and report each row's median over rounds and every "
                        "round's ratio (default 1)")
    p.add_argument("--anchor-check", choices=["warn", "fail", "off"], default="warn",
                   help="with --stack both: each round also times a plain transformers process "
                        "(qwen35_bench/plain_transformers.py: torch and transformers only) on every train step "
                        "and compares the harness's transformers time with it; outside --anchor-tolerance, warn "
                        "(default) or exit 3 (fail); off: skip it")
    p.add_argument("--anchor-tolerance", type=float, default=0.10,
                   help="largest |harness / plain - 1| of the anchor check, median over rounds (default 0.10)")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    args = p.parse_args(argv)
    args.scan_layers = SCAN_LAYERS_FLAGS[args.scan_layers]
    args.run_ours = args.stack in ("both", "ours")
    args.run_torch = args.stack in ("both", "transformers") and not args.skip_torch
    if args.cores == []:
        args.cores = ["gdn", "attention"]
    if args.cores_only and not args.cores:
        p.error("--cores-only needs --cores")
    for name in ("steps", "rounds", "batch", "seq", "core_seq", "core_heads", "core_dim",
                 *SETTINGS):
        value = getattr(args, name)
        if value is not None and value < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if not 0 < args.anchor_tolerance < 1:
        p.error(f"--anchor-tolerance must be in (0, 1), got {args.anchor_tolerance}")
    if args.rounds > 1 and not (args.stack == "both" and args.run_torch):
        p.error("--rounds > 1 alternates both stacks: it needs --stack both without --skip-torch")
    if args.dtype != "float32" and not args.skip_torch:
        p.error("--dtype bfloat16 needs --skip-torch (the transformers side runs float32)")
    if args.preset is not None and args.preset not in PRESETS:
        p.error(f"unknown preset {args.preset!r}; choose one of {sorted(PRESETS)}")
    from qwen35_kernels.choices import GDN_CHUNK_SCANS, GDN_PRECISIONS, GDN_REMATS

    blocks = []
    for value in args.core_kernel_blocks or []:
        try:
            bv, warps = (int(x) for x in value.split(":"))
        except ValueError:
            p.error(f"--core-kernel-blocks takes BV:WARPS pairs such as 64:4, got {value!r}")
        blocks.append((bv, warps))
    args.core_kernel_blocks = blocks or None
    if args.gdn_remat is not None and args.gdn_remat not in GDN_REMATS:
        p.error(f"GDN remat {args.gdn_remat!r} is not one of {GDN_REMATS}")

    for value in [args.gdn_precision, *(args.core_precisions or [])]:
        if value is not None and value not in GDN_PRECISIONS:
            p.error(f"GDN precision {value!r} is not one of {GDN_PRECISIONS}")
    for value in [args.gdn_chunk_scan, *(args.core_scans or [])]:
        if value is not None and value not in GDN_CHUNK_SCANS:
            p.error(f"GDN chunk scan {value!r} is not one of {GDN_CHUNK_SCANS}")
    if args.run_ours and not args.cores_only:
        from qwen35_jax.kernel_choices import check_kernel_choices

        try:
            check_kernel_choices(args.attention, args.dtype, flag="--dtype")
        except ValueError as err:
            p.error(str(err))
    return args


def parse_remat(value: str | None) -> bool | str | None:
    if value is None:
        return None
    low = value.lower()
    if low in ("true", "on", "1"):
        return True
    if low in ("false", "off", "0"):
        return False
    return value


def runs(args: argparse.Namespace) -> list[tuple[str, object, int, int]]:
    """(name, Qwen35Config, batch, seq) of every train step to time."""
    from qwen35_bench.train_step import planned_runs

    overrides = {k: getattr(args, k) for k in SETTINGS if getattr(args, k) is not None}
    planned = planned_runs(args.config, preset=args.preset, overrides=overrides, batch=args.batch, seq=args.seq,
                           remat=parse_remat(args.remat), dtype=args.dtype, scan_layers=args.scan_layers)
    changes = getattr(args, "kernel_changes", {})  # the kernel flags, into each config's kernel choices
    return [(name, config.replace(kernels=config.kernels.replace(**changes)), batch, seq)
            for name, config, batch, seq in planned]


def time_rows(args: argparse.Namespace) -> tuple[list[dict], list[dict] | None]:
    """Every planned train step, then the cores, then the breakdown, in this process."""
    from qwen35_bench.breakdown import time_pieces
    from qwen35_bench.cores import time_attention_core, time_gdn_chunk_local, time_gdn_core
    from qwen35_bench.report import table
    from qwen35_bench.train_step import time_train_step

    rows, breakdown = [], None
    planned = [] if args.cores_only else runs(args)
    for name, config, batch, seq in planned:
        rows.append(time_train_step(name, config, batch, seq, steps=args.steps, ours=args.run_ours,
                                    theirs=args.run_torch, attention=args.attention,
                                    logprob_backend=args.logprob_backend, profile_dir=args.profile,
                                    peak_tflops=args.peak_tflops))
        print(table(rows[-1:]).splitlines()[-1], flush=True)
    both = dict(steps=args.steps, ours=args.run_ours, theirs=args.run_torch)
    if "gdn" in (args.cores or []):
        rows.append(time_gdn_core(args.core_seq, args.core_heads, args.core_dim, scans=args.core_scans,
                                  precisions=args.core_precisions, kernel_blocks=args.core_kernel_blocks, **both))
    if "attention" in (args.cores or []):
        rows.append(time_attention_core(args.core_seq, **both))
    if "gdn_local" in (args.cores or []) and args.run_ours:
        rows.append(time_gdn_chunk_local(args.core_seq, args.core_heads, args.core_dim, steps=args.steps,
                                         precisions=args.core_precisions))
    if args.breakdown and args.run_ours and planned:
        _, config, batch, seq = planned[0]
        breakdown = time_pieces(config, batch, seq, args.steps)
    return rows, breakdown


def run_isolated(args: argparse.Namespace, argv: list[str]
                 ) -> tuple[list[dict], list[dict] | None, dict[str, str | None]]:
    """Every row timed in child processes, `--stack ours` then `--stack transformers`, `args.rounds`
    times over, merged; and each child's GLIBC_TUNABLES. With several rounds a row keeps each round's
    ratio and reports the median over rounds: the machine's speed drifts within minutes, and
    alternating the stacks puts both through the same drift. Unless --anchor-check off, each round
    also times a plain transformers process on every train step (`qwen35_bench.anchor`) right beside
    the transformers child: after it in rounds 1, 3, ..., before it in rounds 2, 4, ...."""
    import subprocess
    import tempfile

    from qwen35_bench import anchor
    from qwen35_bench.report import merge_rounds

    planned = [] if args.cores_only or args.anchor_check == "off" else runs(args)
    per_round, plain = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            results = {}
            for stack in ("ours", "plain", "transformers") if r % 2 else ("ours", "transformers", "plain"):
                if stack == "plain":
                    if planned:
                        plain.append(anchor.run_plain(planned, args.steps, tmp, str(r)))
                    continue
                out = os.path.join(tmp, f"{stack}{r}.json")
                cmd = [sys.executable, os.path.abspath(__file__), *argv, "--stack", stack, "--rounds", "1",
                       "--json", out]
                if subprocess.run(cmd).returncode != 0:  # the child printed its error
                    raise SystemExit(f"bench_train: the {stack} child process failed")
                with open(out) as f:
                    results[stack] = json.load(f)
            per_round.append(results)
    by_round = [[{**theirs, **ours} for ours, theirs in zip(res["ours"]["runs"], res["transformers"]["runs"])]
                for res in per_round]
    rows = [merge_rounds(list(row_rounds)) for row_rounds in zip(*by_round)]
    anchor.attach(rows, by_round, plain)
    tunables = {stack: per_round[0][stack]["glibc_tunables"][stack] for stack in per_round[0]}
    return rows, per_round[0]["ours"]["breakdown"], tunables


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import jax

    from qwen35_bench.anchor import report as anchor_report
    from qwen35_bench.report import breakdown_table, table

    tunables = {"ours" if not args.run_torch else args.stack: os.environ.get("GLIBC_TUNABLES")}
    if args.stack == "both" and args.run_torch:
        rows, breakdown, tunables = run_isolated(args, sys.argv[1:] if argv is None else argv)
    else:
        chosen = {"gdn_precision": args.gdn_precision, "gdn_chunk_scan": args.gdn_chunk_scan,
                  "gdn_remat": args.gdn_remat}
        args.kernel_changes = {name: value for name, value in chosen.items() if value is not None}
        rows, breakdown = time_rows(args)  # our train steps take these choices into their configs
    threads = ""
    if args.run_torch:
        import torch

        threads = f", torch {torch.__version__} with {torch.get_num_threads()} threads"
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    malloc = ", ".join(f"{stack} {value or 'unset'}" for stack, value in tunables.items())
    print(f"\njax {jax.__version__} ({jax.default_backend()}){threads}, {os.cpu_count()} CPUs, GLIBC_TUNABLES: "
          f"{malloc}; load average "
          f"{load:.1f}; median of {args.steps} steps after a warm-up"
          + (f", median over {args.rounds} rounds of both stacks" if args.rounds > 1 else ""))
    print(table(rows))
    anchor_lines, anchor_ok = anchor_report(rows, args.anchor_tolerance)
    for line in anchor_lines:
        print(line)
    if not anchor_ok:
        print("bench_train: the anchor check failed (see above)", file=sys.stderr)
    if breakdown:
        print("\n" + breakdown_table(breakdown))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"runs": rows, "breakdown": breakdown, "load_average_1min": load,
                       "glibc_tunables": tunables, "xla_flags": os.environ.get("XLA_FLAGS"),
                       "anchor_ok": anchor_ok}, f, indent=1, default=str)
    return 3 if not anchor_ok and args.anchor_check == "fail" else 0


if __name__ == "__main__":
    args = parse_args()
    if args.run_ours and not args.run_torch:  # our stack alone: in the trainer's start-up environment
        from qwen35_jax.host_memory import restart_with_huge_pages

        restart_with_huge_pages()
    sys.exit(main())
