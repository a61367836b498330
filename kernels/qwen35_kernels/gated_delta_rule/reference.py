"""Gated delta rule: the per-token recurrence, slow and obvious, the oracle of every faster form.

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

_HI = jax.lax.Precision.HIGHEST


def check_and_prepare(q, k, v, g, beta, segment_ids, initial_state, *, repeat_keys=True, cast_qkv=True):
    """Validate shapes, cast to float32 (q, k, v only if `cast_qkv`), repeat key heads onto value heads
    (if asked); make doc index/valid."""
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
    g, beta = g.astype(f32), beta.astype(f32)
    if cast_qkv:
        q, k, v = (x.astype(f32) for x in (q, k, v))
    if repeat_keys and Hv != Hk:
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
    q, k, v, g, beta, valid, doc, state = check_and_prepare(q, k, v, g, beta, segment_ids, initial_state)
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
