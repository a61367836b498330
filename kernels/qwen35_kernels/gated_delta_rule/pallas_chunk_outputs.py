"""Every chunk's output from the state entering it, forward and backward, as Pallas (Triton) kernels.

With the notation of `chunk_states.py` (S_c the state entering chunk c, [Dk, Dv]):

    v_c = u_c - w_c S_c,    out_c = q_c S_c + intra_c v_c          q_c, w_c [L, Dk], u_c [L, Dv], intra_c [L, L]

and, from the output's cotangent o = d out_c,

    dv = intra_c^T o (= du),   dq = o S_c^T,   dintra = o v_c^T,   dw = -dv S_c^T,   dS_c = q_c^T o - w_c^T dv.

Both directions run one program per (sequence, chunk, head), every chunk at once, the state's columns
in blocks of `state_columns`; each reads its chunk's tiles and state once and keeps the products in
registers. As batched XLA matmuls the same arithmetic wrote and read every [B, n, H, L, D] and
[B, n, H, L, L] intermediate. Precision as `pallas_chunk_states.tile_dot` (under "bf16" w, q and intra,
which are only multiplied, are read as bfloat16, and may arrive so); off a GPU interpreted.
The VJP that joins them with the state kernels is `chunk_states.pallas_chunk_states`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from qwen35_kernels.choices import DEFAULT_GDN_KERNEL_BLOCKS
from qwen35_kernels.gated_delta_rule.pallas_chunk_states import (
    COLS_BY_COLS,
    GRADIENT_KERNEL_WARPS,
    ROWS_BY_COLS,
    ROWS_BY_ROWS,
    Blocks,
    read_halved,
    state_columns,
    tile_dot,
)


def _specs(L: int, Dk: int, Dv: int):
    """(chunk(d): chunk c's [L, d] tile, state: block c of [B, n (+ 1), H, Dk, Dv]), on the grid (B, n, H)."""
    def chunk(d):
        return pl.BlockSpec((None, None, None, L, d), lambda b, c, h: (b, c, h, 0, 0))

    state = pl.BlockSpec((None, None, None, Dk, Dv), lambda b, c, h: (b, c, h, 0, 0))
    return chunk, state


def _output_layout(B: int, n: int, H: int, L: int, Dv: int, token_major: bool
                   ) -> tuple[tuple[int, ...], pl.BlockSpec]:
    """The output's (and its cotangent's) shape and block spec: chunk-major [B, n, H, L, Dv], or with
    `token_major` [B, n L, H, Dv], the layout the rest of the layer uses (no transposition after)."""
    if token_major:
        return (B, n * L, H, Dv), pl.BlockSpec((None, L, None, Dv), lambda b, c, h: (b, c, h, 0))
    return (B, n, H, L, Dv), pl.BlockSpec((None, None, None, L, Dv), lambda b, c, h: (b, c, h, 0, 0))


def chunk_outputs(
    u: jax.Array,  # [B, n, H, L, Dv] float32
    w: jax.Array,  # [B, n, H, L, Dk] float32 (or bfloat16 under bf16 precision, as q and intra)
    q: jax.Array,  # [B, n, H, L, Dk]
    intra: jax.Array,  # [B, n, H, L, L]
    states: jax.Array,  # [B, n + 1, H, Dk, Dv] float32: the state entering each chunk, the final one last
    prec,
    interpret: bool,
    out_dtype: jnp.dtype = jnp.float32,
    token_major: bool = False,
    blocks: Blocks = DEFAULT_GDN_KERNEL_BLOCKS,
) -> jax.Array:  # out [B, n, H, L, Dv] (token_major: [B, n L, H, Dv]) in out_dtype
    """out_c = q_c S_c + intra_c (u_c - w_c S_c) for every chunk c (no VJP: `chunk_outputs_backward`),
    summed in float32 and written as `out_dtype`."""
    B, n, H, L, Dk = w.shape
    w, q, intra = read_halved(prec, w, q, intra)
    Dv = u.shape[-1]
    bv = state_columns(Dv, blocks)
    dot = functools.partial(tile_dot, prec=prec, interpret=interpret)

    def kernel(u_ref, w_ref, q_ref, intra_ref, s_ref, out_ref):
        w_c, q_c, intra_c = w_ref[...], q_ref[...], intra_ref[...]
        for j in range(Dv // bv):
            cols = pl.ds(j * bv, bv)
            s = s_ref[:, cols]  # [Dk, bv]
            v = u_ref[:, cols] - dot(w_c, s, ROWS_BY_COLS)  # [L, bv]
            out_ref[:, cols] = (dot(q_c, s, ROWS_BY_COLS) + dot(intra_c, v, ROWS_BY_COLS)).astype(out_dtype)

    chunk, state = _specs(L, Dk, Dv)
    out_shape, out_spec = _output_layout(B, n, H, L, Dv, token_major)
    return pl.pallas_call(
        kernel, grid=(B, n, H),
        in_specs=[chunk(Dv), chunk(Dk), chunk(Dk), chunk(L), state],
        out_specs=out_spec,
        out_shape=jax.ShapeDtypeStruct(out_shape, out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=4, num_stages=2),
        interpret=interpret, name="gdn_chunk_outputs",
    )(u, w, q, intra, states)


def chunk_outputs_backward(
    u: jax.Array, w: jax.Array, q: jax.Array, intra: jax.Array, states: jax.Array,  # as `chunk_outputs`
    d_out: jax.Array,  # [B, n, H, L, Dv] (token_major: [B, n L, H, Dv]), any float dtype
    d_final: jax.Array,  # [B, H, Dk, Dv]: the cotangent of the final state, states[:, -1]
    prec,
    interpret: bool,
    token_major: bool = False,
    blocks: Blocks = DEFAULT_GDN_KERNEL_BLOCKS,
) -> tuple[jax.Array, ...]:  # du, dw, dq, dintra, d_states (shapes of the inputs), float32
    """The gradients of `chunk_outputs`' inputs (v recomputed: one tile product per column block)."""
    B, n, H, L, Dk = w.shape
    Dv = u.shape[-1]
    w, q, intra = read_halved(prec, w, q, intra)
    bv = state_columns(Dv, blocks)
    dot = functools.partial(tile_dot, prec=prec, interpret=interpret)

    def kernel(u_ref, w_ref, q_ref, intra_ref, s_ref, o_ref, du_ref, dw_ref, dq_ref, dintra_ref, ds_ref):
        w_c, q_c, intra_c = w_ref[...], q_ref[...], intra_ref[...]
        dw = jnp.zeros((L, Dk), jnp.float32)
        dq = jnp.zeros((L, Dk), jnp.float32)
        dintra = jnp.zeros((L, L), jnp.float32)
        for j in range(Dv // bv):  # dw, dq and dintra sum over the state's column blocks
            cols = pl.ds(j * bv, bv)
            s, o = s_ref[:, cols], o_ref[:, cols].astype(jnp.float32)  # [Dk, bv], [L, bv]
            v = u_ref[:, cols] - dot(w_c, s, ROWS_BY_COLS)
            dv = dot(intra_c, o, ROWS_BY_ROWS)  # [L, bv]
            du_ref[:, cols] = dv
            ds_ref[:, cols] = dot(q_c, o, ROWS_BY_ROWS) - dot(w_c, dv, ROWS_BY_ROWS)
            dq = dq + dot(o, s, COLS_BY_COLS)
            dw = dw - dot(dv, s, COLS_BY_COLS)
            dintra = dintra + dot(o, v, COLS_BY_COLS)
        dw_ref[...] = dw
        dq_ref[...] = dq
        dintra_ref[...] = dintra

    chunk, state = _specs(L, Dk, Dv)
    _, d_out_spec = _output_layout(B, n, H, L, Dv, token_major)
    f32 = jnp.float32
    du, dw, dq, dintra, d_states = pl.pallas_call(
        kernel, grid=(B, n, H),
        in_specs=[chunk(Dv), chunk(Dk), chunk(Dk), chunk(L), state, d_out_spec],
        out_specs=[chunk(Dv), chunk(Dk), chunk(Dk), chunk(L), state],
        out_shape=[jax.ShapeDtypeStruct(u.shape, f32), jax.ShapeDtypeStruct(w.shape, f32),
                   jax.ShapeDtypeStruct(q.shape, f32), jax.ShapeDtypeStruct(intra.shape, f32),
                   jax.ShapeDtypeStruct(states.shape, f32)],
        compiler_params=plgpu.CompilerParams(num_warps=GRADIENT_KERNEL_WARPS, num_stages=2),
        interpret=interpret, name="gdn_chunk_outputs_backward",
    )(u, w, q, intra, states, d_out)
    # the grid writes the states' cotangent at blocks 0..n-1; block n is the final state's, written in
    # place (a zeros buffer filled around it would be a constant XLA folds when d_final is zero)
    return du, dw, dq, dintra, d_states.at[:, -1].set(d_final.astype(f32))

