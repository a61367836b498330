"""Memory-efficient per-token statistics in plain JAX: loops over [block_t, block_v] logit tiles.

Forward: for each token block, a loop over vocabulary blocks keeps the online (max, sum-exp,
sum p*(z - max), label logit). On GPU and TPU a tile is read once (one variadic reduction whose
combiner merges partial statistics); on CPU twice (its max, then the sums). Backward (custom VJP):
the logits are recomputed tile by tile; the outer loop runs over vocabulary blocks so each
[D, block_v] slice of dW is accumulated in float32 and written once, while dh [T, D] (float32) is
accumulated across it. The logit gradient dz is rounded to the inputs' dtype before its two matmuls
(as the Pallas kernel does), so bf16 inputs run bf16 GEMMs.
Nothing of size T * V exists.

A vocabulary that is not a multiple of block_v is handled without copying the weight: the last block
starts at V - block_v and masks the columns the previous block already covered.

On CPU, non-float32 (bfloat16) weight, dW and hidden states are sliced and updated through a
same-width unsigned integer view (`_bits`): XLA on CPU computes bfloat16 dynamic slices and updates in
float32 and hoists the convert of the whole loop-invariant weight out of the loop, a weight-sized
float32 copy (two with dW). The view costs one weight-sized buffer (dW does not alias the output
through it). float32 inputs, and every dtype on GPU/TPU, are sliced and updated in place.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from qwen35_kernels.choices import KernelChoices, resolved

from . import tiles

# (block_t, block_v) per backend. On CPU a [1024, 2048] float32 tile stays in cache-friendly sizes. On
# GPU every loop iteration is a handful of kernel launches, so the tiles are as large as memory allows
# cheaply ([8192, 4096] float32 = 128 MiB): at T = 8192, V = 248,320 the backward is 61 iterations
# instead of 976.
DEFAULT_BLOCKS = {"cpu": (1024, 2048), "gpu": (8192, 4096), "tpu": (8192, 4096)}


# Backends whose forward reads each logit tile once (`tiles.update_stats_one_pass`); XLA:CPU reduces
# sequentially, and there the two-pass form is both the faster and the more accurate.
ONE_PASS_BACKENDS = ("gpu", "tpu")


def default_blocks(platform: str) -> tuple[int, int]:
    """(block_t, block_v) for `platform`."""
    return DEFAULT_BLOCKS.get(platform, DEFAULT_BLOCKS["gpu"])


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def _blocks(num_tokens: int, vocab: int, block_t: int, block_v: int) -> tuple[int, int, int]:
    """(bt, padded T, bv): bt a multiple of 8 no larger than needed, bv <= V."""
    bt = min(block_t, _round_up(num_tokens, 8))
    return bt, _round_up(num_tokens, bt), min(block_v, vocab)


def _bits(x: jax.Array, as_bits: bool) -> jax.Array:
    """Non-float32 with `as_bits` (on CPU): the same bytes as unsigned integers of the same width; else x itself."""
    if x.dtype == jnp.float32 or not as_bits:
        return x
    return lax.bitcast_convert_type(x, jnp.dtype(f"uint{8 * x.dtype.itemsize}"))


def _unbits(x: jax.Array, dtype) -> jax.Array:
    return x if x.dtype == dtype else lax.bitcast_convert_type(x, dtype)


def _vocab_block(w_bits: jax.Array, dtype, j: jax.Array, bv: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Block j of the vocabulary: (w_v [D, bv] in `dtype`, cols [1, bv] global ids, first new column id)."""
    vocab = w_bits.shape[1]
    start = jnp.minimum(j * bv, vocab - bv)
    w_v = _unbits(lax.dynamic_slice_in_dim(w_bits, start, bv, axis=1), dtype)
    cols = start + lax.broadcasted_iota(jnp.int32, (1, bv), 1)
    return w_v, cols, j * bv


def _tile_logits(h_t, w_v, cols, first, vocab, temperature):  # [bt, D], [D, bv] -> [bt, bv]
    z = jnp.dot(h_t, w_v, preferred_element_type=jnp.float32) * jnp.float32(1.0 / temperature)
    return tiles.mask_columns(z, cols, vocab, first)


def _forward(hidden, weight, labels, temperature, block_t, block_v, one_pass, as_bits):
    T, D = hidden.shape
    V = weight.shape[1]
    bt, tp, bv = _blocks(T, V, block_t, block_v)
    nt, nv = tp // bt, -(-V // bv)
    hb = _bits(jnp.pad(hidden, ((0, tp - T), (0, 0))).reshape(nt, bt, D), as_bits)
    lb = jnp.pad(labels.astype(jnp.int32), (0, tp - T), constant_values=-1).reshape(nt, bt, 1)
    w_bits = _bits(weight, as_bits)

    def token_block(args):
        h_t, l_t = args  # [bt, D] (bits), [bt, 1]
        h_t = _unbits(h_t, hidden.dtype)

        def vocab_step(j, stats):
            w_v, cols, first = _vocab_block(w_bits, weight.dtype, j, bv)
            z = _tile_logits(h_t, w_v, cols, first, V, temperature)
            if one_pass:
                return tiles.update_stats_one_pass(stats, z, cols, l_t)
            return tiles.update_stats(stats, z, cols, l_t, row_max=tiles.select_row_max)

        init = tiles.match_vma(tiles.init_stats((bt, 1)), h_t, weight, l_t)
        return tiles.finish_stats(lax.fori_loop(0, nv, vocab_step, init))

    out = lax.map(token_block, (hb, lb))  # 3 x [nt, bt, 1]
    return tuple(x.reshape(tp)[:T] for x in out)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _stats(hidden, weight, labels, temperature, block_t, block_v, one_pass, as_bits):
    return _forward(hidden, weight, labels, temperature, block_t, block_v, one_pass, as_bits)


