"""Generation from the model's own weights: a hybrid cache, prefill with the training kernels, a jitted
decode loop, sampling. `generate` is the entry point (docs/generation.md)."""

from qwen35_jax.generation.api import Completion, GenerationStats, generate
from qwen35_jax.generation.cache import HybridCache, cache_bytes, describe_cache
from qwen35_jax.generation.sampling import SamplingOptions

__all__ = ["Completion", "GenerationStats", "HybridCache", "SamplingOptions", "cache_bytes", "describe_cache",
           "generate"]
