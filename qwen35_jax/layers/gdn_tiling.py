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

import jax
import jax.numpy as jnp
from qwen35_kernels.gated_delta_rule.tiles import document_starts_tile, stack_tiles, tile_scan, unstack_tiles

from qwen35_jax.layers.gdn_arrays import GdnTokens, GdnWeights

# segment(tokens, weights, segment_ids, halo=(hq, hk, hv, hseg), initial_state=S0)
#   -> (out [B, T, Hv, Dv], final state [B, Hv, Dk, Dv])
Segment = Callable[..., tuple[jax.Array, jax.Array]]


def tiled_gdn_core(
    segment: Segment,
    tokens: GdnTokens,  # [B, S, ...] raw projections (before the conv)
    weights: GdnWeights,
    segment_ids: jax.Array,  # [B, S] document ids >= 1, 0 = padding
    *,
    tile: int,
    halo: int,  # Kc - 1 tokens; at most `tile`
    first_halo: tuple[jax.Array, ...] | None = None,  # raw q, k, v [B, halo, H, d] and ids [B, halo] before S
    initial_state: jax.Array | None = None,  # [B, Hv, Dk, Dv] float32 entering the first tile
    return_state: bool = False,
) -> jax.Array | tuple[jax.Array, jax.Array]:  # [B, S, Hv, Dv] (and the final state [B, Hv, Dk, Dv])
    """`segment` tile by tile. Without `first_halo` and `initial_state` the sequence starts at its
    first token (zeros and padding before it, a zero state); with them it continues a sequence that
    began on another device (GDN state passing). `return_state`: also the state after the last tile."""
    B, S, _, Dk = tokens.q.shape
    Hv, Dv = tokens.v.shape[2:]
    if not 0 <= halo <= tile:
        raise ValueError(f"conv halo of {halo} tokens does not fit a sequence tile of {tile}")
    tiles, ids = tiled_inputs(tuple(tokens), segment_ids, tile, halo, first_halo)

    def one(state: jax.Array, xs: tuple[jax.Array, ...], ws: GdnWeights, ids_i: tuple[jax.Array, ...]
            ) -> tuple[jax.Array, jax.Array]:  # entering state -> (out [B, tile, Hv, Dv], state after)
        st, hs = ids_i
        return segment(GdnTokens(*xs[:6]), ws, st, halo=(*xs[6:], hs), initial_state=state)

    state0 = jnp.zeros((B, Hv, Dk, Dv), jnp.float32) if initial_state is None else initial_state
    out, final = tile_scan(one, state0, tiles, weights, ids, document_starts_tile(ids[0]))
    return (unstack_tiles(out, S), final) if return_state else unstack_tiles(out, S)


def tiled_inputs(
    xs: tuple[jax.Array, ...],  # raw q, k, v first, then any further [B, S, ...] inputs
    segment_ids: jax.Array,  # [B, S]
    tile: int,
    halo: int,
    first_halo: tuple[jax.Array, ...] | None,  # raw q, k, v [B, halo, H, d] and ids [B, halo], or None
) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, jax.Array]]:
    """(per-tile inputs: each of `xs`, then the q, k, v halos; per-tile ids [n, B, tile] and halo ids
    [n, B, halo]): every input stacked [n, B, tile, ...], each tile's conv halo the `halo` raw tokens
    before it (`first_halo` before the first tile, or zeros with padding ids)."""
    seg = segment_ids.astype(jnp.int32)
    if first_halo is None:
        first_halo = (*(jnp.zeros((x.shape[0], halo, *x.shape[2:]), x.dtype) for x in xs[:3]),
                      jnp.zeros((seg.shape[0], halo), jnp.int32))

    def before(xt: jax.Array, first: jax.Array) -> jax.Array:  # [n, B, tile, ...] -> [n, B, halo, ...]
        return jnp.concatenate([first[None].astype(xt.dtype), xt[:-1, :, tile - halo:]], axis=0)

    seg_t = stack_tiles(seg, tile)  # [n, B, tile]
    stacked = tuple(stack_tiles(x, tile) for x in xs)
    halos = tuple(before(x, f) for x, f in zip(stacked[:3], first_halo[:3]))
    return (*stacked, *halos), (seg_t, before(seg_t, first_halo[3]))
