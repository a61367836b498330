"""Gated full attention: q_proj gives [query, gate] per head, q/k RMSNorm, partial rotary, GQA, sigmoid gate."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from qwen35_kernels.attention import attention_core, decode_attention

from qwen35_jax.config import Qwen35Config
from qwen35_jax.layers.cache import AttentionCache, LayerCache, is_decode_step
from qwen35_jax.layers.linear import Linear
from qwen35_jax.layers.norms import RMSNorm
from qwen35_jax.layers.rope import apply_rope
from qwen35_jax.parallel.ulysses import ulysses_attention


class Attention(nnx.Module):
    def __init__(self, config: Qwen35Config, *, rngs: nnx.Rngs):
        c = self.config = config
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

    def core(self, q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """The attention kernel of the config's kernel choices on one device's heads:
        q [B, S, H, Dh], k/v [B, S, K, Dh], segment_ids [B, S] -> [B, S, H, Dh]."""
        return attention_core(q, k, v, segment_ids, choices=self.config.kernels)

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

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array,
                 cache: LayerCache | None = None) -> jax.Array | tuple[jax.Array, AttentionCache]:
        """x: [B, S, D], cos/sin: [B, S, R], segment_ids: [B, S] -> [B, S, D]; with `cache`, also this
        layer's stacked K/V [NB, B, L, K, Dh] holding the call's keys and values (`layers/cache.py`).

        A sequence (training, or a prompt that starts the cache) runs the training kernel, sequence-
        parallel under a mesh; a decode step (one token per row, rows whole on a device) attends to
        the cache, its own slot (the row's cache length) written in place first."""
        b, s, _ = x.shape
        q, gate, k, v = self.project(x, cos, sin)
        if is_decode_step(x, cache):
            slots, block, rows = cache.lengths, cache.block, jnp.arange(b)
            kv = AttentionCache(k=cache.stacked.k.at[block, rows, slots].set(k[:, 0].astype(cache.stacked.k.dtype)),
                                v=cache.stacked.v.at[block, rows, slots].set(v[:, 0].astype(cache.stacked.v.dtype)))
            out = decode_attention(q[:, 0], kv.k[block], kv.v[block], slots + 1)[:, None]  # [B, 1, H, Dh]
        else:
            out = ulysses_attention(self.core, q, k, v, segment_ids)  # [B, S, H, Dh]; seq<->heads under sp
            if cache is not None:
                kv = AttentionCache(*(c.at[cache.block, :, :s].set(a.astype(c.dtype))
                                      for c, a in zip(cache.stacked, (k, v))))
        out = self.o_proj((out * jax.nn.sigmoid(gate)).reshape(b, s, -1))
        return out if cache is None else (out, kv)
