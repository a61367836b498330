"""The longest sequence whose whole train step fits a device: powers of two, then refined.

Memory is affine in S for fixed shapes (every activation is [tokens, width]), so after the powers of
two bracket the limit, the line through the two bracketing compiles predicts it; the prediction is
compiled and stepped down until it fits, backing off further after each miss (padding to whole
tiles makes memory a staircase around the line). Every reported length was compiled, none
extrapolated.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from qwen35_jax.memory.step_memory import StepMemory

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_bytes(text: str) -> int:
    """"141GB", "80 GiB", "1.5e11" -> bytes; a one-line ValueError otherwise."""
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise ValueError(f"bad memory size {text!r}: expected e.g. 141GB, 80GiB or 1.4e11")
    return int(float(m.group(1)) * _UNITS[m.group(2).upper()])


def longest_fitting(measure: Callable[[int], StepMemory], limit: int, *, start: int, granule: int,
                    max_seq: int = 2**24, log: Callable[[str], None] = lambda _: None
                    ) -> tuple[StepMemory | None, list[StepMemory]]:
    """(the longest measured S with total <= limit, or None; every measurement).

    Halving stops early, with None, when the step's arguments (parameters and optimizer state)
    alone exceed the limit, or when the line through the last two lengths is above it at S = 0.

    start: the first power of two tried; granule: lengths are multiples of it (e.g. sp * chunk).
    """
    tried: dict[int, StepMemory] = {}

    def at(seq: int) -> StepMemory:
        if seq not in tried:
            tried[seq] = measure(seq)
            m = tried[seq]
            log(f"S = {seq:>9,}: {m.total / 2**30:8.2f} GiB {'fits' if m.total <= limit else 'does not fit'}"
                f" ({m.compile_s:.0f} s compile)")
        return tried[seq]

    seq = start
    if at(seq).total > limit:  # halve down to a fit, unless the state alone is already too big
        while seq // 2 >= granule and at(seq).total > limit and at(seq).arguments <= limit:
            seq //= 2
            if at(seq).total > limit and 2 * at(seq).total - at(2 * seq).total > limit:
                break  # the affine fit's S = 0 intercept is over the limit: no S fits
        if at(seq).total > limit:
            return None, list(tried.values())
        low, high = seq, seq * 2
    else:  # double up to a miss
        while seq * 2 <= max_seq and at(seq * 2).total <= limit:
            seq *= 2
        if seq * 2 > max_seq:
            return at(seq), list(tried.values())
        low, high = seq, seq * 2
    lo, hi = at(low), at(high)
    best = lo
    slope = (hi.total - lo.total) / (high - low)
    guess = low + int((limit - lo.total) / slope) if slope > 0 else low
    guess = max(low, min(high - granule, guess // granule * granule))
    for attempt in range(4):  # step down from the prediction until it fits, backing off 1x, 2x, 4x the miss
        if guess <= best.seq:
            break
        m = at(guess)
        if m.total <= limit:
            best = m
            break
        step = (m.total - limit) / slope * 2**attempt  # padding to whole tiles makes memory step, not a line
        guess = max(best.seq, (guess - step) // granule * granule - granule)
        guess = int(guess)
    return best, list(tried.values())
