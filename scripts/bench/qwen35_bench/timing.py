"""Timing of callables that block until their work is done, one stack at a time."""

from __future__ import annotations

import os
import statistics
import time
from collections.abc import Callable


def time_calls(fn: Callable[[], object], steps: int) -> list[float]:
    """Seconds of each of `steps` calls of `fn`."""
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return times


def time_side_by_side(fns: dict[str, Callable[[], None]], steps: int) -> dict[str, dict[str, float]]:
    """For each stack in turn: one warm-up call, then the median (and min/max) of `steps` timed calls.

    One stack at a time, not alternating step by step: XLA's and torch's CPU thread pools each spin
    for a while after their work, and interleaved they slow each other down several-fold.
    """
    out = {}
    for name, fn in fns.items():
        t0 = time.perf_counter()
        fn()
        warm = time.perf_counter() - t0
        times = time_calls(fn, steps)
        out[name] = {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
                     "warmup_s": warm, "load_average": os.getloadavg()[0]}
    return out


def jit_tuned(fn: Callable) -> Callable:
    """`jax.jit` with the compiler options our train step uses (`qwen35_jax.xla_options`)."""
    import jax

    from qwen35_jax.xla_options import compiler_options

    return jax.jit(fn, compiler_options=compiler_options())
