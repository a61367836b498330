"""Gated DeltaNet sequence-parallel by passing recurrent states between sequence shards.

The alternative to the all-to-all of `ulysses_gdn`: every device keeps its sequence shard with all
heads, and only per-shard states cross devices, so the traffic does not grow with S.

Why it is exact: within a shard the state update is affine in the state the shard starts from,
S_t = M_t S_0 + C_t (M_t [Dk, Dk] per head: the decays and (I - beta k k^T) factors; zero after a
document start), so o_t = S_t^T q_t = o_t|S_0=0 + S_0^T (M_t^T q_t). One chunked delta-rule pass
with S_0 = 0 gives o|S_0=0 and C; a second pass with S_0 = I and v = 0 gives M_t^T q_t and M (it is
the same recurrence with Dk-wide "values"). Every device all-gathers the (M, C) of all shards, folds
them in shard order into its own S_0, and adds S_0^T (M_t^T q_t).

The depthwise causal conv1d needs the Kc - 1 raw tokens before the shard: a one-way `ppermute`
halo from the previous device (with their segment ids, so the window still stops at document
starts). Shards must hold at least Kc - 1 tokens.

Traffic per device and layer: halo 3 * (Kc - 1) tokens + all-gather of sp * B * Hv * Dk * (Dk + Dv)
float32, independent of S. Compute: one extra delta-rule pass of width Dk.

Shards longer than the sequence tile (the kernel choices' `sequence_tile`) run in two sweeps of tiles instead
(`_two_sweeps`): the first carries (M, C) from tile to tile, the second is the tiled mixer
(`gdn_tiling.tiled_gdn_core`) from the folded S_0, so no float32 array spans the shard; it computes
the conv, norms, gates and one delta-rule pass twice.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from qwen35_kernels.choices import KernelChoices, resolved
from qwen35_kernels.gated_delta_rule.chunk_states import apply_gdn_remat
from qwen35_kernels.gated_delta_rule.chunked import chunked_gated_delta_rule
from qwen35_kernels.gated_delta_rule.tiles import delta_rule_tile, document_starts_tile, tile_scan

from qwen35_jax.layers.gdn_arrays import GdnTokens, GdnWeights, conv_halo
from qwen35_jax.layers.gdn_inputs import rule_inputs
from qwen35_jax.layers.gdn_segment import gdn_segment
from qwen35_jax.layers.gdn_tiling import tiled_gdn_core, tiled_inputs
from qwen35_jax.layers.norms import gated_rms_norm
from qwen35_jax.parallel.mesh import FSDP, SP, mesh_axis_size

GDN_STATE_SCOPE = "gdn_state_passing"


def _shifted_in(x: jax.Array, sp: int) -> jax.Array:
    """Device r receives device r - 1's `x`; device 0 receives zeros (inside shard_map)."""
    return jax.lax.ppermute(x, SP, [(r, r + 1) for r in range(sp - 1)])


def _halo_and_reset(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, h: int, sp: int
                    ) -> tuple[tuple[jax.Array, ...], jax.Array]:
    """The conv halo (the h raw q, k, v tokens [B, h, H, d] before this shard and their ids [B, h];
    zeros with padding ids on device 0) and whether the state handed in is dropped [B] (a document
    starts at the shard's first token, or this is the first shard)."""
    L = q.shape[1]
    r = jax.lax.axis_index(SP)
    halo = (*(_shifted_in(x[:, L - h:], sp) for x in (q, k, v)),
            jnp.where(r == 0, 0, _shifted_in(segment_ids[:, L - h:], sp)))
    prev_last = jnp.where(r == 0, 0, _shifted_in(segment_ids[:, L - 1], sp))  # [B]
    first = segment_ids[:, 0]
    return halo, ((first != prev_last) & (first != 0)) | (r == 0)


def _entering_state(m_end: jax.Array, c_end: jax.Array, reset: jax.Array, sp: int) -> jax.Array:
    """The state entering this shard [B, Hv, Dk, Dv]: every shard's map S_end = M S_0 + C
    (m_end [B, Hv, Dk, Dk], c_end [B, Hv, Dk, Dv]) and reset flag [B] all-gathered and folded in order."""
    r = jax.lax.axis_index(SP)
    all_m = jax.lax.all_gather(m_end, SP)  # [sp, B, Hv, Dk, Dk]
    all_c = jax.lax.all_gather(c_end, SP)  # [sp, B, Hv, Dk, Dv]
    all_reset = jax.lax.all_gather(reset, SP)  # [sp, B]
    state = jnp.zeros(c_end.shape, jnp.float32)  # state entering shard j, folded in order
    start = state
    for j in range(sp):
        state = jnp.where(all_reset[j][:, None, None, None], 0.0, state)
        start = jnp.where(r == j, state, start)
        state = jnp.einsum("bhkm,bhmv->bhkv", all_m[j], state, precision=jax.lax.Precision.HIGHEST) + all_c[j]
    return start


