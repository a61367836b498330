"""The GDN input pieces shared by the layer and the state-passing path, the conv gradient stored once,
the import order they allow, and the Pallas kernels that run the conv, SiLU and L2 norms on a GPU."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from qwen35_kernels.gdn_inputs.stored_cotangent import materialized, stored_cotangent
from qwen35_kernels.gdn_inputs.xla import causal_conv1d_silu, causal_conv1d_update
from qwen35_kernels.choices import KernelChoices

from qwen35_jax.layers.gdn_arrays import GdnWeights
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


@pytest.mark.parametrize("prefix", [2, 5])  # shorter and longer than the conv state (Kc - 1 = 3)
def test_conv_update_continues_the_sequence(prefix):
    # Prefill `prefix` tokens with the whole-sequence conv, hand its last Kc - 1 raw inputs on as the
    # conv state (zeros before the sequence), then 3 tokens at once and the rest one at a time: the
    # outputs are the whole sequence's conv, against float64 (a sum of 4 products of O(1): ~1e-7).
    rng = np.random.default_rng(1)
    B, S, H, D, Kc = 2, 11, 3, 4, 4
    x = rng.normal(size=(B, S, H, D)).astype(np.float32)
    w = rng.normal(size=(Kc, H, D)).astype(np.float32)
    padded = np.concatenate([np.zeros((B, Kc - 1, H, D)), x.astype(np.float64)], axis=1)
    want = sum(padded[:, Kc - 1 - s: Kc - 1 - s + S] * w[Kc - 1 - s] for s in range(Kc))
    want = want / (1 + np.exp(-want))  # SiLU
    outs = [causal_conv1d_silu(jnp.asarray(x[:, :prefix]), jnp.asarray(w), None)]
    state = jnp.asarray(padded[:, prefix: prefix + Kc - 1].astype(np.float32))
    t = prefix
    for n in [3] + [1] * (S - prefix - 3):
        y, state = causal_conv1d_update(jnp.asarray(x[:, t: t + n]), state, jnp.asarray(w))
        outs.append(y)
        t += n
    np.testing.assert_allclose(np.concatenate(outs, axis=1), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(state, x[:, S - (Kc - 1):])
    with pytest.raises(ValueError, match=r"conv_state must be \[B, Kc - 1, H, D\]"):
        causal_conv1d_update(jnp.asarray(x[:, :1]), state[:, :2], jnp.asarray(w))


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
    np.testing.assert_array_equal(stored_cotangent(x, True), x)
    f = lambda x: jnp.sum(jnp.sin(x) * x)  # noqa: E731
    for materialize in (True, False):
        np.testing.assert_array_equal(jax.grad(lambda x: f(stored_cotangent(x, materialize)))(x), jax.grad(f)(x))
    np.testing.assert_array_equal(materialized(x), x)


def _conv_problem(dtype, seed=0, B=2, S=48, H=3, D=16, Kc=4):
    """Raw q-like inputs with two documents, padding inside and at the end of a row."""
    rng = np.random.default_rng(seed)
    x = jnp.asarray(rng.normal(size=(B, S, H, D)), dtype)
    w = jnp.asarray(rng.normal(size=(Kc, H, D)) * 0.5, dtype)
    seg = np.ones((B, S), np.int32)
    seg[0, 20:] = 2
    seg[0, 40:] = 0
    seg[1, 5:9] = 0
    return x, w, jnp.asarray(seg), jnp.asarray(rng.normal(size=(B, S, H, D)), jnp.float32)


def _xla_inputs_path(x, w, seg, scale):
    """rule_inputs' XLA path for one tensor: padding zeroed, conv + SiLU, L2 norm times scale (or none)."""
    from qwen35_kernels.gated_delta_rule.reference import document_index
    from qwen35_kernels.gdn_inputs.xla import l2_normalize

    valid, doc = document_index(seg, *seg.shape)
    y = causal_conv1d_silu(jnp.where(valid[..., None, None], x, jnp.zeros((), x.dtype)), w, doc)
    return y if scale is None else l2_normalize(y) * scale


def _float64_inputs_path(x, w, valid, doc, scale):
    """The same in plain jnp on float64 arrays (under jax.enable_x64; the library's XLA path computes in
    float32 whatever it is given): padding zeroed, the conv tap by tap within documents, SiLU, the L2
    norm (eps 1e-6) times scale."""
    Kc, S = w.shape[0], x.shape[1]
    x = jnp.where(valid[..., None, None], x, 0.0)
    pre = 0.0
    for s in range(Kc):  # tap s reads token t - s with w[Kc - 1 - s]
        past = jnp.pad(x, [(0, 0), (s, 0), (0, 0), (0, 0)])[:, :S]
        same = jnp.pad(doc, [(0, 0), (s, 0)], constant_values=-1)[:, :S] == doc
        pre = pre + jnp.where(same[..., None, None], past, 0.0) * w[Kc - 1 - s]
    y = pre / (1.0 + jnp.exp(-pre))
    return y if scale is None else y / jnp.sqrt(jnp.sum(y * y, axis=-1, keepdims=True) + 1e-6) * scale


