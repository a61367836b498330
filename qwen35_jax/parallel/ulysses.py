"""Ulysses sequence parallelism: the seq <-> heads all-to-all around any per-head sequence mixer.

Outside, activations are sequence shards [B, S/sp, H, d]. Inside `jax.shard_map` one all-to-all per
input turns them into head shards over the whole sequence [B, S, H/sp, d]; the mixer (attention core,
gated DeltaNet core) runs unchanged on its local heads; one all-to-all brings the output back to
[B, S/sp, H, d]. This is exact: every mixer here is independent per head.

Grouped heads (GQA kv heads, GDN key heads) that do not split evenly over sp are replicated before the
all-to-all so that every device receives exactly the shared heads its own heads read.

The wrappers read the context mesh (`jax.set_mesh(mesh)`); with no mesh, or sp == 1, they call the
mixer directly, so single-device code is unchanged. (GDN layers can instead pass states between
sequence shards: `layers/gdn_state_passing.py`, chosen by the layer.)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from qwen35_jax.parallel.mesh import FSDP, SP, auto_mesh, mesh_axis_size

# Named scopes of the two wrappers: they appear in the HLO metadata (op_name) of their collectives.
ATTENTION_SCOPE = "ulysses_attention"
GDN_SCOPE = "ulysses_gdn"


def valid_sp(n_heads: int) -> list[int]:
    """The sp sizes that divide `n_heads`."""
    return [s for s in range(1, n_heads + 1) if n_heads % s == 0]


def check_heads(n_heads: int, sp: int, what: str) -> None:
    """One-line error when `n_heads` (the sharded head count) is not divisible by sp."""
    if n_heads % sp:
        raise ValueError(
            f"{what} = {n_heads} is not divisible by sp = {sp}; valid sp values: {valid_sp(n_heads)}"
        )


def shared_head_index(n_heads: int, n_shared: int, sp: int) -> np.ndarray | None:
    """Which shared (kv / key) head each device receives, for heads split contiguously over sp.

    Head h reads shared head h // (n_heads // n_shared). Device r holds heads [r*Hl, (r+1)*Hl),
    Hl = n_heads // sp. Returns the global shared-head index of every device's chunk, concatenated
    ([sp * Kl], chunk r = the Kl shared heads of device r, in the order that keeps the local mapping
    j -> j // (Hl // Kl)), or None when the plain split (Kl = n_shared // sp) already is that.
    Kl is the smallest divisor of Hl that keeps each block of Hl // Kl heads on one shared head.
    """
    if n_heads % n_shared:
        raise ValueError(f"{n_heads} heads do not split into {n_shared} shared (kv / key) heads")
    group = n_heads // n_shared
    local = n_heads // sp
    if n_shared % sp == 0 and local % group == 0:
        return None
    for kl in range(1, local + 1):
        if local % kl:
            continue
        block = local // kl
        index = [
            [(r * local + b * block + j) // group for j in range(block)]
            for r in range(sp)
            for b in range(kl)
        ]
        if all(len(set(row)) == 1 for row in index):
            return np.array([row[0] for row in index], dtype=np.int32)
    raise AssertionError("unreachable: kl = local heads always works")


@dataclass(frozen=True)
class Arg:
    """How one mixer argument crosses the shard_map boundary.

    kind:
      - "seq_heads": a [B, S/sp, ..., H, ...] sequence shard; all-to-all'd to [B, S, ..., H/sp, ...].
      - "seq": a [B, S/sp, ...] sequence shard without heads (segment ids); all-gathered to [B, S, ...].
      - "heads": a weight with a head axis (conv kernels, A_log): passed whole (weights are small),
        each device takes its heads' slice inside.
      - "replicated": the same on every device (a norm weight).
    head_axis: the head axis of "seq_heads" / "heads".
    index: global head per device chunk (see `shared_head_index`); None = the plain contiguous split.
    """

    kind: Literal["seq_heads", "seq", "heads", "replicated"]
    head_axis: int = 2
    index: np.ndarray | None = None


def _spec(arg: Arg, ndim: int, batch: str | None) -> P:
    spec: list[str | None] = [None] * ndim
    if arg.kind in ("seq_heads", "seq"):
        spec[0], spec[1] = batch, SP
    return P(*spec)


def _local_heads(w: jax.Array, arg: Arg, sp: int) -> jax.Array:
    """This device's slice of a whole per-head weight (inside shard_map)."""
    r = jax.lax.axis_index(SP)
    if arg.index is None:
        n = w.shape[arg.head_axis] // sp
        return jax.lax.dynamic_slice_in_dim(w, r * n, n, axis=arg.head_axis)
    table = jnp.asarray(arg.index).reshape(sp, -1)  # [sp, Kl]
    return jnp.take(w, table[r], axis=arg.head_axis)


def ulysses_call(
    core: Callable[..., jax.Array],
    args: Sequence[Any],
    kinds: Sequence[Any],
    mesh: jax.sharding.AbstractMesh | jax.sharding.Mesh,
    *,
    out_head_axis: int = 2,
    extra_head_axes: tuple[int, ...] = (),
) -> jax.Array | tuple[jax.Array, ...]:
    """Run `core(*args)` with sequence shards turned into head shards; returns [B, S/sp, H, ...].
    `args` may hold pytrees (the GDN mixer's NamedTuples): `kinds` then has the same structure, one
    `Arg` per array. With `extra_head_axes`, `core` returns (out, *extras): per-head arrays without a
    sequence axis (a final recurrent state [B, H/sp, ...]), returned head-sharded over sp on those axes."""
    structure = jax.tree.structure(tuple(args))
    kinds = structure.flatten_up_to(tuple(kinds))
    args = structure.flatten_up_to(tuple(args))
    sp = mesh_axis_size(mesh, SP)
    first = next(a for a, k in zip(args, kinds) if k.kind == "seq_heads")
    b, s = first.shape[:2]
    if s % sp:
        raise ValueError(f"sequence length {s} is not divisible by sp = {sp}; pad it (the model does)")
    batch = FSDP if b % mesh_axis_size(mesh, FSDP) == 0 else None

    prepared = []
    for x, k in zip(args, kinds):
        if k.kind == "seq_heads" and k.index is not None:
            x = jnp.take(x, jnp.asarray(k.index), axis=k.head_axis)  # replicate shared heads
        prepared.append(x)
    in_specs = tuple(_spec(k, x.ndim, batch) for x, k in zip(prepared, kinds))
    out_spec = P(batch, SP, *([None] * (first.ndim - 2)))
    if extra_head_axes:
        out_spec = (out_spec, *(P(batch, *([None] * (axis - 1)), SP) for axis in extra_head_axes))

    def local(*xs: jax.Array) -> jax.Array | tuple[jax.Array, ...]:
        if sp == 1:  # a batch shard of whole sequences with every head: nothing to exchange
            return core(*structure.unflatten(xs))
        inner = []
        for x, k in zip(xs, kinds):
            if k.kind == "seq_heads":  # [B, S/sp, H, d] -> [B, S, H/sp, d]
                x = jax.lax.all_to_all(x, SP, split_axis=k.head_axis, concat_axis=1, tiled=True)
            elif k.kind == "seq":  # [B, S/sp] -> [B, S]
                x = jax.lax.all_gather(x, SP, axis=1, tiled=True)
            elif k.kind == "heads":
                x = _local_heads(x, k, sp)
            inner.append(x)
        out = core(*structure.unflatten(inner))  # [B, S, H/sp, d]
        if extra_head_axes:
            out, *extras = out
            return (jax.lax.all_to_all(out, SP, split_axis=1, concat_axis=out_head_axis, tiled=True), *extras)
        return jax.lax.all_to_all(out, SP, split_axis=1, concat_axis=out_head_axis, tiled=True)

    # check_vma=False: the mixers are written for one device (e.g. scan carries start as plain zeros);
    # tests check values and gradients against the unsharded call.
    return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=out_spec, check_vma=False)(*prepared)


