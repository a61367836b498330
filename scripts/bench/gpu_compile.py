#!/usr/bin/env python3
"""Compile the trainer's step for an H100 or H200 that is not here: its memory, its kernels, its
roofline.

    pip install -e ".[gpu-compile]"
    python scripts/bench/gpu_compile.py --preset 0.8B --target h200 --seq 8192
    python scripts/bench/gpu_compile.py --preset 9B --target h100 --mesh fsdp=2,sp=4 --seq 65536 --remat full
    python scripts/bench/gpu_compile.py --from-hlo out/train_step_hlo.txt.gz   # a GPU's own program, read

XLA:GPU compiles the step (sequence-sharded forward, fused log-prob loss, gradients, clipping, AdamW,
float32 master weights and moments ZeRO-3 sharded, bf16 compute) for compile-only devices of the
target, exactly as on the device: the per-device memory is the device's own figure. The optimised
program is then read kernel by kernel (`qwen35_bench.hlo_census`): bytes moved, dot FLOPs and the
source line behind each, and the least time each could take at the datasheet's rates. Nothing runs:
the times are lower bounds, not measurements. --from-hlo reads a program instead of compiling one
(the optimised HLO `scripts/device_check.sh` brings back from a GPU), to set the roofline beside the
profile of the same program.
"""

import argparse
import json
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="0.8B", help="Qwen35Config preset (default 0.8B)")
    p.add_argument("--target", default="h200", help="GPU to compile for: h100 or h200 (default h200)")
    p.add_argument("--seq", type=int, default=8192, help="tokens per row (default 8192)")
    p.add_argument("--batch", type=int, default=1, help="rows per step, a multiple of fsdp (default 1)")
    p.add_argument("--mesh", default="fsdp=1,sp=1", help="device mesh 'fsdp=F,sp=S' (default fsdp=1,sp=1)")
    p.add_argument("--remat", default="none", help="remat policy (default none; see REMAT_POLICIES)")
    p.add_argument("--scan-layers", default="auto",
                   help="blocks as one scan (true) or one after another (false); auto: as a GPU trainer runs them")
    p.add_argument("--attention", default="auto", help="attention kernel: auto, pallas, cudnn or xla (default auto)")
    p.add_argument("--gdn-mode", default="all_to_all", help="GDN sp mode: all_to_all or state_passing")
    p.add_argument("--gdn-precision", default=None, help="GDN chunked-form matmul precision (default: the GPU's)")
    p.add_argument("--gdn-remat", default=None, help="what GDN mixers keep for the backward: auto, none or states")
    p.add_argument("--logprob-backend", default="auto",
                   help="fused log-prob kernel: auto, xla, pallas or pallas_xla (default auto: xla on GPU)")
    p.add_argument("--top", type=int, default=25, help="source lines listed (default 25)")
    p.add_argument("--hlo", default=None, metavar="PATH", help="also write the optimised HLO here")
    p.add_argument("--from-hlo", default=None, metavar="PATH",
                   help="read this optimised HLO text (.gz allowed) instead of compiling; needs no plugin")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    # the CUDA plugin registers its compiler either way; this keeps it from looking for a device
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    from qwen35_bench.gpu_compile import run

    result = run(preset=args.preset, target=args.target, seq=args.seq, batch=args.batch, mesh=args.mesh,
                 remat=args.remat, scan_layers=args.scan_layers, attention=args.attention, gdn_mode=args.gdn_mode,
                 gdn_precision=args.gdn_precision, top=args.top, hlo_path=args.hlo, from_hlo=args.from_hlo,
                 gdn_remat=args.gdn_remat, logprob_backend=args.logprob_backend,
                 log=None if args.json else print)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, RuntimeError, OSError) as err:
        print(f"gpu_compile: {err}", file=sys.stderr)
        sys.exit(2)
