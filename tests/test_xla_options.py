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


def test_unknown_option_or_value_is_dropped_and_the_rest_kept(monkeypatch):
    known = {"xla_disable_hlo_passes": "cse_barrier_expander"}
    monkeypatch.setattr(xla_options, "CPU_OPTIONS", {
        **known, "xla_cpu_no_such_option_for_this_test": "1",
        "xla_cpu_scheduler_type": "CPU_SCHEDULER_TYPE_NO_SUCH_VALUE"})
    assert xla_options.compiler_options() == known


def _stack_loss(ws: list[tuple[jax.Array, jax.Array]], x: jax.Array, remat: bool) -> jax.Array:
    """Eight residual tanh-MLP layers on x [T, D], each checkpointed when `remat`."""
    layer = lambda x, w1, w2: x + jnp.tanh(x @ w1) @ w2  # noqa: E731
    layer = jax.checkpoint(layer) if remat else layer
    for w1, w2 in ws:
        x = layer(x, w1, w2)
    return jnp.sum(x * x)


def test_remat_saves_memory_on_cpu_with_the_same_gradients():
    """Under our options XLA:CPU keeps jax.checkpoint's recomputation (without them it merged the
    recomputed forward into the saved one, and a checkpointed step needed what an unchecked one did)."""
    rng = np.random.default_rng(0)
    ws = [(rng.normal(size=(64, 256)).astype(np.float32) * 0.1, rng.normal(size=(256, 64)).astype(np.float32) * 0.1)
          for _ in range(8)]
    x = rng.normal(size=(1024, 64)).astype(np.float32)
    compiled = {remat: jax.jit(jax.grad(lambda ws, x, remat=remat: _stack_loss(ws, x, remat)),
                               compiler_options=xla_options.compiler_options()).lower(ws, x).compile()
                for remat in (False, True)}
    saved = {remat: c.memory_analysis().temp_size_in_bytes for remat, c in compiled.items()}
    # without remat every layer keeps its [1024, 256] tanh output (1 MiB each); with it only the inputs
    assert saved[True] < 0.6 * saved[False], saved
    with jax.enable_x64(True):
        truth = jax.grad(lambda ws, x: _stack_loss(ws, x, False))(*jax.tree.map(lambda a: a.astype(np.float64), (ws, x)))
    # float32 against float64 through 8 layers of 64- and 256-term dots: measured 6.1e-7 of the largest entry
    for remat, c in compiled.items():
        for got, want in zip(jax.tree.leaves(c(ws, x)), jax.tree.leaves(truth)):
            want = np.asarray(want)
            assert np.abs(np.asarray(got, np.float64) - want).max() < 1e-4 * np.abs(want).max(), remat
