"""Fused log-prob/entropy benchmark: compile-time scratch memory and wall time of forward+backward.

Compares the backends of qwen35_kernels.linear_logprob_entropy (reference = full [T, V] logits, xla =
tiled custom VJP, optionally pallas) and tokamax's linear_softmax_cross_entropy_loss (cross-entropy only,
if importable) at the lm_head shape of Qwen3.5 (V = 248,320). Memory comes from
jax.jit(f).lower(...).compile().memory_analysis() and needs no allocation; timing allocates the inputs
and runs `--repeats` forward+backward steps after one warm-up.

    python scripts/bench/bench_logprob.py --T 1024 4096 16384 --skip-time
    python scripts/bench/bench_logprob.py --T 1024 --repeats 2 --backends reference xla tokamax
    python scripts/bench/bench_logprob.py --sharded fsdp=2,sp=4 --T 4096 --dtype bfloat16   # per device

With --sharded F,S the two lm_head modes of sharded_linear_logprob_entropy ("gather": all-gather the
weight; "vocab_parallel": all-gather the hidden states) are compared by per-device scratch memory, T
tokens per device, on an F x S mesh (on CPU, F * S simulated devices).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import sys
import time

_MESH = re.search(r"--sharded[= ]fsdp=(\d+),sp=(\d+)", " ".join(sys.argv))
if _MESH and "--xla_force_host_platform_device_count" not in os.environ.get("XLA_FLAGS", ""):
    # XLA reads the device count once, when jax initialises: set it before the import (CPU only).
    n = int(_MESH.group(1)) * int(_MESH.group(2))
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={n}"

import jax
import jax.numpy as jnp
import numpy as np

import qwen35_kernels as qk

MiB = 1024 * 1024


def make_loss(backend: str):
    """(hidden [T, D], weight [D, V], labels [T]) -> scalar loss using `backend`."""
    if backend == "tokamax":
        import tokamax
        from absl import flags

        if not flags.FLAGS.is_parsed():  # tokamax reads absl flags; ours are not absl flags
            flags.FLAGS(sys.argv[:1])

        def loss(h, w, labels):  # cross-entropy only: no entropy, no temperature, no ignored labels
            return tokamax.linear_softmax_cross_entropy_loss(h, labels, w, reduction="sum")

        return loss

    def loss(h, w, labels):
        lp, ent = qk.linear_logprob_entropy(h, w, labels, backend=backend)
        return -jnp.sum(lp) + 0.01 * jnp.sum(ent)

    return loss


def step_fn(backend: str):
    return jax.jit(jax.value_and_grad(make_loss(backend), argnums=(0, 1)))


def memory(backend: str, T: int, D: int, V: int, dtype) -> dict:
    args = (
        jax.ShapeDtypeStruct((T, D), dtype),
        jax.ShapeDtypeStruct((D, V), dtype),
        jax.ShapeDtypeStruct((T,), jnp.int32),
    )
    t0 = time.perf_counter()
    m = step_fn(backend).lower(*args).compile().memory_analysis()
    return {
        "temp_MiB": m.temp_size_in_bytes / MiB,
        "args_MiB": m.argument_size_in_bytes / MiB,
        "out_MiB": m.output_size_in_bytes / MiB,
        "compile_s": time.perf_counter() - t0,
    }


def wall_time(backend: str, T: int, D: int, V: int, dtype, repeats: int) -> dict:
    k = jax.random.split(jax.random.key(0), 3)
    h = jax.random.normal(k[0], (T, D), dtype)
    w = (jax.random.normal(k[1], (D, V)) * D**-0.5).astype(dtype)
    labels = jax.random.randint(k[2], (T,), 0, V)
    f = step_fn(backend)
    jax.block_until_ready(f(h, w, labels))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(f(h, w, labels))
        times.append(time.perf_counter() - t0)
    return {"time_s": float(np.median(times)), "times_s": times}


def sharded_memory(mode: str, backend: str, fsdp: int, sp: int, T: int, D: int, V: int, dtype) -> dict:
    """Per-device scratch of a sharded forward+backward, T tokens per device, V split over all devices."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    mesh = jax.make_mesh((fsdp, sp), ("fsdp", "sp"), axis_types=(AxisType.Auto, AxisType.Auto))
    axes = ("fsdp", "sp")
    n = fsdp * sp

    def local(h, w, labels):
        lp, ent = qk.sharded_linear_logprob_entropy(h, w, labels, mode=mode, axis_names=axes, backend=backend)
        return lp, ent

    sm = jax.shard_map(local, mesh=mesh, in_specs=(P(axes), P(None, axes), P(axes)), out_specs=(P(axes), P(axes)))

    def loss(h, w, labels):
        lp, ent = sm(h, w, labels)
        return -jnp.sum(lp) + 0.01 * jnp.sum(ent)

    args = (
        jax.ShapeDtypeStruct((n * T, D), dtype, sharding=NamedSharding(mesh, P(axes))),
        jax.ShapeDtypeStruct((D, V), dtype, sharding=NamedSharding(mesh, P(None, axes))),
        jax.ShapeDtypeStruct((n * T,), jnp.int32, sharding=NamedSharding(mesh, P(axes))),
    )
    t0 = time.perf_counter()
    m = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(*args).compile().memory_analysis()
    return {"temp_MiB": m.temp_size_in_bytes / MiB, "args_MiB": m.argument_size_in_bytes / MiB,
            "out_MiB": m.output_size_in_bytes / MiB, "compile_s": time.perf_counter() - t0}


