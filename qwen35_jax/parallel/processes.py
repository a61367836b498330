"""The processes of a jax.distributed run: which one writes files, waiting for all of them, and
gathering every process's rows of an array. In one process each is trivial (no collective)."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np


def is_lead_process() -> bool:
    """Under jax.distributed only process 0 writes files (all processes see the same file system)."""
    return jax.process_index() == 0


def sync_processes(name: str) -> None:
    """Wait until every process has reached the barrier `name` (the same name on each)."""
    if jax.process_count() > 1:
        from jax.experimental import multihost_utils

        multihost_utils.sync_global_devices(name)


def gather_rows(x: np.ndarray | jax.Array) -> np.ndarray:
    """On every process, the whole array: a host array [n, ...] of each process's own rows -> their
    concatenation [P * n, ...] in process order; a global jax.Array -> all of it, also the shards
    other processes hold. Collective: every process calls it with the same shapes."""
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(x))
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x, tiled=True))


def gather_values(value: Any) -> np.ndarray:
    """[P]: one scalar from every process, in process order."""
    return gather_rows(np.asarray([value]))
