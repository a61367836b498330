"""Causal, document-masked attention: XLA core, Pallas flash kernels (GPU Triton, TPU Mosaic), cuDNN;
and the decode step's attention of one query per row against a key/value cache."""

from .api import IMPLEMENTATIONS, KERNELS, attention_core, resolve_implementation
from .decode import decode_attention

__all__ = ["IMPLEMENTATIONS", "KERNELS", "attention_core", "decode_attention", "resolve_implementation"]
