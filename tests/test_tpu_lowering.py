"""The trainer's step as a TPU runs it, lowered for TPU from this CPU machine.

As test_gpu_lowering does for CUDA: `jax.default_backend()` reads "tpu" while the step is traced, so
every backend-dependent choice is the TPU's (the Pallas TPU flash attention, the associative GDN chunk
scan, the Pallas log-prob kernels, the scanned layers). Lowering runs every Pallas TPU (Mosaic)
lowering rule, so a kernel whose block shapes or operations Mosaic refuses fails here; Mosaic's own
compilation needs libtpu (`pip install -e ".[tpu-compile]"`, tests/test_tpu_compile.py).
"""

from __future__ import annotations

import re
from collections import Counter

import jax
import pytest
from qwen35_kernels.choices import KernelChoices

from lowering_testutil import abstract_step_inputs, train_step_for

from qwen35_jax.config import Qwen35Config
from qwen35_jax.parallel.mesh import make_mesh

# jax's Pallas TPU flash attention (forward; the backward's dK/dV and dQ kernels) and ours
TPU_ATTENTION = {"_flash_attention_kernel", "_flash_attention_dkv_kernel", "_flash_attention_dq_kernel"}
LOGPROB_KERNELS = {"logprob_forward", "logprob_backward_dh", "logprob_backward_dw"}


# remat "full": the layers scanned (the TPU's layout), the attention forward recomputed in the backward;
# fsdp=2, sp=1 (the trainer's default layout, all devices on fsdp): the mixers' kernels still run per
# device, inside shard_map, which Mosaic requires
@pytest.mark.parametrize("preset, mesh_shape, gdn_mode, lm_head, remat", [
    ("tiny", (2, 4), "all_to_all", "gather", "full"),
    ("tiny-moe", (2, 4), "state_passing", "vocab_parallel", "none"),
    ("tiny", (2, 1), "all_to_all", "gather", "full"),
])
def test_train_step_lowers_for_tpu(preset, mesh_shape, gdn_mode, lm_head, remat):
    mesh = make_mesh(mesh_shape, devices=jax.devices()[:mesh_shape[0] * mesh_shape[1]])
    config = Qwen35Config.preset(preset, dtype="bfloat16", remat=remat, gdn_sp_mode=gdn_mode,
                                 kernels=KernelChoices(platform="tpu"))  # the program is the TPU's
    graphdef, tx, params, opt_state, batch = abstract_step_inputs(config, mesh, 256)
    step = train_step_for(config, graphdef, tx, params, opt_state, lm_head)
    with jax.set_mesh(mesh):
        text = step.trace(params, opt_state, batch).lower(lowering_platforms=("tpu",)).as_text()

    targets = Counter(re.findall(r"custom_call @([\w$.]+)", text))
    kernels = Counter(re.findall(r'kernel_name = "(\w+)"', text))
    # every Pallas call is a Mosaic kernel (none left in interpret mode, no Triton), and only these
    assert set(targets) - {"Sharding", "SPMDFullToShardShape", "SPMDShardToFullShape"} == {"tpu_custom_call"}
    assert sum(kernels.values()) == targets["tpu_custom_call"]
    assert set(kernels) == TPU_ATTENTION | LOGPROB_KERNELS, kernels
    # one attention layer: its forward, once more when "full" recomputes it, and its two backward kernels
    assert kernels["_flash_attention_kernel"] == (2 if remat == "full" else 1)
    assert kernels["_flash_attention_dkv_kernel"] == kernels["_flash_attention_dq_kernel"] == 1
    if mesh_shape[1] > 1:
        assert "all_to_all" in text  # Ulysses around the attention (and the GDN layers, unless state passing)
    if gdn_mode == "state_passing":
        assert "collective_permute" in text  # the conv halo from the previous shard
    if preset == "tiny-moe":
        assert "chlo.ragged_dot" in text  # the experts' grouped matmuls
