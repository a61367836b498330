"""Sequence tiling of token-local work: each tile recomputed in the backward pass, so that no
[tokens, intermediate] buffer exists for the whole sequence (ALST's TiledMLP).

`tiled_over_sequence(fn, module, x, tile=...)`: `fn(module, x)` for a token-local `fn` (RMSNorm + MLP +
residual, the MoE block) over tiles of `tile` tokens of each device's own sequence shard. Exact:
every token is computed on its own. The caller passes its kernel choices' `sequence_tile`, the
delta rule's tile too (`qwen35_kernels.gated_delta_rule.tiles.delta_rule_tile`), so one setting
tiles the whole step.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P
from qwen35_kernels.gated_delta_rule.tiles import zeros_after

from qwen35_jax.parallel.mesh import FSDP, SP, auto_mesh, constrain, mesh_axis_size


def tiled_over_sequence(fn: Callable[[Any, jax.Array], jax.Array], module: nnx.Module,
                        x: jax.Array, *, recompute: bool = False, tile: int | None
                        ) -> jax.Array:  # [B, S, D] -> [B, S, D]
    """`fn(module, x)` tile by tile along S, `tile` tokens at a time (None: untiled; the kernel
    choices' `sequence_tile`); under a mesh each device tiles its own [B, S/sp, D] shard.

    `fn` must be token-local (token t of the output depends on token t of the input only) and keep
    the shape. Each tile's forward is rematerialised in the backward; only the tiles' inputs are kept.
    `recompute`: rematerialise `fn` also where the sequence fits one tile (remat "mlp"), keeping x only.
    """
    b, s, d = x.shape
    mesh = auto_mesh()
    sp = mesh_axis_size(mesh, SP)
    if s % sp:
        sp = 1
    local = s // sp
    if tile is None or local <= tile:
        return nnx.remat(fn)(module, x) if recompute else fn(module, x)
    n = -(-local // tile)
    graphdef, state = nnx.split(module)
    xs = x.reshape(b, sp, local, d)
    xs = jnp.pad(xs, ((0, 0), (0, 0), (0, n * tile - local), (0, 0)))  # zero tokens, dropped below
    spec = P(FSDP if b % mesh_axis_size(mesh, FSDP) == 0 else None, SP if sp > 1 else None, None, None)

    def one(state: Any, xt: jax.Array) -> jax.Array:  # [B, sp, tile, D] -> [B, sp, tile, D]
        y = fn(nnx.merge(graphdef, state), constrain(xt, spec).reshape(b, sp * tile, d))
        return constrain(y.reshape(b, sp, tile, d).astype(xt.dtype), spec)

    ys = _tiles_in_place(one, tile, state, xs)  # [B, sp, n * tile, D]
    return ys[:, :, :local].reshape(b, s, d)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _tiles_in_place(one: Callable[[Any, jax.Array], jax.Array], tile: int, state: Any, xs: jax.Array) -> jax.Array:
    """`one(state, xt)` on every `tile` tokens (axis 2) of xs [B, sp, n * tile, D], written where they were.

    Each tile is sliced from the whole input and written into the whole output, so neither exists a
    second time as a stack of tiles; only `state` and xs are kept for the backward, which recomputes
    each tile and writes its input gradient over the output gradient's own tile (no zero-filled
    accumulator the size of xs)."""
    return _tiles_forward(one, tile, state, xs)[0]


def _tiles_forward(one: Callable[[Any, jax.Array], jax.Array], tile: int, state: Any, xs: jax.Array
                   ) -> tuple[jax.Array, tuple[Any, jax.Array]]:
    def body(i: jax.Array, ys: jax.Array) -> jax.Array:
        xt = jax.lax.dynamic_slice_in_dim(xs, i * tile, tile, axis=2)
        return jax.lax.dynamic_update_slice_in_dim(ys, one(state, xt), i * tile, axis=2)

    # every tile is overwritten, so the output starts as a copy of the input (not a zero fill)
    return jax.lax.fori_loop(0, xs.shape[2] // tile, body, xs), (state, xs)


def _tiles_backward(one: Callable[[Any, jax.Array], jax.Array], tile: int, saved: tuple[Any, jax.Array],
                    d_ys: jax.Array) -> tuple[Any, jax.Array]:  # d_ys [B, sp, n * tile, D]
    state, xs = saved
    d_state = jax.tree.map(lambda w: zeros_after(d_ys, w.shape, w.dtype), state)

    def body(i: jax.Array, carry: tuple[Any, jax.Array]) -> tuple[Any, jax.Array]:
        d_state, d_xs = carry  # d_xs: the input gradient in tiles < i, the output gradient from i on
        xt = jax.lax.dynamic_slice_in_dim(xs, i * tile, tile, axis=2)
        _, vjp = jax.vjp(one, state, xt)
        d_st, d_xt = vjp(jax.lax.dynamic_slice_in_dim(d_xs, i * tile, tile, axis=2))
        d_state = jax.tree.map(lambda acc, g: acc + g.astype(acc.dtype), d_state, d_st)
        return d_state, jax.lax.dynamic_update_slice_in_dim(d_xs, d_xt.astype(d_xs.dtype), i * tile, axis=2)

    # tile i of d_ys is read once, then replaced by tile i of the input gradient
    return jax.lax.fori_loop(0, xs.shape[2] // tile, body, (d_state, d_ys.astype(xs.dtype)))


_tiles_in_place.defvjp(_tiles_forward, _tiles_backward)
