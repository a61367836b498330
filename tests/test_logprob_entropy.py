"""Fused log-prob/entropy: every backend against a float64 NumPy reference, values and gradients."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import qwen35_kernels as qk
from jaxpr_testutil import all_equations
from qwen35_kernels.logprob_entropy import api, pallas, pallas_xla, reference, tiles, xla


# ----------------------------------------------------------------------------- float64 truth


def np_logprob_entropy(h, w, labels, temperature, g_lp, g_ent):
    """(log_probs, entropy, d/dh, d/dw) of sum(g_lp * log_probs + g_ent * entropy), in float64."""
    h, w = np.asarray(h, np.float64), np.asarray(w, np.float64)
    labels = np.asarray(labels)
    z = h @ w / temperature  # [T, V]
    z_max = z.max(axis=1, keepdims=True)
    lse = z_max[:, 0] + np.log(np.exp(z - z_max).sum(axis=1))
    p = np.exp(z - lse[:, None])
    mean_z = (p * z).sum(axis=1)
    entropy = lse - mean_z
    valid = labels >= 0
    picked = z[np.arange(len(labels)), np.where(valid, labels, 0)]
    log_probs = np.where(valid, picked - lse, 0.0)
    onehot = np.zeros_like(z)
    onehot[np.arange(len(labels))[valid], labels[valid]] = 1.0
    g_lp = np.where(valid, np.asarray(g_lp, np.float64), 0.0)[:, None]
    g_ent = np.asarray(g_ent, np.float64)[:, None]
    dz = (g_lp * (onehot - p) + g_ent * p * (mean_z[:, None] - z)) / temperature
    return log_probs, entropy, dz @ w.T, h.T @ dz


# ----------------------------------------------------------------------------- backends under test


def _from_stats(stats_fn):
    def run(h, w, labels, temperature):
        lse, ent, zl = stats_fn(h, w, labels, temperature)
        return api.log_probs_from_stats(lse, zl, labels), ent

    return run


SMALL_GPU = pallas.make_blocks("gpu", block_t=16, block_v=64, block_d=16, interpret=True)
SMALL_TPU = pallas.make_blocks("tpu", block_t=16, block_v=128, interpret=True)
# Vocabulary blocks split unevenly over programs (5 blocks of 64 for V = 300: 2 + 2 + 1).
SMALL_GPU_SPLIT = pallas.make_blocks("gpu", block_t=16, block_v=64, block_d=16, interpret=True, v_splits=3)

VARIANTS = {
    "reference": functools.partial(qk.linear_logprob_entropy, backend="reference"),
    "xla": functools.partial(qk.linear_logprob_entropy, backend="xla"),
    "xla-small-tiles": _from_stats(functools.partial(xla.token_stats, block_t=16, block_v=64)),
    # the GPU/TPU forward (each tile read once) run on CPU
    "xla-one-pass-small-tiles": _from_stats(
        functools.partial(xla.token_stats, block_t=16, block_v=64, one_pass=True)),
    "pallas-gpu-layout": _from_stats(functools.partial(pallas.token_stats, blocks=SMALL_GPU)),
    "pallas-tpu-layout": _from_stats(functools.partial(pallas.token_stats, blocks=SMALL_TPU)),
    # the Pallas forward's statistics as the XLA backward's residuals
    "pallas-forward-xla-backward": _from_stats(functools.partial(pallas_xla.token_stats, blocks=SMALL_GPU)),
}


def _call(variant, h, w, labels, temperature):
    fn = VARIANTS[variant] if isinstance(variant, str) else variant
    if fn.__class__ is functools.partial and "backend" in fn.keywords:
        return fn(h, w, labels, temperature=temperature)
    return fn(h, w, labels, temperature)


def _value_and_grads(variant, h, w, labels, temperature, g_lp, g_ent):
    def objective(h, w):
        lp, ent = _call(variant, h, w, labels, temperature)
        return jnp.sum(g_lp * lp) + jnp.sum(g_ent * ent), (lp, ent)

    (_, (lp, ent)), (dh, dw) = jax.jit(jax.value_and_grad(objective, (0, 1), has_aux=True))(h, w)
    return lp, ent, dh, dw


def _problem(seed, T, D, V, dtype=jnp.float32, ignore_frac=0.25, scale=1.0):
    k = jax.random.split(jax.random.key(seed), 6)
    h = (jax.random.normal(k[0], (T, D)) * scale).astype(dtype)
    w = (jax.random.normal(k[1], (D, V)) * (2.0 / np.sqrt(D))).astype(dtype)
    labels = jax.random.randint(k[2], (T,), 0, V)
    labels = jnp.where(jax.random.uniform(k[3], (T,)) < ignore_frac, -1, labels)
    g_lp = jax.random.normal(k[4], (T,))
    g_ent = jax.random.normal(k[5], (T,))
    return h, w, labels, g_lp, g_ent


def _rel(x, y):
    x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
    return np.max(np.abs(x - y)) / max(np.max(np.abs(y)), 1e-30)


def _check(variant, T, D, V, temperature, *, seed=0, dtype=jnp.float32, tol_val=1e-5, tol_grad=1e-4):
    h, w, labels, g_lp, g_ent = _problem(seed, T, D, V, dtype)
    lp, ent, dh, dw = _value_and_grads(variant, h, w, labels, temperature, g_lp, g_ent)
    r_lp, r_ent, r_dh, r_dw = np_logprob_entropy(
        np.asarray(h.astype(jnp.float32)), np.asarray(w.astype(jnp.float32)), labels, temperature, g_lp, g_ent
    )
    assert lp.dtype == ent.dtype == jnp.float32 and lp.shape == ent.shape == (T,)
    assert dh.dtype == h.dtype and dw.dtype == w.dtype
    np.testing.assert_allclose(lp, r_lp, rtol=tol_val, atol=tol_val)
    np.testing.assert_allclose(ent, r_ent, rtol=tol_val, atol=tol_val)
    assert np.all(np.asarray(lp)[np.asarray(labels) < 0] == 0.0)
    assert _rel(dh, r_dh) < tol_grad, _rel(dh, r_dh)
    assert _rel(dw, r_dw) < tol_grad, _rel(dw, r_dw)


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_backends_match_float64(variant, temperature):
    # T = 37 and V = 203 are multiples of no tile; D = 48 is not a multiple of the 32-wide D chunks.
    _check(variant, T=37, D=48, V=203, temperature=temperature)


@pytest.mark.parametrize("variant", ["xla", "pallas-gpu-layout", "pallas-tpu-layout", "pallas-forward-xla-backward"])
def test_bfloat16_inputs(variant):
    # bf16 h and w, float32 accumulation. Values are close to float64 on the rounded inputs (the
    # products are exact in float32); gradients are rounded to bf16 on output (and dz to bf16 before
    # the gradient matmuls of every backend), so their bound is 1e-2 of the largest entry.
    _check(variant, T=37, D=48, V=203, temperature=1.0, dtype=jnp.bfloat16, tol_val=1e-4, tol_grad=1e-2)


@pytest.mark.parametrize("variant", ["xla", "pallas-gpu-layout", "pallas-tpu-layout"])
def test_bfloat16_hidden_with_float32_weight(variant):
    # What a bf16-compute model hands the kernel when its lm_head weight stays float32: every backend
    # multiplies in the promoted dtype (float32), as jnp.dot does. Values against float64 on the rounded
    # hidden states to float32 rounding; dh is rounded to bf16 on output (1e-2 of its largest entry), dW
    # stays float32 (1e-4).
    h, w, labels, g_lp, g_ent = _problem(0, 37, 48, 203)
    h = h.astype(jnp.bfloat16)
    lp, ent, dh, dw = _value_and_grads(variant, h, w, labels, 1.0, g_lp, g_ent)
    r_lp, r_ent, r_dh, r_dw = np_logprob_entropy(np.asarray(h.astype(jnp.float32)), np.asarray(w), labels, 1.0,
                                                 g_lp, g_ent)
    assert dh.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    np.testing.assert_allclose(lp, r_lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, r_ent, rtol=1e-5, atol=1e-5)
    assert _rel(dh, r_dh) < 1e-2 and _rel(dw, r_dw) < 1e-4, (_rel(dh, r_dh), _rel(dw, r_dw))


def test_xla_backward_matmuls_take_the_input_dtype():
    # bf16 hidden and weight: every matmul of the XLA backend's forward and backward multiplies bf16
    # operands (float32 accumulation). A float32 dz against the bf16 weight would promote both to
    # float32, which on a GPU is a TF32 GEMM at a third of the bf16 rate.
    h, w, labels, g_lp, _ = _problem(0, 37, 48, 203)
    h, w = h.astype(jnp.bfloat16), w.astype(jnp.bfloat16)

    def loss(h, w):
        return jnp.sum(g_lp * qk.linear_logprob_entropy(h, w, labels, backend="xla")[0])

    jaxpr = jax.make_jaxpr(jax.grad(loss, (0, 1)))(h, w)
    dots = [{v.aval.dtype for v in eqn.invars} for eqn in all_equations(jaxpr) if eqn.primitive.name == "dot_general"]
    assert len(dots) >= 3 and all(d == {jnp.dtype(jnp.bfloat16)} for d in dots), dots


def test_ignored_labels_send_no_gradient():
    h, w, labels, _, _ = _problem(1, 24, 16, 150, ignore_frac=0.5)
    ignored = np.asarray(labels) < 0
    assert ignored.any() and (~ignored).any()
    for variant in ("xla", "pallas-gpu-layout"):
        dh = jax.grad(lambda h: jnp.sum(_call(variant, h, w, labels, 1.0)[0]))(h)
        assert np.all(np.asarray(dh)[ignored] == 0.0), variant
        assert np.all(np.abs(np.asarray(dh)[~ignored]).sum(axis=1) > 0), variant
        ent = _call(variant, h, w, labels, 1.0)[1]
        assert np.all(np.asarray(ent)[ignored] > 0), variant  # entropy still computed


def test_large_logits_are_stable():
    # Logits around +-300: float32 exp would overflow without the running max.
    h, w, labels, g_lp, g_ent = _problem(2, 20, 16, 100)
    h = h * 40.0
    for variant in ("xla", "xla-one-pass-small-tiles", "pallas-tpu-layout"):
        lp, ent, dh, dw = _value_and_grads(variant, h, w, labels, 1.0, g_lp, g_ent)
        r_lp, r_ent, r_dh, _ = np_logprob_entropy(h, w, labels, 1.0, g_lp, g_ent)
        assert np.all(np.isfinite(np.asarray(dh))) and np.all(np.isfinite(np.asarray(dw)))
        np.testing.assert_allclose(lp, r_lp, rtol=1e-5, atol=1e-3)
        np.testing.assert_allclose(ent, r_ent, atol=1e-3)
        assert _rel(dh, r_dh) < 1e-4


@pytest.mark.parametrize(
    "layout", [SMALL_GPU, SMALL_GPU_SPLIT, SMALL_TPU], ids=["gpu-layout", "gpu-layout-3-splits", "tpu-layout"]
)
def test_pallas_interpret_equals_xla(layout):
    h, w, labels, g_lp, g_ent = _problem(3, 45, 32, 300)
    a = _value_and_grads(_from_stats(functools.partial(pallas.token_stats, blocks=layout)), h, w, labels, 0.8, g_lp, g_ent)
    b = _value_and_grads("xla-small-tiles", h, w, labels, 0.8, g_lp, g_ent)
    for x, y in zip(a, b):
        assert _rel(x, y) < 2e-6


@pytest.mark.parametrize("dtype, precision", [(jnp.bfloat16, "DEFAULT"), (jnp.float32, "HIGHEST")])
@pytest.mark.parametrize("layout", [SMALL_GPU, SMALL_TPU], ids=["gpu-layout", "tpu-layout"])
def test_pallas_kernel_dots_of_bf16_tiles_at_default_precision(layout, dtype, precision):
    # conftest sets jax_default_matmul_precision "highest", as a user may: Mosaic refuses bf16 tiles at a
    # float32 contraction, so every dot of the kernels (forward and backward) on bf16 tiles asks for
    # DEFAULT (bf16 products accumulate in float32 exactly either way); float32 keeps what was asked for.
    assert jax.config.jax_default_matmul_precision == "highest"
    h, w, labels, _, _ = _problem(3, 45, 32, 300)
    h, w = h.astype(dtype), w.astype(dtype)

    def loss(h, w):
        lse, ent, zl = pallas.token_stats(h, w, labels, 0.8, blocks=layout)
        return jnp.sum(lse) + jnp.sum(ent) - jnp.sum(zl)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(h, w)
    kernels = [e for e in all_equations(jaxpr) if e.primitive.name == "pallas_call"]
    dots = [e for kernel in kernels for e in all_equations(kernel.params["jaxpr"])
            if e.primitive.name == "dot_general"]
    assert len(kernels) >= 2 and len(dots) >= 3, (len(kernels), len(dots))
    assert {str(p) for e in dots for p in e.params["precision"]} == {precision}


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    T=st.integers(1, 40),
    D=st.integers(1, 24),
    V=st.integers(1, 150),
    temperature=st.sampled_from([0.5, 1.0, 2.0]),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_shapes_xla(T, D, V, temperature, seed):
    _check("xla-small-tiles", T, D, V, temperature, seed=seed)


@pytest.mark.slow
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    T=st.integers(1, 40),
    D=st.integers(1, 40),
    V=st.integers(1, 150),
    layout=st.sampled_from(["pallas-gpu-layout", "pallas-tpu-layout"]),
    seed=st.integers(0, 2**16),
)
def test_hypothesis_shapes_pallas(T, D, V, layout, seed):
    _check(layout, T, D, V, 1.0, seed=seed)


# ----------------------------------------------------------------------------- no [T, V] array


def _largest_intermediate(closed_jaxpr) -> int:
    """Most elements of any value in the jaxpr, nested jaxprs (loops, custom VJPs, kernels) included."""
    return max(int(np.prod(getattr(v.aval, "shape", ()) or (1,)))
               for eqn in all_equations(closed_jaxpr) for v in eqn.outvars)


@pytest.mark.parametrize("variant", ["reference", "xla-small-tiles", "pallas-gpu-layout", "pallas-tpu-layout"])
def test_no_tokens_by_vocab_array(variant):
    T, D, V = 256, 8, 512  # T * V = 131072 > every tile, the weight (4096) and dh (2048)
    h, w, labels, g_lp, g_ent = _problem(4, T, D, V)

    def objective(h, w):
        lp, ent = _call(variant, h, w, labels, 1.0)
        return jnp.sum(g_lp * lp) + jnp.sum(g_ent * ent)

    largest = _largest_intermediate(jax.make_jaxpr(jax.grad(objective, (0, 1)))(h, w))
    if variant == "reference":
        assert largest >= T * V  # the check sees a [T, V] array when there is one
    else:
        assert largest < T * V // 8, largest


def test_xla_scratch_memory_is_flat_in_tokens():
    D, V = 8, 32768

    def temp_bytes(T):
        h, w, labels, g_lp, g_ent = _problem(5, T, D, V)

        def objective(h, w):
            lp, ent = qk.linear_logprob_entropy(h, w, labels, backend="xla")
            return jnp.sum(g_lp * lp + g_ent * ent)

        compiled = jax.jit(jax.grad(objective, (0, 1))).lower(h, w).compile()
        return compiled.memory_analysis().temp_size_in_bytes

    small, large = temp_bytes(1024), temp_bytes(4096)
    # Only the [T, D] float32 dh accumulator and padded copies grow with T (a few hundred KiB here);
    # the [1024, 2048] tiles are fixed. A [T, V] float32 array would be 512 MiB at T = 4096.
    assert large - small < 4 * (4096 - 1024) * D * 4 + (1 << 20), (small, large)
    assert large < 4096 * V * 4 // 16, large


# ----------------------------------------------------------------------------- API


def test_xla_forward_reads_each_tile_once_on_gpu(monkeypatch):
    # On GPU (and TPU) the vocabulary loop reduces each logit tile by one variadic reduction
    # (max, sum-exp, sum p (z - max)); XLA:CPU keeps the max-then-sums form (about 5x faster there).
    h, w, labels, _, _ = _problem(0, 37, 48, 203)

    def variadic_reduces():
        jaxpr = jax.make_jaxpr(lambda h, w: xla.token_stats(h, w, labels, block_t=16, block_v=64))(h, w)
        return [e for e in all_equations(jaxpr) if e.primitive.name == "reduce" and len(e.outvars) == 3]

    assert variadic_reduces() == []
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert len(variadic_reduces()) == 1


def test_one_pass_tile_statistics():
    # Two tiles with masked columns (one tile mostly masked), merged into running statistics: lse and
    # entropy equal float64 to float32 rounding of values around 10 (1e-5 absolute); a NaN logit reaches
    # the sum-exp, as in the two-pass form, so a non-finite loss is seen.
    rng = np.random.default_rng(0)
    z = rng.normal(size=(2, 6, 64)) * 4
    z[1, :, :50] = tiles.NEG
    cols, labels = jnp.arange(64)[None], jnp.asarray(rng.integers(0, 64, (6, 1)))
    stats = tiles.init_stats((6, 1))
    for tile in z:
        stats = tiles.update_stats_one_pass(stats, jnp.asarray(tile, jnp.float32), cols, labels)
    lse, ent, _ = tiles.finish_stats(stats)
    real = np.concatenate([z[0], z[1, :, 50:]], axis=1)
    top = real.max(axis=1, keepdims=True)
    e = np.exp(real - top)
    ref_lse = top[:, 0] + np.log(e.sum(axis=1))
    ref_ent = ref_lse - (e * real).sum(axis=1) / e.sum(axis=1)
    np.testing.assert_allclose(np.asarray(lse)[:, 0], ref_lse, atol=1e-5)
    np.testing.assert_allclose(np.asarray(ent)[:, 0], ref_ent, atol=1e-5)
    bad = np.asarray(z[0], np.float32)
    bad[2, 7] = np.nan
    stats = tiles.update_stats_one_pass(tiles.init_stats((6, 1)), jnp.asarray(bad), cols, labels)
    assert np.isnan(np.asarray(stats[1])[2, 0]) and np.isfinite(np.asarray(stats[1])[[0, 1, 3, 4, 5], 0]).all()


def test_auto_backend_on_cpu_is_xla():
    assert api.resolve_backend("auto") == ("pallas" if jax.default_backend() == "tpu" else "xla")
    from qwen35_kernels.choices import KernelChoices

    assert api.resolve_backend(None, KernelChoices(platform="tpu")) == "pallas"  # the choices' platform
    assert api.resolve_backend(choices=KernelChoices(logprob_backend="pallas_xla")) == "pallas_xla"


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(backend="cuda"), "backend must be one of"),
        (dict(temperature=0.0), "temperature must be a finite number > 0"),
        (dict(temperature=float("nan")), "temperature must be a finite number > 0"),
        (dict(hidden=jnp.zeros((4, 8, 2))), r"hidden must be \[T, D\]"),
        (dict(weight=jnp.zeros((7, 10))), "disagree on D"),
        (dict(labels=jnp.zeros((5,), jnp.int32)), r"labels must be \[T\]"),
        (dict(labels=jnp.zeros((4,), jnp.float32)), "labels must be integers"),
        (dict(hidden=jnp.zeros((4, 8), jnp.int32)), "hidden must be floating point"),
    ],
)
def test_bad_arguments_raise(kwargs, match):
    args = dict(hidden=jnp.zeros((4, 8)), weight=jnp.zeros((8, 10)), labels=jnp.zeros((4,), jnp.int32))
    call = {k: kwargs.pop(k) for k in list(kwargs) if k in args}
    args.update(call)
    with pytest.raises(ValueError, match=match):
        qk.linear_logprob_entropy(args["hidden"], args["weight"], args["labels"], **kwargs)


def test_bad_pallas_blocks_raise():
    with pytest.raises(ValueError, match="powers of two"):
        pallas.make_blocks("gpu", block_t=24)
    with pytest.raises(ValueError, match="layout must be"):
        pallas.make_blocks("cuda")


def test_reference_stats_contract():
    h, w, labels, _, _ = _problem(6, 10, 8, 30)
    lse, ent, zl = reference.token_stats(h, w, labels, 1.0)
    z = np.asarray(h, np.float64) @ np.asarray(w, np.float64)
    valid = np.asarray(labels) >= 0
    np.testing.assert_allclose(zl[valid], z[np.arange(10)[valid], np.asarray(labels)[valid]], rtol=1e-5)
    assert np.all(np.asarray(zl)[~valid] == 0)


@pytest.mark.parametrize("backend", ["pallas", "pallas_xla"])
def test_api_pallas_backends_interpret_on_cpu(backend):
    # the Pallas backends through the public API: this platform's default blocks, interpreted on CPU.
    h, w, labels, g_lp, g_ent = _problem(7, 21, 40, 150)
    lp, ent, dh, dw = _value_and_grads(
        functools.partial(qk.linear_logprob_entropy, backend=backend), h, w, labels, 1.0, g_lp, g_ent
    )
    r_lp, r_ent, r_dh, r_dw = np_logprob_entropy(h, w, labels, 1.0, g_lp, g_ent)
    np.testing.assert_allclose(lp, r_lp, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(ent, r_ent, rtol=1e-5, atol=1e-5)
    assert _rel(dh, r_dh) < 1e-4 and _rel(dw, r_dw) < 1e-4


@pytest.mark.parametrize(
    "layout, platform, kernels",
    [
        ("gpu", "cuda", {"logprob_forward", "logprob_backward"}),
        ("tpu", "tpu", {"logprob_forward", "logprob_backward_dh", "logprob_backward_dw"}),
    ],
)
@pytest.mark.parametrize("shape, w_dtype", [((1000, 512, 5003), jnp.bfloat16), ((8192, 4096, 248320), jnp.bfloat16),
                                            ((1000, 512, 5003), jnp.float32)], ids=["ragged", "qwen", "f32-weight"])
def test_pallas_lowers_for_gpu_and_tpu(layout, platform, kernels, shape, w_dtype):
    # Cross-platform lowering on this CPU machine: Pallas -> Triton IR ("cuda") and -> Mosaic ("tpu"),
    # forward and backward kernels. Compiling that IR to device code needs the device itself. The
    # f32-weight case is a bf16-compute model's float32 lm_head: Triton's dot takes one element type.
    T, D, V = shape
    blk = pallas.make_blocks(layout, interpret=False)

    def step(h, w, labels, g):
        def objective(h, w):
            lse, ent, zl = pallas.token_stats(h, w, labels, 1.0, blocks=blk)
            lp = api.log_probs_from_stats(lse, zl, labels)
            return jnp.sum(g[0] * lp) + jnp.sum(g[1] * ent)

        return jax.value_and_grad(objective, (0, 1))(h, w)

    args = (
        jax.ShapeDtypeStruct((T, D), jnp.bfloat16),
        jax.ShapeDtypeStruct((D, V), w_dtype),
        jax.ShapeDtypeStruct((T,), jnp.int32),
        jax.ShapeDtypeStruct((2, T), jnp.float32),
    )
    text = jax.jit(step).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    target = "__gpu$xla.gpu.triton" if platform == "cuda" else "tpu_custom_call"
    assert f"custom_call @{target}" in text
    assert kernels <= set(re.findall(r'name = "(\w+)"', text)), kernels