def _state_map_passes(
    q: jax.Array,  # [B, T, Hk, Dk] rule inputs (after conv, norms)
    k: jax.Array,  # [B, T, Hk, Dk]
    v: jax.Array,  # [B, T, Hv, Dv]
    g: jax.Array,  # [B, T, Hv]
    beta: jax.Array,  # [B, T, Hv]
    m0: jax.Array,  # [B, Hv, Dk, Dk] the map entering these tokens (I at a shard start)
    c0: jax.Array | None,  # [B, Hv, Dk, Dv] its constant part (None: 0)
    *,
    segment_ids: jax.Array,  # [B, T]
    chunk_size: int,
    choices: KernelChoices,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The two delta-rule passes of the affine state map S = M S_0 + C: values v from C's state
    (outputs [B, T, Hv, Dv] and C after) and zero values from M's (M_t^T q_t [B, T, Hv, Dk] and M after)."""
    rule = dict(segment_ids=segment_ids, chunk_size=chunk_size, choices=choices)
    out_c, c_end = chunked_gated_delta_rule(q, k, v, g, beta, initial_state=c0, **rule)
    zeros = jnp.zeros((*v.shape[:3], q.shape[-1]), jnp.float32)
    out_m, m_end = chunked_gated_delta_rule(q, k, zeros, g, beta, initial_state=m0, **rule)
    return out_c, c_end, out_m, m_end


def _identity_map(b: int, hv: int, dk: int) -> jax.Array:  # [B, Hv, Dk, Dk] float32
    return jnp.broadcast_to(jnp.eye(dk, dtype=jnp.float32), (b, hv, dk, dk))


def _local_gdn(
    tokens: GdnTokens,  # [B, L, ...], L = S/sp: this device's shard
    weights: GdnWeights,
    segment_ids: jax.Array,  # [B, L]
    *,
    eps: float,
    chunk_size: int,
    sp: int,
    tile: int | None,
    choices: KernelChoices,
    recomputed: bool = False,
) -> jax.Array:  # [B, L, Hv, Dv]
    """The whole shard at once (tile None): one pass with S_0 = 0 (outputs and C), one with S_0 = I
    and v = 0 (M_t^T q_t and M), then the outputs corrected by the folded entering state. With a
    tile, `_two_sweeps`. `recomputed`: inside `apply_gdn_remat`'s checkpoint."""
    q, k, v, z, b, a = tokens
    B, _, _, Dk = q.shape
    halo, reset = _halo_and_reset(q, k, v, segment_ids, conv_halo(weights), sp)
    if tile is not None:
        return _two_sweeps(tokens, weights, segment_ids, halo, reset, eps=eps, chunk_size=chunk_size, sp=sp,
                           tile=tile, choices=choices)
    dtype = q.dtype
    q, k, v, g, beta = rule_inputs(q, k, v, b, a, weights, segment_ids, halo, choices=choices, recomputed=recomputed)
    out0, c_end, mq, m_end = _state_map_passes(q, k, v, g, beta, _identity_map(B, v.shape[2], Dk), None,
                                               segment_ids=segment_ids, chunk_size=chunk_size, choices=choices)
    start = _entering_state(m_end, c_end, reset, sp)
    out = out0 + jnp.einsum("bshk,bhkv->bshv", mq, start, precision=jax.lax.Precision.HIGHEST)
    return gated_rms_norm(out.astype(dtype), z, weights.norm_weight, eps)  # [B, L, Hv, Dv]


def _two_sweeps(
    tokens: GdnTokens,  # [B, L, ...] the shard's raw projections
    weights: GdnWeights,
    segment_ids: jax.Array,  # [B, L]
    halo: tuple[jax.Array, ...],  # the raw q, k, v [B, Kc - 1, H, d] before the shard and their ids
    reset: jax.Array,  # [B] the state handed in is dropped
    *,
    eps: float,
    chunk_size: int,
    sp: int,
    tile: int,
    choices: KernelChoices,
) -> jax.Array:  # [B, L, Hv, Dv]
    """The shard in two sweeps of `tile` tokens, so that no float32 array of the mixer spans the
    shard: the first carries the shard's map (M, C) from tile to tile (each tile's conv, norms, gates
    and both delta-rule passes, no outputs); the second, once the entering state is known, is the
    tiled mixer (`gdn_tiling.tiled_gdn_core`) started from it. It recomputes the conv, norms, gates and
    one delta-rule pass, to keep a long shard's memory at the tiled all-to-all mixer's."""
    q, k, v, _, b, a = tokens
    B, _, _, Dk = q.shape
    Hv, Dv = v.shape[2:]
    h = conv_halo(weights)
    tiles, ids = tiled_inputs((q, k, v, b, a), segment_ids, tile, h, halo)

    def one(state: jax.Array, xs: tuple[jax.Array, ...], ws: GdnWeights, ids_i: tuple[jax.Array, ...]
            ) -> tuple[jax.Array, jax.Array]:  # [M | C] entering [B, Hv, Dk, Dk + Dv] -> (unused [B, 1], after)
        qt, kt, vt, bt, at, hq, hk, hv = xs
        st, hs = ids_i
        qr, kr, vr, g, beta = rule_inputs(qt, kt, vt, bt, at, ws, st, (hq, hk, hv, hs), choices=choices)
        _, c_after, _, m_after = _state_map_passes(qr, kr, vr, g, beta, state[..., :Dk], state[..., Dk:],
                                                   segment_ids=st, chunk_size=chunk_size, choices=choices)
        return jnp.zeros((B, 1), jnp.float32), jnp.concatenate([m_after, c_after], axis=-1)

    state0 = jnp.concatenate([_identity_map(B, Hv, Dk), jnp.zeros((B, Hv, Dk, Dv), jnp.float32)],
                             axis=-1)  # M = I, C = 0
    _, ends = tile_scan(one, state0, tiles, weights, ids,
                        document_starts_tile(ids[0]))  # a document start inside the shard drops M and C
    start = _entering_state(ends[..., :Dk], ends[..., Dk:], reset, sp)
    segment = functools.partial(gdn_segment, eps=eps, chunk_size=chunk_size, choices=choices)
    return tiled_gdn_core(segment, tokens, weights, segment_ids, tile=tile, halo=h, first_halo=halo,
                          initial_state=start)


def gdn_state_passing(
    tokens: GdnTokens,  # [B, S/sp, ...] each: this device's sequence shard of the raw projections
    weights: GdnWeights,
    segment_ids: jax.Array,  # [B, S/sp]
    *,
    mesh: jax.sharding.AbstractMesh,
    eps: float,
    chunk_size: int,
    choices: KernelChoices | None,
) -> jax.Array:  # [B, S/sp, Hv, Dv]
    """The gated DeltaNet mixer on sequence shards with state passing (see the module docstring), by
    the kernels of `choices` (None: the defaults for jax's backend)."""
    choices = resolved(choices)
    sp = mesh_axis_size(mesh, SP)
    bsz, s = tokens.q.shape[:2]
    halo = conv_halo(weights)
    if s % sp:
        raise ValueError(f"sequence length {s} is not divisible by sp = {sp}; pad it (the model does)")
    if s // sp < halo:
        raise ValueError(f"GDN state passing needs >= {halo} tokens per shard (conv halo), got {s // sp}; "
                         "use the all_to_all mode or a smaller sp")
    batch = FSDP if bsz % mesh_axis_size(mesh, FSDP) == 0 else None
    seq4, seq3 = P(batch, SP, None, None), P(batch, SP, None)
    in_specs = (GdnTokens(q=seq4, k=seq4, v=seq4, z=seq4, b=seq3, a=seq3), GdnWeights(*[P()] * 6), P(batch, SP))

    tile = delta_rule_tile(chunk_size, choices)
    if tile is not None and s // sp > tile:  # long shards: two sweeps of tiles, their backward written out
        local = functools.partial(_local_gdn, eps=eps, chunk_size=chunk_size, sp=sp, tile=tile, choices=choices)
    else:
        local = apply_gdn_remat(functools.partial(_local_gdn, eps=eps, chunk_size=chunk_size, sp=sp, tile=None,
                                                  choices=choices), choices)

    with jax.named_scope(GDN_STATE_SCOPE):
        return jax.shard_map(local, mesh=mesh, in_specs=in_specs, out_specs=seq4, check_vma=False)(
            tokens, weights, segment_ids)
