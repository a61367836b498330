"""Internal padding so that any [B, S] batch runs on any (fsdp, sp) mesh.

Ulysses needs S divisible by sp and the batch split needs B divisible by fsdp. The model pads both at
the end (segment id 0 = padding, so nothing attends to it and no recurrent state carries it) and
strips the padding from its output; users never pad by hand. Positions are derived from the segment
ids on the global sequence *before* any split, so they restart at 0 in every document.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def padded_size(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def pad_inputs(
    tokens: jax.Array,  # [B, S]
    positions: jax.Array,  # [B, S] or [3, B, S]
    segment_ids: jax.Array,  # [B, S]
    fsdp: int,
    sp: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # [B', S'], [(3,) B', S'], [B', S']
    """Pad B to a multiple of fsdp and S to a multiple of sp: token 0, position 0, segment 0."""
    b, s = tokens.shape
    pb, ps = padded_size(b, fsdp) - b, padded_size(s, sp) - s
    if pb == 0 and ps == 0:
        return tokens, positions, segment_ids
    pad2 = ((0, pb), (0, ps))
    lead = ((0, 0),) * (positions.ndim - 2)
    return (
        jnp.pad(tokens, pad2),
        jnp.pad(positions, lead + pad2),
        jnp.pad(segment_ids, pad2),
    )


def strip(x: jax.Array, batch: int, seq: int) -> jax.Array:  # [B', S', ...] -> [B, S, ...]
    """Drop the rows and positions `pad_inputs` added."""
    return x[:batch, :seq]
