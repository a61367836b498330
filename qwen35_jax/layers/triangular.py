"""Solve (I + N) X = R for strictly lower-triangular N, batched: the UT transform of the delta rule.

On GPU and TPU this is XLA's triangular solve. On CPU, XLA calls LAPACK through a kernel that
parallelises over the batch on the same thread pool that runs the devices of a simulated multi-device
mesh; with every device inside such a solve at once, the pool deadlocks. So the CPU path is a plain
forward substitution over the L rows (a `fori_loop` of small matmuls), with a custom VJP whose backward
is the transposed (backward) substitution, so the gradient stores only N and X.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_HI = jax.lax.Precision.HIGHEST


def _forward_substitution(n: jax.Array, r: jax.Array) -> jax.Array:
    """X with (I + n) X = r, row by row; n [..., L, L] strictly lower, r [..., L, D] -> [..., L, D]."""

    def row(i: jax.Array, x: jax.Array) -> jax.Array:
        n_i = jax.lax.dynamic_slice_in_dim(n, i, 1, axis=-2)  # [..., 1, L]; zero from column i on
        x_i = jax.lax.dynamic_slice_in_dim(r, i, 1, axis=-2) - jnp.matmul(n_i, x, precision=_HI)
        return jax.lax.dynamic_update_slice_in_dim(x, x_i, i, axis=-2)

    return jax.lax.fori_loop(0, n.shape[-1], row, r)


@jax.custom_vjp
def _substitution_solve(n: jax.Array, r: jax.Array) -> jax.Array:
    return _forward_substitution(n, r)


def _substitution_fwd(n: jax.Array, r: jax.Array) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    x = _forward_substitution(n, r)
    return x, (n, x)


def _substitution_bwd(res: tuple[jax.Array, jax.Array], dx: jax.Array) -> tuple[jax.Array, jax.Array]:
    n, x = res
    # dR = (I + n)^-T dX: an upper-triangular solve, i.e. a lower one with rows and columns reversed.
    n_rev = jnp.flip(jnp.swapaxes(n, -1, -2), axis=(-1, -2))
    dr = jnp.flip(_forward_substitution(n_rev, jnp.flip(dx, axis=-2)), axis=-2)
    dn = -jnp.tril(jnp.matmul(dr, jnp.swapaxes(x, -1, -2), precision=_HI), -1)
    return dn, dr


_substitution_solve.defvjp(_substitution_fwd, _substitution_bwd)


def _xla_solve(n: jax.Array, r: jax.Array) -> jax.Array:
    a = n + jnp.eye(n.shape[-1], dtype=n.dtype)
    return jax.lax.linalg.triangular_solve(a, r, left_side=True, lower=True, unit_diagonal=True)


def unit_lower_solve(
    n: jax.Array,  # [..., L, L] strictly lower triangular (the diagonal and above are ignored)
    r: jax.Array,  # [..., L, D]
) -> jax.Array:  # [..., L, D]
    """X = (I + n)^-1 r."""
    n = jnp.tril(n, -1)
    return jax.lax.platform_dependent(n, r, cpu=_substitution_solve, default=_xla_solve)
