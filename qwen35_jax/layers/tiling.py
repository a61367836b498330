"""Sequence tiling: token-local work and the delta rule run tile by tile, each tile recomputed in the
backward pass, so that no [tokens, intermediate] buffer exists for the whole sequence (ALST's TiledMLP).

- `tiled_over_sequence(fn, module, x)`: `fn(module, x)` for a token-local `fn` (RMSNorm + MLP +
  residual, the MoE block) over tiles of `sequence_tile()` tokens of each device's own sequence
  shard. Exact: every token is computed on its own.
- `tiled_delta_rule(rule, ...)`: the chunked gated delta rule over tiles of whole chunks, the state
  carried from tile to tile (reset where a document starts at a tile's first token). The backward
  keeps one state per tile and recomputes the chunk states and intra-chunk matrices of one tile at
  a time. Exact up to float32 rounding.

`with sequence_tile(tokens):` sets the tile for everything traced inside it (read at trace time,
like `gdn_sp_mode`: set it around the first trace of a jitted step); `None` or 0 turns tiling off.
Sequences no longer than one tile run untiled.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Callable, Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from qwen35_jax.parallel.mesh import FSDP, SP, auto_mesh, constrain, mesh_axis_size

DEFAULT_SEQUENCE_TILE = 8192  # tokens per tile of each device's shard
_tile: contextvars.ContextVar[int | None] = contextvars.ContextVar("sequence_tile", default=DEFAULT_SEQUENCE_TILE)


@contextlib.contextmanager
def sequence_tile(tokens: int | None) -> Iterator[None]:
    """Tile token-local work and the delta rule in tiles of `tokens` (None or 0: no tiling)."""
    if tokens is not None and tokens < 0:
        raise ValueError(f"sequence tile must be >= 0 tokens (0 or None: off), got {tokens}")
    token = _tile.set(tokens or None)
    try:
        yield
    finally:
        _tile.reset(token)


def current_sequence_tile() -> int | None:
    return _tile.get()


def tiled_over_sequence(fn: Callable[[Any, jax.Array], jax.Array], module: nnx.Module,
                        x: jax.Array) -> jax.Array:  # [B, S, D] -> [B, S, D]
    """`fn(module, x)` tile by tile along S; under a mesh each device tiles its own [B, S/sp, D] shard.

    `fn` must be token-local (token t of the output depends on token t of the input only) and keep
    the shape. Each tile's forward is rematerialised in the backward; only the tiles' inputs are kept.
    """
    tile = current_sequence_tile()
    b, s, d = x.shape
    mesh = auto_mesh()
    sp = mesh_axis_size(mesh, SP)
    if s % sp:
        sp = 1
    local = s // sp
    if tile is None or local <= tile:
        return fn(module, x)
    n = -(-local // tile)
    graphdef, state = nnx.split(module)
    xs = x.reshape(b, sp, local, d)
    xs = jnp.pad(xs, ((0, 0), (0, 0), (0, n * tile - local), (0, 0)))  # zero tokens, dropped below
    spec = P(FSDP if b % mesh_axis_size(mesh, FSDP) == 0 else None, SP if sp > 1 else None, None, None)

    # The tile is sliced inside the checkpoint from the whole (loop-invariant) input, and written into
    # the whole output: neither the inputs nor the outputs exist a second time as a stack of tiles.
    @jax.checkpoint
    def one(xs: jax.Array, i: jax.Array) -> jax.Array:  # [B, sp, n * tile, D] -> [B, sp, tile, D]
        xt = constrain(jax.lax.dynamic_slice_in_dim(xs, i * tile, tile, axis=2), spec)
        y = fn(nnx.merge(graphdef, state), xt.reshape(b, sp * tile, d))
        return constrain(y.reshape(b, sp, tile, d), spec)

    def body(i: jax.Array, ys: jax.Array) -> jax.Array:
        return jax.lax.dynamic_update_slice_in_dim(ys, one(xs, i).astype(ys.dtype), i * tile, axis=2)

    ys = jax.lax.fori_loop(0, n, body, jnp.zeros_like(xs))  # [B, sp, n * tile, D]
    return ys[:, :, :local].reshape(b, s, d)


def delta_rule_tile(chunk_size: int) -> int | None:
    """The delta rule's tile: `sequence_tile()` rounded down to whole chunks (None: untiled)."""
    tile = current_sequence_tile()
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
    n = -(-S // tile)
    pad = n * tile - S
    seg = jnp.ones((B, S), jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)

    def tiles(x: jax.Array) -> jax.Array:  # [B, S, ...] -> [n, B, tile, ...]
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(B, n, tile, *x.shape[2:]), 1, 0)

    seg_t = tiles(seg)  # [n, B, tile]
    first, last_before = seg_t[1:, :, 0], seg_t[:-1, :, -1]  # [n - 1, B]
    reset = jnp.concatenate([jnp.zeros((1, B), bool), (first != last_before) & (first != 0)])  # [n, B]
    state = jnp.zeros((B, Hv, Dk, Dv), jnp.float32) if initial_state is None else initial_state.astype(jnp.float32)

    @jax.checkpoint
    def one(state: jax.Array, xs: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array]:
        qt, kt, vt, gt, bt, st, rt = xs
        state = jnp.where(rt[:, None, None, None], 0.0, state)
        out, state = rule(qt, kt, vt, gt, bt, segment_ids=st, initial_state=state, chunk_size=chunk_size)
        return state, out  # [B, Hv, Dk, Dv], [B, tile, Hv, Dv]

    state, out = jax.lax.scan(one, state, (*(tiles(x) for x in (q, k, v, g, beta)), seg_t, reset))
    out = jnp.moveaxis(out, 0, 1).reshape(B, n * tile, Hv, Dv)[:, :S]
    return out, state
