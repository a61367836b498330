"""The chunk-local part of the chunked delta rule, forward and backward, as Pallas (Triton) kernels.

Per chunk and value head (the notation of `delta_rule.chunked_gated_delta_rule`; q, k of its key head,
L tokens, c the cumulative log-decay inside the chunk, r the factor with which a token reads the
entering state):

    D_ij  = exp(c_i - c_j) where i >= j are in one document, else 0       [L, L]
    A     = strict_lower(beta_i (k k^T)_ij D_ij),   T = (I + A)^-1         [L, L]
    u     = T (beta v),   w = T (beta r k),   intra = (q k^T) o D          [L, Dv], [L, Dk], [L, L]

One program per (sequence, chunk, value head) forms both Gram matrices, the decay and the inverse in
registers and writes u, w, intra, T (the backward's residual) and the queries and keys as the
chunk-state kernels read them, q_read = r q and k_write = e k (e_i = exp(c_L - c_i) where token i
writes the state carried out of the chunk, else 0). As XLA ops the same work wrote and
read a dozen [B, n, H, L, L] and [B, n, H, L, D] float32 arrays between small batched matmuls.

The inverse works on b x b blocks (b = 16, Triton's smallest product; Triton cannot slice a register
tile, so each block of A is formed from its own rows of k): with A_ij the blocks of A,

    T_ii = (I + A_ii)^-1,     T_ij = -T_ii sum_{j <= m < i} A_im T_mj   (i > j, by growing i - j)

and each T_ii by block doubling on the b x b tile: with T_m the inverse of its diagonal blocks of size
m, T_2m = T_m - T_m (A o C_m) T_m (C_m: the lower-left m x m corner of every diagonal 2m block;
[[P, 0], [C, Q]]^-1 = [[P^-1, 0], [-Q^-1 C P^-1, Q^-1]]), from T_2 = I - A o C_1. At L = 64 that is
40 products of [16, 16] tiles where doubling on the whole tile took 10 of [64, 64] (16x the
arithmetic); u and w are formed from the lower blocks of T only. The inverse's products run in
float32 (IEEE when interpreted, three TF32 passes on a GPU); the others at the rule's `prec`, as
`pallas_chunk_states.tile_dot`.

Backward, from du, dw, dintra (rhs_u = beta v, rhs_w = beta r k):

    dT = du rhs_u^T + dw rhs_w^T,   d rhs = T^T d(u, w),   dA = -strict_lower(T^T dT T^T)
    dkk = dA o beta D,   dqk = dintra o D,   dE = (dA o beta kk + dintra o qk) o D
    dq = dqk k,   dk = dqk^T q + (dkk + dkk^T) k + beta r d rhs_w,   dv = beta d rhs_u
    dc = rowsum(dE) - colsum(dE),   dbeta, dr from the row sums of d rhs o (v, k) and dA o kk D

plus the shares of q_read and k_write: dq += r dq_read, dk += e dk_write, dr += rowsum(dq_read o q),
de = rowsum(dk_write o k).

dq and dk come per value head; with several value heads per key head (G > 1) XLA sums their G copies.
q, k and v are read, and dq, dk, dv written, chunk-major [B, n, H, L, d] or (`token_major`, what the
end-to-end rule uses) in the layer's token-major [B, n L, H, d], the same [L, d] tiles by block spec;
q, k and v may be bfloat16 (read as float32, their gradients written in their dtype).
Off a GPU the kernels run interpreted (tests).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from qwen35_kernels.choices import KernelChoices, resolved
from qwen35_kernels.gated_delta_rule.matmul import GdnPrecision
from qwen35_kernels.gated_delta_rule.pallas_chunk_states import (
    COLS_BY_COLS,
    GRADIENT_KERNEL_WARPS,
    ROWS_BY_COLS,
    ROWS_BY_ROWS,
    tile_dot,
)


def local_kernel_fits(dk: int, dv: int, chunk: int) -> bool:
    """Whether Triton can compile the kernels for these sizes: whole [L, Dk], [L, Dv] and [L, L] tiles
    need powers of two of at least 16 (every Qwen3.5 model: 128, 128 and chunks of 64)."""
    return all(x >= 16 and x & (x - 1) == 0 for x in (dk, dv, chunk))


def _tile_dots(prec: GdnPrecision, interpret: bool):
    """(dot at the rule's `prec`, dot for the inverse: IEEE float32 interpreted, three TF32 passes on a GPU)."""
    exact = lax.Precision.HIGHEST if interpret else lax.DotAlgorithmPreset.TF32_TF32_F32_X3
    return (functools.partial(tile_dot, prec=prec, interpret=interpret),
            functools.partial(tile_dot, prec=exact, interpret=interpret))


def _sizes(q: jax.Array, v: jax.Array, cum: jax.Array, token_major: bool) -> tuple[int, ...]:
    """(B, n, Hk, Hv, L, Dk, Dv) from q, v (chunk-major [B, n, H, L, d] or token-major [B, n L, H, d])
    and cum [B, n, Hv, L]."""
    B, n, Hv, L = cum.shape
    Hk = q.shape[2]
    expected = ((B, n * L, Hk, q.shape[-1]), (B, n * L, Hv, v.shape[-1])) if token_major else (
        (B, n, Hk, L, q.shape[-1]), (B, n, Hv, L, v.shape[-1]))
    if (q.shape, v.shape) != expected:
        raise ValueError(f"q {q.shape} and v {v.shape} do not match cum {cum.shape} "
                         f"({'token' if token_major else 'chunk'}-major)")
    return B, n, Hk, Hv, L, q.shape[-1], v.shape[-1]


def _qkv_specs(L: int, G: int, token_major: bool):
    """(key_tile(d), value_tile(d)): the block specs of q, k (key heads) and of v, dq, dk, dv (value
    heads) on the grid (B, n, Hv), chunk-major [B, n, H, L, d] or token-major [B, n L, H, d] (the
    layer's own layout, read and written in place: no transposition around the kernels)."""
    if token_major:
        return (lambda d: pl.BlockSpec((None, L, None, d), lambda b, c, h: (b, c, h // G, 0)),
                lambda d: pl.BlockSpec((None, L, None, d), lambda b, c, h: (b, c, h, 0)))
    value_tile, key_tile, _, _ = _grid_specs(L, G)
    return key_tile, value_tile


def _grid_specs(L: int, G: int):
    """Block specs on the grid (B, n, Hv): value head h reads key head h // G."""
    def value_tile(d):  # [L, d] of [B, n, Hv, L, d]
        return pl.BlockSpec((None, None, None, L, d), lambda b, c, h: (b, c, h, 0, 0))

    def key_tile(d):  # [L, d] of [B, n, Hk, L, d]
        return pl.BlockSpec((None, None, None, L, d), lambda b, c, h: (b, c, h // G, 0, 0))

    per_token = pl.BlockSpec((None, None, None, L), lambda b, c, h: (b, c, h, 0))  # [L] of [B, n, Hv, L]
    document = pl.BlockSpec((None, None, L), lambda b, c, h: (b, c, 0))  # [L] of [B, n, L]
    return value_tile, key_tile, per_token, document


def _decay(cum: jax.Array, doc: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
    """cum [L] float32, doc [L] int32 (-1: padding) -> D [L, L], row and column indices [L, L]."""
    return _pair_decay(cum, cum, doc, doc, diagonal=True)


def _pair_decay(cum_r: jax.Array, cum_c: jax.Array, doc_r: jax.Array, doc_c: jax.Array, *, diagonal: bool
                ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The block of D between row tokens (cum_r, doc_r [m]) and column tokens (cum_c, doc_c [m]) -> D [m, m],
    row and column indices [m, m]. diagonal: the two are the same tokens (D is lower triangular), else
    every row token comes after every column token."""
    m = cum_r.shape[0]
    row = lax.broadcasted_iota(jnp.int32, (m, m), 0)
    col = lax.broadcasted_iota(jnp.int32, (m, m), 1)
    pair = (doc_r[:, None] == doc_c[None, :]) & (doc_r[:, None] >= 0)
    if diagonal:
        pair = pair & (row >= col)
    diff = jnp.where(pair, cum_r[:, None] - cum_c[None, :], 0.0)
    return jnp.where(pair, jnp.exp(diff), 0.0), row, col


def _unit_lower_inverse(a: jax.Array, row: jax.Array, col: jax.Array, dot) -> jax.Array:
    """(I + a)^-1 for a [L, L] strictly lower, by block doubling on whole tiles (module docstring)."""
    L = a.shape[0]
    eye = (row == col).astype(jnp.float32)
    t = eye - jnp.where((row == col + 1) & (lax.rem(row, 2) == 1), a, 0.0)  # T_2
    m = 2
    while m < L:
        shift = m.bit_length() - 1  # m = 2 ** shift
        same_block = lax.shift_right_logical(row, shift + 1) == lax.shift_right_logical(col, shift + 1)
        corner = same_block & ((row & m) != 0) & ((col & m) == 0)
        t = t - dot(dot(t, jnp.where(corner, a, 0.0), ROWS_BY_COLS), t, ROWS_BY_COLS)
        m *= 2
    return t


def _inverse_block(L: int) -> int:
    """The block size b of the inverse: 16 where it divides a longer chunk, else the whole chunk."""
    return 16 if L > 16 and L % 16 == 0 else L


def _blocked_inverse(k_ref, beta_ref, cum_ref, doc_ref, blocks: list, dot, exact) -> dict:
    """T = (I + A)^-1 of the chunk by b x b blocks (module docstring) -> {(i, j): T_ij [b, b]} for i >= j.

    A_ij = strict_lower(beta_i (k_i k_j^T) o D_ij) is formed block by block from the rows of k_ref
    ([L, Dk]) and of beta, cum, doc ([L]) that `blocks` (static slices of b tokens) select."""
    k = [k_ref[rows, :].astype(jnp.float32) for rows in blocks]  # [b, Dk] each
    beta = [beta_ref[rows] for rows in blocks]
    cum = [cum_ref[rows] for rows in blocks]
    doc = [doc_ref[rows] for rows in blocks]
    a, t = {}, {}
    for i in range(len(blocks)):
        for j in range(i + 1):
            decay, row, col = _pair_decay(cum[i], cum[j], doc[i], doc[j], diagonal=i == j)
            a_ij = beta[i][:, None] * dot(k[i], k[j], COLS_BY_COLS) * decay
            a[i, j] = jnp.where(row > col, a_ij, 0.0) if i == j else a_ij
        t[i, i] = _unit_lower_inverse(a[i, i], row, col, exact)
    for distance in range(1, len(blocks)):
        for i in range(distance, len(blocks)):
            j = i - distance
            acc = exact(a[i, j], t[j, j], ROWS_BY_COLS)
            for m in range(j + 1, i):
                acc = acc + exact(a[i, m], t[m, j], ROWS_BY_COLS)
            t[i, j] = -exact(t[i, i], acc, ROWS_BY_COLS)
    return t


@functools.partial(jax.custom_vjp, nondiff_argnums=(8, 9))
def _chunk_local(q, k, v, cum, beta, read, write, doc, prec, interpret):
    return chunk_local_forward(q, k, v, cum, beta, read, write, doc, prec, interpret)[:5]


def chunk_local_forward(q: jax.Array, k: jax.Array, v: jax.Array, cum: jax.Array, beta: jax.Array,
                        read: jax.Array, write: jax.Array, doc: jax.Array, prec: GdnPrecision, interpret: bool,
                        operand_dtype: jnp.dtype = jnp.float32, token_major: bool = False) -> tuple[jax.Array, ...]:
    """The forward kernel alone (no VJP): shapes as `pallas_chunk_local` (with `token_major`, q, k
    [B, n L, Hk, Dk] and v [B, n L, Hv, Dv]) -> u [B, n, Hv, L, Dv], w, intra, q_read, k_write as there,
    and T [B, n, Hv, L, L] (the backward's residual). w, intra, q_read and k_write, which later kernels
    only multiply, are written as `operand_dtype`; u and T are float32."""
    B, n, Hk, Hv, L, Dk, Dv = _sizes(q, v, cum, token_major)
    dot, exact = _tile_dots(prec, interpret)

    b = _inverse_block(L)
    blocks = [pl.ds(i * b, b) for i in range(L // b)]

    def kernel(q_ref, k_ref, v_ref, cum_ref, beta_ref, read_ref, write_ref, doc_ref,
               u_ref, w_ref, intra_ref, q_read_ref, k_write_ref, t_ref):
        t = _blocked_inverse(k_ref, beta_ref, cum_ref, doc_ref, blocks, dot, exact)  # {(i, j): [b, b]}, i >= j
        for i, rows in enumerate(blocks):
            for j, cols in enumerate(blocks):
                t_ref[rows, cols] = t[i, j] if j <= i else jnp.zeros((b, b), jnp.float32)
            # row block i of u = T (beta v) and w = T (beta r k), from T's blocks left of the diagonal
            u_i = w_i = 0.0
            for j, cols in enumerate(blocks[:i + 1]):
                beta_j = beta_ref[cols]
                u_i = u_i + dot(t[i, j], v_ref[cols, :].astype(jnp.float32) * beta_j[:, None], ROWS_BY_COLS)
                k_j = k_ref[cols, :].astype(jnp.float32)
                w_i = w_i + dot(t[i, j], k_j * (beta_j * read_ref[cols])[:, None], ROWS_BY_COLS)
            u_ref[rows, :] = u_i
            w_ref[rows, :] = w_i.astype(operand_dtype)
        k_c, q_c, read_c = k_ref[...].astype(jnp.float32), q_ref[...].astype(jnp.float32), read_ref[...]
        decay, _, _ = _decay(cum_ref[...], doc_ref[...])
        k_write_ref[...] = (k_c * write_ref[...][:, None]).astype(operand_dtype)
        intra_ref[...] = (dot(q_c, k_c, COLS_BY_COLS) * decay).astype(operand_dtype)
        q_read_ref[...] = (q_c * read_c[:, None]).astype(operand_dtype)

    value_tile, _, per_token, document = _grid_specs(L, Hv // Hk)
    key_in, value_in = _qkv_specs(L, Hv // Hk, token_major)
    f32, op = jnp.float32, operand_dtype
    return tuple(pl.pallas_call(
        kernel, grid=(B, n, Hv),
        in_specs=[key_in(Dk), key_in(Dk), value_in(Dv)] + [per_token] * 4 + [document],
        out_specs=[value_tile(Dv), value_tile(Dk), value_tile(L), value_tile(Dk), value_tile(Dk), value_tile(L)],
        out_shape=[jax.ShapeDtypeStruct((B, n, Hv, L, Dv), f32), jax.ShapeDtypeStruct((B, n, Hv, L, Dk), op),
                   jax.ShapeDtypeStruct((B, n, Hv, L, L), op), jax.ShapeDtypeStruct((B, n, Hv, L, Dk), op),
                   jax.ShapeDtypeStruct((B, n, Hv, L, Dk), op), jax.ShapeDtypeStruct((B, n, Hv, L, L), f32)],
        compiler_params=plgpu.CompilerParams(num_warps=GRADIENT_KERNEL_WARPS, num_stages=2),
        interpret=interpret, name="gdn_chunk_local",
    )(q, k, v, cum, beta, read, write, doc))


def _chunk_local_fwd(q, k, v, cum, beta, read, write, doc, prec, interpret):
    *outputs, t = chunk_local_forward(q, k, v, cum, beta, read, write, doc, prec, interpret)
    return tuple(outputs), (q, k, v, cum, beta, read, write, doc, t)


def _chunk_local_bwd(prec, interpret, res, cotangents):
    return (*chunk_local_backward(*res, *cotangents, prec, interpret), None)


def chunk_local_backward(
    q: jax.Array, k: jax.Array, v: jax.Array, cum: jax.Array, beta: jax.Array, read: jax.Array,
    write: jax.Array, doc: jax.Array,  # the forward's inputs (shapes as `pallas_chunk_local`)
    t: jax.Array,  # [B, n, Hv, L, L]: the forward's T
    du: jax.Array, dw: jax.Array, dintra: jax.Array, dq_read: jax.Array, dk_write: jax.Array,  # float32 cotangents
    prec: GdnPrecision,
    interpret: bool,
    token_major: bool = False,
) -> tuple[jax.Array, ...]:  # dq, dk [B, n, Hk, L, Dk], dv [B, n, Hv, L, Dv], dcum, dbeta, dread, dwrite [B, n, Hv, L]
    """The backward kernel alone: the gradients of `chunk_local_forward`'s inputs but doc, dq, dk and dv
    in the layout of q, k and v (`token_major`: [B, n L, Hk, Dk], [B, n L, Hv, Dv])."""
    B, n, Hk, Hv, L, Dk, Dv = _sizes(q, v, cum, token_major)
    G = Hv // Hk
    dot, exact = _tile_dots(prec, interpret)

    def kernel(q_ref, k_ref, v_ref, cum_ref, beta_ref, read_ref, write_ref, doc_ref, t_ref, du_ref, dw_ref,
               dintra_ref, dq_read_ref, dk_write_ref, dq_ref, dk_ref, dv_ref, dcum_ref, dbeta_ref, dread_ref,
               dwrite_ref):
        # In the order that keeps the fewest [L, D] and [L, L] tiles live at once (each is 16-32 registers
        # a thread at 8 warps): every tile is read where it is first needed, every gradient written
        # as soon as it is complete.
        beta_c, read_c, write_c = beta_ref[...], read_ref[...], write_ref[...]  # [L]
        k_factor = beta_c * read_c
        decay, row, col = _decay(cum_ref[...], doc_ref[...])
        k_c, t = k_ref[...].astype(jnp.float32), t_ref[...]
        kk = dot(k_c, k_c, COLS_BY_COLS)  # [L, L]
        # through u = T (beta v)
        du_c, v_c = du_ref[...], v_ref[...].astype(jnp.float32)
        d_rhs_u = dot(t, du_c, ROWS_BY_ROWS)  # [L, Dv]
        dv_ref[...] = (d_rhs_u * beta_c[:, None]).astype(dv_ref.dtype)
        d_beta = jnp.sum(d_rhs_u * v_c, axis=1)
        d_t = dot(du_c, v_c * beta_c[:, None], COLS_BY_COLS)  # [L, L]
        # through w = T (beta r k)
        dw_c = dw_ref[...]
        d_t = d_t + dot(dw_c, k_c * k_factor[:, None], COLS_BY_COLS)
        d_rhs_w = dot(t, dw_c, ROWS_BY_ROWS)  # [L, Dk]
        d_k_factor = jnp.sum(d_rhs_w * k_c, axis=1)  # [L]
        dk = d_rhs_w * k_factor[:, None]
        # through T = (I + A)^-1 and A = strict_lower(beta kk o D)
        d_a = jnp.where(row > col, -exact(exact(t, d_t, ROWS_BY_ROWS), t, COLS_BY_COLS), 0.0)
        d_a = d_a * decay
        dbeta_ref[...] = d_beta + d_k_factor * read_c + jnp.sum(d_a * kk, axis=1)
        d_kk = d_a * beta_c[:, None]
        dk = dk + dot(d_kk, k_c, ROWS_BY_COLS) + dot(d_kk, k_c, ROWS_BY_ROWS)
        d_exp = d_kk * kk  # d exp(c_i - c_j) o D
        # through intra = (q k^T) o D
        q_c, dintra_c = q_ref[...].astype(jnp.float32), dintra_ref[...]
        d_qk = dintra_c * decay
        d_exp = d_exp + d_qk * dot(q_c, k_c, COLS_BY_COLS)
        dcum_ref[...] = jnp.sum(d_exp, axis=1) - jnp.sum(d_exp, axis=0)
        dq = dot(d_qk, k_c, ROWS_BY_COLS)
        dk = dk + dot(d_qk, q_c, ROWS_BY_ROWS)
        # through q_read = r q and k_write = e k
        dq_read, dk_write = dq_read_ref[...], dk_write_ref[...]  # [L, Dk]
        dq_ref[...] = (dq + dq_read * read_c[:, None]).astype(dq_ref.dtype)
        dread_ref[...] = d_k_factor * beta_c + jnp.sum(dq_read * q_c, axis=1)
        dwrite_ref[...] = jnp.sum(dk_write * k_c, axis=1)
        dk_ref[...] = (dk + dk_write * write_c[:, None]).astype(dk_ref.dtype)

    value_tile, _, per_token, document = _grid_specs(L, G)
    key_in, value_in = _qkv_specs(L, G, token_major)
    f32 = jnp.float32
    layout = (lambda d: (B, n * L, Hv, d)) if token_major else (lambda d: (B, n, Hv, L, d))
    dqk = q.dtype if G == 1 else f32  # with G > 1 the value heads' shares are summed in float32 first
    dq, dk, dv, dcum, dbeta, dread, dwrite = pl.pallas_call(
        kernel, grid=(B, n, Hv),
        in_specs=[key_in(Dk), key_in(Dk), value_in(Dv)] + [per_token] * 4 + [document]
                 + [value_tile(L), value_tile(Dv), value_tile(Dk), value_tile(L), value_tile(Dk), value_tile(Dk)],
        out_specs=[value_in(Dk), value_in(Dk), value_in(Dv)] + [per_token] * 4,
        out_shape=[jax.ShapeDtypeStruct(layout(Dk), dqk), jax.ShapeDtypeStruct(layout(Dk), dqk),
                   jax.ShapeDtypeStruct(layout(Dv), v.dtype)]
                  + [jax.ShapeDtypeStruct((B, n, Hv, L), f32)] * 4,
        compiler_params=plgpu.CompilerParams(num_warps=GRADIENT_KERNEL_WARPS, num_stages=2),
        interpret=interpret, name="gdn_chunk_local_backward",
    )(q, k, v, cum, beta, read, write, doc, t, du, dw, dintra, dq_read, dk_write)
    if G > 1:  # each value head's share of its key head's gradient
        grouped = (B, n * L, Hk, G, Dk) if token_major else (B, n, Hk, G, L, Dk)
        dq, dk = (x.reshape(grouped).sum(axis=3).astype(q.dtype) for x in (dq, dk))
    return dq, dk, dv, dcum, dbeta, dread, dwrite


_chunk_local.defvjp(_chunk_local_fwd, _chunk_local_bwd)


def pallas_chunk_local(
    q: jax.Array,  # [B, n, Hk, L, Dk] float32 or bfloat16 (read as float32; dq in its dtype), scaled
    k: jax.Array,  # [B, n, Hk, L, Dk] as q
    v: jax.Array,  # [B, n, Hv, L, Dv] float32 or the compute dtype (read as float32; its gradient in its own)
    cum: jax.Array,  # [B, n, Hv, L] float32: cumulative log-decay inside each chunk
    beta: jax.Array,  # [B, n, Hv, L] float32
    read: jax.Array,  # [B, n, Hv, L] float32: the factor with which each token reads the entering state
    write: jax.Array,  # [B, n, Hv, L] float32: the factor with which each token's key enters the next state
    doc: jax.Array,  # [B, n, L] int32: document index, -1 on padding
    prec: GdnPrecision,
    *,
    choices: KernelChoices | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, ...]:  # u [B, n, Hv, L, Dv], w [.., L, Dk], intra [.., L, L], q_read, k_write [.., L, Dk]
    """u, w and intra of every chunk and value head (module docstring), and the queries and keys as the
    chunk-state kernels take them, q_read = r q and k_write = write k. `interpret`: None runs the
    Triton kernels on the choices' GPU and interprets them elsewhere; False builds them for Triton anywhere."""
    if interpret is None:
        interpret = resolved(choices).interpret
    return _chunk_local(q, k, v, cum, beta, read, write, doc, prec, interpret)
