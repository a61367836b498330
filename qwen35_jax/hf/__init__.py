"""Hugging Face safetensors checkpoints <-> our parameters (name table, checked import, exact export)."""

from qwen35_jax.hf.export import export_hf
from qwen35_jax.hf.load import HFCheckpoint, inspect_hf, load_hf, read_hf_config
from qwen35_jax.hf.names import Layout

__all__ = ["HFCheckpoint", "Layout", "export_hf", "inspect_hf", "load_hf", "read_hf_config"]
