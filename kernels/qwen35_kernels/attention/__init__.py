"""Causal, document-masked attention: XLA core, Pallas flash kernels (GPU Triton, TPU Mosaic), cuDNN."""

from .api import attention_core
from .pallas import IMPLEMENTATIONS, attention_implementation, resolve_implementation

__all__ = ["IMPLEMENTATIONS", "attention_core", "attention_implementation", "resolve_implementation"]
