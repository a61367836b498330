"""The vision tower's layout on the mesh: a bucket's patch rows split over every device.

A batch's images are one bucket of P patch rows (`vision/inputs.py`). Everything the tower does but
attention is per patch row (embedding, norms, MLP, rotary), and its merger mixes only the merge_unit
consecutive rows of one window, so the rows are split over fsdp x sp together: each of N devices holds
P/N rows, a whole number of merge windows, and no device computes another's patches (a tower run on
every sp rank, as verl does, costs sp times the work).

Attention is full within a frame, and a frame's rows may sit on several devices: each device keeps its
P/N query rows and gathers every key and value row of the bucket (`attend_all_keys`), so it computes
[H, P/N, P] scores, masked to each query's frame. Exact for any head count (the 0.8B tower's 12 heads do
not split over 8 devices, which a heads all-to-all would need); the gathered K/V is 2 x P x D values,
small next to the tower's own weights for the image sizes a step holds.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from qwen35_jax.parallel.mesh import AXES, auto_mesh, constrain
from qwen35_jax.parallel.padding import padded_size

PATCHES_P = P(AXES)  # per-patch scalars [P]: rows over every device
PATCHES_PD = P(AXES, None)  # patch rows [P, D]
PATCHES_PHD = P(AXES, None, None)  # per-head patch rows [P, H, Dh]


def patch_shards() -> int:
    """How many devices share a bucket's rows: the multi-device context mesh's size, else 1."""
    mesh = auto_mesh()
    return 1 if mesh is None else mesh.size


def constrain_rows(x: jax.Array) -> jax.Array:
    """x [P, ...] with its rows split over every device of the context mesh (the identity without one)."""
    return constrain(x, P(AXES, *([None] * (x.ndim - 1))))


def pad_rows(arrays: tuple[jax.Array, ...], multiple: int) -> tuple[jax.Array, ...]:
    """Each [P, ...] array with zero rows appended up to a multiple of `multiple` (segment id 0: padding)."""
    p = arrays[0].shape[0]
    extra = padded_size(p, multiple) - p
    if extra == 0:
        return arrays
    return tuple(jnp.pad(a, ((0, extra),) + ((0, 0),) * (a.ndim - 1)) for a in arrays)


Attend = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array], jax.Array]


def attend_all_keys(attend: Attend, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """`attend(q, k, v, q_segments, k_segments)` with q, k, v [P, H, Dh] and segment_ids [P] -> [P, H, Dh].

    On a multi-device mesh each device runs `attend` on its P/N query rows against all P key and value
    rows (gathered inside `shard_map`; their gradients reduce-scatter back); P must be a multiple of the
    device count. Without a mesh: one plain call."""
    mesh = auto_mesh()
    if mesh is None:
        return attend(q, k, v, segment_ids, segment_ids)
    if q.shape[0] % mesh.size:
        raise ValueError(f"{q.shape[0]} patch rows do not split over {mesh.size} devices")

    def local(q: jax.Array, k: jax.Array, v: jax.Array, seg: jax.Array) -> jax.Array:  # [P/N, H, Dh] ...
        k_all, v_all, seg_all = (jax.lax.all_gather(a, AXES, axis=0, tiled=True) for a in (k, v, seg))
        return attend(q, k_all, v_all, seg, seg_all)  # [P/N, H, Dh]

    return jax.shard_map(local, mesh=mesh, in_specs=(PATCHES_PHD, PATCHES_PHD, PATCHES_PHD, PATCHES_P),
                         out_specs=PATCHES_PHD, check_vma=False)(q, k, v, segment_ids)
