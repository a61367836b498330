"""The hybrid decode cache: per attention layer its keys and values, per gated DeltaNet layer its conv
window and delta-rule state, each stacked over blocks like the parameters ([num_blocks, ...]), and
the number of tokens each row holds.

Its size is known before a run (`cache_bytes`): the GDN part depends on the rows only, the attention
part grows with the prompt plus the new tokens.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax.numpy as jnp

from qwen35_jax.config import Qwen35Config


class HybridCache(NamedTuple):
    # One entry per layer of the repeating block, in `layer_types` order, every array [num_blocks, ...]:
    # AttentionCache k, v [NB, B, L, K, Dh] or GdnCache conv [NB, B, Kc - 1, C], state [NB, B, Hv, Dk, Dv].
    layers: tuple[Any, ...]
    lengths: Any  # [B] int32: tokens cached per row = the position of its next token


def cache_bytes(config: Qwen35Config, rows: int, max_len: int) -> dict[str, int]:
    """Bytes of the cache of `rows` rows of up to `max_len` tokens: {"attention", "gdn", "total"}."""
    item = jnp.dtype(config.dtype).itemsize
    n_attn = sum(kind == "full_attention" for kind in config.layer_types)
    n_gdn = len(config.layer_types) - n_attn
    attention = n_attn * 2 * rows * max_len * config.num_key_value_heads * config.head_dim * item
    conv_channels = (2 * config.linear_num_key_heads * config.linear_key_head_dim
                     + config.linear_num_value_heads * config.linear_value_head_dim)
    conv = rows * (config.linear_conv_kernel_dim - 1) * conv_channels * item
    state = rows * config.linear_num_value_heads * config.linear_key_head_dim * config.linear_value_head_dim * 4
    gdn = n_gdn * (conv + state)
    return {"attention": attention, "gdn": gdn, "total": attention + gdn}


def describe_cache(config: Qwen35Config, rows: int, max_len: int) -> str:
    """One line: the cache's total and its two parts, for `rows` rows of up to `max_len` tokens."""
    size = cache_bytes(config, rows, max_len)

    def mib(n: int) -> str:
        return f"{n / 2**20:,.1f} MiB"

    return (f"cache for {rows} rows x {max_len} tokens: {mib(size['total'])} (attention K/V {mib(size['attention'])}, "
            f"grows with the length; GDN conv + state {mib(size['gdn'])}, constant)")
