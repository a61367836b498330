"""Pallas kernels for the per-token statistics, forward and backward, in two launch layouts.

Both layouts run the same tile math (tiles.py) on [bt, bv] logit tiles; they differ only in how tiles
are scheduled, because the two compilers offer different ways to reduce across tiles:

- "gpu" (Triton): one program per token block for the forward, looping over vocabulary blocks and, for
  each logit tile, over D in chunks of bd (a [bt, D] block does not fit in registers). The backward
  launches one program per (token block, vocabulary block): it recomputes the tile, forms dz and adds
  dz @ W^T into dh and h^T @ dz into dW with float32 atomic adds, chunk by chunk over D (the
  Cut Cross-Entropy scheme). Block shapes are powers of two.
- "tpu" (Mosaic): grids whose last axis is a sequential reduction ("arbitrary"), with the running
  statistics in VMEM scratch and dh / dW accumulated in their resident output blocks: forward and dh
  over (token block, vocabulary block), dW over (vocabulary block, token block). Blocks hold all of D.

Ragged T, V (and D for "gpu") are padded up to the block sizes: padded tokens carry label -1 and zero
cotangents, padded vocabulary columns are masked to tiles.NEG. The weight is copied only when V is not
a multiple of bv (Qwen3.5's 248,320 = 1940 * 128 never is). On CPU the kernels run with
`interpret=True`; both layouts can be interpreted there, which is how the tests check them.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu
from jax.experimental.pallas import triton as plgpu
from qwen35_kernels.choices import KernelChoices, resolved

from . import tiles


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Launch layout and block sizes (static)."""

    layout: str  # "gpu" or "tpu"
    block_t: int
    block_v: int
    block_d: int  # "gpu" only: D chunk of each tile matmul
    interpret: bool
    num_warps: int = 4
    num_stages: int = 2
    v_splits: int = 0  # "gpu" forward: vocabulary splits per token block (0: enough for target_programs)
    target_programs: int = 1024


DEFAULTS = {
    # H100/H200: 64x128 f32 logit tile in registers with 4 warps, 64-wide D chunks (bf16 tensor cores).
    "gpu": dict(block_t=64, block_v=128, block_d=64),
    # TPU: MXU-sized tiles; h [256, D] and w [D, 512] blocks are double-buffered in VMEM.
    "tpu": dict(block_t=256, block_v=512, block_d=0),
}
TPU_VMEM_LIMIT = 64 * 1024 * 1024


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _iota_cols(j, bv: int) -> jax.Array:  # [1, bv] global vocabulary ids of block j
    return (j * bv + jnp.arange(bv, dtype=jnp.int32))[None, :]


def _dot(a, b, contract: tuple[tuple[int], tuple[int]]) -> jax.Array:  # float32 result
    return lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=jnp.float32,
                           precision=tiles.half_operand_precision(a.dtype, b.dtype))


def _dot_nn(a, b):  # [m, k] x [k, n] -> [m, n]
    return _dot(a, b, ((1,), (0,)))


def _dot_nt(a, b):  # [m, k] x [n, k] -> [m, n]
    return _dot(a, b, ((1,), (1,)))


def _dot_tn(a, b):  # [k, m] x [k, n] -> [m, n]
    return _dot(a, b, ((0,), (0,)))


# ----------------------------------------------------------------------------- "gpu" layout


def _gpu_tile_logits(h_ref, w_ref, j, blk: Blocks, n_d: int, vocab: int, inv_t: float):
    """Masked scaled logits [bt, bv] of vocabulary block j, contracting D in chunks of bd."""
    bt, bv, bd = blk.block_t, blk.block_v, blk.block_d

    def d_step(k, acc):
        h = h_ref[:, pl.ds(k * bd, bd)]  # [bt, bd]
        w = w_ref[pl.ds(k * bd, bd), pl.ds(j * bv, bv)]  # [bd, bv]
        return acc + _dot_nn(h, w)

    z = lax.fori_loop(0, n_d, d_step, jnp.zeros((bt, bv), jnp.float32)) * inv_t
    cols = _iota_cols(j, bv)
    return tiles.mask_columns(z, cols, vocab), cols


