"""The model's forward pass as generation calls it (`Qwen35ForCausalLM.__call__` with a cache):

- `prefill`: right-padded prompts through the training path (chunked GDN kernels, Ulysses under a
  mesh, sequences split over sp) into an empty cache; each row's last hidden state.
- `decode_step`: one token per row against the cache. Rows are whole on one device (the cache and
  the token are split over rows on all fsdp x sp devices), parameters stay ZeRO-3 sharded.

Prompts with images (a VLM): the prefill also takes the batch's `VisionInputs` and the rows' mrope
positions [3, B, S] (`data/mrope.py`); a decode step then takes each row's position offset, so that
generated token i of a row sits at next_position + i on all three axes (an image advances the
positions by max(h, w) / merge, not by its token count, so the cache length alone is not the
position). Text-only generation passes neither and traces the program it always did.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen35_jax.layers.cache import HybridCache, init_cache
from qwen35_jax.model import Qwen35ForCausalLM
from qwen35_jax.parallel.mesh import POSITIONS_3BS, TOKENS_BS, constrain, rows_spec
from qwen35_jax.vision.inputs import VisionInputs

ROWS = rows_spec(1)  # [B]: rows split over every device


def constrain_cache(cache: HybridCache) -> HybridCache:
    """The decode layout of a cache: every [NB, B, ...] array split over rows."""
    layers = jax.tree.map(lambda x: constrain(x, rows_spec(x.ndim, 1)), cache.layers)
    return HybridCache(layers=layers, lengths=constrain(cache.lengths, ROWS))


def prefill(
    model: Qwen35ForCausalLM,
    tokens: jax.Array,  # [B, S] int32 right-padded prompts; B % (fsdp * sp) == 0, S % sp == 0 on a mesh
    lengths: jax.Array,  # [B] int32 prompt lengths, 1 <= lengths <= S
    max_len: int,  # cache slots per row: S plus the tokens to generate
    positions: jax.Array | None = None,  # [3, B, S] int32 mrope positions of the prompts (None: 0..S-1)
    vision: VisionInputs | None = None,  # the batch's images, in row-major placeholder order (None: no tower)
) -> tuple[jax.Array, HybridCache]:  # final-normed hidden state of each row's last prompt token [B, D], cache
    """Every prompt through the model at once; padding is segment 0, so it changes no row."""
    b, s = tokens.shape
    segment_ids = (jnp.arange(s, dtype=jnp.int32)[None, :] < lengths[:, None]).astype(jnp.int32)  # [B, S]
    tokens, segment_ids = constrain(tokens, TOKENS_BS), constrain(segment_ids, TOKENS_BS)
    if positions is not None:
        positions = constrain(positions, POSITIONS_3BS)
    hidden, cache = model(tokens, positions=positions, segment_ids=segment_ids,
                          cache=constrain_cache(init_cache(model.config, b, max_len)), vision=vision)
    last = jnp.take_along_axis(hidden, (lengths - 1)[:, None, None], axis=1)  # [B, 1, D]
    return constrain(last, rows_spec(3))[:, 0], constrain_cache(cache)


def decode_step(
    model: Qwen35ForCausalLM,
    tokens: jax.Array,  # [B] int32: each row's newest token, to be cached at position cache.lengths
    cache: HybridCache,
    advance: jax.Array,  # [B] bool: rows whose length grows (finished rows rewrite their last slot)
    offsets: jax.Array | None = None,  # [B] int32: position - cache slot of each row's tokens (None: 0)
) -> tuple[jax.Array, HybridCache]:  # final-normed hidden state [B, D] after the token, the cache
    """One token of every row through the model against the cache. The token's position is its slot
    (cache.lengths) plus the row's offset: after a prompt with images, next_position - prompt length
    (transformers' rope_delta). Text positions (t = h = w) are given as [B, 1]."""
    positions = None if offsets is None else constrain((cache.lengths + offsets)[:, None], rows_spec(2))
    hidden, cache = model(tokens[:, None], positions=positions, segment_ids=advance[:, None].astype(jnp.int32),
                          cache=cache)
    return hidden[:, 0], constrain_cache(cache)
