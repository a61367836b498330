"""Gated full attention: q_proj gives [query, gate] per head, q/k RMSNorm, partial rotary, GQA, sigmoid gate."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from qwen35_jax.config import Qwen35Config
from qwen35_jax.layers.attention_kernels import KERNELS, check_attention_inputs, resolve_implementation
from qwen35_jax.layers.norms import RMSNorm
from qwen35_jax.layers.rope import apply_rope
from qwen35_jax.parallel.ulysses import ulysses_attention


def _attend_block(qg: jax.Array, k: jax.Array, v: jax.Array, q_idx: jax.Array, q_seg: jax.Array,
                  kv_seg: jax.Array) -> jax.Array:
    """One block of queries against every key, in head-major layout.

    qg: [B, K, G, Q, Dh], k/v: [B, K, T, Dh], q_idx: [Q] absolute query positions, q_seg: [B, Q],
    kv_seg: [B, T] -> [B, K, G, Q, Dh]. Head-major operands keep both einsums plain batched matmuls
    whose outputs need no relayout; a sequence-major layout made XLA transpose every [Q, T] score block.
    """
    dh = qg.shape[-1]
    logits = jnp.einsum("bkgqd,bktd->bkgqt", qg, k).astype(jnp.float32) * (dh ** -0.5)  # [B, K, G, Q, T]
    causal = q_idx[:, None] >= jnp.arange(k.shape[2])[None, :]  # [Q, T]
    same_doc = q_seg[:, :, None] == kv_seg[:, None, :]  # [B, Q, T]
    mask = (causal[None] & same_doc)[:, None, None]  # [B, 1, 1, Q, T]
    logits = jnp.where(mask, logits, jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(logits, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgqt,bktd->bkgqd", probs, v)


def attention_core(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                   block_q: int = 512, implementation: str | None = None) -> jax.Array:
    """Causal softmax attention that never crosses documents; softmax in float32.

    q: [B, S, H, Dh] (normed, rotated), k/v: [B, S, K, Dh] with H % K == 0, segment_ids: [B, S]
    -> [B, S, H, Dh]. Scale 1/sqrt(Dh). Query head h reads kv head h // (H // K).
    `implementation` (None: the `attention_implementation` context, default "auto") picks a flash
    kernel on GPU/TPU (`attention_kernels.py`); the XLA code below runs on CPU and is the reference.
    Sequences longer than `block_q` run block by block of queries, each against only the keys up to
    its last query (the later ones are all masked: about half the work of every score matrix is
    skipped), rematerialised in the backward pass: peak memory O(block_q * S) per head instead of
    O(S^2). Each row's softmax still sees every key it may attend to, so the result is the same.
    """
    check_attention_inputs(q, k, v, segment_ids)
    name = resolve_implementation(implementation)
    if name != "xla":
        return KERNELS[name](q, k, v, segment_ids)
    b, s, h, dh = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, s, kh, h // kh, dh).transpose(0, 2, 3, 1, 4)  # [B, K, G, S, Dh]
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, Dh]
    if s <= block_q:
        out = _attend_block(qg, kt, vt, jnp.arange(s), segment_ids, segment_ids)
    else:
        one = jax.checkpoint(_attend_block)
        outs = []
        for start in range(0, s, block_q):  # static shapes: block i sees keys [0, end_i)
            end = min(start + block_q, s)
            outs.append(one(qg[:, :, :, start:end], kt[:, :, :end], vt[:, :, :end], jnp.arange(start, end),
                            segment_ids[:, start:end], segment_ids[:, :end]))  # [B, K, G, Q_i, Dh]
        out = jnp.concatenate(outs, axis=3)  # [B, K, G, S, Dh]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, s, h, dh)


class Attention(nnx.Module):
    def __init__(self, config: Qwen35Config, *, rngs: nnx.Rngs):
        c = config
        self.num_heads, self.num_kv_heads, self.head_dim = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        lin = dict(use_bias=False, dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype), rngs=rngs,
                   kernel_init=nnx.initializers.normal(0.02))
        d, h, kh, dh = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        self.q_proj = nnx.Linear(d, h * dh * 2, **lin)  # output [H, 2, Dh]: query then gate per head
        self.k_proj = nnx.Linear(d, kh * dh, **lin)
        self.v_proj = nnx.Linear(d, kh * dh, **lin)
        self.o_proj = nnx.Linear(h * dh, d, **lin)
        self.q_norm = RMSNorm(dh, eps=c.rms_norm_eps, param_dtype=c.param_dtype)
        self.k_norm = RMSNorm(dh, eps=c.rms_norm_eps, param_dtype=c.param_dtype)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """x: [B, S, D], cos/sin: [B, S, R], segment_ids: [B, S] -> [B, S, D]"""
        b, s, _ = x.shape
        h, kh, dh = self.num_heads, self.num_kv_heads, self.head_dim
        qg = self.q_proj(x).reshape(b, s, h, 2 * dh)
        q, gate = qg[..., :dh], qg[..., dh:]  # [B, S, H, Dh] each
        q = apply_rope(self.q_norm(q), cos, sin)
        k = apply_rope(self.k_norm(self.k_proj(x).reshape(b, s, kh, dh)), cos, sin)
        v = self.v_proj(x).reshape(b, s, kh, dh)
        out = ulysses_attention(attention_core, q, k, v, segment_ids)  # [B, S, H, Dh]; seq<->heads under sp
        out = out * jax.nn.sigmoid(gate)
        return self.o_proj(out.reshape(b, s, h * dh))
