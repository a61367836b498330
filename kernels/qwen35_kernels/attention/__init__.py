"""Causal, document-masked attention: XLA core, Pallas flash kernels (GPU Triton, TPU Mosaic), cuDNN;
and the decode step's attention of one query per row against a key/value cache."""

from .api import attention_core
from .decode import decode_attention
from .pallas import IMPLEMENTATIONS, resolve_implementation

__all__ = ["IMPLEMENTATIONS", "attention_core", "decode_attention", "resolve_implementation"]
