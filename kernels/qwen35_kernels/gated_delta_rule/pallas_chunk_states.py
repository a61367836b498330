"""The delta rule's chunk-to-chunk state recurrence as one Pallas (Triton) kernel per direction.

With the notation of `chunk_states.py`, the state entering chunk c + 1 is

    S_c+1 = d_c S_c + k_c^T (u_c - w_c S_c)          S_c [Dk, Dv], k_c, w_c [L, Dk], u_c [L, Dv]

Forward: one program per (sequence x head, block of Dv columns) walks the chunks in order, the state
in registers, two [L, Dk] x [Dk, BV]-sized matmuls per chunk, and writes every entering state. The
columns of S never mix, so the Dv blocks are independent programs. On a GPU this replaces the 128
steps of a dozen small kernels each (`lax.scan`) or the log n rounds of [Dk, Dk] products
(associative scan) with one launch.

Backward: with G_c the gradient of everything downstream with respect to S_c, and dS_c the
cotangent arriving on the output S_c itself,

    G_n = dS_n,    G_c = dS_c + d_c G_c+1 - w_c^T (k_c G_c+1)          (the transposed map)

is the same kernel run in reverse, with (k, w) swapped and dS added. It hands back every G_c; a
third kernel, one program per chunk and head, turns them and the saved states into the gradients
of u, w, k, d: v_c = u_c - w_c S_c, dv_c = k_c G_c+1, du_c = dv_c, dw_c = -dv_c S_c^T,
dk_c = v_c G_c+1^T, dd_c = <S_c, G_c+1>; the initial state's gradient is G_0.

Everything is float32 but that under "bf16" precision the keys and w may arrive as bfloat16 (they are
only multiplied) and the states and their gradients are stored as bfloat16 (only multiplied after,
but for dd; the final state and G_0 leave in float32 too); the matmuls run at `prec` (None: TF32 tensor cores on a GPU, HIGHEST: IEEE
float32, "bf16": both operands rounded to bfloat16, the keys read as bfloat16; `matmul.py`).
Off a GPU the kernel runs interpreted (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from qwen35_kernels.choices import DEFAULT_GDN_KERNEL_BLOCKS
from qwen35_kernels.gated_delta_rule.matmul import GdnPrecision, bf16_operands, operand_dtype, round_to_bf16

CHUNK_STATES_NAME = "gdn_chunk_states"  # checkpoint name of the states (see chunk_states.apply_gdn_remat)
# The chunk-gradient kernel holds dw and dk ([L, Dk] float32 each: 64 KiB at L = 64, Dk = 128) across
# the column blocks: eight warps keep that at 64 registers a thread.
GRADIENT_KERNEL_WARPS = 8
# `tile_dot` contractions of two 2-D tiles
ROWS_BY_COLS = (((1,), (0,)), ((), ()))  # [a, b] x [b, c]
COLS_BY_COLS = (((1,), (1,)), ((), ()))  # [a, c] x [b, c]^T
ROWS_BY_ROWS = (((0,), (0,)), ((), ()))  # [b, a]^T x [b, c]


Blocks = tuple[int, int]  # (state columns, Triton warps) per program: the kernel choices' `gdn_kernel_blocks`


def state_columns(dv: int, blocks: Blocks = DEFAULT_GDN_KERNEL_BLOCKS) -> int:
    """State columns per program (`blocks`, the kernel choices' `gdn_kernel_blocks`), at most the head's Dv."""
    return min(blocks[0], dv)


def kernel_fits(dk: int, dv: int, chunk: int, blocks: Blocks = DEFAULT_GDN_KERNEL_BLOCKS) -> bool:
    """Whether Triton can compile the kernel for these sizes: its tiles ([L, Dk], [Dk, min(Dv, 64)])
    need powers of two of at least 16 (every Qwen3.5 model: 128, 128 and chunks of 64)."""
    bv = state_columns(dv, blocks)
    return all(x >= 16 and x & (x - 1) == 0 for x in (dk, bv, chunk)) and dv % bv == 0


def _recurrence_kernel(p_ref, q_ref, b_ref, decay_ref, first_ref, add_ref, out_ref, last_ref, *, n: int,
                       reverse: bool, prec, interpret: bool):
    # p_ref, q_ref [n, L, Dk]; b_ref [n, L, BV] or None; decay_ref [n]; first_ref [Dk, BV];
    # add_ref [n + 1, Dk, BV] or None; out_ref [n + 1, Dk, BV] (float32, or bf16 under bf16 precision);
    # last_ref [Dk, BV] float32: the last x computed
    x = first_ref[...]
    out_ref[n if reverse else 0] = x.astype(out_ref.dtype)

    def step(i, x):  # x [Dk, BV] float32
        c = n - 1 - i if reverse else i
        rhs = -tile_dot(q_ref[c], x, ROWS_BY_COLS, prec, interpret)  # [L, BV]
        if b_ref is not None:
            rhs = rhs + b_ref[c]
        x = decay_ref[c] * x + tile_dot(p_ref[c], rhs, ROWS_BY_ROWS, prec, interpret)
        if add_ref is not None:
            x = x + add_ref[c]
        out_ref[c if reverse else c + 1] = x.astype(out_ref.dtype)
        return x

    last_ref[...] = lax.fori_loop(0, n, step, x)


def tile_dot(a: jax.Array, b: jax.Array, dims: tuple, prec: GdnPrecision, interpret: bool) -> jax.Array:
    """A float32 product of two tiles at `prec` (bf16: both rounded to bfloat16 first; interpreted, as
    `matmul.gdn_einsum` does it on CPU)."""
    if bf16_operands(prec) and interpret:
        a, b, prec = round_to_bf16(a), round_to_bf16(b), lax.Precision.HIGHEST
    elif bf16_operands(prec):
        a, b, prec = a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), None
    return lax.dot_general(a, b, dims, precision=prec, preferred_element_type=jnp.float32)


def read_halved(prec: GdnPrecision, *arrays: jax.Array) -> tuple[jax.Array, ...]:
    """Arrays the kernels only multiply, as bfloat16 under bf16 precision (`tile_dot` would round them to
    it anyway: half the bytes read), else as they are."""
    return tuple(x.astype(jnp.bfloat16) for x in arrays) if bf16_operands(prec) else arrays


def _recurrence(p: jax.Array, q: jax.Array, b: jax.Array | None, decay: jax.Array, first: jax.Array,
                add: jax.Array | None, *, reverse: bool, prec, interpret: bool, blocks: Blocks) -> jax.Array:
    """Forward, x_c+1 = d_c x_c + p_c^T (b_c - q_c x_c) from x_0 = first; reverse,
    x_c = d_c x_c+1 + p_c^T (b_c - q_c x_c+1) + add_c from x_n = first.

    p, q [B, n, H, L, Dk]; b [B, n, H, L, Dv] or None; decay [B, n, H]; first [B, H, Dk, Dv];
    add [B, n + 1, H, Dk, Dv] or None -> x [B, n + 1, H, Dk, Dv] and the last one computed (x_n forward,
    x_0 reverse) [B, H, Dk, Dv] float32. Under bf16 precision every x is stored as bfloat16 (they are
    only multiplied afterwards, but for the decay gradient's sum; the recurrence itself runs in float32
    registers), the last one also as float32.
    """
    B, n, H, L, Dk = p.shape
    Dv = first.shape[-1]
    p, q = read_halved(prec, p, q)
    block_v, num_warps = blocks
    bv = min(block_v, Dv)
    if Dv % bv:
        raise ValueError(f"pallas chunk scan: value head dim {Dv} is not a multiple of {bv}")
    # grid (B, H, Dv / bv): each program sees its own sequence and head, all chunks, bv state columns
    keys = pl.BlockSpec((None, n, None, L, Dk), lambda b, h, j: (b, 0, h, 0, 0))
    states = pl.BlockSpec((None, n + 1, None, Dk, bv), lambda b, h, j: (b, 0, h, 0, j))
    in_specs, args = [keys, keys], [p, q]
    if b is not None:
        in_specs.append(pl.BlockSpec((None, n, None, L, bv), lambda b, h, j: (b, 0, h, 0, j)))
        args.append(b)
    in_specs += [pl.BlockSpec((None, n, None), lambda b, h, j: (b, 0, h)),
                 pl.BlockSpec((None, None, Dk, bv), lambda b, h, j: (b, h, 0, j))]
    args += [decay, first]
    if add is not None:
        in_specs.append(states)
        args.append(add)

    def kernel(*refs):
        refs = list(refs)
        p_ref, q_ref = refs.pop(0), refs.pop(0)
        b_ref = refs.pop(0) if b is not None else None
        decay_ref, first_ref = refs.pop(0), refs.pop(0)
        add_ref = refs.pop(0) if add is not None else None
        _recurrence_kernel(p_ref, q_ref, b_ref, decay_ref, first_ref, add_ref, *refs, n=n, reverse=reverse,
                           prec=prec, interpret=interpret)

    stored = operand_dtype(prec)
    return pl.pallas_call(
        kernel,
        grid=(B, H, Dv // bv),
        in_specs=in_specs,
        out_specs=[states, pl.BlockSpec((None, None, Dk, bv), lambda b, h, j: (b, h, 0, j))],
        out_shape=[jax.ShapeDtypeStruct((B, n + 1, H, Dk, Dv), stored),
                   jax.ShapeDtypeStruct((B, H, Dk, Dv), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=num_warps, num_stages=2),
        interpret=interpret,
        name="gdn_chunk_states_reverse" if reverse else "gdn_chunk_states",
    )(*args)


def entering_states(
    u: jax.Array,  # [B, n, H, L, Dv] float32
    w: jax.Array,  # [B, n, H, L, Dk] float32 (or bfloat16 under bf16 precision, as k)
    k: jax.Array,  # [B, n, H, L, Dk]
    decay: jax.Array,  # [B, n, H] float32
    state: jax.Array,  # [B, H, Dk, Dv] float32
    prec: GdnPrecision,
    interpret: bool,
    blocks: Blocks = DEFAULT_GDN_KERNEL_BLOCKS,
) -> tuple[jax.Array, jax.Array]:  # states [B, n + 1, H, Dk, Dv], final state [B, H, Dk, Dv] float32
    """The forward kernel alone: every chunk's entering state, the final one last (float32; bfloat16 under
    bf16 precision), and the final state in float32. Its VJP, with the output kernel's, is
    `chunk_states.pallas_chunk_states`; `entering_states_backward` is its half."""
    return _recurrence(k, w, u, decay, state, None, reverse=False, prec=prec, interpret=interpret, blocks=blocks)


def entering_states_backward(
    u: jax.Array,  # [B, n, H, L, Dv]
    w: jax.Array,  # [B, n, H, L, Dk]
    k: jax.Array,  # [B, n, H, L, Dk]
    decay: jax.Array,  # [B, n, H]
    states: jax.Array,  # [B, n + 1, H, Dk, Dv]: `entering_states`
    d_states: jax.Array,  # [B, n + 1, H, Dk, Dv]: their cotangent
    prec,
    interpret: bool,
    blocks: Blocks = DEFAULT_GDN_KERNEL_BLOCKS,
    du_add: jax.Array | None = None,  # [B, n, H, L, Dv]: another use's gradient of u, added in the kernel
    dw_add: jax.Array | None = None,  # [B, n, H, L, Dk]: likewise for w
) -> tuple[jax.Array, ...]:  # du, dw, dk, d_decay, d_state [B, H, Dk, Dv]
    """The gradients of `entering_states`' inputs: the reverse recurrence, then the chunk-gradient kernel."""
    # G_c for c = 0..n: the reverse map with (k, w) swapped, no b, dS_c added, from G_n = dS_n
    grads, d_state = _recurrence(w, k, None, decay, d_states[:, -1], d_states, reverse=True, prec=prec,
                                 interpret=interpret, blocks=blocks)
    du, dw, dk, d_decay = _chunk_gradients(u, w, k, states, grads, du_add, dw_add, prec=prec, interpret=interpret,
                                           blocks=blocks)
    return du, dw, dk, d_decay, d_state


