"""KernelChoices: "auto" resolved per platform in one place, one-line errors, carried by the model config
through a checkpoint's JSON, and passed by argument, so a step's backward pass runs its forward's."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from qwen35_kernels import KernelChoices, resolved
from qwen35_kernels.gated_delta_rule import chunked_gated_delta_rule

from qwen35_jax.checkpoint import _config_dict
from qwen35_jax.config import Qwen35Config

AUTO = {  # platform -> (attention, gdn_chunk_scan, gdn_precision, gdn_remat)
    "cpu": ("xla", "sequential", "highest", "none"),
    "gpu": ("pallas_gpu", "pallas", "default", "states"),
    "tpu": ("pallas_tpu", "associative", "default", "none"),
}


@pytest.mark.parametrize("platform", AUTO)
def test_auto_resolves_per_platform_and_resolving_again_changes_nothing(platform):
    resolved = KernelChoices().resolve(platform)
    assert (resolved.attention, resolved.gdn_chunk_scan, resolved.gdn_precision, resolved.gdn_remat) == AUTO[platform]
    assert resolved.platform == platform and resolved.resolve("cpu") == resolved  # its own platform wins
    assert KernelChoices(attention="pallas").resolve(platform).attention == ("pallas_tpu" if platform == "tpu"
                                                                              else "pallas_gpu")
    # an explicit scan has no fallback (a one-line error where Triton cannot take the sizes); "auto" has one
    assert KernelChoices(gdn_chunk_scan="pallas").resolve(platform).gdn_chunk_scan_fallback is None
    assert resolved.gdn_chunk_scan_fallback == "associative"


@pytest.mark.parametrize("platform, inputs, logprob", [("cpu", "xla", "xla"), ("gpu", "pallas", "xla"),
                                                       ("tpu", "xla", "pallas")])
def test_gdn_inputs_and_logprob_backend_resolve_per_platform(platform, inputs, logprob):
    choices = KernelChoices().resolve(platform)
    assert (choices.gdn_inputs, choices.logprob_backend) == (inputs, logprob)
    # the GDN input kernels go with the Pallas chunk scan
    assert KernelChoices(gdn_chunk_scan="associative").resolve(platform).gdn_inputs == "xla"
    assert KernelChoices(gdn_inputs="pallas", logprob_backend="pallas_xla").resolve(platform).gdn_inputs == "pallas"
    # replacing the scan of a resolved value drops the fallback of "auto"; resolving again keeps it so
    assert choices.replace(gdn_chunk_scan="pallas").resolve().gdn_chunk_scan_fallback is None
    assert choices.replace(gdn_precision="high").gdn_chunk_scan_fallback == "associative"
    assert hash(choices) == hash(KernelChoices().resolve(platform))  # a static argument of a jit


def test_none_are_this_backends_defaults():
    assert resolved(None) == KernelChoices().resolve(jax.default_backend())
    outer = resolved(KernelChoices(gdn_precision="bf16"))
    assert resolved(outer) is not None and resolved(outer) == outer and outer.gdn_precision == "bf16"
    inner = resolved(outer.replace(attention="pallas"))  # another choice keeps the others
    assert (inner.gdn_precision, inner.attention) == ("bf16", "pallas_gpu")
    assert resolved(None).gdn_precision == "highest"


@pytest.mark.parametrize("changes, message", [
    ({"attention": "flash"}, "kernel choice attention must be one of"),
    ({"gdn_chunk_scan": "parallel"}, "kernel choice gdn_chunk_scan must be one of"),
    ({"sequence_tile": -1}, "sequence tile must be >= 0"),
    ({"gdn_kernel_blocks": (24, 4)}, "block_v must be a power of two >= 16"),
])
def test_bad_choices_are_one_line_errors(changes, message):
    with pytest.raises(ValueError, match=message):
        KernelChoices(**changes)
    with pytest.raises(ValueError, match="'cudnn' needs a CUDA GPU, this backend is tpu"):
        KernelChoices(attention="cudnn").resolve("tpu")


def test_the_config_carries_the_choices_through_a_checkpoints_json():
    kernels = KernelChoices(attention="xla", gdn_precision="bf16", sequence_tile=0, gdn_kernel_blocks=(32, 8),
                            platform="gpu")
    config = Qwen35Config.preset("tiny", kernels=kernels, gdn_sp_mode="state_passing")
    assert config.kernels.sequence_tile is None  # 0 turns tiling off
    stored = json.loads(json.dumps(_config_dict(config)))
    assert Qwen35Config(**stored) == config
    old = {k: v for k, v in stored.items() if k not in ("kernels", "gdn_sp_mode")}  # written before they existed
    assert Qwen35Config(**old).kernels == KernelChoices()
    with pytest.raises(ValueError, match="gdn_sp_mode must be one of"):
        dataclasses.replace(config, gdn_sp_mode="ring")


def test_a_tiled_rules_backward_runs_the_forwards_choices():
    # The tiled rule's backward retraces each tile when the gradient is taken, after the forward's
    # trace. It must still run the forward's choices: here bf16 matmuls, whose gradients differ from
    # the float32 ones by ~1e-3 of their scale, so running the default in the backward would show; the
    # same choices traced under jit agree to float32 rounding.
    rng = np.random.default_rng(0)
    b, s, h, d = 1, 64, 2, 16
    q, k = (jnp.asarray(x / np.linalg.norm(x, axis=-1, keepdims=True)) for x in rng.normal(size=(2, b, s, h, d)))
    v = jnp.asarray(rng.normal(size=(b, s, h, d)))
    g = jnp.asarray(-0.1 * np.abs(rng.normal(size=(b, s, h))))
    beta = jnp.asarray(1 / (1 + np.exp(-rng.normal(size=(b, s, h)))))
    args = tuple(x.astype(jnp.float32) for x in (q, k, v, g, beta))
    choices = KernelChoices(gdn_precision="bf16", sequence_tile=16)  # 4 tiles of 2 chunks

    def loss(*xs, kernels=None):
        return jnp.sum(jnp.sin(chunked_gated_delta_rule(*xs, chunk_size=8, choices=kernels)[0]))

    def loss_choosing_inside(*xs):
        return loss(*xs, kernels=choices)

    inside = jax.grad(loss_choosing_inside, argnums=range(5))(*args)
    around = jax.jit(jax.grad(loss_choosing_inside, argnums=range(5)))(*args)
    default = jax.grad(loss, argnums=range(5))(*args)
    for got, want, other in zip(inside, around, default):
        scale = float(jnp.abs(want).max())
        assert float(jnp.abs(got - want).max()) <= 1e-6 * scale
        assert float(jnp.abs(other - want).max()) > 1e-4 * scale  # the choice shows in the gradient


def test_with_config_switches_a_models_kernels_without_copying_its_parameters():
    from flax import nnx

    from qwen35_jax.model import Qwen35ForCausalLM, with_config

    config = Qwen35Config.preset("tiny")
    model = Qwen35ForCausalLM(config, rngs=nnx.Rngs(0))
    switched = with_config(model, config.replace(kernels=KernelChoices(attention="pallas")))
    assert switched.config.kernels.attention == "pallas" and model.config.kernels.attention == "auto"
    assert switched.blocks.layers[0].linear_attn.config.kernels.attention == "pallas"  # every module's config
    assert switched.embed_tokens.embedding[...] is model.embed_tokens.embedding[...]
