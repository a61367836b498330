"""The trainer's step as a GPU runs it, lowered for CUDA from this CPU machine.

Every backend-dependent choice (the attention kernel, the GDN chunk scan and its Pallas kernels, the
layer loop, the log-prob backend) is read from `jax.default_backend()` when the step is traced; here
it reads "gpu", so the program traced is the GPU's, on the fsdp=2, sp=4 mesh. Lowering runs every
Pallas/Triton and cuDNN lowering rule; compiling and running need the device
(scripts/device_check.sh). A GPU lease is rare: a GPU-only path that no longer traces must fail here.
"""

from __future__ import annotations

import re
from collections import Counter

import jax
import pytest
from qwen35_kernels.choices import KernelChoices

from lowering_testutil import abstract_step_inputs, train_step_for
from qwen35_jax.config import Qwen35Config

GDN_KERNELS = {"gdn_chunk_local", "gdn_chunk_local_backward", "gdn_chunk_states", "gdn_chunk_states_reverse",
               "gdn_chunk_gradients", "gdn_chunk_outputs", "gdn_chunk_outputs_backward"}
TRITON_ATTENTION = {"mha_forward", "mha_preprocess_backward", "mha_backward"}
# the GDN conv + SiLU (+ L2 norm) kernels, where a mixer sees whole sequences (no conv halo)
GDN_INPUT_KERNELS = {"gdn_conv_silu", "gdn_conv_silu_l2", "gdn_conv_silu_backward", "gdn_conv_silu_l2_backward"}


# remat "none" and "mlp": the blocks one after another (the GPU's default layout then); "full": scanned
# tile: the long-context sequence tiling (`KernelChoices.sequence_tile`): 2 tiles of the GDN layers' 256 tokens
# under all-to-all; 2 tiles of each 128-token shard under state passing (its two sweeps)
@pytest.mark.parametrize("preset, attention, gdn_precision, gdn_mode, lm_head, remat, seq, tile", [
    ("tiny", "auto", None, "all_to_all", "gather", "none", 256, None),
    ("tiny", "cudnn", "bf16", "all_to_all", "gather", "full", 256, None),
    ("tiny-moe", "auto", None, "state_passing", "vocab_parallel", "mlp", 256, None),
    ("tiny", "auto", None, "all_to_all", "gather", "full", 256, 128),
    ("tiny", "auto", None, "state_passing", "gather", "full", 512, 64),
])
def test_train_step_lowers_for_cuda(monkeypatch, mesh_2x4, preset, attention, gdn_precision, gdn_mode, lm_head,
                                    remat, seq, tile):
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    # the program is the GPU's: the kernel choices name the platform (nothing is patched for that); jax's
    # cuDNN module also reads the cuDNN version and the compute capability: a Hopper with cuDNN 9.10
    kernels = KernelChoices(attention=attention, gdn_precision=gdn_precision or "auto", sequence_tile=tile,
                            platform="gpu")
    config = Qwen35Config.preset(preset, dtype="bfloat16", remat=remat, kernels=kernels, gdn_sp_mode=gdn_mode)
    graphdef, tx, params, opt_state, batch = abstract_step_inputs(config, mesh_2x4, seq)
    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)
    step = train_step_for(config, graphdef, tx, params, opt_state, lm_head)
    with jax.set_mesh(mesh_2x4):
        text = step.trace(params, opt_state, batch).lower(lowering_platforms=("cuda",)).as_text()

    targets = Counter(re.findall(r"custom_call @([\w$.]+)", text))
    kernels = set(re.findall(r'name = "(\w+)"', text)) - {"fsdp", "sp"}
    # the GDN chunk scan's Pallas kernels, forward and reverse, and the Triton attention kernels
    # (with cuDNN: its fallback branch); the GDN input kernels unless every mixer has a conv halo
    # (state passing: each sequence shard reads the one before it; sequence tiles: the tile before)
    inputs = GDN_INPUT_KERNELS if gdn_mode == "all_to_all" and tile is None else set()
    assert kernels == GDN_KERNELS | TRITON_ATTENTION | inputs, kernels
    cudnn_calls = targets["__cudnn$fmhaSoftmax"], targets["__cudnn$fmhaSoftmaxBackward"]
    if attention == "cudnn":
        assert cudnn_calls == (2, 1)  # forward, its recomputation under "full", backward
    else:
        assert cudnn_calls == (0, 0)
    assert "all_to_all" in text  # Ulysses around the attention (and the GDN layers, unless state passing)
    if gdn_mode == "state_passing":
        assert "collective_permute" in text  # the conv halo from the previous shard
    if tile is not None:  # the tile loops (MLP, GDN mixer and their written-out backward) on top of the layer scan
        assert text.count("stablehlo.while") > 6
    if preset == "tiny-moe":
        assert "chlo.ragged_dot" in text  # the experts' grouped matmuls (XLA:GPU lowers them itself)
