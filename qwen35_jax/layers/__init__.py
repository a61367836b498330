"""Qwen3.5 building blocks: norms, rotary, attention, Gated DeltaNet, MLP, MoE."""