def _stats_fwd(hidden, weight, labels, temperature, block_t, block_v, one_pass, as_bits):
    lse, ent, zl = _forward(hidden, weight, labels, temperature, block_t, block_v, one_pass, as_bits)
    return (lse, ent, zl), (hidden, weight, labels, lse, ent)


def _stats_bwd(temperature, block_t, block_v, one_pass, as_bits, res, cts):
    return stats_backward(*res, cts, temperature, block_t, block_v, as_bits)


def stats_backward(
    hidden: jax.Array,  # [T, D]
    weight: jax.Array,  # [D, V]
    labels: jax.Array,  # [T] int
    lse: jax.Array,  # [T] float32, from any backend's forward
    ent: jax.Array,  # [T] float32
    cts: tuple[jax.Array, jax.Array, jax.Array],  # cotangents of (lse, entropy, label logit), [T] each
    temperature: float,
    block_t: int,
    block_v: int,
    as_bits: bool,
) -> tuple[jax.Array, jax.Array, None]:  # dh [T, D], dW [D, V] in the inputs' dtypes, None (labels)
    """The custom VJP's backward: logits recomputed tile by tile, dh and dW accumulated by XLA loops;
    `as_bits` (on CPU) slices and updates non-float32 arrays through an integer view (module docstring)."""
    T, D = hidden.shape
    V = weight.shape[1]
    bt, tp, bv = _blocks(T, V, block_t, block_v)
    nt, nv = tp // bt, -(-V // bv)

    def col(x, fill=0):  # [T] -> [nt, bt, 1]
        return jnp.pad(x, (0, tp - T), constant_values=fill).reshape(nt, bt, 1)

    hb = _bits(jnp.pad(hidden, ((0, tp - T), (0, 0))).reshape(nt, bt, D), as_bits)
    w_bits = _bits(weight, as_bits)
    lb = col(labels.astype(jnp.int32), -1)
    to_buf, from_buf = functools.partial(_bits, as_bits=as_bits), lambda x: _unbits(x, weight.dtype)  # dW buffer
    lse_b, mean_b = col(lse), col(lse - ent)
    g_lse, g_ent, g_zl = (col(jnp.asarray(g, jnp.float32)) for g in cts)
    # The two gradient matmuls take the inputs' own precision: float32 dz against a bf16 weight would
    # promote both operands to float32 (TF32 GEMMs on a GPU, slower than bf16 ones).
    compute = jnp.promote_types(hidden.dtype, weight.dtype)

    def vocab_step(j, carry):
        dh, dw = carry  # [nt, bt, D] f32, [D, V] weight bits
        w_v, cols, first = _vocab_block(w_bits, weight.dtype, j, bv)

        def token_step(i, c):
            dh, dw_v = c
            h_t = _unbits(hb[i], hidden.dtype)  # [bt, D]
            z = _tile_logits(h_t, w_v, cols, first, V, temperature)
            dz = tiles.dlogits(
                z, cols, lb[i], lse_b[i], mean_b[i], g_lse[i], g_ent[i], g_zl[i], temperature
            )  # [bt, bv]
            dz = dz.astype(compute)  # bf16 inputs: bf16 x bf16 matmuls, float32 accumulation
            dh = dh.at[i].add(jnp.dot(dz, w_v.T.astype(compute), preferred_element_type=jnp.float32))
            dw_v = dw_v + jnp.dot(h_t.T.astype(compute), dz, preferred_element_type=jnp.float32)
            return dh, dw_v

        dw_v0 = tiles.match_vma(jnp.zeros((D, bv), jnp.float32), hidden, weight)
        dh, dw_v = lax.fori_loop(0, nt, token_step, (dh, dw_v0))
        start = cols[0, 0]
        old = from_buf(lax.dynamic_slice_in_dim(dw, start, bv, axis=1))
        tile = to_buf(jnp.where(cols >= first, dw_v.astype(weight.dtype), old))
        dw = lax.dynamic_update_slice_in_dim(dw, tile, start, axis=1)
        return dh, dw

    init = tiles.match_vma((jnp.zeros((nt, bt, D), jnp.float32), to_buf(jnp.zeros_like(weight))), hidden, weight)
    dh, dw = lax.fori_loop(0, nv, vocab_step, init)
    dw = from_buf(dw)
    dh = dh.reshape(tp, D)[:T].astype(hidden.dtype)
    return tiles.match_cotangent(dh, hidden), tiles.match_cotangent(dw, weight), None


_stats.defvjp(_stats_fwd, _stats_bwd)


def token_stats(
    hidden: jax.Array,  # [T, D]
    weight: jax.Array,  # [D, V]
    labels: jax.Array,  # [T] int
    temperature: float = 1.0,
    *,
    block_t: int | None = None,
    block_v: int | None = None,
    one_pass: bool | None = None,
    choices: KernelChoices | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (lse, entropy, label_logit), 3 x [T] float32
    """See reference.token_stats for the contract; block sizes default to `default_blocks` of the
    `choices`' platform (None: jax's backend), one_pass (the forward reads each logit tile once,
    `tiles.update_stats_one_pass`) to that platform's (`ONE_PASS_BACKENDS`)."""
    platform = resolved(choices).platform
    bt, bv = default_blocks(platform)
    if one_pass is None:
        one_pass = platform in ONE_PASS_BACKENDS
    return _stats(hidden, weight, labels, float(temperature), int(block_t or bt), int(block_v or bv),
                  bool(one_pass), platform == "cpu")