def _gpu_fwd_kernel(h_ref, w_ref, l_ref, lse_ref, ent_ref, zl_ref, *, blk, n_v, per_split, n_d, vocab, inv_t):
    labels = l_ref[...]  # [bt, 1]
    first = pl.program_id(1) * per_split  # this program's vocabulary blocks: [first, last)
    last = jnp.minimum(first + per_split, n_v)

    def v_step(j, stats):
        z, cols = _gpu_tile_logits(h_ref, w_ref, j, blk, n_d, vocab, inv_t)
        return tiles.update_stats(stats, z, cols, labels)

    stats = lax.fori_loop(first, last, v_step, tiles.init_stats((blk.block_t, 1)))
    lse, ent, zl = tiles.finish_stats(stats)
    lse_ref[...], ent_ref[...], zl_ref[...] = lse, ent, zl


def _gpu_bwd_kernel(
    h_ref, w_ref, l_ref, lse_ref, mz_ref, gl_ref, ge_ref, gz_ref, _dh0, _dw0, dh_ref, dw_ref,
    *, blk, n_d, vocab, inv_t, temperature,
):
    i, j = pl.program_id(0), pl.program_id(1)
    bt, bv, bd = blk.block_t, blk.block_v, blk.block_d
    z, cols = _gpu_tile_logits(h_ref, w_ref, j, blk, n_d, vocab, inv_t)
    dz = tiles.dlogits(
        z, cols, l_ref[...], lse_ref[...], mz_ref[...], gl_ref[...], ge_ref[...], gz_ref[...],
        temperature,
    ).astype(w_ref.dtype)  # [bt, bv]

    def d_step(k, carry):
        h = h_ref[:, pl.ds(k * bd, bd)]  # [bt, bd]
        w = w_ref[pl.ds(k * bd, bd), pl.ds(j * bv, bv)]  # [bd, bv]
        plgpu.atomic_add(dh_ref, (pl.ds(i * bt, bt), pl.ds(k * bd, bd)), _dot_nt(dz, w))
        plgpu.atomic_add(dw_ref, (pl.ds(k * bd, bd), pl.ds(j * bv, bv)), _dot_tn(h.astype(dz.dtype), dz))
        return carry

    lax.fori_loop(0, n_d, d_step, 0)


# ----------------------------------------------------------------------------- "tpu" layout


def _tpu_tile_logits(h_ref, w_ref, j, bv: int, vocab: int, inv_t: float):
    z = _dot_nn(h_ref[...], w_ref[...]) * inv_t  # [bt, bv]
    cols = _iota_cols(j, bv)
    return tiles.mask_columns(z, cols, vocab), cols


def _tpu_fwd_kernel(
    h_ref, w_ref, l_ref, lse_ref, ent_ref, zl_ref, m_sc, s_sc, r_sc, zl_sc, *, n_v, bv, vocab, inv_t
):
    j = pl.program_id(1)
    scratch = (m_sc, s_sc, r_sc, zl_sc)

    @pl.when(j == 0)
    def _init():
        for ref, x in zip(scratch, tiles.init_stats(m_sc.shape)):
            ref[...] = x

    z, cols = _tpu_tile_logits(h_ref, w_ref, j, bv, vocab, inv_t)
    stats = tiles.update_stats(tuple(ref[...] for ref in scratch), z, cols, l_ref[...])
    for ref, x in zip(scratch, stats):
        ref[...] = x

    @pl.when(j == n_v - 1)
    def _finish():
        lse, ent, zl = tiles.finish_stats(stats)
        lse_ref[...], ent_ref[...], zl_ref[...] = lse, ent, zl


def _tpu_dz(h_ref, w_ref, rows, j, bv, vocab, inv_t, temperature):
    z, cols = _tpu_tile_logits(h_ref, w_ref, j, bv, vocab, inv_t)
    return tiles.dlogits(z, cols, *(r[...] for r in rows), temperature).astype(w_ref.dtype)


