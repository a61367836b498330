import jax
import jax.numpy as jnp
import numpy as np
import pytest
from qwen35_kernels.gated_delta_rule.triangular import unit_lower_inverse, unit_lower_solve


def random_system(seed: int, batch=(2, 3), L=16, D=5):
    rng = np.random.default_rng(seed)
    n = np.tril(rng.normal(scale=0.3, size=(*batch, L, L)), -1).astype(np.float32)
    r = rng.normal(size=(*batch, L, D)).astype(np.float32)
    return jnp.asarray(n), jnp.asarray(r)


def lapack_solve(n: jax.Array, r: jax.Array) -> jax.Array:
    a = jnp.tril(n, -1) + jnp.eye(n.shape[-1], dtype=n.dtype)
    return jax.scipy.linalg.solve_triangular(a, r, lower=True, unit_diagonal=True)


@pytest.mark.parametrize("L", [1, 2, 5, 16, 33, 64])
def test_solve_and_inverse_match_numpy_in_float64(L):
    """Every chunk size, powers of two or not (padded with identity rows inside)."""
    n, r = random_system(L, L=L)
    a = np.asarray(n, np.float64) + np.eye(L)
    # float32 rounding through log2(L) rounds of products; the entries of the inverse here are O(1-10)
    np.testing.assert_allclose(unit_lower_inverse(n), np.linalg.inv(a), rtol=1e-5, atol=2e-5)
    np.testing.assert_allclose(unit_lower_solve(n, r), np.linalg.solve(a, np.asarray(r, np.float64)),
                               rtol=1e-5, atol=2e-5)


def test_upper_triangle_is_ignored():
    n, r = random_system(1)
    noisy = n + jnp.triu(jnp.ones_like(n))
    np.testing.assert_allclose(unit_lower_solve(noisy, r), unit_lower_solve(n, r), atol=1e-6)


@pytest.mark.parametrize("L", [16, 24])
def test_custom_vjp_matches_lapack_triangular_solve_gradients(L):
    n, r = random_system(2, L=L)
    w = jnp.asarray(np.random.default_rng(3).normal(size=r.shape).astype(np.float32))

    def loss(solve):
        return lambda n, r: jnp.sum(solve(n, r) * w)

    got = jax.grad(loss(unit_lower_solve), argnums=(0, 1))(n, r)
    want = jax.grad(loss(lapack_solve), argnums=(0, 1))(n, r)
    assert np.abs(np.triu(np.asarray(got[0]))).max() == 0  # only the strict lower triangle is an input
    for g, h in zip(got, want):
        np.testing.assert_allclose(g, h, rtol=1e-4, atol=1e-5)


def test_cpu_lowering_is_loop_free_and_avoids_the_lapack_solver():
    """On CPU the LAPACK triangular solver deadlocks a simulated multi-device mesh (see the module
    docstring; tests/test_scoring.py runs the model at sp=8 with batch 3), so it must not be used; and
    the inverse is log-depth matmuls, not a loop over rows, forward and backward."""
    n, r = random_system(4, L=64, D=8)
    hlo = jax.jit(jax.value_and_grad(lambda n, r: jnp.sum(unit_lower_solve(n, r)), (0, 1))).lower(n, r)
    text = hlo.compile().as_text()
    assert "lapack_strsm" not in text
    assert " while(" not in text and "while_loop" not in text
    assert "lapack_strsm" in jax.jit(lapack_solve).lower(n, r).compile().as_text()
