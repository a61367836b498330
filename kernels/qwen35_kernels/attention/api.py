"""Causal, document-masked attention behind one function: the XLA core (`xla.py`, the reference and
the CPU path), the Pallas flash kernels (`pallas.py`: Triton on GPU, Mosaic on TPU) and cuDNN's
(`cudnn.py`, opt-in on GPU)."""

from __future__ import annotations

import jax
from qwen35_kernels.attention.cudnn import cudnn_flash_attention
from qwen35_kernels.attention.pallas import (
    check_attention_inputs,
    gpu_flash_attention,
    resolve_implementation,
    tpu_flash_attention,
)
from qwen35_kernels.attention.xla import xla_attention_core

KERNELS = {"pallas_gpu": gpu_flash_attention, "pallas_tpu": tpu_flash_attention, "cudnn": cudnn_flash_attention}


def attention_core(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                   block_q: int | None = None, implementation: str | None = None) -> jax.Array:
    """Causal softmax attention that never crosses documents; softmax in float32.

    q: [B, S, H, Dh] (normed, rotated), k/v: [B, S, K, Dh] with H % K == 0, segment_ids: [B, S]
    -> [B, S, H, Dh]. Scale 1/sqrt(Dh). Query head h reads kv head h // (H // K).
    `implementation` (None: the kernel choices' `attention`, "auto" by default) picks a flash
    kernel on GPU/TPU (`pallas.py`, `cudnn.py`); the XLA core (`xla.py`)
    runs on CPU and is the reference. It runs block_q queries at a time (None: `default_block_q`), each block against
    only the keys up to its last query (the later ones are all masked: about half the work of every score
    matrix is skipped). Each block is a flash-style custom VJP that saves its output and log-sum-exp,
    not its [block_q, S] probabilities: peak memory O(block_q * S) per head instead of O(S^2). Each
    row's softmax still sees every key it may attend to, so the result does not depend on block_q.
    """
    check_attention_inputs(q, k, v, segment_ids)
    name = resolve_implementation(implementation)
    if name != "xla":
        return KERNELS[name](q, k, v, segment_ids)
    return xla_attention_core(q, k, v, segment_ids, block_q)
