"""HF config.json dict -> `Qwen35Config` keyword arguments (`Qwen35Config.from_hf` reads with it)."""

from __future__ import annotations

from typing import Any, Mapping

from qwen35_jax.config import _TEXT_TYPE, MODEL_TYPES, VISION_TOKEN_IDS, hybrid_layer_types
from qwen35_jax.vision.config import VisionConfig


def parse_hf(raw: Mapping[str, Any]) -> dict[str, Any]:
    """HF config.json dict -> Qwen35Config kwargs; anything we do not implement is a ValueError."""
    model_type = raw.get("model_type")
    if model_type not in MODEL_TYPES:
        raise ValueError(f"unsupported model_type {model_type!r}; expected one of {MODEL_TYPES}")
    text = raw
    tie = raw.get("tie_word_embeddings")
    vision: dict[str, Any] = {}
    if model_type in _TEXT_TYPE:
        text = raw.get("text_config") or {}
        if not isinstance(text, Mapping):
            raise ValueError(f"text_config of a {model_type} config must be a dict")
        # transformers ties a ForConditionalGeneration model by the top-level flag (default false) only
        if raw.get("vision_config") is not None:
            try:
                vision["vision"] = VisionConfig.from_hf(raw["vision_config"])
            except ValueError as e:
                raise ValueError(f"vision_config: {e}") from None
        vision.update({n: raw[n] for n in VISION_TOKEN_IDS if raw.get(n) is not None})
    is_moe = model_type.startswith("qwen3_5_moe")

    def get(key: str, default: Any = None) -> Any:
        return text.get(key, default) if text.get(key) is not None else default

    if get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act {get('hidden_act')!r} is not supported (only silu)")
    if get("attention_bias", False):
        raise ValueError("attention_bias=true is not supported")
    if not get("attn_output_gate", True):
        raise ValueError("attn_output_gate=false is not supported")
    if get("mlp_only_layers", []):
        raise ValueError(f"mlp_only_layers {get('mlp_only_layers')} is not supported (every layer is MoE)")
    if get("decoder_sparse_step", 1) != 1:
        raise ValueError(f"decoder_sparse_step {get('decoder_sparse_step')} is not supported (must be 1)")
    if is_moe and get("norm_topk_prob", True) is False:
        raise ValueError("norm_topk_prob=false is not supported (Qwen3.5 MoE renormalises top-k weights)")

    rope = dict(get("rope_parameters", None) or get("rope_scaling", None) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default":
        raise ValueError(f"rope_type {rope_type!r} is not supported (only default)")
    rope_theta = rope.get("rope_theta", get("rope_theta", 10_000.0))
    partial = rope.get("partial_rotary_factor", get("partial_rotary_factor", 0.25))
    mrope_section = rope.get("mrope_section", [11, 11, 10])  # transformers' default, whatever the rotary dim
    mrope_interleaved = bool(rope.get("mrope_interleaved", True))

    num_layers = int(get("num_hidden_layers", 32 if not is_moe else 40))
    layer_types = get("layer_types", None)
    if layer_types is None:
        layer_types = hybrid_layer_types(num_layers, int(get("full_attention_interval", 4)))

    hidden = int(get("hidden_size", 4096 if not is_moe else 2048))
    heads = int(get("num_attention_heads", 16))
    return dict(
        vocab_size=int(get("vocab_size", 248320)),
        hidden_size=hidden,
        intermediate_size=0 if is_moe else int(get("intermediate_size", 12288)),
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=int(get("num_key_value_heads", 4 if not is_moe else 2)),
        head_dim=int(get("head_dim", 256)),
        rms_norm_eps=float(get("rms_norm_eps", 1e-6)),
        rope_theta=float(rope_theta),
        partial_rotary_factor=float(partial),
        mrope_section=mrope_section,
        mrope_interleaved=mrope_interleaved,
        tie_word_embeddings=bool(tie) if tie is not None else False,
        layer_types=tuple(layer_types),
        linear_conv_kernel_dim=int(get("linear_conv_kernel_dim", 4)),
        linear_key_head_dim=int(get("linear_key_head_dim", 128)),
        linear_value_head_dim=int(get("linear_value_head_dim", 128)),
        linear_num_key_heads=int(get("linear_num_key_heads", 16)),
        linear_num_value_heads=int(get("linear_num_value_heads", 32)),
        num_experts=int(get("num_experts", 256)) if is_moe else 0,
        num_experts_per_tok=int(get("num_experts_per_tok", 8)) if is_moe else 0,
        moe_intermediate_size=int(get("moe_intermediate_size", 512)) if is_moe else 0,
        shared_expert_intermediate_size=int(get("shared_expert_intermediate_size", 512)) if is_moe else 0,
        norm_topk_prob=True if is_moe else False,
        hf_model_type=model_type,
        **vision,
    )