@pytest.mark.parametrize("scale", [None, 0.25], ids=["v", "q"])
def test_pallas_conv_silu_matches_float64(scale):
    """The fused conv + SiLU (+ L2 norm) kernels, interpreted, against the same computation in float64
    (`_float64_inputs_path`; documents, padding inside and at the end, blocks of 16 tokens so the conv
    reads across block edges): outputs and the gradients of x and the conv kernel. float32 lands within 2e-7 of
    each result's largest entry; 2e-6 allows another CPU's rounding, not a lost tap or a document
    edge crossed (1e-2 and more)."""
    from qwen35_kernels.gated_delta_rule.reference import document_index
    from qwen35_kernels.gdn_inputs.pallas import pallas_conv_silu

    x, w, seg, ct = _conv_problem(jnp.float32)
    valid, doc = document_index(seg, *seg.shape)

    def pallas(x, w):
        return pallas_conv_silu(x, w, valid, doc, l2_scale=scale)

    with jax.enable_x64(True):
        x64, w64, ct64 = (jnp.asarray(np.asarray(a, np.float64)) for a in (x, w, ct))
        ref = functools.partial(_float64_inputs_path, valid=jnp.asarray(valid), doc=jnp.asarray(doc), scale=scale)
        want = [np.asarray(ref(x64, w64))]
        want += [np.asarray(g) for g in jax.grad(lambda x, w: jnp.sum(ref(x, w) * ct64), (0, 1))(x64, w64)]
    assert want[0].dtype == np.float64
    got = [pallas(x, w)] + list(jax.grad(lambda x, w: jnp.sum(pallas(x, w) * ct), (0, 1))(x, w))
    for g, r in zip(got, want):
        assert g.shape == r.shape
        assert np.abs(np.asarray(g, np.float64) - r).max() <= 2e-6 * np.abs(r).max()


def test_pallas_conv_silu_rounds_bf16_where_the_xla_path_does():
    """bf16 inputs: the kernels round the conv's sum and the SiLU output to bfloat16 where the XLA path
    does (the L2 norm then in float32): outputs and gradients within 2 bfloat16 steps (2**-7) of the
    XLA path's largest entry, which it misses only by where a product's last bit rounds; the bf16
    output dtypes are the XLA path's."""
    from qwen35_kernels.gated_delta_rule.reference import document_index
    from qwen35_kernels.gdn_inputs.pallas import pallas_conv_silu

    x, w, seg, ct = _conv_problem(jnp.bfloat16, seed=1)
    valid, doc = document_index(seg, *seg.shape)
    for scale in (None, 1.0):
        def xla(x, w, scale=scale):
            return _xla_inputs_path(x, w, seg, scale)

        def pallas(x, w, scale=scale):
            return pallas_conv_silu(x, w, valid, doc, l2_scale=scale)

        results = []
        for fn in (xla, pallas):
            out = fn(x, w)
            grads = jax.grad(lambda x, w, fn=fn: jnp.sum(fn(x, w).astype(jnp.float32) * ct), (0, 1))(x, w)
            results.append((out, *grads))
        for want, got in zip(*results):
            assert got.dtype == want.dtype
            want = np.asarray(want.astype(jnp.float32), np.float64)
            assert np.abs(np.asarray(got.astype(jnp.float32), np.float64) - want).max() <= 2**-7 * np.abs(want).max()


