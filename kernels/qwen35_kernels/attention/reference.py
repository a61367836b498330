"""Causal, document-masked attention, plain and slow: the whole [S, S] score matrix at once, the
semantics of `api.attention_core` written out (the oracle the XLA core and the flash kernels are
checked against in tests)."""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def reference_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """q: [B, S, H, Dh], k/v: [B, S, K, Dh] with H % K == 0, segment_ids: [B, S] -> [B, S, H, Dh] in
    q's dtype. Query i attends to key j iff j <= i and segment_ids[i] == segment_ids[j]; scale
    1/sqrt(Dh); everything in float32 at HIGHEST precision."""
    s, h, dh = q.shape[1], q.shape[2], q.shape[3]
    g = h // k.shape[2]
    kf, vf = (jnp.repeat(x.astype(jnp.float32), g, axis=2) for x in (k, v))  # head h <- kv head h // g
    scores = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), kf, precision=_HI) * dh ** -0.5
    seg = segment_ids.astype(jnp.int32)
    mask = jnp.tril(jnp.ones((s, s), bool))[None] & (seg[:, :, None] == seg[:, None, :])  # [B, S, S]
    scores = jnp.where(mask[:, None], scores, -jnp.inf)
    p = jax.nn.softmax(scores, axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, vf, precision=_HI).astype(q.dtype)