def active_sp_mesh() -> jax.sharding.AbstractMesh | None:
    """The context mesh when it has an sp axis > 1 and is not manual already, else None."""
    mesh = auto_mesh()
    return None if mesh_axis_size(mesh, SP) == 1 else mesh


# The mixers run inside shard_map on any multi-device mesh (`auto_mesh`), at sp = 1 too, on their
# batch shards: their Pallas kernels are custom calls that XLA's partitioner cannot split (Mosaic
# refuses to lower one outside shard_map; a Triton call would run on the whole gathered batch).


def ulysses_attention(
    core: Callable[..., jax.Array],
    q: jax.Array,  # [B, S/sp, H, Dh]
    k: jax.Array,  # [B, S/sp, K, Dh]
    v: jax.Array,  # [B, S/sp, K, Dh]
    segment_ids: jax.Array,  # [B, S/sp]
) -> jax.Array:  # [B, S/sp, H, Dh]
    """`core(q, k, v, segment_ids)` (causal attention) sequence-parallel over the context mesh."""
    mesh = auto_mesh()
    if mesh is None:
        return core(q, k, v, segment_ids)
    sp = mesh_axis_size(mesh, SP)
    n_heads, n_kv = q.shape[2], k.shape[2]
    check_heads(n_heads, sp, "attention query heads")
    kv = shared_head_index(n_heads, n_kv, sp)
    kinds = (Arg("seq_heads"), Arg("seq_heads", index=kv), Arg("seq_heads", index=kv), Arg("seq"))
    with jax.named_scope(ATTENTION_SCOPE):
        return ulysses_call(core, (q, k, v, segment_ids), kinds, mesh)
