"""Causal, document-masked attention: XLA core, Pallas flash kernels (GPU Triton, TPU Mosaic), cuDNN."""

from .api import attention_core
from .pallas import IMPLEMENTATIONS, resolve_implementation

__all__ = ["IMPLEMENTATIONS", "attention_core", "resolve_implementation"]
