"""Qwen3.5 (dense and MoE) training in JAX: Flax NNX model, fsdp x sp Ulysses parallelism, fused losses."""

from __future__ import annotations

from typing import Any

__all__ = ["Qwen35Config", "Qwen35ForCausalLM", "linear_logprob_entropy"]


def __getattr__(name: str) -> Any:
    # Loaded on first use, so that `import qwen35_jax.<light module>` (a CLI's option parsing, its
    # signal handler) does not wait for jax.
    if name == "Qwen35Config":
        from qwen35_jax.config import Qwen35Config
        return Qwen35Config
    if name == "Qwen35ForCausalLM":
        from qwen35_jax.model import Qwen35ForCausalLM
        return Qwen35ForCausalLM
    if name == "linear_logprob_entropy":
        from qwen35_kernels import linear_logprob_entropy
        return linear_logprob_entropy
    raise AttributeError(f"module 'qwen35_jax' has no attribute {name!r}")
