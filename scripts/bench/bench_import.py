#!/usr/bin/env python
"""Peak host memory (RSS) of importing a synthetic multi-GB Hugging Face checkpoint.

    python scripts/bench/bench_import.py [--preset 0.8B] [--dtype float32] [--workdir DIR] [--max-shard-size 2GB]

Writes a random checkpoint with the published shapes of --preset (HF names, shards + index) and
measures the two steps of scripts/import_hf.py in a fresh process, the peak reset between them:
`load_hf` (tensor by tensor onto the device) and `save_checkpoint` (orbax); then, in another fresh
process, a naive load that reads every tensor with `safetensors.numpy.load_file` before placing
it. On a CPU backend the "device" is host memory too, so the loaded parameters themselves count in
RSS; the overhead column is peak RSS minus the RSS before the step minus the new parameter bytes.
Linux only (reads /proc/self/status).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

_SIZE_UNITS = {"MB": 10**6, "GB": 10**9}


def _status(field: str) -> int:
    """A byte count from /proc/self/status (VmRSS: now, VmHWM: peak since start or last reset)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no {field} in /proc/self/status (this benchmark needs Linux)")


def _reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS


def make_checkpoint(directory: str, preset: str, dtype: str, max_shard_bytes: int) -> dict:
    import numpy as np

    from qwen35_jax.config import Qwen35Config
    from qwen35_jax.hf import names as N
    from qwen35_jax.hf.safetensors_io import DTYPE_TO_NP, TensorToWrite, write_checkpoint

    config = Qwen35Config.preset(preset, param_dtype=dtype).text_only()  # the text model's tensors, as measured before
    layout = N.Layout.default(config)
    tensors = []
    for entry in N.build_table(config, layout):
        for slot in entry.hf_names:
            for name, shape in zip(slot, entry.hf_shapes):
                def produce(shape=shape, seed=len(tensors)) -> np.ndarray:
                    x = np.random.default_rng(seed).standard_normal(shape, dtype=np.float32) * 0.02
                    return x.astype(DTYPE_TO_NP[layout.dtype])

                tensors.append(TensorToWrite(name, layout.dtype, shape, produce))
    os.makedirs(directory)
    files = write_checkpoint(directory, tensors, max_shard_bytes=max_shard_bytes)
    with open(os.path.join(directory, "config.json"), "w") as f:
        json.dump(config.to_hf_dict(), f)
    return {"bytes": sum(t.nbytes for t in tensors), "largest": max(t.nbytes for t in tensors),
            "tensors": len(tensors), "files": len(files)}


def child(mode: str, hf_dir: str, out_dir: str) -> None:
    """One measurement in this (fresh) process; prints a JSON line."""
    import jax
    import numpy as np
    from flax import nnx
    from safetensors.numpy import load_file

    from qwen35_jax.checkpoint import save_checkpoint
    from qwen35_jax.hf.load import load_hf
    from qwen35_jax.hf.safetensors_io import SafetensorsCheckpoint

    jax.devices()
    rows = []

    def measure(name: str, fn) -> Any:
        _reset_peak()
        base, t0 = _status("VmRSS"), time.perf_counter()
        result, nbytes = fn()
        rows.append({"mode": name, "base": base, "peak": _status("VmHWM"), "params": nbytes,
                     "seconds": time.perf_counter() - t0})
        return result

    def naive() -> tuple[None, int]:
        host = {}
        for path in SafetensorsCheckpoint(hf_dir).files:
            host.update(load_file(path))
        arrays = jax.block_until_ready([jax.device_put(x) for x in host.values()])
        return None, sum(x.nbytes for x in arrays)

    def load() -> tuple[Any, int]:
        model, config, ckpt = load_hf(hf_dir)
        params = jax.block_until_ready(jax.tree.leaves(nnx.state(model, nnx.Param)))
        return (model, config, ckpt), sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in params)

    if mode == "naive":
        measure("naive: load_file all, then device_put", naive)
    else:
        model, config, ckpt = measure("load_hf (tensor by tensor)", load)
        measure("save_checkpoint (orbax), after load_hf", lambda: (save_checkpoint(
            out_dir, model, config, layout=ckpt.layout, hf_config=ckpt.raw_config), 0))
    print(json.dumps(rows))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n\n".join(__doc__.split("\n\n")[1:]))
    p.add_argument("--preset", default="0.8B", help="model shapes (Qwen35Config.preset name), default 0.8B")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="checkpoint dtype")
    p.add_argument("--workdir", default=None, help="where to write the synthetic checkpoint (default: a temp dir)")
    p.add_argument("--max-shard-size", default="2GB", help="shard size of the synthetic checkpoint (MB/GB)")
    p.add_argument("--modes", default="import,naive", help="comma-separated: import (load_hf + orbax save), naive")
    p.add_argument("--child", nargs=3, metavar=("MODE", "HF_DIR", "OUT_DIR"), help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        child(*args.child)
        return 0

    size = args.max_shard_size.upper()
    unit = size[-2:]
    if unit not in _SIZE_UNITS:
        p.error(f"--max-shard-size {args.max_shard_size!r}: use e.g. 2GB or 500MB")
    shard_bytes = int(float(size[:-2]) * _SIZE_UNITS[unit])
    work = tempfile.mkdtemp(prefix="bench_import_", dir=args.workdir)
    try:
        hf_dir = os.path.join(work, "hf")
        t0 = time.perf_counter()
        info = make_checkpoint(hf_dir, args.preset, args.dtype, shard_bytes)
        print(f"synthetic {args.preset} {args.dtype}: {info['bytes'] / 1e9:.2f} GB in {info['files']} files, "
              f"{info['tensors']} tensors, largest {info['largest'] / 1e9:.2f} GB "
              f"(written in {time.perf_counter() - t0:.0f} s)", flush=True)
        env = {**os.environ, "JAX_PLATFORMS": os.environ.get("JAX_PLATFORMS", "cpu")}
        env.pop("XLA_FLAGS", None)
        rows = []
        for mode in args.modes.split(","):
            out_dir = os.path.join(work, f"out-{mode}")
            r = subprocess.run([sys.executable, __file__, "--child", mode, hf_dir, out_dir],
                               capture_output=True, text=True, env=env)
            if r.returncode != 0:
                print(f"bench_import: {mode} failed:\n{r.stderr[-2000:]}", file=sys.stderr)
                return 1
            rows += json.loads(r.stdout.strip().splitlines()[-1])
            shutil.rmtree(out_dir, ignore_errors=True)
        gb = 1e9
        print("\n| step | RSS before (GB) | peak RSS (GB) | new params (GB) | overhead (GB) | overhead / largest tensor "
              "| time (s) |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        for m in rows:
            over = m["peak"] - m["base"] - m["params"]
            print(f"| {m['mode']} | {m['base'] / gb:.2f} | {m['peak'] / gb:.2f} | {m['params'] / gb:.2f} | "
                  f"{over / gb:.2f} | {over / info['largest']:.2f} | {m['seconds']:.1f} |")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
