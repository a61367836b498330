import jax
import jax.numpy as jnp
import numpy as np

from qwen35_jax.layers.triangular import _substitution_solve, _xla_solve, unit_lower_solve


def random_system(seed: int, batch=(2, 3), L=16, D=5):
    rng = np.random.default_rng(seed)
    n = np.tril(rng.normal(scale=0.3, size=(*batch, L, L)), -1).astype(np.float32)
    r = rng.normal(size=(*batch, L, D)).astype(np.float32)
    return jnp.asarray(n), jnp.asarray(r)


def test_substitution_matches_numpy_solve():
    n, r = random_system(0)
    a = np.asarray(n, np.float64) + np.eye(n.shape[-1])
    want = np.linalg.solve(a, np.asarray(r, np.float64))
    np.testing.assert_allclose(unit_lower_solve(n, r), want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(_substitution_solve(n, r), _xla_solve(n, r), rtol=1e-5, atol=1e-5)


def test_upper_triangle_is_ignored():
    n, r = random_system(1)
    noisy = n + jnp.triu(jnp.ones_like(n))
    np.testing.assert_allclose(unit_lower_solve(noisy, r), unit_lower_solve(n, r), atol=1e-6)


def test_custom_vjp_matches_xla_triangular_solve_gradients():
    n, r = random_system(2)
    w = jnp.asarray(np.random.default_rng(3).normal(size=r.shape).astype(np.float32))

    def loss(solve):
        return lambda n, r: jnp.sum(solve(jnp.tril(n, -1), r) * w)

    got = jax.grad(loss(_substitution_solve), argnums=(0, 1))(n, r)
    want = jax.grad(loss(_xla_solve), argnums=(0, 1))(n, r)
    for g, h in zip(got, want):
        np.testing.assert_allclose(g, h, rtol=1e-4, atol=1e-5)


def test_cpu_lowering_avoids_the_lapack_solver():
    """On CPU the LAPACK triangular solver deadlocks a simulated multi-device mesh (see the module
    docstring; tests/test_scoring.py runs the model at sp=8 with batch 3), so it must not be used."""
    n, r = random_system(4, L=64, D=8)
    assert "lapack_strsm" not in jax.jit(unit_lower_solve).lower(n, r).compile().as_text()
    assert "lapack_strsm" in jax.jit(_xla_solve).lower(n, r).compile().as_text()
