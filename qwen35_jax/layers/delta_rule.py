"""Gated delta rule: the per-token recurrence (test oracle) and the chunked UT/WY form.

State S [Dk, Dv] per head. For each token t of a document:

    S <- exp(g_t) * S
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T q_t

q and k arrive L2-normalised, q already scaled by Dk**-0.5. Key heads may be fewer than value heads
(Hv % Hk == 0); value head h reads key head h // (Hv // Hk).

Documents (`segment_ids` [B, S], ids >= 1, 0 = padding): the state restarts from zero at every
document start (a non-zero id that differs from the previous token's id). Padding tokens are
transparent no-ops: they leave the state untouched and output zeros. `initial_state` belongs to the
document of the first token. The final state is the state after the last token, i.e. that of the last
document (trailing padding does not change it). All arithmetic is float32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen35_jax.layers.tiling import delta_rule_tile, tiled_delta_rule
from qwen35_jax.layers.triangular import unit_lower_solve

_HI = jax.lax.Precision.HIGHEST


def _check_and_prepare(q, k, v, g, beta, segment_ids, initial_state):
    """Validate shapes, cast to float32, repeat key heads onto value heads; make doc index/valid."""
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, S, Hk, Dk], got q {q.shape} and k {k.shape}")
    B, S, Hk, Dk = q.shape
    if v.ndim != 4 or v.shape[:2] != (B, S):
        raise ValueError(f"v must be [B, S, Hv, Dv] with B, S = {(B, S)}, got {v.shape}")
    Hv, Dv = v.shape[2:]
    if Hv % Hk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of key heads ({Hk})")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, S, Hv):
            raise ValueError(f"{name} must be [B, S, Hv] = {(B, S, Hv)}, got {x.shape}")
    if initial_state is not None and initial_state.shape != (B, Hv, Dk, Dv):
        raise ValueError(f"initial_state must be [B, Hv, Dk, Dv] = {(B, Hv, Dk, Dv)}, got {initial_state.shape}")
    if segment_ids is not None and segment_ids.shape != (B, S):
        raise ValueError(f"segment_ids must be [B, S] = {(B, S)}, got {segment_ids.shape}")

    f32 = jnp.float32
    q, k, v, g, beta = (x.astype(f32) for x in (q, k, v, g, beta))
    if Hv != Hk:
        q = jnp.repeat(q, Hv // Hk, axis=2)  # [B, S, Hv, Dk]
        k = jnp.repeat(k, Hv // Hk, axis=2)
    valid, doc = document_index(segment_ids, B, S)
    g = jnp.where(valid[..., None], g, 0.0)  # padding never decays the state
    state = jnp.zeros((B, Hv, Dk, Dv), f32) if initial_state is None else initial_state.astype(f32)
    return q, k, v, g, beta, valid, doc, state


def document_index(segment_ids: jax.Array | None, B: int, S: int) -> tuple[jax.Array, jax.Array]:
    """valid [B, S] bool (not padding) and doc [B, S] int32: the running count of document starts.

    A document starts where a non-zero id differs from the previous token's id (never at t = 0, so
    that an initial state continues the first document). Two tokens share a document iff their doc
    indices are equal and both are valid; padding inherits the index of the document before it.
    """
    if segment_ids is None:
        return jnp.ones((B, S), bool), jnp.zeros((B, S), jnp.int32)
    seg = segment_ids.astype(jnp.int32)
    prev = jnp.concatenate([seg[:, :1], seg[:, :-1]], axis=1)
    start = (seg != prev) & (seg != 0)
    return seg != 0, jnp.cumsum(start.astype(jnp.int32), axis=1)


def recurrent_gated_delta_rule(
    q: jax.Array,  # [B, S, Hk, Dk]
    k: jax.Array,  # [B, S, Hk, Dk]
    v: jax.Array,  # [B, S, Hv, Dv]
    g: jax.Array,  # [B, S, Hv] log-decay, <= 0
    beta: jax.Array,  # [B, S, Hv]
    *,
    segment_ids: jax.Array | None = None,  # [B, S]
    initial_state: jax.Array | None = None,  # [B, Hv, Dk, Dv]
) -> tuple[jax.Array, jax.Array]:  # [B, S, Hv, Dv] float32, [B, Hv, Dk, Dv] float32
    """Per-token `lax.scan`; slow and obvious, the oracle for the chunked form."""
    q, k, v, g, beta, valid, doc, state = _check_and_prepare(q, k, v, g, beta, segment_ids, initial_state)
    prev_doc = jnp.concatenate([doc[:, :1], doc[:, :-1]], axis=1)
    reset = doc != prev_doc  # [B, S]

    def step(S, xs):  # S [B, H, Dk, Dv]
        q_t, k_t, v_t, g_t, b_t, valid_t, reset_t = xs
        S = jnp.where(reset_t[:, None, None, None], 0.0, S)
        S_new = S * jnp.exp(g_t)[..., None, None]
        kv_mem = jnp.einsum("bhkv,bhk->bhv", S_new, k_t, precision=_HI)
        delta = (v_t - kv_mem) * b_t[..., None]
        S_new = S_new + k_t[..., :, None] * delta[..., None, :]
        o_t = jnp.einsum("bhkv,bhk->bhv", S_new, q_t, precision=_HI)
        keep = valid_t[:, None, None, None]
        return jnp.where(keep, S_new, S), jnp.where(keep[..., 0], o_t, 0.0)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, valid, reset))
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1), state


def chunked_gated_delta_rule(
    q: jax.Array,  # [B, S, Hk, Dk]
    k: jax.Array,  # [B, S, Hk, Dk]
    v: jax.Array,  # [B, S, Hv, Dv]
    g: jax.Array,  # [B, S, Hv] log-decay, <= 0
    beta: jax.Array,  # [B, S, Hv]
    *,
    segment_ids: jax.Array | None = None,  # [B, S]
    initial_state: jax.Array | None = None,  # [B, Hv, Dk, Dv]
    chunk_size: int = 64,
) -> tuple[jax.Array, jax.Array]:  # [B, S, Hv, Dv] float32, [B, Hv, Dk, Dv] float32
    """Chunked UT/WY form: intra-chunk work as batched matmuls, `lax.scan` over chunks for the state.

    Document boundaries are masks on the intra-chunk decay matrix, on which tokens read the carried
    state, and on which tokens (and whether the old state) enter the state carried out of a chunk.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    tile = delta_rule_tile(chunk_size)  # long sequences: tile by tile, one tile's chunks in memory at a time
    if tile is not None and q.ndim == 4 and q.shape[1] > tile:
        return tiled_delta_rule(chunked_gated_delta_rule, q, k, v, g, beta, segment_ids=segment_ids,
                                initial_state=initial_state, chunk_size=chunk_size, tile=tile)
    q, k, v, g, beta, valid, doc, state = _check_and_prepare(q, k, v, g, beta, segment_ids, initial_state)
    B, S, H, Dk = q.shape
    Dv = v.shape[-1]
    L = chunk_size
    pad = (-S) % L
    n = (S + pad) // L

    def chunks(x, fill=0):  # [B, S, ...] -> [B, n, L, ...], padded with no-op tokens
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)
        return x.reshape(B, n, L, *x.shape[2:])

    # Per-head tensors as [B, n, H, L, ...].
    q, k, v = (jnp.swapaxes(chunks(x), 2, 3) for x in (q, k, v))  # [B, n, H, L, D]
    g, beta = (jnp.swapaxes(chunks(x), 2, 3) for x in (g, beta))  # [B, n, H, L]
    valid = chunks(valid, False)  # [B, n, L]
    # The no-op tail tokens take the doc index of the token before them (doc indices never decrease).
    doc = jax.lax.cummax(chunks(doc, -1).reshape(B, n * L), axis=1).reshape(B, n, L)
    # Doc index of the token just before each chunk (0 for the first: the initial state's document).
    doc_before = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), doc[:, :-1, -1]], axis=1)  # [B, n]

    same_doc = (doc[..., :, None] == doc[..., None, :]) & valid[..., :, None] & valid[..., None, :]
    causal = jnp.tril(jnp.ones((L, L), bool))
    pair_mask = (same_doc & causal)[:, :, None]  # [B, n, 1, L, L]
    reads_state = (valid & (doc == doc_before[..., None]))[:, :, None]  # [B, n, 1, L]
    writes_state = (valid & (doc == doc[..., -1:]))[:, :, None]  # [B, n, 1, L]
    keeps_state = (doc[..., -1] == doc_before)[:, :, None]  # [B, n, 1]

    cum = jnp.cumsum(g, axis=-1)  # [B, n, H, L]
    diff = cum[..., :, None] - cum[..., None, :]  # [B, n, H, L, L]
    decay = jnp.where(pair_mask, jnp.exp(jnp.where(pair_mask, diff, 0.0)), 0.0)

    k_beta = k * beta[..., None]
    v_beta = v * beta[..., None]
    # Unit lower-triangular system (I + A) with A = strict_tril(k_beta k^T * decay).
    A = jnp.einsum("...id,...jd->...ij", k_beta, k, precision=_HI) * decay
    rhs = jnp.concatenate([v_beta, k_beta * (jnp.exp(cum) * reads_state)[..., None]], axis=-1)
    sol = unit_lower_solve(A, rhs)  # uses only the strict lower triangle of A
    u, w = sol[..., :Dv], sol[..., Dv:]  # u [B, n, H, L, Dv]: new values; w [.., Dk]: decayed keys reading S

    intra = jnp.einsum("...id,...jd->...ij", q, k, precision=_HI) * decay  # [B, n, H, L, L]
    q_read = q * (jnp.exp(cum) * reads_state)[..., None]
    k_write = k * (jnp.exp(cum[..., -1:] - cum) * writes_state)[..., None]
    chunk_decay = jnp.exp(cum[..., -1]) * keeps_state  # [B, n, H]

    def step(S, xs):  # S [B, H, Dk, Dv]
        u_c, w_c, q_c, k_c, intra_c, dec_c = xs
        v_new = u_c - jnp.einsum("bhlk,bhkv->bhlv", w_c, S, precision=_HI)
        o = jnp.einsum("bhlk,bhkv->bhlv", q_c, S, precision=_HI)
        o = o + jnp.einsum("bhij,bhjv->bhiv", intra_c, v_new, precision=_HI)
        S = S * dec_c[..., None, None] + jnp.einsum("bhlk,bhlv->bhkv", k_c, v_new, precision=_HI)
        return S, o

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (u, w, q_read, k_write, intra, chunk_decay))
    state, out = jax.lax.scan(step, state, xs)  # out [n, B, H, L, Dv]
    out = jnp.transpose(out, (1, 0, 3, 2, 4)).reshape(B, n * L, H, Dv)[:, :S]
    return out, state

