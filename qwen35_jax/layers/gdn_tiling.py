"""The whole gated DeltaNet mixer tile by tile along the sequence, so that no float32 buffer of it
spans the whole sequence.

Under Ulysses every device runs the mixer on the whole sequence for its H/sp heads; the conv1d, the
L2 norms, the gates, the delta rule's float32 inputs and the gated norm are all [B, S, H/sp, d]
float32 arrays there, and their residuals for the backward pass dominate a long-context step.
`tiled_gdn_core` runs them on one tile at a time in a `lax.scan` whose backward recomputes each tile:
what persists across it is the raw (input dtype) q, k, v, z, b, a, the output, one delta-rule state
per tile and a conv halo per tile. Each tile receives:

- its conv halo: the Kc - 1 raw q, k, v tokens before it (with their segment ids, so that the window
  still stops at document starts; zeros and padding before the first tile, as the untiled conv pads);
- the delta-rule state after the previous tile, dropped where a document starts at its first token.

Exact up to float32 rounding (the delta rule's chunk scan restarts its summation at tile edges).
The backward is written out (`tiling.tile_scan`) so that its per-tile cotangent buffers exist only
once this layer's backward has begun.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from qwen35_jax.layers.tiling import document_starts_tile, stack_tiles, tile_scan, unstack_tiles

# segment(q, k, v, z, b, a, *weights, segment_ids, halo=(hq, hk, hv, hseg), initial_state=S0)
#   -> (out [B, T, Hv, Dv], final state [B, Hv, Dk, Dv])
Segment = Callable[..., tuple[jax.Array, jax.Array]]


def tiled_gdn_core(
    segment: Segment,
    q: jax.Array,  # [B, S, Hk, Dk] raw (before the conv)
    k: jax.Array,  # [B, S, Hk, Dk]
    v: jax.Array,  # [B, S, Hv, Dv]
    z: jax.Array,  # [B, S, Hv, Dv]
    b: jax.Array,  # [B, S, Hv]
    a: jax.Array,  # [B, S, Hv]
    weights: tuple[Any, ...],  # conv_q, conv_k, conv_v, A_log, dt_bias, norm_weight
    segment_ids: jax.Array,  # [B, S] document ids >= 1, 0 = padding
    *,
    tile: int,
    halo: int,  # Kc - 1 tokens; at most `tile`
) -> jax.Array:  # [B, S, Hv, Dv]
    B, S, _, Dk = q.shape
    Hv, Dv = v.shape[2:]
    if not 0 <= halo <= tile:
        raise ValueError(f"conv halo of {halo} tokens does not fit a sequence tile of {tile}")

    def before(xt: jax.Array) -> jax.Array:  # [n, B, tile, ...] -> [n, B, halo, ...]: the tokens before each tile
        prev = xt[:-1, :, tile - halo:]
        return jnp.concatenate([jnp.zeros_like(xt[:1, :, :halo]), prev], axis=0)

    seg_t = stack_tiles(segment_ids.astype(jnp.int32), tile)  # [n, B, tile]
    raw = tuple(stack_tiles(x, tile) for x in (q, k, v))
    halos = tuple(before(x) for x in raw)  # zeros before the first tile
    tiles = (*raw, *(stack_tiles(x, tile) for x in (z, b, a)), *halos)  # the differentiable inputs, per tile
    ids = (seg_t, before(seg_t))  # the ids before the first tile are 0 (padding)

    def one(state: jax.Array, xs: tuple[jax.Array, ...], ws: tuple[Any, ...], ids_i: tuple[jax.Array, ...]
            ) -> tuple[jax.Array, jax.Array]:  # entering state -> (out [B, tile, Hv, Dv], state after)
        qt, kt, vt, zt, bt, at, hq, hk, hv = xs
        st, hs = ids_i
        return segment(qt, kt, vt, zt, bt, at, *ws, st, halo=(hq, hk, hv, hs), initial_state=state)

    state0 = jnp.zeros((B, Hv, Dk, Dv), jnp.float32)
    out, _ = tile_scan(one, state0, tiles, weights, ids, document_starts_tile(seg_t))
    return unstack_tiles(out, S)
