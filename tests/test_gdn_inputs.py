"""The GDN input pieces shared by the layer and the state-passing path, the conv gradient stored once,
and the import order they allow."""

import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_jax.layers.gdn_inputs import causal_conv1d_silu
from qwen35_jax.layers.stored_cotangent import materialized, stored_cotangent
from qwen35_jax.xla_options import compiler_options


def test_causal_conv_matches_a_loop_over_taps_and_stops_at_documents():
    rng = np.random.default_rng(0)
    B, S, H, D, Kc = 2, 11, 3, 4, 4
    x = rng.normal(size=(B, S, H, D)).astype(np.float32)
    w = rng.normal(size=(Kc, H, D)).astype(np.float32)
    doc = np.array([[0] * 4 + [1] * 7, [0] * 11])
    want = np.zeros_like(x, dtype=np.float64)
    for b in range(B):
        for t in range(S):
            for s in range(Kc):  # tap s reads token t - s with kernel[Kc - 1 - s]
                if t - s >= 0 and doc[b, t - s] == doc[b, t]:
                    want[b, t] += x[b, t - s] * w[Kc - 1 - s]
    want = want / (1 + np.exp(-want))  # SiLU
    got = causal_conv1d_silu(jnp.asarray(x), jnp.asarray(w), jnp.asarray(doc))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def _shifted_taps(y: jax.Array) -> jax.Array:  # [S, C] -> [S, C]: four shifted reads, like a conv's backward
    padded = jnp.pad(y, ((3, 0), (0, 0)))
    return sum(padded[3 - s: 3 - s + y.shape[0]] * (s + 1.0) for s in range(4))


def _sines_compiled(fn, options: dict[str, str]) -> int:
    """sin ops in XLA:CPU's optimised program of fn(a, b) = taps of an elementwise chain with 6 sin."""
    def chain(a, b):  # a [C, S] -> [S, C]
        y = a.T
        for _ in range(6):
            y = y * b + jnp.sin(y) * 0.1
        return y
    a, b = jnp.ones((96, 64)), jnp.ones((64, 96))
    return jax.jit(lambda a, b: fn(chain(a, b)), compiler_options=options).lower(a, b).compile() \
        .as_text().count(" sine(")


def test_materialized_stops_xla_recomputing_a_chain_in_each_shifted_reader():
    """XLA:CPU fuses the chain into the taps and evaluates it once per tap (12 sin for 6). With XLA's
    default options an optimisation barrier does not stop it (the barrier is expanded first);
    through `materialized` the taps read one stored result under any options."""
    assert _sines_compiled(_shifted_taps, {}) > 6  # what materialized prevents
    assert _sines_compiled(lambda y: _shifted_taps(jax.lax.optimization_barrier(y)), {}) > 6
    for options in ({}, compiler_options()):
        assert _sines_compiled(lambda y: _shifted_taps(materialized(y)), options) == 6


def test_stored_cotangent_is_the_identity_with_the_same_gradient():
    x = jax.random.normal(jax.random.key(0), (3, 5, 7))
    np.testing.assert_array_equal(stored_cotangent(x), x)
    f = lambda x: jnp.sum(jnp.sin(x) * x)  # noqa: E731
    np.testing.assert_array_equal(jax.grad(lambda x: f(stored_cotangent(x)))(x), jax.grad(f)(x))
    np.testing.assert_array_equal(materialized(x), x)


@pytest.mark.parametrize("first", ["qwen35_jax.layers.gdn_state_passing", "qwen35_jax.parallel.ulysses",
                                   "qwen35_jax.layers.gated_deltanet", "qwen35_jax.parallel"])
def test_gdn_modules_import_in_any_order(first):
    code = f"import {first}; import qwen35_jax.model; from qwen35_jax.layers.gated_deltanet import gdn_core"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
