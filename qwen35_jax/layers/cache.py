"""What the token mixers keep between forward calls: the hybrid decode cache. NamedTuples, hence
pytrees, every array stacked over blocks like the parameters ([num_blocks, ...]) and sharded per field.

- Attention: the keys and values of every cached position, after the norm and rotary.
- Gated DeltaNet: the conv window (the last Kc - 1 raw q|k|v inputs, as `in_proj_qkv` gave them)
  and the delta-rule state. Its size does not depend on the sequence length.

A forward call given a cache appends its tokens to it (`Qwen35ForCausalLM.__call__`): a call of one
token per row is a decode step against what the cache holds; a longer call is a prompt, and starts
the cache (its rows must hold nothing yet).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from qwen35_jax.config import Qwen35Config


class AttentionCache(NamedTuple):
    k: Any  # [NB, B, L, K, Dh] compute dtype; slot t holds position t's key (normed, rotated)
    v: Any  # [NB, B, L, K, Dh]


class GdnCache(NamedTuple):
    conv: Any  # [NB, B, Kc - 1, C] compute dtype: the last Kc - 1 raw inputs, channels q | k | v (zeros before the row)
    state: Any  # [NB, B, Hv, Dk, Dv] float32: the delta-rule state after the last token


class HybridCache(NamedTuple):
    # One entry per layer of the repeating block, in `layer_types` order: AttentionCache or GdnCache.
    layers: tuple[Any, ...]
    lengths: Any  # [B] int32: tokens cached per row = the slot of its next token


class LayerCache(NamedTuple):
    """One layer's view of the hybrid cache during a forward call."""
    stacked: AttentionCache | GdnCache  # every block's arrays of this layer kind, [NB, B, ...]
    block: int  # the block whose slot this layer reads and writes
    lengths: jax.Array  # [B] int32: tokens each row held before this call (where its tokens go)


def is_decode_step(x: jax.Array, cache: Any) -> bool:
    """Whether a layer call is a decode step: a cache and one token per row (x [B, 1, ...])."""
    return cache is not None and x.shape[1] == 1


def init_cache(config: Qwen35Config, batch: int, max_len: int) -> HybridCache:
    """An empty cache of `batch` rows with `max_len` attention slots each (zeros, lengths 0)."""
    nb, dtype = config.num_blocks, jnp.dtype(config.dtype)
    conv_channels = (2 * config.linear_num_key_heads * config.linear_key_head_dim
                     + config.linear_num_value_heads * config.linear_value_head_dim)
    layers = []
    for kind in config.layer_types[:config.block_period]:
        if kind == "full_attention":
            kv = jnp.zeros((nb, batch, max_len, config.num_key_value_heads, config.head_dim), dtype)
            layers.append(AttentionCache(k=kv, v=kv))
        else:
            layers.append(GdnCache(
                conv=jnp.zeros((nb, batch, config.linear_conv_kernel_dim - 1, conv_channels), dtype),
                state=jnp.zeros((nb, batch, config.linear_num_value_heads, config.linear_key_head_dim,
                                 config.linear_value_head_dim), jnp.float32)))
    return HybridCache(layers=tuple(layers), lengths=jnp.zeros((batch,), jnp.int32))
