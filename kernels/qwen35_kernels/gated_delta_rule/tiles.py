"""The chunked delta rule tile by tile along the sequence, the state carried from tile to tile.

- `tiled_delta_rule(rule, ...)`: the chunked gated delta rule over tiles of whole chunks (reset where
  a document starts at a tile's first token). The backward keeps one state per tile and recomputes
  the chunk states and intra-chunk matrices of one tile at a time. Exact up to float32 rounding.
- `tile_scan(one, ...)`: the state-carrying loop over tiles, its backward written out; also what the
  model's whole-mixer tiling runs on.

The tile is the kernel choices' `sequence_tile` (None: untiled); sequences no longer than one tile
run untiled. The model's token-local tiling takes the same choice.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from qwen35_kernels.choices import KernelChoices, resolved


def zeros_after(like: jax.Array, shape: tuple[int, ...], dtype: Any) -> jax.Array:
    """Zeros of `shape`, computed from an element of `like` (zero for any finite or infinite value) so
    that the compiler cannot create the buffer before `like` exists. A plain zero fill is a constant,
    which XLA shares between loops and may allocate long before its loop runs: XLA:CPU allocated the
    backward buffers of every layer of a recomputed block when the block's backward began."""
    tie = jnp.minimum(jnp.abs(like.reshape(-1)[0]).astype(jnp.float32), 0.0)
    return jnp.broadcast_to(tie.astype(dtype), shape)


def _entering(state: jax.Array, reset: jax.Array) -> jax.Array:  # [B, H, Dk, Dv], [B] -> [B, H, Dk, Dv]
    """The state a tile starts from: the previous tile's, or zero where a document starts at its first token."""
    return jnp.where(reset[:, None, None, None], 0.0, state)


# one(state, tile_inputs, weights, tile_ids) -> (out, state after the tile)
TileStep = Callable[[jax.Array, tuple[jax.Array, ...], Any, tuple[jax.Array, ...]], tuple[jax.Array, jax.Array]]