def test_rule_inputs_by_kernels_match_float64():
    """rule_inputs with the kernels (what a GPU runs without a conv halo): q, k, v against
    `_float64_inputs_path` (q scaled by Dk**-0.5), the gates against NumPy float64, dtypes and shapes
    those of its XLA path (float32 q, k under float32 GDN matmuls). float32 lands within 2e-7 of each
    result's largest entry; 2e-6 allows another CPU's rounding, not a swapped tensor or scale."""
    from qwen35_kernels.gated_delta_rule.reference import document_index

    from qwen35_jax.layers.gdn_inputs import rule_inputs

    rng = np.random.default_rng(2)
    B, S, Hk, Hv, D = 1, 32, 2, 4, 16
    q, k = (jnp.asarray(rng.normal(size=(B, S, Hk, D)), jnp.float32) for _ in range(2))
    v = jnp.asarray(rng.normal(size=(B, S, Hv, D)), jnp.float32)
    b, a = (jnp.asarray(rng.normal(size=(B, S, Hv)), jnp.float32) for _ in range(2))
    convs = [jnp.asarray(rng.normal(size=(4, h, D)) * 0.5, jnp.float32) for h in (Hk, Hk, Hv)]
    A_log, dt_bias = jnp.asarray(rng.normal(size=Hv), jnp.float32), jnp.asarray(rng.normal(size=Hv), jnp.float32)
    seg = jnp.asarray(np.r_[np.ones(12), np.full(17, 2), np.zeros(3)].astype(np.int32)[None])
    args = (q, k, v, b, a, GdnWeights(*convs, A_log, dt_bias, jnp.ones(D)), seg)
    got = rule_inputs(*args, choices=KernelChoices(gdn_inputs="pallas"))
    xla = rule_inputs(*args, choices=KernelChoices(gdn_inputs="xla"))
    valid, doc = document_index(seg, B, S)
    with jax.enable_x64(True):
        f64 = [jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, *convs)]
        ref = functools.partial(_float64_inputs_path, valid=jnp.asarray(valid), doc=jnp.asarray(doc))
        want = [np.asarray(ref(f64[0], f64[3], scale=D**-0.5)), np.asarray(ref(f64[1], f64[4], scale=1.0)),
                np.asarray(ref(f64[2], f64[5], scale=None))]
    b64, a64 = np.asarray(b, np.float64), np.asarray(a, np.float64)
    softplus = np.log1p(np.exp(a64 + np.asarray(dt_bias, np.float64)))
    want += [-np.exp(np.asarray(A_log, np.float64)) * softplus, 1 / (1 + np.exp(-b64))]  # g, beta
    for g, x, r in zip(got, xla, want):
        assert g.dtype == x.dtype and g.shape == x.shape == r.shape
        assert np.abs(np.asarray(g, np.float64) - r).max() <= 2e-6 * np.abs(r).max()


def test_pallas_conv_silu_lowers_for_gpu():
    # The four kernels built for Triton (not interpreted) and lowered for "cuda" on this CPU machine at
    # the 0.8B shapes (8192 tokens, 16 heads of 128), forward and backward.
    import re

    from qwen35_kernels.gdn_inputs.pallas import pallas_conv_silu

    def loss(x, w, valid, doc):
        return jnp.sum(pallas_conv_silu(x, w, valid, doc, l2_scale=1.0, interpret=False)) + jnp.sum(
            pallas_conv_silu(x, w, valid, doc, interpret=False).astype(jnp.float32))

    args = (jax.ShapeDtypeStruct((1, 8192, 16, 128), jnp.bfloat16), jax.ShapeDtypeStruct((4, 16, 128), jnp.bfloat16),
            jax.ShapeDtypeStruct((1, 8192), jnp.int32), jax.ShapeDtypeStruct((1, 8192), jnp.int32))
    text = jax.jit(jax.grad(loss, (0, 1))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert {"gdn_conv_silu", "gdn_conv_silu_l2", "gdn_conv_silu_backward", "gdn_conv_silu_l2_backward"} <= set(
        re.findall(r'name = "(\w+)"', text))


def test_rule_inputs_use_the_kernels_on_gpu_with_the_pallas_chunk_scan_only():
    # A GPU traces the input kernels with the Pallas chunk scan ("auto" there) and not with the XLA
    # fallback that scripts/device_check.sh reruns a failed step with, nor with a conv halo.
    from jaxpr_testutil import all_equations
    from qwen35_jax.layers.gdn_inputs import rule_inputs

    B, S, H, D = 1, 32, 2, 16
    q = jnp.zeros((B, S, H, D), jnp.bfloat16)
    b = jnp.zeros((B, S, H), jnp.bfloat16)
    conv = jnp.zeros((4, H, D), jnp.bfloat16)
    seg = jnp.ones((B, S), jnp.int32)
    halo = (q[:, :3], q[:, :3], q[:, :3], seg[:, :3])
    weights = GdnWeights(conv, conv, conv, jnp.zeros(H), jnp.zeros(H), jnp.zeros(D))

    def kernels(scan, halo=None):
        choices = KernelChoices(gdn_chunk_scan=scan, platform="gpu")  # the program a GPU traces
        jaxpr = jax.make_jaxpr(lambda q: rule_inputs(q, q, q, b, b, weights, seg, halo, choices=choices))(q)
        return sorted(e.params["name"] for e in all_equations(jaxpr.jaxpr) if e.primitive.name == "pallas_call")

    assert kernels("auto") == ["gdn_conv_silu", "gdn_conv_silu_l2", "gdn_conv_silu_l2"]
    assert kernels("associative") == [] and kernels("pallas", halo) == []