def _tpu_dh_kernel(h_ref, w_ref, *refs, bv, vocab, inv_t, temperature):
    rows, dh_ref = refs[:6], refs[6]
    j = pl.program_id(1)

    @pl.when(j == 0)
    def _init():
        dh_ref[...] = jnp.zeros(dh_ref.shape, jnp.float32)

    dz = _tpu_dz(h_ref, w_ref, rows, j, bv, vocab, inv_t, temperature)
    dh_ref[...] += _dot_nt(dz, w_ref[...])


def _tpu_dw_kernel(h_ref, w_ref, *refs, bv, vocab, inv_t, temperature):
    rows, dw_ref = refs[:6], refs[6]
    j, i = pl.program_id(0), pl.program_id(1)

    @pl.when(i == 0)
    def _init():
        dw_ref[...] = jnp.zeros(dw_ref.shape, jnp.float32)

    dz = _tpu_dz(h_ref, w_ref, rows, j, bv, vocab, inv_t, temperature)
    dw_ref[...] += _dot_tn(h_ref[...].astype(dz.dtype), dz)


# ----------------------------------------------------------------------------- launches


def _padded(hidden, weight, labels, blk: Blocks):
    """Pad T, V (and D for "gpu") to the blocks; labels become int32 [Tp, 1] (pad -1)."""
    T, D = hidden.shape
    V = weight.shape[1]
    tp, vp = _round_up(T, blk.block_t), _round_up(V, blk.block_v)
    dp = _round_up(D, blk.block_d) if blk.layout == "gpu" else D
    if (tp, dp) != (T, D):
        hidden = jnp.pad(hidden, ((0, tp - T), (0, dp - D)))
    if (dp, vp) != (D, V):
        weight = jnp.pad(weight, ((0, dp - D), (0, vp - V)))
    labels = jnp.pad(labels.astype(jnp.int32), (0, tp - T), constant_values=-1)[:, None]
    return hidden, weight, labels


def _col(x, tp: int):  # [T] -> [Tp, 1] float32, zero padded
    return jnp.pad(jnp.asarray(x, jnp.float32), (0, tp - x.shape[0]))[:, None]


def _params(blk: Blocks, semantics: tuple[str, ...]):
    if blk.layout == "gpu":
        return plgpu.CompilerParams(num_warps=blk.num_warps, num_stages=blk.num_stages)
    return pltpu.CompilerParams(dimension_semantics=semantics, vmem_limit_bytes=TPU_VMEM_LIMIT)