def _chunk_gradients(u: jax.Array, w: jax.Array, k: jax.Array, states: jax.Array, grads: jax.Array,
                     du_add: jax.Array | None, dw_add: jax.Array | None, *, prec,
                     interpret: bool, blocks: Blocks) -> tuple[jax.Array, ...]:
    """Per chunk c, from S_c = states[:, c] and G_c+1 = grads[:, c + 1]: v = u - w S, dv = k G,
    dw = -dv S^T, dk = v G^T, dd = <S, G>. One program per (sequence, chunk, head), every chunk at
    once; each reads its two states once and keeps v, dv's partial products and the sums in registers
    (as batched XLA matmuls these were a dozen passes over [B, n, H, L, D] and [B, n, H, Dk, Dv] arrays).
    du_add and dw_add (both or neither) are added to du = dv and dw before they are written: the
    gradients that u and w get from the chunk-output kernel, without an XLA pass that sums them.

    u [B, n, H, L, Dv], w, k [B, n, H, L, Dk], states, grads [B, n + 1, H, Dk, Dv] float32 ->
    du [B, n, H, L, Dv], dw, dk [B, n, H, L, Dk], dd [B, n, H] float32.
    """
    adds = du_add is not None
    B, n, H, L, Dk = w.shape
    Dv = u.shape[-1]
    w, k = read_halved(prec, w, k)
    bv = state_columns(Dv, blocks)
    dot = functools.partial(tile_dot, prec=prec, interpret=interpret)

    def kernel(u_ref, w_ref, k_ref, s_ref, g_ref, *refs):
        du_add_ref, dw_add_ref = refs[:2] if adds else (None, None)
        dv_ref, dw_ref, dk_ref, dd_ref = refs[2:] if adds else refs
        w_c, k_c = w_ref[...], k_ref[...]  # [L, Dk]
        dw = dw_add_ref[...] if adds else jnp.zeros((L, Dk), jnp.float32)
        dk = jnp.zeros((L, Dk), jnp.float32)
        dd = jnp.zeros((), jnp.float32)
        for j in range(Dv // bv):  # the state's column blocks: dw, dk and dd sum over them
            cols = pl.ds(j * bv, bv)
            s, g = s_ref[:, cols], g_ref[:, cols]  # S_c, G_c+1 [Dk, bv]
            v = u_ref[:, cols] - dot(w_c, s, ROWS_BY_COLS)  # [L, bv]
            dv = dot(k_c, g, ROWS_BY_COLS)
            dv_ref[:, cols] = dv + du_add_ref[:, cols] if adds else dv
            dw = dw - dot(dv, s, COLS_BY_COLS)
            dk = dk + dot(v, g, COLS_BY_COLS)
            dd = dd + jnp.sum(s.astype(jnp.float32) * g.astype(jnp.float32))
        dw_ref[...] = dw
        dk_ref[...] = dk
        dd_ref[...] = dd

    def chunk(d):
        return pl.BlockSpec((None, None, None, L, d), lambda b, c, h: (b, c, h, 0, 0))

    def state(shift):  # S_c (shift 0) or G_c+1 (shift 1) of the n + 1 states
        return pl.BlockSpec((None, None, None, Dk, Dv), lambda b, c, h: (b, c + shift, h, 0, 0))

    return pl.pallas_call(
        kernel,
        grid=(B, n, H),
        in_specs=[chunk(Dv), chunk(Dk), chunk(Dk), state(0), state(1)] + ([chunk(Dv), chunk(Dk)] if adds else []),
        out_specs=[chunk(Dv), chunk(Dk), chunk(Dk), pl.BlockSpec((None, None, None), lambda b, c, h: (b, c, h))],
        out_shape=[jax.ShapeDtypeStruct((B, n, H, L, Dv), jnp.float32),
                   jax.ShapeDtypeStruct((B, n, H, L, Dk), jnp.float32),
                   jax.ShapeDtypeStruct((B, n, H, L, Dk), jnp.float32),
                   jax.ShapeDtypeStruct((B, n, H), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=GRADIENT_KERNEL_WARPS, num_stages=2),
        interpret=interpret,
        name="gdn_chunk_gradients",
    )(u, w, k, states, grads, *((du_add, dw_add) if adds else ()))

