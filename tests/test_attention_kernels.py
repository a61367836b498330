"""The GPU/TPU flash kernels (interpreted on CPU) against the XLA attention core; dispatch; lowering."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from qwen35_kernels.attention import attention_core, resolve_implementation
from qwen35_kernels.attention.pallas_gpu import gpu_flash_attention
from qwen35_kernels.attention.pallas_tpu import tpu_flash_attention
from qwen35_kernels.choices import KernelChoices

from qwen35_jax.parallel.ulysses import ulysses_attention


def _inputs(b: int, s: int, h: int, k: int, dh: int, seed: int = 0):
    keys = jax.random.split(jax.random.key(seed), 4)
    q = jax.random.normal(keys[0], (b, s, h, dh))
    kk = jax.random.normal(keys[1], (b, s, k, dh))
    v = jax.random.normal(keys[2], (b, s, k, dh))
    # row 0: three packed documents, padding (0) at the end; row 1: padding in the middle and one
    # long document; further rows: one document
    seg = np.ones((b, s), np.int32)
    seg[0, s // 4:] = 2
    seg[0, s // 2:] = 3
    seg[0, s - 5:] = 0
    if b > 1:
        seg[1, s // 3: s // 3 + 4] = 0
        seg[1, s // 3 + 4:] = 9
    return q, kk, v, jnp.asarray(seg), jax.random.normal(keys[3], (b, s, h, dh))


def _value_and_grads(fn, q, k, v, seg, w):
    def loss(q, k, v):
        out = fn(q, k, v, seg)
        return jnp.sum(out * w), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


def _check_against_xla(fn, q, k, v, seg, w):
    want, want_grads = _value_and_grads(functools.partial(attention_core, implementation="xla"), q, k, v, seg, w)
    got, got_grads = _value_and_grads(fn, q, k, v, seg, w)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    for name, g, gw in zip("qkv", got_grads, want_grads):
        err = float(jnp.max(jnp.abs(g - gw)) / jnp.max(jnp.abs(gw)))
        assert err < 1e-4, (name, err)


# ------------------------------------------------------------------------------------- kernels


@pytest.mark.parametrize(
    "s, kv_heads, blocks",
    [
        (37, 2, dict(block_q=16, block_k=16, block_bwd=16)),  # 3 blocks, S padded to 48
        (50, 1, dict(block_q=32, block_k=16, block_bwd=16)),  # K = 1; q and kv blocks differ
        (20, 2, {}),  # default blocks, clipped to one 32-row tile
    ],
)
def test_gpu_kernel_interpreted_equals_xla(s, kv_heads, blocks):
    q, k, v, seg, w = _inputs(b=2, s=s, h=4, k=kv_heads, dh=16)
    fn = functools.partial(gpu_flash_attention, interpret=True, **blocks)
    _check_against_xla(fn, q, k, v, seg, w)


@pytest.mark.parametrize("s, kv_heads", [(150, 2), (130, 1)])
def test_tpu_kernel_interpreted_equals_xla(s, kv_heads):
    # S padded to 256: two 128-row blocks, the second mostly padding
    q, k, v, seg, w = _inputs(b=2, s=s, h=2, k=kv_heads, dh=16, seed=1)
    fn = functools.partial(tpu_flash_attention, interpret=True)
    _check_against_xla(fn, q, k, v, seg, w)


@pytest.mark.parametrize("dtype, precision", [(jnp.bfloat16, "DEFAULT"), (jnp.float32, "HIGHEST")])
def test_tpu_kernel_dots_of_bf16_blocks_at_default_precision(dtype, precision):
    # conftest sets jax_default_matmul_precision "highest", as a user may; the TPU kernel's dots read it
    # when traced, and Mosaic refuses bf16 blocks at a float32 contraction. bf16 inputs: every dot of the
    # forward and both backward kernels at DEFAULT (bf16 x bf16 products accumulate in float32 exactly
    # either way); float32 inputs keep the precision asked for.
    from jaxpr_testutil import all_equations

    q, k, v, seg, w = (x.astype(dtype) if x.dtype == jnp.float32 else x for x in _inputs(b=1, s=130, h=2, k=1, dh=16))
    assert jax.config.jax_default_matmul_precision == "highest"

    def loss(q, k, v):
        return jnp.sum(tpu_flash_attention(q, k, v, seg, interpret=True).astype(jnp.float32) * w)

    jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    kernels = [e for e in all_equations(jaxpr) if e.primitive.name == "pallas_call"]
    dots = [e for kernel in kernels for e in all_equations(kernel.params["jaxpr"])
            if e.primitive.name == "dot_general"]
    assert len(kernels) == 3 and len(dots) >= 6, (len(kernels), len(dots))
    assert {str(p) for e in dots for p in e.params["precision"]} == {precision}


def test_gpu_kernel_bfloat16_close_to_float32_reference():
    # bf16 in and out; the kernel keeps scores and softmax in float32 like the XLA core
    q, k, v, seg, _ = _inputs(b=1, s=40, h=4, k=2, dh=16, seed=2)
    want = attention_core(q, k, v, seg, implementation="xla")
    bf = [x.astype(jnp.bfloat16) for x in (q, k, v)]
    got = gpu_flash_attention(*bf, seg, block_q=16, block_k=16, block_bwd=16, interpret=True)
    assert got.dtype == jnp.bfloat16
    np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want), atol=3e-2)


# ------------------------------------------------------------------------------------ dispatch


def test_auto_is_xla_on_cpu():
    assert jax.default_backend() == "cpu"
    assert resolve_implementation("auto") == "xla"
    assert resolve_implementation() == "xla"
    q, k, v, seg, _ = _inputs(b=1, s=8, h=2, k=1, dh=8)
    assert "pallas_call" not in str(jax.make_jaxpr(lambda *a: attention_core(*a))(q, k, v, seg))
    pallas = KernelChoices(attention="pallas")
    assert resolve_implementation(choices=pallas) == "pallas_gpu"  # interpreted on CPU
    assert "pallas_call" in str(jax.make_jaxpr(lambda *a: attention_core(*a, choices=pallas))(q, k, v, seg))
    assert "pallas_call" in str(jax.make_jaxpr(lambda *a: attention_core(*a, implementation="pallas"))(q, k, v, seg))
    assert resolve_implementation() == "xla"


@pytest.mark.parametrize("platform, auto, pallas", [("gpu", "pallas_gpu", "pallas_gpu"),
                                                    ("tpu", "pallas_tpu", "pallas_tpu"),
                                                    ("cpu", "xla", "pallas_gpu")])
def test_resolution_per_platform(platform, auto, pallas):
    assert resolve_implementation("auto", platform) == auto
    assert resolve_implementation("pallas", platform) == pallas
    assert resolve_implementation("xla", platform) == "xla"
    assert resolve_implementation(choices=KernelChoices(platform=platform)) == auto
    assert resolve_implementation(choices=KernelChoices(attention="pallas_tpu", platform=platform)) == "pallas_tpu"


def test_choices_select_kernel_inside_ulysses(mesh_2x4):
    # the kernel is what Ulysses runs per device after the all-to-all (whole sequence, local heads)
    q, k, v, seg, w = _inputs(b=2, s=24, h=8, k=2, dh=16, seed=3)
    core = functools.partial(attention_core, choices=KernelChoices(attention="pallas_gpu"))

    def sharded(q, k, v, seg):
        return ulysses_attention(core, q, k, v, seg)

    with jax.set_mesh(mesh_2x4):
        jaxpr = str(jax.make_jaxpr(sharded)(q, k, v, seg))
        assert "pallas_call" in jaxpr and "shard_map" in jaxpr
        _check_against_xla(sharded, q, k, v, seg, w)


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: resolve_implementation("flash"), "attention implementation must be one of"),
        (lambda: resolve_implementation("cudnn"), "'cudnn' needs a CUDA GPU, this backend is cpu"),
        (lambda: KernelChoices(attention="flash"), "kernel choice attention must be one of"),
        (lambda: attention_core(jnp.zeros((1, 4, 3, 8)), jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 2, 8)),
                                jnp.ones((1, 4), jnp.int32)), "H = 3 are not a multiple of kv heads K = 2"),
        (lambda: attention_core(jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 5, 1, 8)), jnp.zeros((1, 5, 1, 8)),
                                jnp.ones((1, 4), jnp.int32)), r"k must be \[B, S, K, Dh\]"),
        (lambda: attention_core(jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 1, 8)), jnp.zeros((1, 4, 1, 8)),
                                jnp.ones((1, 5), jnp.int32)), r"segment_ids must be \[B, S\] = \[1, 4\]"),
        (lambda: attention_core(jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 1, 8)), jnp.zeros((1, 4, 1, 8)),
                                jnp.ones((1, 4))), "segment_ids must be integers"),
        (lambda: gpu_flash_attention(jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 1, 8)), jnp.zeros((1, 4, 1, 8)),
                                        jnp.ones((1, 4), jnp.int32), block_q=24), "block_q must be a power of two"),
        (lambda: tpu_flash_attention(jnp.zeros((1, 4, 2, 8)), jnp.zeros((1, 4, 1, 8)), jnp.zeros((1, 4, 1, 8)),
                                        jnp.ones((1, 4), jnp.int32), block=64), "multiple of 128"),
    ],
)
def test_bad_inputs_raise(call, match):
    with pytest.raises(ValueError, match=match):
        call()


# ------------------------------------------------------------------------------------ lowering


@pytest.mark.parametrize(
    "platform, fn, target, kernels",
    [
        ("cuda", gpu_flash_attention, "__gpu$xla.gpu.triton",
         {"mha_forward", "mha_preprocess_backward", "mha_backward"}),
        ("tpu", tpu_flash_attention, "tpu_custom_call",
         {"_flash_attention_kernel", "_flash_attention_dkv_kernel", "_flash_attention_dq_kernel"}),
    ],
)
def test_kernels_lower_for_their_platform(platform, fn, target, kernels):
    # Qwen3.5 attention shapes per device under sp (16 query heads / 2 kv heads, Dh = 256), bf16,
    # a ragged S; forward and backward lowered from this CPU machine (compiling needs the device).
    b, s, h, kh, dh = 1, 4000, 16, 2, 256

    def step(q, k, v, seg, w):
        return jax.grad(lambda q, k, v: jnp.sum(fn(q, k, v, seg, interpret=False).astype(jnp.float32) * w),
                        argnums=(0, 1, 2))(q, k, v)

    args = (jax.ShapeDtypeStruct((b, s, h, dh), jnp.bfloat16), jax.ShapeDtypeStruct((b, s, kh, dh), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, s, kh, dh), jnp.bfloat16), jax.ShapeDtypeStruct((b, s), jnp.int32),
            jax.ShapeDtypeStruct((b, s, h, dh), jnp.float32))
    text = jax.jit(step).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    assert text.count(f"custom_call @{target}") == 3  # forward and two backward kernels
    assert set(re.findall(r'name = "(\w+)"', text)) == kernels
    # no [S, S] array anywhere in the program
    assert "4000x4000" not in text and "4096x4096" not in text


# ------------------------------------------------------------------------------------ model


@pytest.mark.slow
def test_model_with_pallas_kernel_equals_xla():
    # the whole model (nnx.scan over layers, remat) with the GPU kernel interpreted in its attention layer
    from flax import nnx

    from qwen35_jax.config import Qwen35Config
    from qwen35_jax.model import Qwen35ForCausalLM, with_config

    config = Qwen35Config.preset(
        "tiny", vocab_size=128, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        partial_rotary_factor=0.5, mrope_section=(2, 1, 1), linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=8, linear_value_head_dim=8, gdn_chunk_size=8, intermediate_size=64)
    graphdef, state = nnx.split(Qwen35ForCausalLM(config, rngs=nnx.Rngs(0)))
    tokens = jax.random.randint(jax.random.key(4), (2, 21), 0, 128)
    seg = jnp.asarray([[1] * 9 + [2] * 10 + [0] * 2, [5] * 21], jnp.int32)

    def run(implementation):
        chosen = nnx.graphdef(with_config(nnx.merge(graphdef, state),
                                          config.replace(kernels=KernelChoices(attention=implementation))))

        def loss(state):
            hidden = nnx.merge(chosen, state)(tokens, segment_ids=seg)  # [B, S, D]
            return jnp.sum(jnp.sin(hidden)), hidden

        kernel_used = "pallas_call" in str(jax.make_jaxpr(loss)(state))
        assert kernel_used == (implementation == "pallas"), implementation
        return jax.jit(jax.value_and_grad(loss, has_aux=True))(state)

    (_, want), want_grads = run("xla")
    (_, got), got_grads = run("pallas")
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=1e-5)
    for (path, g), gw in zip(jax.tree.leaves_with_path(got_grads), jax.tree.leaves(want_grads)):
        err = float(jnp.max(jnp.abs(g - gw)) / jnp.maximum(jnp.max(jnp.abs(gw)), 1e-30))
        assert err < 1e-4, (jax.tree_util.keystr(path), err)
