"""Qwen3.5 (dense and MoE) training in JAX."""
