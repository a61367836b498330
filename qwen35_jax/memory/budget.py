"""Analytic per-device memory of a train step, by component, from the config alone.

What must exist, not what a compiler allocates: element counts times the dtype each buffer has on a
device that computes in bf16 with float32 master weights (XLA:CPU, which widens bf16 matmuls to
float32, allocates more; `docs/parallelism.md` compares both). T = B * S / (F * sp) local tokens.
"""

from __future__ import annotations

from qwen35_jax.config import Qwen35Config

F32, BF16 = 4, 2


def parameter_counts(config: Qwen35Config) -> dict[str, int]:
    """Elements of the embedding, the lm_head (0 when tied) and one decoder layer of each kind."""
    c = config
    d = c.hidden_size
    conv_dim = 2 * c.linear_num_key_heads * c.linear_key_head_dim + c.linear_num_value_heads * c.linear_value_head_dim
    value_dim = c.linear_num_value_heads * c.linear_value_head_dim
    gdn = (d * (conv_dim + value_dim + 2 * c.linear_num_value_heads) + value_dim * d  # projections
           + c.linear_conv_kernel_dim * conv_dim + 2 * c.linear_num_value_heads + c.linear_value_head_dim)
    attn = (d * c.num_attention_heads * c.head_dim * 2 + 2 * d * c.num_key_value_heads * c.head_dim
            + c.num_attention_heads * c.head_dim * d + 2 * c.head_dim)
    norms = 2 * d  # input and post-attention RMSNorm of every layer
    if c.is_moe:
        mlp = (c.num_experts * 3 * d * c.moe_intermediate_size + 3 * d * c.shared_expert_intermediate_size
               + d * c.num_experts + d)
    else:
        mlp = 3 * d * c.intermediate_size
    return {"embedding": c.vocab_size * d, "lm_head": 0 if c.tie_word_embeddings else c.vocab_size * d,
            "final_norm": d, "linear_attention": gdn + mlp + norms, "full_attention": attn + mlp + norms,
            "mlp": mlp, "vision": vision_parameters(c)}


def vision_parameters(config: Qwen35Config) -> int:
    """Elements of the vision tower (0 without one): patch embedding, position table, blocks, merger."""
    v = config.vision
    if v is None:
        return 0
    d, i, merged = v.hidden_size, v.intermediate_size, v.hidden_size * v.merge_unit
    block = 4 * d + (3 * d * d + 3 * d) + (d * d + d) + (d * i + i) + (i * d + d)  # 2 LayerNorms, qkv, proj, MLP
    merger = 2 * d + (merged * merged + merged) + (merged * v.out_hidden_size + v.out_hidden_size)
    return v.patch_dim * d + d + v.num_position_embeddings * d + v.depth * block + merger


def total_parameters(config: Qwen35Config) -> int:
    p = parameter_counts(config)
    return (p["embedding"] + p["lm_head"] + p["final_norm"] + sum(p[kind] for kind in config.layer_types)
            + p["vision"])


def gdn_bytes_per_token(config: Qwen35Config) -> int:
    """One GDN layer's forward activations kept for its backward, per local token (any sp mode:
    all-to-all holds S tokens x H/sp heads, state passing S/sp tokens x H heads: the same bytes)."""
    c = config
    qk = 2 * c.linear_num_key_heads * c.linear_key_head_dim
    v = c.linear_num_value_heads * c.linear_value_head_dim
    hv = c.linear_num_value_heads
    projections = (qk + 2 * v + 2 * hv) * BF16  # q, k, v, z, b, a
    conv_out = (qk + v) * F32  # conv1d + SiLU, then L2-normed q, k, float32
    repeated = 2 * hv * c.linear_key_head_dim * F32  # q, k repeated onto the value heads
    rule = (2 * hv + v) * F32  # g, beta, delta-rule output
    gated = v * BF16
    return projections + conv_out + repeated + rule + gated + c.hidden_size * BF16


def attention_bytes_per_token(config: Qwen35Config) -> int:
    """One attention layer (flash kernel: no scores) kept for its backward, per local token."""
    c = config
    q = c.num_attention_heads * c.head_dim
    kv = 2 * c.num_key_value_heads * c.head_dim
    repeated_kv = 2 * q  # the kernels take kv heads repeated to the query heads
    return (2 * q + kv) * BF16 + (q + kv) * BF16 + repeated_kv * BF16 + 2 * q * BF16 + c.hidden_size * BF16


def step_budget(config: Qwen35Config, seq: int, mesh_shape: tuple[int, int], *, batch: int | None = None,
                tile: int | None = 8192) -> dict[str, int]:
    """Per-device bytes by component for one [batch, seq] train step under `config.remat`."""
    if config.remat == "auto":
        raise ValueError("remat 'auto' is chosen by the trainer at its first step; budget a policy: "
                         "'none', 'mlp' or 'full' (what auto picks from)")
    fsdp, sp = mesh_shape
    n = fsdp * sp
    b = fsdp if batch is None else batch
    t = b * seq // n  # local tokens
    c = config
    d = c.hidden_size
    counts = parameter_counts(c)
    p_total = total_parameters(c)
    period = c.layer_types[: c.block_period]
    block_params = sum(counts[kind] for kind in period)
    head = counts["lm_head"] or counts["embedding"]
    per_layer = max(gdn_bytes_per_token(c) if "linear_attention" in period else 0,
                    attention_bytes_per_token(c) if "full_attention" in period else 0)
    width = c.moe_intermediate_size * c.num_experts_per_tok + c.shared_expert_intermediate_size \
        if c.is_moe else c.intermediate_size
    mlp_tokens = t if tile is None else min(t, tile)
    boundaries = {
        "none": c.num_hidden_layers * (per_layer + 3 * width * BF16),
        "mlp": c.num_hidden_layers * (per_layer + d * BF16),  # the feed-forward's input instead of its insides
        "full": c.num_blocks * d * BF16,
        "dots": c.num_blocks * d * BF16,
        "layer": c.num_hidden_layers * d * BF16,
        "nested": (c.num_blocks + c.block_period) * d * BF16,
        "offload": c.num_blocks * d * BF16,
    }[c.remat]
    recompute_layers = {"none": 0, "mlp": 0, "full": c.block_period, "dots": c.block_period}.get(c.remat, 1)
    mlp_recomputed = {"none": 0, "mlp": 1}.get(c.remat, recompute_layers)  # feed-forwards alive at once
    return {
        "parameters (float32)": F32 * p_total // n,
        "gradients (float32)": F32 * p_total // n,
        "adamw moments (float32)": 2 * F32 * p_total // n,
        "gathered block weights + their gradients": 2 * F32 * block_params,
        "lm_head gathered + its gradient (loss)": 2 * F32 * head,
        "remat boundaries": boundaries * t,
        "layer recompute (mixer)": recompute_layers * per_layer * t * 2,  # activations and cotangents
        "mlp tile": mlp_recomputed * mlp_tokens * 3 * width * BF16 * 2,
        "residual stream + cotangent": 2 * t * d * F32,
    }
