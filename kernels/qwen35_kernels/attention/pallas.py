"""TEMPORARY (issue 43): the names this module had, until `qwen35_jax/kernel_choices.py` imports them
from `qwen35_kernels.attention` (`pallas_gpu.py`, `pallas_tpu.py`, `checks.py`, `api.py`)."""

from qwen35_kernels.attention.api import resolve_implementation
from qwen35_kernels.attention.checks import IMPLEMENTATIONS, check_attention_inputs, check_implementation
from qwen35_kernels.attention.pallas_gpu import gpu_flash_attention
from qwen35_kernels.attention.pallas_tpu import tpu_flash_attention

__all__ = ["IMPLEMENTATIONS", "check_attention_inputs", "check_implementation", "gpu_flash_attention",
           "resolve_implementation", "tpu_flash_attention"]
