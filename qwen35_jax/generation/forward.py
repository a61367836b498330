"""The model's two generation passes over its blocks:

- `prefill`: right-padded prompts through the training path (chunked GDN kernels, Ulysses under a
  mesh, sequences split over sp, blocks scanned or not as `scan_layers` says), returning each row's
  last hidden state and the hybrid cache.
- `decode_step`: one token per row against the cache. Rows are whole on one device (the cache and
  the token are split over rows on all fsdp x sp devices), parameters stay ZeRO-3 sharded. Its
  blocks run one after another whatever `scan_layers` says, each writing its slots of the stacked
  cache in place: a scan would read each block's cache as a slice and stack the updated ones into a
  new buffer, copying the whole cache every token.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from qwen35_jax.generation.cache import HybridCache
from qwen35_jax.layers.cache import AttentionCache
from qwen35_jax.layers.rope import rope_cos_sin
from qwen35_jax.model import Block, Qwen35ForCausalLM, embed_lookup, scans_layers
from qwen35_jax.parallel.mesh import ACT_BSD, FSDP, SP, TOKENS_BS, constrain

def rows_spec(ndim: int, row_axis: int = 0) -> P:
    """The decode layout of an array with rows on `row_axis`: split over (fsdp, sp), the rest whole."""
    spec: list[Any] = [None] * ndim
    spec[row_axis] = (FSDP, SP)
    return P(*spec)


ROWS = rows_spec(1)  # [B]: rows split over every device
ROWS_HIDDEN = rows_spec(3)  # [B, 1, D]


def constrain_cache(cache: HybridCache) -> HybridCache:
    """The decode layout of a cache: every [NB, B, ...] array split over rows."""
    layers = jax.tree.map(lambda x: constrain(x, rows_spec(x.ndim, 1)), cache.layers)
    return HybridCache(layers=layers, lengths=constrain(cache.lengths, ROWS))


def over_blocks(model: Qwen35ForCausalLM, body: Callable[[Block, jax.Array], tuple[jax.Array, Any]],
                x: jax.Array) -> tuple[jax.Array, Any]:
    """`body(block, x) -> (x, out)` over the blocks in order, the outs stacked [NB, ...], under
    `nnx.scan` or unrolled as the model's forward pass runs its blocks."""
    if scans_layers(model.config):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=(nnx.Carry, 0))
        def run(block: Block, x: jax.Array) -> tuple[jax.Array, Any]:
            return body(block, x)

        return run(model.blocks, x)
    graphdef, stacked = nnx.split(model.blocks)
    outs = []
    for i in range(model.config.num_blocks):
        x, out = body(nnx.merge(graphdef, jax.tree.map(lambda p, i=i: p[i], stacked)), x)
        outs.append(out)
    return x, jax.tree.map(lambda *xs: jnp.stack(xs), *outs)


def _cos_sin(model: Qwen35ForCausalLM, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
    """positions [B, S] -> cos, sin [B, S, R] (text positions: t = h = w under mrope)."""
    if model.config.mrope_section is not None:
        positions = jnp.broadcast_to(positions, (3, *positions.shape))
    return rope_cos_sin(positions, model.config)


def prefill(
    model: Qwen35ForCausalLM,
    tokens: jax.Array,  # [B, S] int32 right-padded prompts; B % (fsdp * sp) == 0, S % sp == 0 on a mesh
    lengths: jax.Array,  # [B] int32 prompt lengths, 1 <= lengths <= S
    max_len: int,  # cache slots per row: S plus the tokens to generate
) -> tuple[jax.Array, HybridCache]:  # final-normed hidden state of each row's last prompt token [B, D], cache
    """Every prompt through the model at once; padding is segment 0, so it changes no row."""
    b, s = tokens.shape
    positions = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    segment_ids = (positions < lengths[:, None]).astype(jnp.int32)  # [B, S]
    tokens, segment_ids = constrain(tokens, TOKENS_BS), constrain(segment_ids, TOKENS_BS)
    cos, sin = _cos_sin(model, positions)
    x = constrain(embed_lookup(model.embed_tokens.embedding[...], tokens, model.config.dtype), ACT_BSD)

    def body(block: Block, x: jax.Array) -> tuple[jax.Array, Any]:
        return block.prefill(x, cos, sin, segment_ids, lengths)

    x, layers = over_blocks(model, body, x)
    pad = max_len - s
    layers = tuple(AttentionCache(*(jnp.pad(a, ((0, 0), (0, 0), (0, pad), (0, 0), (0, 0))) for a in c))
                   if isinstance(c, AttentionCache) else c for c in layers)  # K/V [NB, B, max_len, K, Dh]
    last = jnp.take_along_axis(x, (lengths - 1)[:, None, None], axis=1)  # [B, 1, D]
    hidden = model.norm(constrain(last, ROWS_HIDDEN))[:, 0]
    return hidden, constrain_cache(HybridCache(layers=layers, lengths=lengths.astype(jnp.int32)))


def decode_step(
    model: Qwen35ForCausalLM,
    tokens: jax.Array,  # [B] int32: each row's newest token, to be cached at position cache.lengths
    cache: HybridCache,
    advance: jax.Array,  # [B] bool: rows whose length grows (finished rows rewrite their last slot)
) -> tuple[jax.Array, HybridCache]:  # final-normed hidden state [B, D] after the token, the cache
    """One token of every row through the model against the cache."""
    positions = cache.lengths  # [B]
    cos, sin = _cos_sin(model, positions[:, None])  # [B, 1, R]
    x = jnp.take(model.embed_tokens.embedding[...].astype(model.config.dtype), tokens, axis=0)[:, None]
    x = constrain(x, ROWS_HIDDEN)  # [B, 1, D]

    graphdef, stacked = nnx.split(model.blocks)
    layers = cache.layers
    for i in range(model.config.num_blocks):
        block = nnx.merge(graphdef, jax.tree.map(lambda p, i=i: p[i], stacked))
        x, layers = block.decode(x, cos, sin, layers, i, positions)
        x = constrain(x, ROWS_HIDDEN)
    hidden = model.norm(x)[:, 0]
    lengths = jnp.where(advance, positions + 1, positions)
    return hidden, constrain_cache(HybridCache(layers=layers, lengths=lengths))

