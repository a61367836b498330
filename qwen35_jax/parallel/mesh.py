"""The 2D device mesh (fsdp x sp), its PartitionSpec table and the parameter shardings.

Axes:
- `fsdp`: the batch is split over it; parameters are ZeRO-3 sharded over `fsdp` and `sp` together.
- `sp`: the sequence is split over it (Ulysses: the sequence mixers all-to-all to head shards).

The mesh axes are `AxisType.Auto`: the model is written once, with sharding constraints on its
activations, and XLA places everything else. Code that needs the mesh reads the context mesh set by
`jax.set_mesh(mesh)` (`jax.sharding.get_abstract_mesh()`), the same one Flax NNX uses.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

FSDP = "fsdp"
SP = "sp"
AXES = (FSDP, SP)
PARAM_AXES = (FSDP, SP)  # ZeRO-3: one weight dim split over both axes together

# PartitionSpecs named by the shape letters of what they shard (see docs/architecture.md).
TOKENS_BS = P(FSDP, SP)  # tokens, segment_ids, positions [B, S]
POSITIONS_3BS = P(None, FSDP, SP)  # mrope positions [3, B, S]
ACT_BSD = P(FSDP, SP, None)  # hidden states [B, S, D]
ACT_BSV = P(FSDP, SP, None)  # logits [B, S, V]
HEADS_BSHD = P(FSDP, SP, None, None)  # per-head activations, sequence shards [B, S/sp, H, Dh]
HEADS_BSH = P(FSDP, SP, None)  # per-head scalars, sequence shards [B, S/sp, H]


def rows_spec(ndim: int, row_axis: int = 0) -> P:
    """The decode layout of an array with rows on `row_axis`: rows split over (fsdp, sp), the rest
    whole (a decode step has no sequence axis to split)."""
    spec: list[Any] = [None] * ndim
    spec[row_axis] = (FSDP, SP)
    return P(*spec)


# Weights smaller than this many elements stay replicated: sharding them costs more than it saves.
MIN_SHARDED_SIZE = 2**14


def valid_layouts(n_devices: int) -> list[tuple[int, int]]:
    """All (fsdp, sp) with fsdp * sp == n_devices."""
    return [(f, n_devices // f) for f in range(1, n_devices + 1) if n_devices % f == 0]


def _layouts_text(n_devices: int) -> str:
    return ", ".join(f"fsdp={f},sp={s}" for f, s in valid_layouts(n_devices))


def parse_mesh(spec: str | None, n_devices: int | None = None) -> tuple[int, int]:
    """Parse "fsdp=F,sp=S" (either order; a missing axis is 1) into (F, S).

    `None` or "" puts every device on fsdp. F * S must equal `n_devices` (default: the device count of
    all processes together).
    """
    n = jax.device_count() if n_devices is None else n_devices
    if spec is None or not spec.strip():
        return n, 1
    sizes = {FSDP: 1, SP: 1}
    seen = set()
    for part in spec.split(","):
        name, eq, value = part.strip().partition("=")
        name = name.strip()
        if not eq or name not in sizes or name in seen:
            raise ValueError(
                f"bad mesh {spec!r}: expected 'fsdp=F,sp=S' with each axis at most once, "
                f"e.g. one of: {_layouts_text(n)}"
            )
        try:
            size = int(value)
        except ValueError:
            size = 0
        if size < 1:
            raise ValueError(f"bad mesh {spec!r}: axis {name} needs a positive integer, got {value!r}")
        sizes[name] = size
        seen.add(name)
    f, s = sizes[FSDP], sizes[SP]
    if f * s != n:
        raise ValueError(
            f"mesh {spec!r} has fsdp*sp = {f * s} devices but there are {n}; valid layouts: "
            f"{_layouts_text(n)}"
        )
    return f, s


def init_distributed() -> bool:
    """Join a multi-process run before any other JAX call; returns True when one was joined.

    Explicit: JAX_COORDINATOR_ADDRESS (host:port of process 0), JAX_NUM_PROCESSES, JAX_PROCESS_ID.
    Otherwise a Slurm or Open MPI launch with more than one task is detected by JAX itself.
    Single-process launches do nothing.
    """
    if jax.distributed.is_initialized():
        return True
    address = os.environ.get("JAX_COORDINATOR_ADDRESS")
    if address:
        num = os.environ.get("JAX_NUM_PROCESSES")
        pid = os.environ.get("JAX_PROCESS_ID")
        if num is None or pid is None:
            raise ValueError(
                "JAX_COORDINATOR_ADDRESS is set but JAX_NUM_PROCESSES or JAX_PROCESS_ID is missing"
            )
        jax.distributed.initialize(address, num_processes=int(num), process_id=int(pid))
        return True
    tasks = os.environ.get("SLURM_NTASKS") or os.environ.get("OMPI_COMM_WORLD_SIZE")
    if tasks is not None and int(tasks) > 1:
        jax.distributed.initialize()
        return True
    return False


def make_mesh(spec: str | tuple[int, int] | None = None, devices: Sequence[Any] | None = None) -> Mesh:
    """The (fsdp, sp) mesh over all devices of all processes (or `devices`).

    Neighbouring devices (the same host first) go on `sp`, the axis that carries the all-to-alls.
    """
    devs = list(jax.devices() if devices is None else devices)
    f, s = spec if isinstance(spec, tuple) else parse_mesh(spec, len(devs))
    if f * s != len(devs):
        raise ValueError(
            f"mesh fsdp={f},sp={s} needs {f * s} devices but there are {len(devs)}; valid layouts: "
            f"{_layouts_text(len(devs))}"
        )
    devs.sort(key=lambda d: (d.process_index, d.id))
    grid = np.array(devs, dtype=object).reshape(f, s)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto, AxisType.Auto))


def mesh_axis_size(mesh: Any, axis: str) -> int:
    """Size of `axis` on a (concrete or abstract) mesh; 1 when the mesh is empty or lacks it."""
    if mesh is None or getattr(mesh, "empty", False):
        return 1
    return dict(zip(mesh.axis_names, mesh.axis_sizes)).get(axis, 1)


def context_mesh() -> Any | None:
    """The mesh set with `jax.set_mesh`, or None when there is none."""
    mesh = jax.sharding.get_abstract_mesh()
    return None if mesh.empty else mesh


def auto_mesh() -> Any | None:
    """The context mesh when it spans several devices and no axis is manual (not inside a
    shard_map over it); else None: then sharding code has nothing to do."""
    mesh = context_mesh()
    if mesh is None or mesh.size == 1 or AxisType.Manual in mesh.axis_types:
        return None
    return mesh


def constrain(x: jax.Array, spec: P) -> jax.Array:
    """`with_sharding_constraint(x, spec)` on the context mesh (real on CPU meshes too); the identity
    without a multi-device mesh."""
    return x if auto_mesh() is None else jax.lax.with_sharding_constraint(x, spec)


def param_spec(
    shape: Sequence[int], n_shards: int, *, skip_dims: int = 0, min_size: int = MIN_SHARDED_SIZE
) -> P:
    """ZeRO-3 spec for one weight: its largest dim divisible by `n_shards`, split over (fsdp, sp).

    The first `skip_dims` dims (the stacked layer dim scanned over) are never split. Weights with
    fewer than `min_size` elements, or without a divisible dim, stay replicated.
    """
    if n_shards == 1 or int(np.prod(shape, dtype=np.int64)) < min_size:
        return P()
    best = None
    for d in range(skip_dims, len(shape)):
        if shape[d] % n_shards == 0 and (best is None or shape[d] > shape[best]):
            best = d
    if best is None:
        return P()
    spec: list[Any] = [None] * len(shape)
    spec[best] = PARAM_AXES
    return P(*spec)


def _stacked_dims(path: tuple[Any, ...]) -> int:
    """1 for parameters of the scanned block stack (leading dim = block index), else 0."""
    keys = [getattr(k, "key", getattr(k, "name", k)) for k in path]
    return 1 if "blocks" in keys else 0


def state_shardings(state: Any, mesh: Mesh) -> Any:
    """A NamedSharding for every array leaf of an nnx State (or any pytree of arrays/ShapeDtypeStructs)."""
    n = mesh_axis_size(mesh, FSDP) * mesh_axis_size(mesh, SP)

    def one(path: tuple[Any, ...], leaf: Any) -> NamedSharding:
        spec = param_spec(leaf.shape, n, skip_dims=_stacked_dims(path))
        return NamedSharding(mesh, spec)

    return jax.tree.map_with_path(one, state)


def shard_model(model: nnx.Module, mesh: Mesh) -> nnx.Module:
    """Move every parameter/variable of `model` to its ZeRO-3 sharding on `mesh`, in place."""
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, state_shardings(state, mesh)))
    return model


def create_sharded(factory: Callable[[], nnx.Module], mesh: Mesh) -> nnx.Module:
    """Build a model straight into its shardings (no full copy on one device): `factory()` under jit."""
    abstract = nnx.eval_shape(factory)
    graphdef, abs_state = nnx.split(abstract)
    shardings = state_shardings(abs_state, mesh)

    build = jax.jit(lambda: nnx.state(factory()), out_shardings=shardings)

    return nnx.merge(graphdef, build())
