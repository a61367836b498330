"""Generation from the model's own weights: a hybrid cache, prefill with the training kernels, a jitted
decode loop, sampling. `generate` is the entry point (docs/generation.md).

Names load on first use, so that `scripts/generate.py` parses and checks its options before jax loads.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Completion": "api", "GenerationStats": "api", "generate": "api",
    "HybridCache": "cache", "cache_bytes": "cache", "describe_cache": "cache",
    "SamplingOptions": "sampling",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'qwen35_jax.generation' has no attribute {name!r}")
    return getattr(importlib.import_module(f"qwen35_jax.generation.{_EXPORTS[name]}"), name)
