"""The Qwen3.5 vision tower: config, host-side patch layout, NNX modules, transformers weight copy."""
