"""Attention of one new query per row against a key/value cache (the decode step), in XLA.

Each row attends to the first `lengths[b]` cache slots (the new token's own key included, written
before the call). The arithmetic follows the XLA training core (`xla.py`): scores from compute-dtype
operands accumulated in float32 and scaled by 1/sqrt(Dh), softmax in float32 after subtracting the row
maximum, probabilities rounded to v's dtype for the p @ v matmul, and the denominator summed from those
same rounded probabilities. One query per row makes the work [B, H, L]: no tiling is needed.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_MASKED = float(jnp.finfo(jnp.float32).min)


def decode_attention(
    q: jax.Array,  # [B, H, Dh] the new token's queries (normed, rotated)
    k_cache: jax.Array,  # [B, L, K, Dh] H % K == 0; query head h reads kv head h // (H // K)
    v_cache: jax.Array,  # [B, L, K, Dh]
    lengths: jax.Array,  # [B] int: slots [0, lengths[b]) are visible to row b (>= 1)
) -> jax.Array:  # [B, H, Dh] in v's dtype
    """Softmax attention of each row's query over its first `lengths[b]` cached keys."""
    b, h, dh = q.shape
    if k_cache.ndim != 4 or k_cache.shape != v_cache.shape or k_cache.shape[0] != b or k_cache.shape[3] != dh:
        raise ValueError(f"decode_attention: q {q.shape}, k_cache {k_cache.shape}, v_cache {v_cache.shape} "
                         f"must be [B, H, Dh] and [B, L, K, Dh]")
    n_kv = k_cache.shape[2]
    if h % n_kv:
        raise ValueError(f"decode_attention: {h} query heads are not a multiple of {n_kv} kv heads")
    if lengths.shape != (b,):
        raise ValueError(f"decode_attention: lengths must be [B] = [{b}], got {lengths.shape}")
    # Every query head against every kv head's keys, then each head's own: [B, L, K, Dh] is read as
    # [B, L * K, Dh] (a free reshape), so the dots contract the cache as it lies. A dot batched over
    # (B, K) would first copy the whole cache into a [B, K, L, Dh] layout every step; the K - 1 wasted
    # products per score cost less than that copy.
    length = k_cache.shape[1]
    g = h // n_kv
    s = jnp.einsum("bhd,bnd->bhn", q, k_cache.reshape(b, length * n_kv, dh).astype(q.dtype),
                   preferred_element_type=jnp.float32)  # [B, H, L * K]
    s = jnp.diagonal(s.reshape(b, n_kv, g, length, n_kv), axis1=1, axis2=4)  # [B, G, L, K]: head (k, g), key kv k
    s = s * (dh ** -0.5)
    visible = jnp.arange(length)[None, :] < lengths[:, None]  # [B, L]
    s = jnp.where(visible[:, None, :, None], s, _MASKED)
    p = jnp.exp(s - jnp.max(s, axis=2, keepdims=True)).astype(v_cache.dtype)  # [B, G, L, K]
    denom = jnp.sum(p.astype(jnp.float32), axis=2)  # [B, G, K]
    p = jnp.moveaxis(p, 3, 1).reshape(b, h, length)  # [B, H, L], head (k, g)
    out = jnp.einsum("bhl,ble->bhe", p, v_cache.reshape(b, length, n_kv * dh),
                     preferred_element_type=jnp.float32)  # [B, H, K * Dh]
    out = jnp.diagonal(out.reshape(b, n_kv, g, n_kv, dh), axis1=1, axis2=3)  # [B, G, Dh, K]
    out = jnp.moveaxis(out, 3, 1) / jnp.moveaxis(denom, 2, 1)[..., None]  # [B, K, G, Dh]
    return out.reshape(b, h, dh).astype(v_cache.dtype)
