"""TPUs to compile for without one: their descriptions, compile-only devices of them, and tracing as
a TPU traces.

libtpu holds XLA:TPU's compiler and, through `jax.experimental.topologies`, makes compile-only devices
of a named slice (a generation and a chip grid); a jit lowered onto a mesh of them compiles to the
program the slice would run, the Pallas TPU (Mosaic) kernels included, with each chip's own memory
figures. It needs libtpu, not a TPU (`pip install -e ".[tpu-compile]"`, which is `jax[tpu]`; on a TPU
machine the installed one serves). The program traced is the TPU's because the model's kernel
choices, which its layers pass to every kernel, name the platform "tpu" (`qwen35_kernels.choices`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TpuTarget:
    """A TPU generation as libtpu's topologies name it."""

    description: str  # as the device reports its kind
    generation: str  # the topology name's prefix
    grid_dims: int  # 2: a 2D torus (v5e, v6e), 3: a 3D one (v4, v5p)
    chip_config: str  # "megacore": one device per chip of two TensorCores; "default": one core
    host_bounds: tuple[int, int, int]  # chips per host, as a grid
    memory_bytes: int  # HBM per chip


# Cloud TPU's published HBM per chip.
TPU_TARGETS = {
    "v4": TpuTarget("TPU v4", "v4", 3, "megacore", (2, 2, 1), 32 * 2**30),
    "v5e": TpuTarget("TPU v5 lite", "v5e", 2, "default", (2, 4, 1), 16 * 2**30),
    "v5p": TpuTarget("TPU v5", "v5p", 3, "megacore", (2, 2, 1), 95 * 2**30),
    "v6e": TpuTarget("TPU v6 lite", "v6e", 2, "default", (2, 4, 1), 32 * 2**30),
}


def slice_grid(target: str, chips: int) -> tuple[int, ...]:
    """The chip grid of a `chips`-chip slice (a power of two), shaped as Cloud TPU shapes its slices
    (v5e: 4 chips 2 x 2, 8 chips 2 x 4; v5p: 4 chips 2 x 2 x 1, 8 chips 2 x 2 x 2, 16 chips 2 x 2 x 4):
    each doubling takes the smallest dimension that keeps the slice on one host, once the host is full
    the smallest dimension; ties go to the last."""
    if chips < 1 or chips & (chips - 1):
        raise ValueError(f"a TPU slice has a power-of-two number of chips, not {chips}")
    tpu = TPU_TARGETS[target]
    grid = [1] * tpu.grid_dims
    for _ in range(chips.bit_length() - 1):
        on_host = [i for i in range(len(grid)) if 2 * grid[i] <= tpu.host_bounds[i]]
        dims = on_host or range(len(grid))
        smallest = min(grid[i] for i in dims)
        grid[max(i for i in dims if grid[i] == smallest)] *= 2
    return tuple(grid)


def tpu_compile_only_devices(target: str, count: int) -> list[Any]:
    """`count` compile-only devices (chips) of a TPU_TARGETS[target] slice; a one-line error when libtpu
    is missing."""
    from jax.experimental import topologies

    if target not in TPU_TARGETS:
        raise ValueError(f"unknown TPU target {target!r}; choose one of {sorted(TPU_TARGETS)}")
    tpu = TPU_TARGETS[target]
    grid = slice_grid(target, count)
    bounds = tuple(min(g, h) for g, h in zip(grid + (1,) * (3 - len(grid)), tpu.host_bounds))
    try:
        with _libtpu_without_a_tpu(f"{tpu.generation}-{count}"):
            topology = topologies.get_topology_desc(
                platform="tpu", topology_name=f"{tpu.generation}:{'x'.join(map(str, grid))}",
                chip_config_name=tpu.chip_config, chips_per_host_bounds=bounds, num_slices=1,
                wrap=(False,) * 3)
    except RuntimeError as err:
        first = (str(err).strip().splitlines() or [""])[0]
        if "not installed" in first:
            raise RuntimeError("compiling for a TPU without one needs libtpu: pip install -e '.[tpu-compile]' "
                               f"({first})") from None
        raise RuntimeError(f"libtpu made no compile-only {target} devices: {first}") from None
    return list(topology.devices)


@contextlib.contextmanager
def _libtpu_without_a_tpu(accelerator: str) -> Iterator[None]:
    """The environment libtpu reads when it loads, for a process that only compiles: the TPU VM's
    metadata it would otherwise look for and warn about (one local slice of `accelerator`), and no
    lock file claiming the TPU, so that several compiling processes (pytest workers, a tool run from
    a test) can load it at once. Restored afterwards, so that child processes start clean."""
    settings = {"TPU_ACCELERATOR_TYPE": accelerator, "TPU_WORKER_HOSTNAMES": "localhost",
                "ALLOW_MULTIPLE_LIBTPU_LOAD": "1"}
    saved = {name: os.environ.get(name) for name in settings}
    os.environ.update({name: value for name, value in settings.items() if saved[name] is None})
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)

