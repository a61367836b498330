"""The GDN input pieces shared by the layer and the state-passing path; the import order they allow."""

import subprocess
import sys

import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_jax.layers.gdn_inputs import causal_conv1d_silu


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


@pytest.mark.parametrize("first", ["qwen35_jax.parallel.gdn_state_passing", "qwen35_jax.parallel.ulysses",
                                   "qwen35_jax.layers.gated_deltanet"])
def test_gdn_modules_import_in_any_order(first):
    code = f"import {first}; import qwen35_jax.model; from qwen35_jax.layers.gated_deltanet import gdn_core"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
