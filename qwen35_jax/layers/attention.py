"""Gated full attention: q_proj gives [query, gate] per head, q/k RMSNorm, partial rotary, GQA, sigmoid gate."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from qwen35_kernels.attention import attention_core, decode_attention

from qwen35_jax.config import Qwen35Config
from qwen35_jax.layers.cache import AttentionCache
from qwen35_jax.layers.linear import Linear
from qwen35_jax.layers.norms import RMSNorm
from qwen35_jax.layers.rope import apply_rope
from qwen35_jax.parallel.ulysses import ulysses_attention


class Attention(nnx.Module):
    def __init__(self, config: Qwen35Config, *, rngs: nnx.Rngs):
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        lin = dict(use_bias=False, dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype), rngs=rngs,
                   kernel_init=nnx.initializers.normal(0.02))
        d, h, kh, dh = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = Linear(d, h * dh * 2, **lin)  # output [H, 2, Dh]: query then gate per head
        self.k_proj = Linear(d, kh * dh, **lin)
        self.v_proj = Linear(d, kh * dh, **lin)
        self.o_proj = Linear(h * dh, d, **lin)
        self.q_norm = RMSNorm(dh, eps=c.rms_norm_eps, param_dtype=c.param_dtype)
        self.k_norm = RMSNorm(dh, eps=c.rms_norm_eps, param_dtype=c.param_dtype)

    def project(self, x: jax.Array, cos: jax.Array, sin: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
        """x: [B, S, D], cos/sin: [B, S, R] -> q, gate [B, S, H, Dh] and k, v [B, S, K, Dh]: q and k normed
        and rotated, as attention and the cache read them."""
        b, s, _ = x.shape
        h, kh, dh = self.num_heads, self.num_kv_heads, self.head_dim
        qg = self.q_proj(x).reshape(b, s, h, 2 * dh)
        q, gate = qg[..., :dh], qg[..., dh:]  # [B, S, H, Dh] each
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).reshape(b, s, kh, dh)), cos, sin)
        v = self.v_proj(x).reshape(b, s, kh, dh)
        return q, gate, k, v

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """x: [B, S, D], cos/sin: [B, S, R], segment_ids: [B, S] -> [B, S, D]"""
        return self.prefill(x, cos, sin, segment_ids)[0]

    def prefill(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
        """The layer on a whole sequence, and what a cache keeps of it: out [B, S, D], k and v [B, S, K, Dh]."""
        b, s, _ = x.shape
        q, gate, k, v = self.project(x, cos, sin)
        out = ulysses_attention(attention_core, q, k, v, segment_ids)  # [B, S, H, Dh]; seq<->heads under sp
        out = out * jax.nn.sigmoid(gate)
        return self.o_proj(out.reshape(b, s, -1)), k, v

    def decode(self, x: jax.Array, cos: jax.Array, sin: jax.Array, cache: AttentionCache, block: int,
               positions: jax.Array) -> tuple[jax.Array, AttentionCache]:
        """One new token per row. x: [B, 1, D], cos/sin: [B, 1, R], positions: [B] int, the slot of each
        row's token; `cache` stacked over blocks [NB, B, L, K, Dh], this layer's at `block` -> out
        [B, 1, D] and the cache with the token's key and value in their slot (written in place)."""
        b = x.shape[0]
        q, gate, k, v = self.project(x, cos, sin)  # [B, 1, ., Dh]
        rows = jnp.arange(b)
        cache = AttentionCache(k=cache.k.at[block, rows, positions].set(k[:, 0].astype(cache.k.dtype)),
                               v=cache.v.at[block, rows, positions].set(v[:, 0].astype(cache.v.dtype)))
        out = decode_attention(q[:, 0], cache.k[block], cache.v[block], positions + 1)  # [B, H, Dh]
        out = out * jax.nn.sigmoid(gate[:, 0])
        return self.o_proj(out.reshape(b, 1, -1)), cache
