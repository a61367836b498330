"""qwen35_kernels: JAX kernels for qwen35-jax (depends on jax only)."""

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
    "linear_logprob_entropy",
    "sharded_linear_logprob_entropy",
    "token_stats",
]
