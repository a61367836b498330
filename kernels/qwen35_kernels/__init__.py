"""qwen35_kernels: JAX kernels for Qwen3.5 (depends on jax only; usable from any JAX code).

- `logprob_entropy`: fused linear -> log-softmax -> label log-prob and entropy, no [T, V] logits.
- `gated_delta_rule`: `chunk_gated_delta_rule` / `fused_recurrent_gated_delta_rule` in FLA's call
  convention (Pallas Triton kernels on GPU, XLA elsewhere).
- `attention`: causal, document-masked attention (XLA, Pallas flash on GPU/TPU, cuDNN) and the decode
  step's attention against a key/value cache.
- `gdn_inputs`: causal conv1d + SiLU within documents, L2 norm.
- `choices`: `KernelChoices`, which kernel runs each op, "auto" resolved per platform; every op takes
  it as its `choices=` argument (None: the defaults for jax's backend, `resolved(None)`).

Names load on first use: `import qwen35_kernels.choices` (a model config's field) loads neither jax nor
the kernels, so a command line parses its options before jax loads.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "attention_core": "attention", "decode_attention": "attention",
    "KernelChoices": "choices", "resolved": "choices",
    "chunk_gated_delta_rule": "gated_delta_rule", "fused_recurrent_gated_delta_rule": "gated_delta_rule",
    "causal_conv1d_silu": "gdn_inputs", "causal_conv1d_update": "gdn_inputs", "l2_normalize": "gdn_inputs",
    **{name: "logprob_entropy" for name in ("BACKENDS", "MODES", "linear_logprob_entropy",
                                            "sharded_linear_logprob_entropy", "token_stats")},
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'qwen35_kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(f"qwen35_kernels.{_EXPORTS[name]}"), name)