def forward_stats(hidden, weight, labels, temperature: float, blk: Blocks):
    """(lse, entropy, label logit), 3 x [T] float32, from one kernel launch (no VJP)."""
    T, V = hidden.shape[0], weight.shape[1]
    h, w, lab = _padded(hidden, weight, labels, blk)
    (tp, dp), vp = h.shape, w.shape[1]
    bt, bv = blk.block_t, blk.block_v
    n_t, n_v = tp // bt, vp // bv
    out_shape = [tiles.out_struct((tp, 1), jnp.float32, h, w, lab)] * 3
    inv_t = 1.0 / temperature
    if blk.layout == "gpu":
        # Split the vocabulary over programs too, so a few token blocks still fill the GPU; the
        # per-split statistics are merged exactly below. No split is empty.
        splits = blk.v_splits or max(1, -(-blk.target_programs // n_t))
        per_split = -(-n_v // min(splits, n_v))
        splits = -(-n_v // per_split)
        kernel = functools.partial(
            _gpu_fwd_kernel, blk=blk, n_v=n_v, per_split=per_split, n_d=dp // blk.block_d, vocab=V,
            inv_t=inv_t,
        )
        part = pl.BlockSpec((None, bt, 1), lambda i, k: (k, i, 0))
        parts = pl.pallas_call(
            kernel,
            grid=(n_t, splits),
            in_specs=[
                pl.BlockSpec((bt, dp), lambda i, k: (i, 0)),
                pl.BlockSpec((dp, vp), lambda i, k: (0, 0)),
                pl.BlockSpec((bt, 1), lambda i, k: (i, 0)),
            ],
            out_specs=[part] * 3,
            out_shape=[tiles.out_struct((splits, tp, 1), jnp.float32, h, w, lab)] * 3,
            compiler_params=_params(blk, ()),
            interpret=blk.interpret,
            name="logprob_forward",
        )(h, w, lab)  # 3 x [splits, Tp, 1]
        out = tiles.combine_stats(
            *parts, max_fn=lambda x: jnp.max(x, axis=0), sum_fn=lambda x: jnp.sum(x, axis=0)
        )
    else:
        kernel = functools.partial(_tpu_fwd_kernel, n_v=n_v, bv=bv, vocab=V, inv_t=inv_t)
        row = pl.BlockSpec((bt, 1), lambda i, j: (i, 0))
        out = pl.pallas_call(
            kernel,
            grid=(n_t, n_v),
            in_specs=[
                pl.BlockSpec((bt, dp), lambda i, j: (i, 0)),
                pl.BlockSpec((dp, bv), lambda i, j: (0, j)),
                row,
            ],
            out_specs=[row] * 3,
            out_shape=out_shape,
            scratch_shapes=[pltpu.VMEM((bt, 1), jnp.float32)] * 4,
            compiler_params=_params(blk, ("parallel", "arbitrary")),
            interpret=blk.interpret,
            name="logprob_forward",
        )(h, w, lab)
    return tuple(x[:T, 0] for x in out)


def _backward(hidden, weight, labels, lse, ent, cts, temperature: float, blk: Blocks):
    T, D = hidden.shape
    V = weight.shape[1]
    h, w, lab = _padded(hidden, weight, labels, blk)
    (tp, dp), vp = h.shape, w.shape[1]
    bt, bv = blk.block_t, blk.block_v
    n_t, n_v = tp // bt, vp // bv
    rows = [lab] + [_col(x, tp) for x in (lse, lse - ent, *cts)]  # labels, lse, E[z], g_lse, g_ent, g_zl
    static = dict(vocab=V, inv_t=1.0 / temperature, temperature=temperature)
    if blk.layout == "gpu":
        zeros = tiles.match_vma(
            (jnp.zeros((tp, dp), jnp.float32), jnp.zeros((dp, vp), jnp.float32)), h, w, *rows
        )  # accumulators for the atomic adds
        row = pl.BlockSpec((bt, 1), lambda i, j: (i, 0))
        whole = lambda shape: pl.BlockSpec(shape, lambda i, j: (0, 0))  # noqa: E731
        dh, dw = pl.pallas_call(
            functools.partial(_gpu_bwd_kernel, blk=blk, n_d=dp // blk.block_d, **static),
            grid=(n_t, n_v),
            in_specs=[pl.BlockSpec((bt, dp), lambda i, j: (i, 0)), whole((dp, vp))]
            + [row] * 6
            + [whole((tp, dp)), whole((dp, vp))],
            out_specs=[whole((tp, dp)), whole((dp, vp))],
            out_shape=[tiles.out_struct(x.shape, jnp.float32, h, w, *rows) for x in zeros],
            input_output_aliases={8: 0, 9: 1},
            compiler_params=_params(blk, ()),
            interpret=blk.interpret,
            name="logprob_backward",
        )(h, w, *rows, *zeros)
    else:
        row = pl.BlockSpec((bt, 1), lambda i, j: (i, 0))
        dh = pl.pallas_call(
            functools.partial(_tpu_dh_kernel, bv=bv, **static),
            grid=(n_t, n_v),
            in_specs=[pl.BlockSpec((bt, dp), lambda i, j: (i, 0)), pl.BlockSpec((dp, bv), lambda i, j: (0, j))]
            + [row] * 6,
            out_specs=pl.BlockSpec((bt, dp), lambda i, j: (i, 0)),
            out_shape=tiles.out_struct((tp, dp), jnp.float32, h, w, *rows),
            compiler_params=_params(blk, ("parallel", "arbitrary")),
            interpret=blk.interpret,
            name="logprob_backward_dh",
        )(h, w, *rows)
        row_t = pl.BlockSpec((bt, 1), lambda j, i: (i, 0))
        dw = pl.pallas_call(
            functools.partial(_tpu_dw_kernel, bv=bv, **static),
            grid=(n_v, n_t),
            in_specs=[pl.BlockSpec((bt, dp), lambda j, i: (i, 0)), pl.BlockSpec((dp, bv), lambda j, i: (0, j))]
            + [row_t] * 6,
            out_specs=pl.BlockSpec((dp, bv), lambda j, i: (0, j)),
            out_shape=tiles.out_struct((dp, vp), jnp.float32, h, w, *rows),
            compiler_params=_params(blk, ("parallel", "arbitrary")),
            interpret=blk.interpret,
            name="logprob_backward_dw",
        )(h, w, *rows)
    return dh[:T, :D].astype(hidden.dtype), dw[:D, :V].astype(weight.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _stats(hidden, weight, labels, temperature, blk):
    return forward_stats(hidden, weight, labels, temperature, blk)


def _stats_fwd(hidden, weight, labels, temperature, blk):
    lse, ent, zl = forward_stats(hidden, weight, labels, temperature, blk)
    return (lse, ent, zl), (hidden, weight, labels, lse, ent)


def _stats_bwd(temperature, blk, res, cts):
    hidden, weight, labels, lse, ent = res
    dh, dw = _backward(hidden, weight, labels, lse, ent, cts, temperature, blk)
    return tiles.match_cotangent(dh, hidden), tiles.match_cotangent(dw, weight), None


_stats.defvjp(_stats_fwd, _stats_bwd)


def make_blocks(
    layout: str | None = None,
    *,
    block_t: int | None = None,
    block_v: int | None = None,
    block_d: int | None = None,
    interpret: bool | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
    v_splits: int = 0,
    choices: KernelChoices | None = None,
) -> Blocks:
    """Blocks for the `choices`' platform (None: jax's backend): layout "tpu" on TPU, else "gpu";
    interpret on anything but GPU/TPU."""
    platform = resolved(choices).platform
    layout = layout or ("tpu" if platform == "tpu" else "gpu")
    if layout not in DEFAULTS:
        raise ValueError(f"layout must be 'gpu' or 'tpu', got {layout!r}")
    if interpret is None:
        interpret = platform not in ("gpu", "tpu")
    d = DEFAULTS[layout]
    blk = Blocks(
        layout=layout,
        block_t=block_t or d["block_t"],
        block_v=block_v or d["block_v"],
        block_d=block_d or d["block_d"],
        interpret=bool(interpret),
        num_warps=num_warps,
        num_stages=num_stages,
        v_splits=v_splits,
    )
    sizes = [blk.block_t, blk.block_v] + ([blk.block_d] if layout == "gpu" else [])
    if layout == "gpu" and any(b < 16 or b & (b - 1) for b in sizes):
        raise ValueError(f"gpu block sizes must be powers of two >= 16, got {sizes}")
    if layout == "tpu" and (blk.block_t % 8 or blk.block_v % 128):
        raise ValueError(f"tpu block_t must be a multiple of 8 and block_v of 128, got {sizes}")
    return blk


def token_stats(
    hidden: jax.Array,  # [T, D]
    weight: jax.Array,  # [D, V]
    labels: jax.Array,  # [T] int
    temperature: float = 1.0,
    *,
    blocks: Blocks | None = None,
    choices: KernelChoices | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (lse, entropy, label_logit), 3 x [T] float32
    """See reference.token_stats for the contract; `blocks` from make_blocks (default: the `choices`'
    platform's; None choices: jax's backend).

    Mixed dtypes multiply in their promoted dtype, as `jnp.dot` (and the xla backend) does: the kernels'
    tile matmuls take one element type. Gradients come back in each input's own dtype.
    """
    common = jnp.promote_types(hidden.dtype, weight.dtype)
    return _stats(hidden.astype(common), weight.astype(common), labels, float(temperature),
                  blocks or make_blocks(choices=choices))
