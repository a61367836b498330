"""Qwen3.5 vision-tower configuration: one frozen dataclass, an HF `vision_config` dict in and out, presets."""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass
from typing import Any, Mapping

ACTIVATIONS = ("gelu_pytorch_tanh",)  # the blocks' MLP activation (the merger's GELU is always exact erf)
HF_MODEL_TYPE = "qwen3_5_vision"
# The MoE tower is "qwen3_5_moe_vision" (the same modules); older checkpoints write the composite model's type.
_HF_MODEL_TYPES = (HF_MODEL_TYPE, "qwen3_5_moe_vision", "qwen3_5", "qwen3_5_moe")


@dataclass(frozen=True)
class VisionConfig:
    depth: int
    hidden_size: int
    hidden_act: str
    intermediate_size: int
    num_heads: int
    in_channels: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    out_hidden_size: int  # the text model's hidden size: the merger writes one row per merge window
    num_position_embeddings: int  # learned absolute table, a square grid_side x grid_side
    rope_theta: float
    layer_norm_eps: float = 1e-6  # transformers hard-codes 1e-6 in every vision LayerNorm

    def __post_init__(self) -> None:
        for name in ("depth", "hidden_size", "intermediate_size", "num_heads", "in_channels", "patch_size",
                     "spatial_merge_size", "temporal_patch_size", "out_hidden_size", "num_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"VisionConfig.{name} must be an int >= 1, got {value!r}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"VisionConfig.hidden_act must be one of {ACTIVATIONS}, got {self.hidden_act!r}")
        if self.hidden_size % self.num_heads:
            raise ValueError(f"VisionConfig.hidden_size ({self.hidden_size}) must be divisible by "
                             f"num_heads ({self.num_heads})")
        if self.head_dim % 4:
            raise ValueError(f"VisionConfig head_dim ({self.head_dim}) must be a multiple of 4 (2-D axial rotary "
                             f"rotates head_dim/4 frequency pairs per axis)")
        side = math.isqrt(self.num_position_embeddings)
        if side * side != self.num_position_embeddings:
            raise ValueError(f"VisionConfig.num_position_embeddings ({self.num_position_embeddings}) must be a "
                             f"perfect square (the learned position grid is square)")
        if not self.rope_theta > 0:
            raise ValueError(f"VisionConfig.rope_theta must be > 0, got {self.rope_theta!r}")
        if not self.layer_norm_eps > 0:
            raise ValueError(f"VisionConfig.layer_norm_eps must be > 0, got {self.layer_norm_eps!r}")

    # ------------------------------------------------------------------ derived
    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def patch_dim(self) -> int:
        """Values in one flattened patch: in_channels * temporal_patch_size * patch_size**2 (order C, T, p, p)."""
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    @property
    def merge_unit(self) -> int:
        """Patches merged into one output row: spatial_merge_size**2."""
        return self.spatial_merge_size ** 2

    @property
    def grid_side(self) -> int:
        """Side of the square learned position table: sqrt(num_position_embeddings)."""
        return math.isqrt(self.num_position_embeddings)

    def replace(self, **changes: Any) -> "VisionConfig":
        return dataclasses.replace(self, **changes)

    # ------------------------------------------------------------------ HF config
    @classmethod
    def from_hf(cls, raw: Mapping[str, Any], **overrides: Any) -> "VisionConfig":
        """An HF `vision_config` dict (as in a Qwen3.5 config.json) -> VisionConfig; missing keys take
        transformers' `Qwen3_5VisionConfig` defaults; what we do not implement is a ValueError."""
        if not isinstance(raw, Mapping):
            raise ValueError(f"vision_config must be a dict, got {type(raw).__name__}")
        model_type = raw.get("model_type", HF_MODEL_TYPE)
        if model_type not in _HF_MODEL_TYPES:
            raise ValueError(f"unsupported vision_config model_type {model_type!r}; expected {HF_MODEL_TYPE!r}")
        if raw.get("deepstack_visual_indexes"):
            raise ValueError(f"deepstack_visual_indexes {raw['deepstack_visual_indexes']} are not supported "
                             f"(Qwen3.5 has no deepstack)")

        def get(key: str, default: Any) -> Any:
            return raw[key] if raw.get(key) is not None else default

        rope = dict(get("rope_parameters", {}))
        rope_type = rope.get("rope_type", rope.get("type", "axial"))
        if rope_type != "axial":
            raise ValueError(f"vision rope_type {rope_type!r} is not supported (only axial)")
        kwargs = dict(
            depth=_int(get("depth", 27), "depth"),
            hidden_size=_int(get("hidden_size", 1152), "hidden_size"),
            hidden_act=str(get("hidden_act", "gelu_pytorch_tanh")),
            intermediate_size=_int(get("intermediate_size", 4304), "intermediate_size"),
            num_heads=_int(get("num_heads", 16), "num_heads"),
            in_channels=_int(get("in_channels", 3), "in_channels"),
            patch_size=_int(get("patch_size", 16), "patch_size"),
            spatial_merge_size=_int(get("spatial_merge_size", 2), "spatial_merge_size"),
            temporal_patch_size=_int(get("temporal_patch_size", 2), "temporal_patch_size"),
            out_hidden_size=_int(get("out_hidden_size", 3584), "out_hidden_size"),
            num_position_embeddings=_int(get("num_position_embeddings", 2304), "num_position_embeddings"),
            rope_theta=float(rope.get("rope_theta", 10_000.0)),  # transformers' default rope_parameters
        )
        return cls(**{**kwargs, **overrides})

    def to_hf_dict(self) -> dict[str, Any]:
        """The HF `vision_config` dict that `from_hf` reads back to this config (layer_norm_eps is fixed there)."""
        if self.layer_norm_eps != 1e-6:
            raise ValueError(f"layer_norm_eps {self.layer_norm_eps} cannot be written: transformers fixes 1e-6")
        return {
            "model_type": HF_MODEL_TYPE,
            "depth": self.depth,
            "hidden_size": self.hidden_size,
            "hidden_act": self.hidden_act,
            "intermediate_size": self.intermediate_size,
            "num_heads": self.num_heads,
            "in_channels": self.in_channels,
            "patch_size": self.patch_size,
            "spatial_merge_size": self.spatial_merge_size,
            "temporal_patch_size": self.temporal_patch_size,
            "out_hidden_size": self.out_hidden_size,
            "num_position_embeddings": self.num_position_embeddings,
            "rope_parameters": {"rope_type": "axial", "rope_theta": self.rope_theta},
        }

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "VisionConfig":
        if name not in PRESETS:
            raise ValueError(f"unknown vision preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


def _int(value: Any, name: str) -> int:
    """An int-like HF value (patch_size may be written as [p, p] there: only square patches are supported)."""
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ValueError(f"vision_config {name} {list(value)} is not supported (only equal sizes)")
        value = value[0]
    try:
        return operator.index(value)
    except TypeError:
        raise ValueError(f"vision_config {name} must be an int, got {value!r}") from None


def _published(*, depth: int, hidden: int, intermediate: int, heads: int, out: int) -> dict[str, Any]:
    """Settings every Qwen3.5 tower shares: 16x16 patches over 2 frames, 2x2 merge, a 48x48 learned grid."""
    return dict(depth=depth, hidden_size=hidden, hidden_act="gelu_pytorch_tanh", intermediate_size=intermediate,
                num_heads=heads, in_channels=3, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                out_hidden_size=out, num_position_embeddings=2304, rope_theta=10_000.0)


# Published sizes. The Qwen/Qwen3.5-* config.json files themselves were not reachable from here (no network);
# the numbers are those of public code that copies their `vision_config` blocks (parsers, fixtures and
# weight-shape contracts written against the released checkpoints):
#   0.8B: 12 blocks of 768, MLP 3072, 12 heads, out 1024 (several independent copies agree);
#   4B:   24 blocks of 1024, MLP 4096, 16 heads, out 2560 (one copy, a weight-shape contract);
#   9B, 27B, 35B-A3B, 397B-A17B: 27 blocks of 1152, MLP 4304, 16 heads (transformers' defaults), out 4096,
#   5120, 2048, 4096 (one copy of the 9B config, two of the 27B, two of the 35B-A3B; for 397B-A17B only a
#   JAX reimplementation's defaults, paired there with the 60 x 4096 text model).
# out_hidden_size is the text hidden size of qwen35_jax/config.py's preset of the same name (the test holds
# that). Every one: patch 16, temporal 2, merge 2, 2304 positions (48 x 48), gelu_pytorch_tanh, and no
# rope_parameters, so transformers' default rope_theta 10000. A 2B tower (24 x 1024 into 2048 in one copy)
# is left out: its MLP width and heads were in no copy found, and the text presets have no 2B either.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": dict(depth=2, hidden_size=32, hidden_act="gelu_pytorch_tanh", intermediate_size=48, num_heads=4,
                 in_channels=3, patch_size=4, spatial_merge_size=2, temporal_patch_size=2, out_hidden_size=64,
                 num_position_embeddings=36, rope_theta=10_000.0),
    "0.8B": _published(depth=12, hidden=768, intermediate=3072, heads=12, out=1024),
    "4B": _published(depth=24, hidden=1024, intermediate=4096, heads=16, out=2560),
    "9B": _published(depth=27, hidden=1152, intermediate=4304, heads=16, out=4096),
    "27B": _published(depth=27, hidden=1152, intermediate=4304, heads=16, out=5120),
    "35B-A3B": _published(depth=27, hidden=1152, intermediate=4304, heads=16, out=2048),
    "397B-A17B": _published(depth=27, hidden=1152, intermediate=4304, heads=16, out=4096),
}
