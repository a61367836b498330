"""Tile math shared by the xla loops and the Pallas kernels.

A tile is a [t, v] block of float32 scaled logits z. The forward keeps, per token, the running max m,
s = sum exp(z - m), r = sum exp(z - m) * (z - m) and the label logit; at the end
lse = m + log s and entropy = log s - r / s (no cancellation against a large max). Columns past the
vocabulary are masked to NEG (finite, so NEG - m never overflows to -inf and 0 * (NEG - m) is 0).
"""

from __future__ import annotations

import functools
import inspect
from typing import Callable

import jax
import jax.numpy as jnp

NEG = -1e30


def init_stats(shape: tuple[int, ...]) -> tuple[jax.Array, ...]:
    """(m, s, r, label_logit), each float32 of `shape` ([t, 1])."""
    return (
        jnp.full(shape, NEG, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros(shape, jnp.float32),
        jnp.zeros(shape, jnp.float32),
    )


def mask_columns(z: jax.Array, cols: jax.Array, vocab: int, first_col: jax.Array | int = 0) -> jax.Array:
    """z [t, v] with columns whose global id `cols` [1, v] is outside [first_col, vocab) set to NEG."""
    return jnp.where((cols >= first_col) & (cols < vocab), z, NEG)


def select_row_max(z: jax.Array) -> jax.Array:
    """[t, v] -> [t, 1]: max over the last axis as compare-and-select, which XLA:CPU vectorises (its
    NaN-propagating `jnp.max` it does not). A NaN logit still reaches s through exp."""
    larger = lambda a, b: jnp.where(a > b, a, b)  # noqa: E731
    return jax.lax.reduce(z, jnp.asarray(-jnp.inf, z.dtype), larger, (z.ndim - 1,))[..., None]


def half_operand_precision(*dtypes: jnp.dtype) -> jax.lax.Precision | None:
    """`Precision.DEFAULT` for a matmul whose operands are all half precision (bf16 / f16), else None
    (whatever `jax_default_matmul_precision` says). Half-precision products are exact in float32, so
    DEFAULT loses nothing, and Mosaic (TPU) refuses half-precision operands at the float32
    contraction that "highest" would ask for."""
    half = all(jnp.dtype(d) in (jnp.bfloat16, jnp.float16) for d in dtypes)
    return jax.lax.Precision.DEFAULT if half else None


def update_stats(
    stats: tuple[jax.Array, ...],  # 4 x [t, 1]
    z: jax.Array,  # [t, v] masked scaled logits
    cols: jax.Array,  # [1, v] global column ids
    labels: jax.Array,  # [t, 1] int
    row_max: Callable[[jax.Array], jax.Array] = functools.partial(jnp.max, axis=1, keepdims=True),
) -> tuple[jax.Array, ...]:
    """Online update of (m, s, r, label_logit) with one tile; row_max: [t, v] -> [t, 1]."""
    m, s, r, zl = stats
    m_new = jnp.maximum(m, row_max(z))
    scale = jnp.exp(m - m_new)
    shifted = z - m_new
    e = jnp.exp(shifted)
    # sum e*(z - m_new) over the old part: scale * (r + (m - m_new) * s)
    r = scale * (r + (m - m_new) * s) + jnp.sum(e * shifted, axis=1, keepdims=True)
    s = scale * s + jnp.sum(e, axis=1, keepdims=True)
    return m_new, s, r, zl + _label_logit(z, cols, labels)


def update_stats_one_pass(
    stats: tuple[jax.Array, ...],  # 4 x [t, 1]
    z: jax.Array,  # [t, v] masked scaled logits
    cols: jax.Array,  # [1, v] global column ids
    labels: jax.Array,  # [t, 1] int
) -> tuple[jax.Array, ...]:
    """`update_stats` reading the tile once: (m, s, r) of the tile by one variadic reduction whose
    combiner merges partial statistics (`merge_partial_stats`), then merged into the running ones.

    For XLA:GPU, where the two-pass form (max, then the sums) reads every tile twice from memory and a
    tree reduction keeps the rounding of the merges small; XLA:CPU reduces sequentially, both slower
    and less accurate, so the CPU keeps `update_stats`."""
    m, s, r, zl = stats
    ones, zeros = jnp.ones_like(z), jnp.zeros_like(z)  # every logit alone: m = z, s = 1, r = 0
    f32 = lambda x: jnp.asarray(x, jnp.float32)  # noqa: E731
    tile = jax.lax.reduce((z, ones, zeros), (f32(NEG), f32(0.0), f32(0.0)), merge_partial_stats, (1,))
    m, s, r = merge_partial_stats((m, s, r), tuple(x[:, None] for x in tile))
    return m, s, r, zl + _label_logit(z, cols, labels)


def merge_partial_stats(
    a: tuple[jax.Array, jax.Array, jax.Array], b: tuple[jax.Array, jax.Array, jax.Array]
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Two partial (m, s, r) of disjoint column sets -> those of their union (any equal shapes).

    With M the larger max and d = (smaller max) - M <= 0, the smaller side's sums rescale by e^d:
    s = s_hi + e^d s_lo, r = r_hi + e^d (r_lo + d s_lo). One exp per merge; a side of only masked
    columns (m = NEG) gets e^d = 0 and d s_lo finite, so it adds nothing."""
    (m1, s1, r1), (m2, s2, r2) = a, b
    first = m1 >= m2
    hi, lo = (lambda x, y: jnp.where(first, x, y)), (lambda x, y: jnp.where(first, y, x))
    d = lo(m1, m2) - hi(m1, m2)
    e = jnp.exp(d)
    return hi(m1, m2), hi(s1, s2) + e * lo(s1, s2), hi(r1, r2) + e * (lo(r1, r2) + d * lo(s1, s2))


def _label_logit(z: jax.Array, cols: jax.Array, labels: jax.Array) -> jax.Array:  # [t, v] -> [t, 1]
    return jnp.sum(jnp.where((cols == labels) & (z > NEG), z, 0.0), axis=1, keepdims=True)


def finish_stats(stats: tuple[jax.Array, ...]) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(m, s, r, label_logit) -> (lse, entropy, label_logit)."""
    m, s, r, zl = stats
    log_s = jnp.log(s)
    return m + log_s, log_s - r / s, zl


def dlogits(
    z: jax.Array,  # [t, v] masked scaled logits
    cols: jax.Array,  # [1, v] global column ids
    labels: jax.Array,  # [t, 1] int
    lse: jax.Array,  # [t, 1]
    mean_z: jax.Array,  # [t, 1] E_p[z] = lse - entropy
    g_lse: jax.Array,  # [t, 1] cotangents of the three outputs
    g_ent: jax.Array,  # [t, 1]
    g_zl: jax.Array,  # [t, 1]
    temperature: float,
) -> jax.Array:  # [t, v] float32: d loss / d (hidden @ weight)
    """dz = g_zl * onehot + p * (g_lse + g_ent * (E[z] - z)), then / temperature; masked columns give 0."""
    valid = z > NEG
    p = jnp.exp(z - lse)
    dz = p * (g_lse + g_ent * (mean_z - z)) + jnp.where(cols == labels, g_zl, 0.0)
    dz = jnp.where(valid, dz, 0.0)
    return dz * jnp.float32(1.0 / temperature)


def match_vma(tree, *like: jax.Array):
    """Mark fresh loop carries as varying over the manual mesh axes that `like` vary over.

    Inside jax.shard_map a loop carry must keep its type; a carry started from constants is invariant
    while one updated from per-device data is varying, so it is cast up front. Outside shard_map the
    set is empty and this is the identity.
    """
    want = varying_axes(*like)

    def cast(x):
        missing = tuple(sorted(want - varying_axes(x)))
        if not missing:
            return x
        if hasattr(jax.lax, "pcast"):
            return jax.lax.pcast(x, missing, to="varying")
        return jax.lax.pvary(x, missing)  # the older name

    return jax.tree.map(cast, tree) if want else tree


def varying_axes(*xs: jax.Array) -> frozenset:
    """Manual mesh axes any of xs varies over (`aval.vma` in some jax versions, `manual_axis_type` in others)."""
    out = frozenset()
    for x in xs:
        aval = jax.typeof(x)
        vma = getattr(aval, "vma", None)
        if vma is None:
            vma = getattr(getattr(aval, "manual_axis_type", None), "varying", frozenset())
        out |= frozenset(vma)
    return out


def out_struct(shape: tuple[int, ...], dtype, *like: jax.Array) -> jax.ShapeDtypeStruct:
    """A pallas_call output type that varies over the same manual mesh axes as `like`
    (`manual_axis_type=` in jax 0.10, `vma=` in versions that name it so)."""
    axes = varying_axes(*like)
    params = inspect.signature(jax.ShapeDtypeStruct).parameters
    if "manual_axis_type" in params and hasattr(jax.sharding, "ManualAxisType"):
        return jax.ShapeDtypeStruct(shape, dtype, manual_axis_type=jax.sharding.ManualAxisType(varying=axes))
    if "vma" in params and axes:
        return jax.ShapeDtypeStruct(shape, dtype, vma=axes)
    return jax.ShapeDtypeStruct(shape, dtype)


def match_cotangent(ct: jax.Array, primal: jax.Array) -> jax.Array:
    """Sum a custom-VJP cotangent over the manual axes it varies over but its primal does not.

    Inside jax.shard_map a weight replicated over an axis meets per-device tokens; ordinary ops would
    transpose the implicit broadcast into a psum, and a custom VJP has to do the same by hand.
    """
    extra = tuple(sorted(varying_axes(ct) - varying_axes(primal)))
    return jax.lax.psum(ct, extra) if extra else ct


def combine_stats(lse_k, ent_k, zl_k, *, max_fn, sum_fn):
    """Exact merge of statistics over disjoint vocabulary parts k (reduced by max_fn / sum_fn):
    lse = log sum_k exp(lse_k), w_k = exp(lse_k - lse), entropy = sum_k w_k (entropy_k + lse - lse_k),
    label_logit = sum_k label_logit_k. Differentiable (the max is only a shift)."""
    top = max_fn(jax.lax.stop_gradient(lse_k))
    lse = top + jnp.log(sum_fn(jnp.exp(lse_k - top)))
    entropy = sum_fn(jnp.exp(lse_k - lse) * (ent_k + lse - lse_k))
    return lse, entropy, sum_fn(zl_k)
