"""SwiGLU feed-forward: down(silu(gate(x)) * up(x))."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from qwen35_jax.config import Qwen35Config
from qwen35_jax.layers.linear import Linear


class MLP(nnx.Module):
    def __init__(self, config: Qwen35Config, intermediate_size: int | None = None, *, rngs: nnx.Rngs):
        i = config.intermediate_size if intermediate_size is None else intermediate_size
        lin = dict(use_bias=False, dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype),
                   rngs=rngs, kernel_init=nnx.initializers.normal(0.02))
        self.gate_proj = Linear(config.hidden_size, i, **lin)
        self.up_proj = Linear(config.hidden_size, i, **lin)
        self.down_proj = Linear(i, config.hidden_size, **lin)

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., D] -> [..., D]
        return self.down_proj(jax.nn.silu(self.gate_proj(x)) * self.up_proj(x))
