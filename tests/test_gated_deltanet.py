"""GatedDeltaNet module == transformers' Qwen3_5GatedDeltaNet in float64 (outputs and gradients); packed documents."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from qwen35_kernels.choices import KernelChoices, resolved
from transformers.models.qwen3_5.configuration_qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

from float64_reference import float64_copy, torch_float64
from jaxpr_testutil import all_equations
from qwen35_jax.config import Qwen35Config
from qwen35_jax.layers.gated_deltanet import GatedDeltaNet, gdn_core
from qwen35_jax.layers.gdn_arrays import GdnTokens, GdnWeights

B = 2


def _pair(seed=0, chunk_size=64, kernels=KernelChoices()):
    """A float64 torch Qwen3_5GatedDeltaNet with random float32 weights and our module holding the same
    weights, running `kernels`."""
    hf = Qwen3_5TextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, layer_types=["linear_attention"], linear_conv_kernel_dim=4,
        linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4,
        rms_norm_eps=1e-6,
    )
    torch.manual_seed(seed)
    ref = Qwen3_5GatedDeltaNet(hf, layer_idx=0).float()
    with torch.no_grad():
        for p in ref.parameters():
            p.copy_(torch.randn_like(p) * 0.1)
        ref.A_log.copy_(torch.empty(4).uniform_(0.01, 16).log())
        ref.norm.weight.copy_(1 + 0.1 * torch.randn(8))
    config = Qwen35Config.preset("tiny").replace(
        hidden_size=32, linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4, rms_norm_eps=1e-6, gdn_chunk_size=chunk_size,
        kernels=kernels)
    ours = GatedDeltaNet(config, rngs=nnx.Rngs(0))
    t = lambda p: jnp.asarray(p.detach().numpy())  # noqa: E731
    for name in ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"):
        getattr(ours, name).kernel[...] = t(getattr(ref, name).weight).T
    ours.conv1d.kernel[...] = t(ref.conv1d.weight)[:, 0, :].T  # [C, 1, Kc] -> [Kc, C]
    ours.A_log[...] = t(ref.A_log)
    ours.dt_bias[...] = t(ref.dt_bias)
    ours.norm.weight[...] = t(ref.norm.weight)
    return float64_copy(ref), ours


@nnx.jit
def _apply(m, x, segment_ids=None):
    return m(x, segment_ids)


def _x(S, seed=1):
    return np.random.default_rng(seed).normal(size=(B, S, 32)).astype(np.float32)


def test_param_shapes_follow_the_contract():
    _, m = _pair()
    C = 2 * 2 * 8 + 4 * 8
    assert m.in_proj_qkv.kernel.shape == (32, C) and m.in_proj_z.kernel.shape == (32, 32)
    assert m.in_proj_b.kernel.shape == (32, 4) and m.in_proj_a.kernel.shape == (32, 4)
    assert m.conv1d.kernel.shape == (4, C) and m.out_proj.kernel.shape == (32, 32)
    assert m.A_log.shape == (4,) and m.dt_bias.shape == (4,) and m.norm.weight.shape == (8,)


def test_fresh_init_like_transformers():
    m = GatedDeltaNet(Qwen35Config.preset("tiny"), rngs=nnx.Rngs(3))
    A = np.exp(np.asarray(m.A_log[...]))
    assert np.all((A >= 0.01) & (A <= 16)) and A.std() > 0.5
    np.testing.assert_array_equal(np.asarray(m.dt_bias[...]), 1.0)
    np.testing.assert_array_equal(np.asarray(m.norm.weight[...]), 1.0)
    assert 0.01 < float(jnp.std(m.in_proj_qkv.kernel[...])) < 0.03


@pytest.mark.parametrize("S", [1, 64, 70])
def test_matches_transformers(S):
    ref, ours = _pair()
    x = _x(S)
    x64 = torch.from_numpy(x.astype(np.float64))
    with torch.no_grad(), torch_float64():
        want = ref(x64).numpy()
    got = np.asarray(_apply(ours, jnp.asarray(x)))
    assert got.shape == (B, S, 32)
    # Our float32 layer vs the float64 truth: measured max 1.0e-6 (outputs up to 0.83) on AMD EPYC; 1e-5 leaves
    # 10x headroom.
    np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)


@pytest.mark.parametrize("scan, remat", [
    ("sequential", "auto"), ("associative", "auto"), ("pallas", "auto"),  # CPU, TPU and GPU defaults
    ("associative", "states"),  # the mixer recomputed around kept chunk states, with the XLA scan
])
def test_gradients_match_torch_autograd(scan, remat):
    ref, ours = _pair(seed=2, chunk_size=16, kernels=KernelChoices(gdn_chunk_scan=scan, gdn_remat=remat))
    S = 40
    x = _x(S, seed=3)
    w = np.random.default_rng(4).normal(size=(B, S, 32)).astype(np.float32)
    x64, w64 = torch.from_numpy(x.astype(np.float64)), torch.from_numpy(w.astype(np.float64))
    with torch_float64():
        (ref(x64) * w64).sum().backward()
    want = {
        "A_log": ref.A_log.grad.numpy(),
        "dt_bias": ref.dt_bias.grad.numpy(),
        "conv": ref.conv1d.weight.grad.numpy()[:, 0, :].T,
        "in_proj_qkv": ref.in_proj_qkv.weight.grad.numpy().T,
    }

    graphdef, params = nnx.split(ours, nnx.Param)

    def loss(p):
        return jnp.sum(nnx.merge(graphdef, p)(jnp.asarray(x)) * w)

    grads = jax.jit(jax.grad(loss))(params)
    got = {
        "A_log": grads["A_log"][...],
        "dt_bias": grads["dt_bias"][...],
        "conv": grads["conv1d"]["kernel"][...],
        "in_proj_qkv": grads["in_proj_qkv"]["kernel"][...],
    }
    for name in want:
        g, r = np.asarray(got[name]), want[name]
        err = np.abs(g - r).max() / np.abs(r).max()
        # Our float32 gradients vs float64 autograd, relative to the largest entry: measured max 9.8e-6 (A_log,
        # a sum over every token) on AMD EPYC; 1e-4 leaves 10x headroom.
        assert err < 1e-4, f"{name}: relative error {err}"


def test_packed_documents_equal_separate_runs():
    """Conv window and state restart at each document start (mid-chunk too); padding gives zeros."""
    _, m = _pair(seed=5, chunk_size=16)
    S = 50
    x = _x(S, seed=6)
    # Documents of lengths 5 and 20 only, so the separate runs batch into two calls.
    spans = {0: [(0, 5), (5, 25), (25, 45)], 1: [(0, 20), (20, 25), (25, 45), (45, 50)]}
    seg = np.zeros((B, S), np.int32)
    for b, docs in spans.items():
        for i, (lo, hi) in enumerate(docs):
            seg[b, lo:hi] = i + 1
    out = np.asarray(_apply(m, jnp.asarray(x), jnp.asarray(seg)))
    docs = [(b, lo, hi) for b, d in spans.items() for lo, hi in d]
    for n in (5, 20):
        group = [d for d in docs if d[2] - d[1] == n]
        alone = np.asarray(_apply(m, jnp.asarray(np.stack([x[b, lo:hi] for b, lo, hi in group]))))
        for (b, lo, hi), o in zip(group, alone):
            np.testing.assert_allclose(out[b, lo:hi], o, atol=1e-5, rtol=0)
    np.testing.assert_allclose(out[0, 45:], 0.0, atol=1e-6)  # padding tail


def test_gdn_core_rejects_mismatched_heads():
    z = jnp.zeros
    with pytest.raises(ValueError, match="multiple of key heads"):
        gdn_core(GdnTokens(z((1, 4, 2, 8)), z((1, 4, 2, 8)), z((1, 4, 3, 8)), z((1, 4, 3, 8)), z((1, 4, 3)),
                           z((1, 4, 3))),
                 GdnWeights(z((4, 2, 8)), z((4, 2, 8)), z((4, 3, 8)), z((3,)), z((3,)), z((8,))), None,
                 eps=1e-6, chunk_size=4)


def test_bfloat16_compute_close_to_float32():
    _, m32 = _pair(seed=7)
    m16 = GatedDeltaNet(m32.config.replace(dtype="bfloat16"), rngs=nnx.Rngs(0))
    nnx.update(m16, nnx.state(m32, nnx.Param))
    x = jnp.asarray(_x(70, seed=8))
    want = np.asarray(_apply(m32, x))
    got = _apply(m16, x)
    assert got.dtype == jnp.bfloat16
    got = np.asarray(got.astype(jnp.float32))
    assert np.isfinite(got).all()
    scale = np.abs(want).max()
    assert np.abs(got - want).max() < 0.1 * scale and np.abs(got - want).mean() < 0.005 * scale


def test_states_remat_keeps_inputs_chunk_states_and_rule_output_only():
    # GDN remat "states" (the GPU default, with the Pallas chunk scan): the backward keeps the mixer's
    # inputs, the named chunk states and the rule's output, and recomputes the rest without rerunning
    # the forward state or output kernel. "none" keeps every intermediate: at 256 tokens several times
    # more bytes.
    from qwen35_jax.layers.gated_deltanet import gdn_core

    B_, S, hk, hv, d = 1, 256, 2, 4, 16
    rng = np.random.default_rng(0)
    rnd = lambda *shape: jnp.asarray(rng.normal(size=shape).astype(np.float32))  # noqa: E731
    args = (rnd(B_, S, hk, d), rnd(B_, S, hk, d), rnd(B_, S, hv, d), rnd(B_, S, hv, d), rnd(B_, S, hv),
            rnd(B_, S, hv), rnd(4, hk, d), rnd(4, hk, d), rnd(4, hv, d), rnd(hv), rnd(hv), rnd(d))

    def loss(*a, choices=None):
        return jnp.sum(gdn_core(GdnTokens(*a[:6]), GdnWeights(*a[6:]), jnp.ones((B_, S), jnp.int32), eps=1e-6,
                                chunk_size=16, choices=choices))

    kept, checkpoints = {}, {}
    for remat in ("none", "states"):
        choices = KernelChoices(gdn_chunk_scan="pallas", gdn_remat=remat)
        assert resolved(choices).gdn_remat == remat
        _, backward = jax.vjp(lambda *a: loss(*a, choices=choices), *args)
        kept[remat] = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(backward))
        checkpoints[remat] = _count_checkpoints(jax.make_jaxpr(lambda *a: loss(*a, choices=choices))(*args).jaxpr)
    # "none": the conv of q, k and v checkpointed each; "states": the mixer's one checkpoint, none inside it
    # (a nested one would run the conv a third time in the backward)
    assert checkpoints == {"none": 3, "states": 1}, checkpoints
    # the compiled backward (after XLA removes what nothing reads) runs the backward kernels, never the
    # forward state or output kernel: their ops keep their kernel's name in the metadata
    text = jax.jit(backward).lower(1.0).compile().as_text()
    kernels = set(re.findall(r'op_name="[^"]*?(gdn_chunk_(?:states|outputs)\w*)', text))
    assert kernels == {"gdn_chunk_states_reverse", "gdn_chunk_outputs_backward"}, kernels
    assert kept["states"] * 3 < kept["none"], kept
    assert resolved(KernelChoices(gdn_chunk_scan="pallas")).gdn_remat == "states"  # "auto"
    assert resolved(None).gdn_remat == "none"  # "auto" with the CPU's sequential scan


def _count_checkpoints(jaxpr) -> int:
    """jax.checkpoint calls in `jaxpr`, nested ones included."""
    # the primitive's name differs across jax releases
    return sum(eqn.primitive.name in ("checkpoint", "remat2") for eqn in all_equations(jaxpr))
