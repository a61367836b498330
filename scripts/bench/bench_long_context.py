#!/usr/bin/env python3
"""The longest sequence whose whole train step fits a device, by compile-time memory analysis.

    python scripts/bench/bench_long_context.py --preset 9B --mesh fsdp=1,sp=8 --device-memory 141GB
    python scripts/bench/bench_long_context.py --preset 0.8B --mesh fsdp=1,sp=1 --seq 262144 --json
    python scripts/bench/bench_long_context.py --preset 9B --mesh fsdp=1,sp=8 --target h200
    python scripts/bench/bench_long_context.py --preset 9B --mesh fsdp=2,sp=8 --target v5p
    python scripts/bench/bench_long_context.py --preset 9B --mesh fsdp=1,sp=8 --seq 32768 --image-patches 4096

The step: sequence-sharded forward, fused log-prob loss, gradients, clipping and AdamW, float32
master weights and moments ZeRO-3 sharded, bf16 compute, one sequence per fsdp row. It is lowered
from abstract inputs (nothing is allocated) and compiled; per device it needs arguments + outputs +
temporaries - aliased bytes (`memory_analysis()`). Without --seq the longest S that fits
--device-memory is searched (powers of two, then refined; every length reported was compiled).
On a CPU host the devices are simulated; XLA:CPU buffers differently from XLA:GPU, so the figure is
an estimate; with --target h100|h200 XLA:GPU itself compiles the step for that GPU (no GPU needed,
`pip install -e ".[gpu-compile]"`), with --target v4|v5e|v5p|v6e XLA:TPU for a slice of those TPU
chips (no TPU needed, `pip install -e ".[tpu-compile]"`), and the figure is the device's own. Without
a TPU target the program traced is the one a GPU runs: the Pallas attention and GDN chunk-state
kernels (interpret mode on CPU), `scan_layers` resolved as on a GPU; with one, the TPU's.
"""

import argparse
import json
import os
import sys


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="9B", help="Qwen35Config preset (default 9B)")
    parser.add_argument("--mesh", default="fsdp=1,sp=8", help="device mesh 'fsdp=F,sp=S' (default fsdp=1,sp=8)")
    parser.add_argument("--device-memory", default=None,
                        help="bytes per device, e.g. 141GB or 80GiB (default: the --target's, else 141GB)")
    parser.add_argument("--target", default=None, help="compile for this device instead of this machine's: a GPU "
                        "(h100, h200; needs pip install -e '.[gpu-compile]') or a TPU chip (v4, v5e, v5p, v6e; "
                        "needs pip install -e '.[tpu-compile]'), no GPU or TPU needed")
    parser.add_argument("--seq", type=int, help="check this one length instead of searching")
    parser.add_argument("--remat", default="nested", help="remat policy (default nested; see REMAT_POLICIES)")
    parser.add_argument("--gdn-mode", default="all_to_all", help="GDN sp mode: all_to_all or state_passing")
    parser.add_argument("--scan-layers", default="auto", help="auto, true (the repeating block compiled once and "
                        "scanned) or false (the blocks one after another); auto: as the target's platform "
                        "resolves it (a GPU's without --target)")
    parser.add_argument("--tile", type=int, default=8192, help="sequence tile in tokens, 0 = untiled (default 8192)")
    parser.add_argument("--start", type=int, help="first power of two of the search (default from the budget)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--devices", type=int, default=8, help="simulated CPU devices when on CPU (default 8)")
    parser.add_argument("--image-patches", type=int, default=None,
                        help="also one bucket of this many image patches through the preset's vision tower "
                             "(a 1024 x 1024 image at patch 16: 4096); default: the text model alone")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.target:  # the CUDA plugin or libtpu loads either way; this keeps it from looking for a device
        os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu" and "device_count" not in os.environ.get("XLA_FLAGS", ""):
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                                   + f" --xla_force_host_platform_device_count={args.devices}").strip()
    from qwen35_jax.memory.report import run

    device_memory = args.device_memory or (None if args.target else "141GB")
    result = run(preset=args.preset, mesh=args.mesh, device_memory=device_memory, seq=args.seq,
                 remat=args.remat, gdn_mode=args.gdn_mode, tile=args.tile or None, start=args.start,
                 target=args.target, scan_layers=args.scan_layers, image_patches=args.image_patches,
                 log=None if args.json else print)
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (ValueError, RuntimeError) as err:
        print(f"bench_long_context: {err}", file=sys.stderr)
        sys.exit(2)