def available(backend: str) -> bool:
    if backend != "tokamax":
        return True
    try:
        import tokamax  # noqa: F401
    except ImportError:
        return False
    return True


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--T", type=int, nargs="+", default=[1024, 4096, 16384], help="token counts")
    p.add_argument("--D", type=int, default=2048, help="hidden size")
    p.add_argument("--V", type=int, default=248320, help="vocabulary size")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--backends", nargs="+", default=["reference", "xla", "tokamax"],
                   choices=["reference", "xla", "pallas", "tokamax"])
    p.add_argument("--repeats", type=int, default=3, help="timed steps after one warm-up")
    p.add_argument("--skip-time", action="store_true", help="memory analysis only (no allocation)")
    p.add_argument("--time-max-T", type=int, default=None, help="time only T up to this (memory for all)")
    p.add_argument("--json", default=None, help="also write the rows to this file")
    p.add_argument("--sharded", default=None, metavar="fsdp=F,sp=S",
                   help="compare the sharded lm_head modes on this mesh (memory only, per device)")
    a = p.parse_args(argv)
    if min(a.T) < 1 or a.D < 1 or a.V < 1 or a.repeats < 1:
        print("error: --T, --D, --V and --repeats must be positive", file=sys.stderr)
        return 2
    dtype = jnp.dtype(a.dtype)
    print(f"# {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC, jax {jax.__version__}, "
          f"{jax.default_backend()} ({platform.processor() or platform.machine()}, {jax.device_count()} devices), "
          f"D={a.D} V={a.V} dtype={a.dtype}; command: {' '.join(sys.argv)}")
    if a.sharded:
        m = re.fullmatch(r"fsdp=(\d+),sp=(\d+)", a.sharded)
        if not m or int(m.group(1)) * int(m.group(2)) != jax.device_count():
            print(f"error: --sharded must be fsdp=F,sp=S with F*S = {jax.device_count()} devices, "
                  f"got {a.sharded!r}", file=sys.stderr)
            return 2
        f, s = int(m.group(1)), int(m.group(2))
        if a.V % (f * s):
            print(f"error: --V {a.V} must divide by the {f * s} devices", file=sys.stderr)
            return 2
        backend = "xla" if "tokamax" in a.backends or "reference" in a.backends else a.backends[0]
        print(f"| mode ({backend}) | T per device | scratch MiB per device | args MiB | out MiB | compile s |")
        print("| --- | --- | --- | --- | --- | --- |")
        rows = []
        for T in a.T:
            for mode in qk.MODES:
                row = {"mode": mode, "T": T, **sharded_memory(mode, backend, f, s, T, a.D, a.V, dtype)}
                rows.append(row)
                print(f"| {mode} | {T} | {row['temp_MiB']:.1f} | {row['args_MiB']:.1f} | {row['out_MiB']:.1f} "
                      f"| {row['compile_s']:.1f} |", flush=True)
        if a.json:
            with open(a.json, "w") as fh:
                json.dump(rows, fh, indent=1)
        return 0
    print("| backend | T | scratch MiB | args MiB | out MiB | compile s | fwd+bwd s |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    rows = []
    for T in a.T:
        for backend in a.backends:
            if not available(backend):
                print(f"| {backend} | {T} | not installed | | | | |", flush=True)
                continue
            row = {"backend": backend, "T": T, **memory(backend, T, a.D, a.V, dtype)}
            if not a.skip_time and (a.time_max_T is None or T <= a.time_max_T):
                row.update(wall_time(backend, T, a.D, a.V, dtype, a.repeats))
            rows.append(row)
            t = f"{row['time_s']:.2f}" if "time_s" in row else "-"
            print(f"| {backend} | {T} | {row['temp_MiB']:.1f} | {row['args_MiB']:.1f} | {row['out_MiB']:.1f} "
                  f"| {row['compile_s']:.1f} | {t} |", flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
