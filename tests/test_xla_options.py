"""The CPU compiler options of our jitted steps: accepted by this jaxlib, in effect, and dropped
(not a compile failure) when a jaxlib does not know them."""

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_jax import xla_options


def _dot_and_column_sum(x: jax.Array, w: jax.Array) -> tuple[jax.Array, jax.Array]:
    """x [S, D], w [D, F] -> ([S, F], [D]): a dot and a column sum, both of which YNNPACK takes on CPU."""
    return x @ w, jnp.sum(x, axis=0)


def test_cpu_options_take_effect_and_keep_the_result():
    assert jax.default_backend() == "cpu"
    options = xla_options.compiler_options()
    assert options == xla_options.CPU_OPTIONS
    x = np.random.default_rng(0).standard_normal((256, 64)).astype(np.float32)
    w = np.random.default_rng(1).standard_normal((64, 64)).astype(np.float32)
    default = jax.jit(_dot_and_column_sum).lower(x, w).compile()
    tuned = jax.jit(_dot_and_column_sum, compiler_options=options).lower(x, w).compile()
    assert "ynn" not in tuned.as_text()
    x64, w64 = x.astype(np.float64), w.astype(np.float64)
    # float32 sums of 64 products / 256 unit normals: ~1e-5 relative at most, whichever library runs them
    for compiled in (default, tuned):
        product, column_sum = compiled(x, w)
        np.testing.assert_allclose(product, x64 @ w64, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(column_sum, x64.sum(0), rtol=1e-4, atol=1e-4)


def test_unknown_option_falls_back_to_defaults(monkeypatch):
    monkeypatch.setattr(xla_options, "CPU_OPTIONS", {"xla_cpu_no_such_option_for_this_test": "1"})
    xla_options._cpu_accepts_options.cache_clear()
    try:
        assert xla_options.compiler_options() == {}
    finally:
        xla_options._cpu_accepts_options.cache_clear()
