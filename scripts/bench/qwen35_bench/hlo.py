"""Read the collectives out of compiled HLO text: which op, result shapes, bytes, source scope.

Used by the tests (all-to-all around every mixer, no full-sequence all-gather) and by
`scripts/bench/bench_parallel.py` (collective bytes per layer). Works on the text of
`jax.jit(f).lower(...).compile().as_text()`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

COLLECTIVES = ("all-to-all", "all-gather", "all-reduce", "reduce-scatter", "collective-permute")

DTYPE_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2, "s16": 2,
          "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_LINE = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+) = (?P<shape>\(.*?\)|[\w]+\[[\d,]*\](?:\{[^}]*\})?) "
    r"(?P<op>" + "|".join(COLLECTIVES) + r")(?P<start>-start)?\("
)
_ARRAY = re.compile(r"(\w+)\[([\d,]*)\]")
_OP_NAME = re.compile(r'op_name="([^"]*)"')


@dataclass(frozen=True)
class Collective:
    name: str
    op: str  # one of COLLECTIVES
    shapes: tuple[tuple[str, tuple[int, ...]], ...]  # (dtype, dims) of every result array
    op_name: str  # the JAX source scope from the metadata ("" when absent)

    @property
    def elements(self) -> int:
        """Elements of the result arrays: what one device receives (all-to-all, all-gather)."""
        total = 0
        for _, dims in self.shapes:
            n = 1
            for d in dims:
                n *= d
            total += n
        return total

    @property
    def bytes(self) -> int:
        """Bytes of the result arrays, in the dtype the compiled HLO uses (XLA:CPU widens bf16 to f32)."""
        total = 0
        for dtype, dims in self.shapes:
            n = 1
            for d in dims:
                n *= d
            total += n * DTYPE_BYTES.get(dtype, 4)
        return total


def collectives(hlo_text: str) -> list[Collective]:
    """Every collective instruction of the module (async `-start` ops counted once, by their output)."""
    found = []
    for line in hlo_text.splitlines():
        m = _LINE.match(line)
        if not m:
            continue
        shapes = tuple(
            (dtype, tuple(int(d) for d in dims.split(",") if d))
            for dtype, dims in _ARRAY.findall(m.group("shape"))
        )
        if m.group("start") and len(shapes) > 1:
            shapes = shapes[len(shapes) // 2:]  # (operands..., outputs...) of an async start
        op_name = _OP_NAME.search(line)
        found.append(Collective(m.group("name"), m.group("op"), shapes, op_name.group(1) if op_name else ""))
    return found
