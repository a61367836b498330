"""Sparse MoE: float32 softmax router, top-k, grouped expert matmuls on expert-sorted tokens, gated shared expert."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from qwen35_kernels.logprob_entropy.tiles import half_operand_precision

from qwen35_jax.config import Qwen35Config
from qwen35_jax.layers.linear import Linear
from qwen35_jax.layers.mlp import MLP
from qwen35_jax.layers.tiling import tiled_over_sequence


def route(logits: jax.Array, k: int, normalize: bool) -> tuple[jax.Array, jax.Array]:
    """logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int32); softmax in float32."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    weights, ids = jax.lax.top_k(probs, k)
    if normalize:
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
    return weights, ids.astype(jnp.int32)


def grouped_experts(x: jax.Array, weights: jax.Array, ids: jax.Array, gate_up: jax.Array,
                    down: jax.Array) -> jax.Array:
    """Each token through its k experts, weighted and summed; one ragged matmul per projection.

    x: [T, D], weights/ids: [T, k], gate_up: [E, D, 2I], down: [E, I, D] -> [T, D]
    """
    t, k = ids.shape
    e, _, two_i = gate_up.shape
    flat_ids = ids.reshape(-1)  # [T*k]
    order = jnp.argsort(flat_ids, stable=True)  # token-slots sorted by expert
    group_sizes = jnp.bincount(flat_ids, length=e).astype(jnp.int32)  # [E]
    xs = x[order // k]  # [T*k, D]
    precision = half_operand_precision(x.dtype)  # ragged_dot's TPU kernel is Mosaic
    h = jax.lax.ragged_dot(xs, gate_up.astype(x.dtype), group_sizes, precision=precision)  # [T*k, 2I]
    h = jax.nn.silu(h[:, : two_i // 2]) * h[:, two_i // 2:]
    ys = jax.lax.ragged_dot(h, down.astype(x.dtype), group_sizes, precision=precision)  # [T*k, D]
    # Unsort with a gather (a permutation), not a scatter-add: deterministic on every backend.
    y = ys[jnp.argsort(order)].reshape(t, k, -1)  # [T, k, D]
    return jnp.einsum("tkd,tk->td", y, weights.astype(y.dtype))


class Experts(nnx.Module):
    """Routed experts stacked on a leading [E] axis (HF's fused layout, transposed to [in, out])."""

    def __init__(self, config: Qwen35Config, *, rngs: nnx.Rngs):
        e, d, i = config.num_experts, config.hidden_size, config.moe_intermediate_size
        init = nnx.initializers.normal(0.02)
        pd = jnp.dtype(config.param_dtype)
        self.gate_up_proj = nnx.Param(init(rngs.params(), (e, d, 2 * i), pd))  # [E, D, 2I]: gate then up
        self.down_proj = nnx.Param(init(rngs.params(), (e, i, d), pd))  # [E, I, D]

    def __call__(self, x: jax.Array, weights: jax.Array, ids: jax.Array) -> jax.Array:  # [T, D] -> [T, D]
        return grouped_experts(x, weights, ids, self.gate_up_proj[...], self.down_proj[...])


class SparseMoeBlock(nnx.Module):
    def __init__(self, config: Qwen35Config, *, rngs: nnx.Rngs):
        self.top_k, self.norm_topk_prob = config.num_experts_per_tok, config.norm_topk_prob
        self.recompute = config.remat == "mlp"  # recomputed in the backward even where not tiled
        self.tile = config.kernels.sequence_tile  # tokens per tile of long sequences (None: untiled)
        lin = dict(use_bias=False, dtype=jnp.dtype(config.dtype), param_dtype=jnp.dtype(config.param_dtype),
                   rngs=rngs, kernel_init=nnx.initializers.normal(0.02))
        self.gate = Linear(config.hidden_size, config.num_experts, **lin)  # router
        self.experts = Experts(config, rngs=rngs)
        self.shared_expert = MLP(config, config.shared_expert_intermediate_size, rngs=rngs)
        self.shared_expert_gate = Linear(config.hidden_size, 1, **lin)

    def __call__(self, x: jax.Array) -> jax.Array:
        """x: [B, S, D] -> [B, S, D]; long sequences tile by tile (routing is per token)."""
        return tiled_over_sequence(SparseMoeBlock.route_and_mix, self, x, recompute=self.recompute, tile=self.tile)

    def route_and_mix(self, x: jax.Array) -> jax.Array:  # [B, S, D] -> [B, S, D]
        b, s, d = x.shape
        xt = x.reshape(b * s, d)  # [T, D]
        weights, ids = route(self.gate(xt), self.top_k, self.norm_topk_prob)
        routed = self.experts(xt, weights.astype(x.dtype), ids)
        shared = jax.nn.sigmoid(self.shared_expert_gate(xt)) * self.shared_expert(xt)
        return (routed + shared).reshape(b, s, d)
