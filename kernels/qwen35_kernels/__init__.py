"""qwen35_kernels: JAX kernels for Qwen3.5 (depends on jax only; usable from any JAX code).

- `logprob_entropy`: fused linear -> log-softmax -> label log-prob and entropy, no [T, V] logits.
- `gated_delta_rule`: `chunk_gated_delta_rule` / `fused_recurrent_gated_delta_rule` in FLA's call
  convention (Pallas Triton kernels on GPU, XLA elsewhere).
- `attention`: causal, document-masked attention (XLA, Pallas flash on GPU/TPU, cuDNN).
- `gdn_inputs`: causal conv1d + SiLU within documents, L2 norm.
- `choices`: `KernelChoices`, which kernel runs each op, "auto" resolved per platform.
"""

from .attention import attention_core
from .choices import KernelChoices, current_choices, kernel_choices
from .gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from .gdn_inputs import causal_conv1d_silu, causal_conv1d_update, l2_normalize
from .logprob_entropy import (
    BACKENDS,
    MODES,
    linear_logprob_entropy,
    sharded_linear_logprob_entropy,
    token_stats,
)

__all__ = [
    "BACKENDS",
    "MODES",
    "KernelChoices",
    "attention_core",
    "causal_conv1d_silu",
    "causal_conv1d_update",
    "chunk_gated_delta_rule",
    "current_choices",
    "fused_recurrent_gated_delta_rule",
    "kernel_choices",
    "l2_normalize",
    "linear_logprob_entropy",
    "sharded_linear_logprob_entropy",
    "token_stats",
]
