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
The backward is written out (`_tile_scan`) so that its per-tile cotangent buffers exist only once
this layer's backward has begun.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from qwen35_jax.layers.tiling import document_starts_tile, stack_tiles, unstack_tiles, zeros_after

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
    # the ids before the first tile are 0 (padding); a document starts at tile i's first token: [n, B]
    ids = (seg_t, before(seg_t), document_starts_tile(seg_t))

    def one(state: jax.Array, xs: tuple[jax.Array, ...], ws: tuple[Any, ...], ids_i: tuple[jax.Array, ...]
            ) -> tuple[jax.Array, jax.Array]:  # entering state -> (out [B, tile, Hv, Dv], state after)
        qt, kt, vt, zt, bt, at, hq, hk, hv = xs
        st, hs, _ = ids_i
        return segment(qt, kt, vt, zt, bt, at, *ws, st, halo=(hq, hk, hv, hs), initial_state=state)

    state0 = jnp.zeros((B, Hv, Dk, Dv), jnp.float32)
    return unstack_tiles(_tile_scan(one, state0, tiles, weights, ids), S)


def _entering(state: jax.Array, reset: jax.Array) -> jax.Array:  # [B, Hv, Dk, Dv], [B] -> [B, Hv, Dk, Dv]
    """The state a tile starts from: the previous tile's, or zero where a document starts at its first token."""
    return jnp.where(reset[:, None, None, None], 0.0, state)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tile_scan(one: Callable[..., tuple[jax.Array, jax.Array]], state0: jax.Array, tiles: tuple[jax.Array, ...],
               weights: tuple[Any, ...], ids: tuple[jax.Array, ...]) -> jax.Array:  # [n, B, tile, Hv, Dv]
    """`one` over the tiles in order, the state carried (and dropped where a document starts).

    Differentiated by hand (`_tile_scan_backward`): autodiff of the scan would build the stacked
    input cotangents from zero-filled buffers that the compiler is free to allocate as early as it
    likes; XLA:CPU allocated those of every layer of a recomputed block when the block's backward
    started (12 GiB at the 9B's 1M tokens on sp = 8). Here they are computed from the cotangent."""
    return _tile_scan_forward(one, state0, tiles, weights, ids)[0]


def _tile_scan_forward(one: Callable[..., tuple[jax.Array, jax.Array]], state0: jax.Array,
                       tiles: tuple[jax.Array, ...], weights: tuple[Any, ...], ids: tuple[jax.Array, ...]
                       ) -> tuple[jax.Array, tuple[Any, ...]]:  # out [n, B, tile, Hv, Dv], what the backward reads
    def body(state: jax.Array, xs: tuple[Any, ...]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        tile_in, ids_i = xs
        state = _entering(state, ids_i[2])
        out, after = one(state, tile_in, weights, ids_i)
        return after, (out, state)

    _, (out, entering) = jax.lax.scan(body, state0, (tiles, ids))
    return out, (entering, tiles, weights, ids)  # entering: [n, B, Hv, Dk, Dv] float32, what each tile started from


def _tile_scan_backward(one: Callable[..., tuple[jax.Array, jax.Array]], saved: tuple[Any, ...],
                        d_out: jax.Array) -> tuple[Any, ...]:  # d_out [n, B, tile, Hv, Dv]
    """Tiles in reverse order, each recomputed from the state it started from (`jax.vjp` of `one`),
    the state's cotangent carried backwards; every buffer is built from d_out (`tiling.zeros_after`)."""
    entering, tiles, weights, ids = saved
    n = d_out.shape[0]
    d_tiles = tuple(zeros_after(d_out, x.shape, x.dtype) for x in tiles)
    d_weights = jax.tree.map(lambda w: zeros_after(d_out, w.shape, w.dtype), weights)
    d_state = zeros_after(d_out, entering.shape[1:], entering.dtype)  # into the last tile's final state: none

    def body(j: jax.Array, carry: tuple[Any, ...]) -> tuple[Any, ...]:
        d_state, d_tiles, d_weights = carry
        i = n - 1 - j
        tile_in = tuple(x[i] for x in tiles)
        ids_i = tuple(x[i] for x in ids)
        _, vjp = jax.vjp(lambda st, xs, ws: one(st, xs, ws, ids_i), entering[i], tile_in, weights)
        d_entering, d_in, d_w = vjp((d_out[i], d_state))
        d_tiles = tuple(buf.at[i].set(d.astype(buf.dtype)) for buf, d in zip(d_tiles, d_in))
        d_weights = jax.tree.map(lambda acc, d: acc + d.astype(acc.dtype), d_weights, d_w)
        return _entering(d_entering, ids_i[2]), d_tiles, d_weights  # nothing flows past a document start

    d_state, d_tiles, d_weights = jax.lax.fori_loop(0, n, body, (d_state, d_tiles, d_weights))
    return d_state, d_tiles, d_weights, jax.tree.map(lambda x: None, ids)


_tile_scan.defvjp(_tile_scan_forward, _tile_scan_backward)
