"""(I + N)^-1 for strictly lower-triangular N, batched: the UT transform of the delta rule, as matmuls.

The inverse is built by block doubling, with no loop over rows: the inverse of a unit lower-triangular
matrix [[P, 0], [C, Q]] is [[P^-1, 0], [-Q^-1 C P^-1, Q^-1]], so starting from the 1 x 1 diagonal
blocks (all 1), log2(L) rounds of two batched matmuls each give the inverses of the diagonal blocks
of size 2, 4, ..., L. The rounds on blocks of at most SMALL_BLOCK rows are broadcast products summed
over the block instead of matmuls: XLA fuses them into one elementwise pass, where batched matmuls of
1 x 1 to 4 x 4 blocks run element by element. Solving (I + N) X = R is then one matmul,
X = (I + N)^-1 R. All of it is float32 at `Precision.HIGHEST` on every backend (the systems are
small; their accuracy bounds the delta rule's).

Why not XLA's triangular solve: on CPU it calls LAPACK through a kernel that parallelises over the
batch on the thread pool that also runs the devices of a simulated multi-device mesh, and with every
device inside such a solve at once the pool deadlocks; and row-by-row substitution is L sequential
steps of thin matmuls. The custom VJP keeps only the inverse for the backward pass:
d N = -strict_tril(T^T dT T^T) with T = (I + N)^-1.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST
SMALL_BLOCK = 4  # doubling rounds on blocks up to this size are elementwise (see the module docstring)


def _diagonal_blocks(n: jax.Array, m: int) -> jax.Array:
    """The lower-left [m, m] quarter of every diagonal [2m, 2m] block: [..., L, L] -> [..., L/2m, m, m]."""
    *batch, L, _ = n.shape
    nb = L // (2 * m)
    blocks = n.reshape(*batch, nb, 2, m, nb, 2, m)[..., :, 1, :, :, 0, :]  # [..., nb, m, nb, m]
    return jnp.moveaxis(jnp.diagonal(blocks, axis1=-4, axis2=-2), -1, -3)  # [..., nb, m, m]


def _small_matmul(a: jax.Array, b: jax.Array) -> jax.Array:
    """[..., m, m] @ [..., m, m] for tiny m, as a broadcast product summed over the contraction (float32)."""
    return jnp.sum(a[..., :, :, None] * b[..., None, :, :], axis=-2)


def _inverse_by_doubling(n: jax.Array) -> jax.Array:
    """(I + n)^-1 for n [..., L, L] strictly lower, L a power of two -> [..., L, L] unit lower."""
    *batch, L, _ = n.shape
    inv = jnp.ones((*batch, L, 1, 1), n.dtype)  # inverses of the [1, 1] diagonal blocks
    m = 1
    while m < L:
        upper, lower = inv[..., 0::2, :, :], inv[..., 1::2, :, :]  # [..., L/2m, m, m] each
        c = _diagonal_blocks(n, m)
        if m <= SMALL_BLOCK:
            corner = -_small_matmul(_small_matmul(lower, c), upper)
        else:
            corner = -jnp.matmul(jnp.matmul(lower, c, precision=_HI), upper, precision=_HI)
        zeros = jnp.zeros_like(upper)
        inv = jnp.concatenate([jnp.concatenate([upper, zeros], axis=-1),
                               jnp.concatenate([corner, lower], axis=-1)], axis=-2)  # [..., L/2m, 2m, 2m]
        m *= 2
    return inv[..., 0, :, :]


@jax.custom_vjp
def _unit_lower_inverse(n: jax.Array) -> jax.Array:
    L = n.shape[-1]
    size = 1 << max(L - 1, 0).bit_length()  # pad to a power of two with identity rows / columns
    padded = jnp.pad(n, [(0, 0)] * (n.ndim - 2) + [(0, size - L), (0, size - L)])
    return _inverse_by_doubling(padded)[..., :L, :L]


def _inverse_fwd(n: jax.Array) -> tuple[jax.Array, jax.Array]:
    t = _unit_lower_inverse(n)
    return t, t


def _inverse_bwd(t: jax.Array, dt: jax.Array) -> tuple[jax.Array]:
    tt = jnp.swapaxes(t, -1, -2)
    return (-jnp.tril(jnp.matmul(jnp.matmul(tt, dt, precision=_HI), tt, precision=_HI), -1),)


_unit_lower_inverse.defvjp(_inverse_fwd, _inverse_bwd)


def unit_lower_inverse(
    n: jax.Array,  # [..., L, L] strictly lower triangular (the diagonal and above are ignored)
) -> jax.Array:  # [..., L, L] unit lower triangular
    """(I + n)^-1, by block doubling (see the module docstring)."""
    return _unit_lower_inverse(jnp.tril(n, -1))


def unit_lower_solve(
    n: jax.Array,  # [..., L, L] strictly lower triangular (the diagonal and above are ignored)
    r: jax.Array,  # [..., L, D]
) -> jax.Array:  # [..., L, D]
    """X = (I + n)^-1 r."""
    return jnp.matmul(unit_lower_inverse(n), r, precision=_HI)
