"""Qwen3.5 (dense and MoE) training in JAX: Flax NNX model, fsdp x sp Ulysses parallelism, fused losses."""

from qwen35_kernels import linear_logprob_entropy

from qwen35_jax.config import Qwen35Config
from qwen35_jax.model import Qwen35ForCausalLM

__all__ = ["Qwen35Config", "Qwen35ForCausalLM", "linear_logprob_entropy"]
