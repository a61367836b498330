"""The whole gated DeltaNet mixer tile by tile along the sequence, so that no float32 buffer of it
spans the whole sequence.

Under Ulysses every device runs the mixer on the whole sequence for its H/sp heads; the conv1d, the
L2 norms, the gates, the delta rule's float32 inputs and the gated norm are all [B, S, H/sp, d]
float32 arrays there, and their residuals for the backward pass dominate a long-context step.
`tiled_gdn_core` runs them on one tile at a time in a rematerialised `lax.scan`: what persists across
the scan is the raw (input dtype) q, k, v, z, b, a, the output, one delta-rule state per tile and
a conv halo per tile. Each tile receives:

- its conv halo: the Kc - 1 raw q, k, v tokens before it (with their segment ids, so that the window
  still stops at document starts; zeros and padding before the first tile, as the untiled conv pads);
- the delta-rule state after the previous tile, dropped where a document starts at its first token.

Exact up to float32 rounding (the delta rule's chunk scan restarts its summation at tile edges).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from qwen35_jax.layers.tiling import document_starts_tile, stack_tiles, unstack_tiles

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
    halos = (*(before(x) for x in raw), before(seg_t))  # zeros with id 0 (padding) before the first tile
    reset = document_starts_tile(seg_t)  # [n, B]

    @jax.checkpoint
    def one(state: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        qt, kt, vt, zt, bt, at, st, rt, *halo_t = xs
        state = jnp.where(rt[:, None, None, None], 0.0, state)
        out, state = segment(qt, kt, vt, zt, bt, at, *weights, st, halo=tuple(halo_t), initial_state=state)
        return state, out  # [B, Hv, Dk, Dv], [B, tile, Hv, Dv]

    state = jnp.zeros((B, Hv, Dk, Dv), jnp.float32)
    xs = (*raw, *(stack_tiles(x, tile) for x in (z, b, a)), seg_t, reset, *halos)
    _, out = jax.lax.scan(one, state, xs)  # [n, B, tile, Hv, Dv]
    return unstack_tiles(out, S)