def tile_scan(one: TileStep, state0: jax.Array, tiles: tuple[jax.Array, ...], weights: Any,
              ids: tuple[jax.Array, ...], reset: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`one` over the tiles in order (tiles, ids: [n, ...] each; reset [n, B]), the state carried from
    tile to tile and dropped where `reset` says a document starts at a tile's first token. Returns
    every tile's output stacked [n, ...] and the state after the last tile.

    Differentiated by hand (`_tile_scan_backward`): autodiff of the scan would build the stacked
    input cotangents from zero-filled buffers that the compiler is free to allocate as early as it
    likes; XLA:CPU allocated those of every layer of a recomputed block when the block's backward
    started. Here they are computed from the cotangent.
    The backward retraces `one` when the gradient is taken: whatever kernel choices it needs, its
    closure carries."""
    return _tile_scan(one, state0, tiles, weights, ids, reset)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _tile_scan(one: TileStep, state0: jax.Array, tiles: tuple[jax.Array, ...], weights: Any,
               ids: tuple[jax.Array, ...], reset: jax.Array) -> tuple[jax.Array, jax.Array]:
    return _tile_scan_forward(one, state0, tiles, weights, ids, reset)[0]


def _tile_scan_forward(one: TileStep, state0: jax.Array, tiles: tuple[jax.Array, ...], weights: Any,
                       ids: tuple[jax.Array, ...], reset: jax.Array
                       ) -> tuple[tuple[jax.Array, jax.Array], tuple[Any, ...]]:
    def body(state: jax.Array, xs: tuple[Any, ...]) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
        tile_in, ids_i, reset_i = xs
        state = _entering(state, reset_i)
        out, after = one(state, tile_in, weights, ids_i)
        return after, (out, state)

    final, (out, entering) = jax.lax.scan(body, state0, (tiles, ids, reset))
    # entering [n, B, H, Dk, Dv] float32: what each tile started from, all the backward needs of the scan
    return (out, final), (entering, tiles, weights, ids, reset)


def _tile_scan_backward(one: TileStep, saved: tuple[Any, ...], cts: tuple[jax.Array, jax.Array]) -> tuple[Any, ...]:
    """Tiles in reverse order, each recomputed from the state it started from (`jax.vjp` of `one`),
    the state's cotangent carried backwards from the final state's; every buffer is built from the
    output cotangent (`zeros_after`)."""
    entering, tiles, weights, ids, reset = saved
    d_out, d_final = cts  # [n, ...], [B, H, Dk, Dv]
    n = d_out.shape[0]
    d_tiles = tuple(zeros_after(d_out, x.shape, x.dtype) for x in tiles)
    d_weights = jax.tree.map(lambda w: zeros_after(d_out, w.shape, w.dtype), weights)

    def body(j: jax.Array, carry: tuple[Any, ...]) -> tuple[Any, ...]:
        d_state, d_tiles, d_weights = carry
        i = n - 1 - j
        tile_in = tuple(x[i] for x in tiles)
        ids_i = tuple(x[i] for x in ids)
        _, vjp = jax.vjp(lambda st, xs, ws: one(st, xs, ws, ids_i), entering[i], tile_in, weights)
        d_entering, d_in, d_w = vjp((d_out[i], d_state))
        d_tiles = tuple(buf.at[i].set(d.astype(buf.dtype)) for buf, d in zip(d_tiles, d_in))
        d_weights = jax.tree.map(lambda acc, d: acc + d.astype(acc.dtype), d_weights, d_w)
        return _entering(d_entering, reset[i]), d_tiles, d_weights  # nothing flows past a document start

    d_state0, d_tiles, d_weights = jax.lax.fori_loop(
        0, n, body, (d_final.astype(entering.dtype), d_tiles, d_weights))
    return d_state0, d_tiles, d_weights, jax.tree.map(lambda x: None, ids), None


_tile_scan.defvjp(_tile_scan_forward, _tile_scan_backward)


def delta_rule_tile(chunk_size: int, choices: KernelChoices | None) -> int | None:
    """The delta rule's tile: the `choices`' `sequence_tile` (None: the defaults') rounded down to whole
    chunks (None: untiled)."""
    tile = resolved(choices).sequence_tile
    if tile is None:
        return None
    return max(chunk_size, tile // chunk_size * chunk_size)


def tiled_delta_rule(
    rule: Callable[..., tuple[jax.Array, jax.Array]],  # chunked_gated_delta_rule
    q: jax.Array,  # [B, S, Hk, Dk]
    k: jax.Array,  # [B, S, Hk, Dk]
    v: jax.Array,  # [B, S, Hv, Dv]
    g: jax.Array,  # [B, S, Hv]
    beta: jax.Array,  # [B, S, Hv]
    *,
    segment_ids: jax.Array | None,  # [B, S]
    initial_state: jax.Array | None,  # [B, Hv, Dk, Dv]
    chunk_size: int,
    tile: int,
) -> tuple[jax.Array, jax.Array]:  # [B, S, Hv, Dv] float32, [B, Hv, Dk, Dv] float32
    """`rule` over tiles of `tile` tokens (a multiple of chunk_size), the state carried between tiles.

    Padding (segment 0) is a no-op for the rule, so the last tile is padded with it. A document
    starts at a tile's first token when its id is non-zero and differs from the previous token's:
    the carried state is dropped there, as the untiled rule does.
    """
    B, S, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    seg = jnp.ones((B, S), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    seg_t = stack_tiles(seg, tile)  # [n, B, tile]
    state = jnp.zeros((B, Hv, Dk, Dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    def one(state: jax.Array, xs: tuple[jax.Array, ...], _: tuple[()], ids_i: tuple[jax.Array]
            ) -> tuple[jax.Array, jax.Array]:  # entering state -> (out [B, tile, Hv, Dv], state after)
        return rule(*xs, segment_ids=ids_i[0], initial_state=state, chunk_size=chunk_size)

    tiles = tuple(stack_tiles(x, tile) for x in (q, k, v, g, beta))
    out, state = tile_scan(one, state, tiles, (), (seg_t,), document_starts_tile(seg_t))
    return unstack_tiles(out, S), state


def stack_tiles(x: jax.Array, tile: int) -> jax.Array:  # [B, S, ...] -> [n, B, tile, ...]
    """Tiles of `tile` tokens along axis 1, stacked first; the last tile is padded with zeros
    (segment id 0: padding)."""
    B, S = x.shape[:2]
    n = -(-S // tile)
    x = jnp.pad(x, [(0, 0), (0, n * tile - S)] + [(0, 0)] * (x.ndim - 2))
    return jnp.moveaxis(x.reshape(B, n, tile, *x.shape[2:]), 1, 0)


def unstack_tiles(xt: jax.Array, S: int) -> jax.Array:  # [n, B, tile, ...] -> [B, S, ...]
    """Inverse of `stack_tiles`: the tiles back in sequence order, the padding dropped."""
    n, B, tile = xt.shape[:3]
    return jnp.moveaxis(xt, 0, 1).reshape(B, n * tile, *xt.shape[3:])[:, :S]


def document_starts_tile(seg_t: jax.Array) -> jax.Array:  # [n, B, tile] -> [n, B] bool
    """Whether a document starts at each tile's first token (a non-zero id that differs from the
    previous tile's last token), where a state carried in from the previous tile must be dropped.
    Never at the first tile: its incoming state belongs to its first document."""
    first, last_before = seg_t[1:, :, 0], seg_t[:-1, :, -1]  # [n - 1, B]
    return jnp.concatenate([jnp.zeros((1, seg_t.shape[1]), bool), (first != last_before) & (first != 0)])
