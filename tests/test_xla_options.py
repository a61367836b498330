"""The CPU compiler options of our jitted steps: accepted by this jaxlib, in effect, and dropped
(not a compile failure) when a jaxlib does not know them."""

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_jax import xla_options


def _reduce_and_dot(x: jax.Array, w: jax.Array) -> jax.Array:
    """x [S, D], w [D, F] -> [D]: a dot and a column sum, both of which YNNPACK would take on CPU."""
    return jnp.sum(x @ w, axis=1) + jnp.sum(x, axis=0)


def test_cpu_options_take_effect_and_keep_the_result():
    assert jax.default_backend() == "cpu"
    options = xla_options.compiler_options()
    assert options == xla_options.CPU_OPTIONS
    x = jnp.asarray(np.random.default_rng(0).standard_normal((256, 64)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((64, 64)), jnp.float32)
    default = jax.jit(_reduce_and_dot).lower(x[:64].T, w).compile()
    tuned = jax.jit(_reduce_and_dot, compiler_options=options).lower(x[:64].T, w).compile()
    assert "ynn" not in tuned.as_text()
    expected = np.asarray(x[:64].T, np.float64) @ np.asarray(w, np.float64)
    expected = expected.sum(1) + np.asarray(x[:64].T, np.float64).sum(0)
    # float32 sums of 64 products of unit normals: ~1e-5 relative at most, whichever library runs them
    for compiled in (default, tuned):
        np.testing.assert_allclose(compiled(x[:64].T, w), expected, rtol=1e-4, atol=1e-4)


def test_unknown_option_falls_back_to_defaults(monkeypatch):
    monkeypatch.setattr(xla_options, "CPU_OPTIONS", {"xla_cpu_no_such_option_for_this_test": "1"})
    xla_options._cpu_accepts_options.cache_clear()
    try:
        assert xla_options.compiler_options() == {}
    finally:
        xla_options._cpu_accepts_options.cache_clear()
