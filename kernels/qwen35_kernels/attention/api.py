"""Causal, document-masked attention behind one function, its implementation chosen by argument: the
XLA core (`xla.py`, the CPU path; `reference.py` is the plain form both are checked against), the
Pallas flash kernels (`pallas_gpu.py`: Triton, `pallas_tpu.py`: Mosaic) and cuDNN's (`cudnn.py`,
opt-in on GPU).

Semantics: query i attends to key j iff j <= i and segment_ids[i] == segment_ids[j]; padding
(segment 0) is one more segment, so padding tokens attend only to earlier padding. Every row keeps at
least its diagonal, so no row is fully masked. Scale 1/sqrt(Dh), softmax in float32, query head h
reads kv head h // (H / K). The flash kernels keep no [S, S] scores in memory, forward or backward.

Selection: `implementation=`, else the `choices`' `attention` (`qwen35_kernels.choices`; None: the
defaults for jax's backend): "auto" is "xla" on CPU (and any other backend), "pallas_gpu" on GPU,
"pallas_tpu" on TPU; "pallas" is the platform's Pallas kernel (on CPU the GPU kernel in interpret
mode: tests); "cudnn" resolves only on a GPU.
"""

from __future__ import annotations

import jax
from qwen35_kernels.attention.checks import IMPLEMENTATIONS, check_attention_inputs, check_implementation
from qwen35_kernels.attention.cudnn import cudnn_flash_attention
from qwen35_kernels.attention.pallas_gpu import gpu_flash_attention
from qwen35_kernels.attention.pallas_tpu import tpu_flash_attention
from qwen35_kernels.attention.xla import xla_attention_core
from qwen35_kernels.choices import KernelChoices, overridden

# the flash kernels by resolved name; "xla" is `xla_attention_core` (it takes block_q)
KERNELS = {"pallas_gpu": gpu_flash_attention, "pallas_tpu": tpu_flash_attention, "cudnn": cudnn_flash_attention}


def resolve_implementation(name: str | None = None, platform: str | None = None,
                           choices: KernelChoices | None = None) -> str:
    """"xla", "pallas_gpu", "pallas_tpu" or "cudnn" for `name` (None: the `choices`' attention) on
    `platform` (None: the choices' platform, else jax's backend); a one-line ValueError for "cudnn" off
    a GPU. `KernelChoices.resolve` decides: this only names its answer."""
    if name is not None:
        check_implementation(name)
    return overridden(choices, attention=name, platform=platform).attention


def attention_core(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                   block_q: int | None = None, implementation: str | None = None,
                   choices: KernelChoices | None = None) -> jax.Array:
    """Causal softmax attention that never crosses documents; softmax in float32.

    q: [B, S, H, Dh] (normed, rotated), k/v: [B, S, K, Dh] with H % K == 0, segment_ids: [B, S]
    -> [B, S, H, Dh]. Scale 1/sqrt(Dh). Query head h reads kv head h // (H // K).
    `implementation` (None: the `choices`' `attention`, "auto" by default; module docstring) picks a
    flash kernel on GPU/TPU (`pallas_gpu.py`, `pallas_tpu.py`, `cudnn.py`); the XLA core (`xla.py`)
    runs on CPU. It runs block_q queries at a time (None: `default_block_q`), each block against
    only the keys up to its last query (the later ones are all masked: about half the work of every score
    matrix is skipped). Each block is a flash-style custom VJP that saves its output and log-sum-exp,
    not its [block_q, S] probabilities: peak memory O(block_q * S) per head instead of O(S^2). Each
    row's softmax still sees every key it may attend to, so the result does not depend on block_q.
    """
    check_attention_inputs(q, k, v, segment_ids)
    if implementation is not None:
        check_implementation(implementation)
    choices = overridden(choices, attention=implementation)
    if choices.attention != "xla":
        return KERNELS[choices.attention](q, k, v, segment_ids, choices=choices)
    return xla_attention_core(q, k, v, segment_ids, block_q)


__all__ = ["IMPLEMENTATIONS", "KERNELS", "attention_core", "check_attention_inputs", "resolve_implementation"]
