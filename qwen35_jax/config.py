"""Qwen3.5 model configuration (the text model, and the vision tower of the VLM types): one frozen dataclass,
HF config.json in and out, named presets."""

from __future__ import annotations

import dataclasses
import json
import operator
import os
from dataclasses import dataclass
from typing import Any, Mapping

from qwen35_kernels.choices import KernelChoices

from qwen35_jax.vision.config import VisionConfig

LAYER_KINDS = ("linear_attention", "full_attention")
DTYPES = ("float32", "bfloat16", "float16")
# The parameter and compute dtypes a run (and scoring, generation, import) takes; float16 only an
# export writes.
RUN_DTYPES = ("float32", "bfloat16")
# Activation checkpointing of the decoder stack (docs/parallelism.md, "Remat policies"):
#   auto    the trainer's default: the first of "none", "mlp", "full" whose compiled step fits the
#           device (train/remat_choice.py); a model used on its own treats it as "full"
#   none    keep every activation of the forward for the backward
#   mlp     as none, but recompute each layer's feed-forward (the MLP with its RMSNorm, or the MoE
#           block) in its backward: no [tokens, intermediate] activations are kept
#   full    recompute each block of `block_period` layers in the backward; keep block inputs only
#   dots    like full, but keep the outputs of the matmuls (recompute only the elementwise work)
#   layer   recompute one layer at a time; keep every layer's input
#   nested  keep block inputs; in a block's backward keep its layers' inputs, recompute one layer at a time
#   offload nested, with the layers' inputs kept in pinned host memory instead of the device's
REMAT_POLICIES = ("auto", "none", "mlp", "full", "dots", "layer", "nested", "offload")
# --scan-layers / config-file text -> Qwen35Config.scan_layers
SCAN_LAYERS_FLAGS: dict[str, bool | str] = {"auto": "auto", "true": True, "false": False}
GDN_SP_MODES = ("all_to_all", "state_passing")
MODEL_TYPES = ("qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")
_TEXT_TYPE = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
VLM_TYPES = ("qwen3_5", "qwen3_5_moe")  # Qwen3_5(Moe)ForConditionalGeneration: may carry a vision tower
# transformers' Qwen3_5Config defaults of the four vision token ids
VISION_TOKEN_IDS = dict(image_token_id=248056, video_token_id=248057, vision_start_token_id=248053,
                        vision_end_token_id=248054)
_ARCHITECTURES = {
    "qwen3_5_text": "Qwen3_5ForCausalLM",
    "qwen3_5": "Qwen3_5ForConditionalGeneration",
    "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM",
    "qwen3_5_moe": "Qwen3_5MoeForConditionalGeneration",
}


def hybrid_layer_types(num_layers: int, full_attention_interval: int = 4) -> tuple[str, ...]:
    """HF's default layout: every `full_attention_interval`-th layer is full attention, the rest GDN."""
    if full_attention_interval < 1:
        raise ValueError(f"full_attention_interval must be >= 1, got {full_attention_interval}")
    return tuple(
        "full_attention" if (i + 1) % full_attention_interval == 0 else "linear_attention"
        for i in range(num_layers)
    )


@dataclass(frozen=True)
class Qwen35Config:
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # dense MLP width; 0 for MoE models (every layer is sparse)
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    partial_rotary_factor: float
    mrope_section: tuple[int, ...] | None  # (t, h, w) rotary pairs; None = plain 1-D rotary
    mrope_interleaved: bool
    tie_word_embeddings: bool
    layer_types: tuple[str, ...]
    linear_conv_kernel_dim: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    num_experts: int  # 0 = dense MLP
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    hf_model_type: str
    # The vision tower of a VLM type (qwen3_5 / qwen3_5_moe); None: the text model only (a text type, or a
    # VLM imported text-only). The token ids are those of the placeholders its features replace.
    vision: VisionConfig | None = None
    image_token_id: int = VISION_TOKEN_IDS["image_token_id"]
    video_token_id: int = VISION_TOKEN_IDS["video_token_id"]
    vision_start_token_id: int = VISION_TOKEN_IDS["vision_start_token_id"]
    vision_end_token_id: int = VISION_TOKEN_IDS["vision_end_token_id"]
    dtype: str = "float32"  # compute dtype
    param_dtype: str = "float32"
    # Tokens per chunk of the chunked delta rule (only float rounding depends on it). "auto": 64, except
    # on CPU when both GDN head dims are at most 64, where 32 is faster (the intra-chunk [L, L] work grows
    # with L and outweighs the state products at small heads; `gdn_chunk` resolves it).
    gdn_chunk_size: int | str = "auto"
    remat: str = "auto"  # one of REMAT_POLICIES; True / False mean "full" / "none"
    # True: one lax.scan over the stacked blocks (one compiled block, however deep the model). False: the
    # blocks one after another in the program, each traced and compiled on its own (compile time grows
    # with depth); the backward then reads every block's saved activations where they are, instead of
    # the scan stacking them into [num_blocks, ...] buffers and slicing them back out (on an H200 the
    # 0.8B step at 8k tokens: 0.283 s scanned, 0.255 s one after another; compile 24 s vs 54 s).
    # "auto": False on GPU when nothing is recomputed (remat "none"), True otherwise (TPU: compile time of
    # deep models; CPU: no measured gain; with recomputation: memory, see `model.scans_layers`).
    scan_layers: bool | str = "auto"
    # How GDN layers run under sequence parallelism: "all_to_all" (Ulysses: seq <-> heads around the
    # mixer) or "state_passing" (each device keeps its shard; per-shard states cross devices).
    gdn_sp_mode: str = "all_to_all"
    # Which kernel runs each op ("auto": the platform's default); the layers pass it to every kernel.
    # Its `platform` names the platform whose program to trace (None: the backend jax runs on).
    kernels: KernelChoices = KernelChoices()

    def __post_init__(self) -> None:
        if isinstance(self.kernels, Mapping):  # as a checkpoint's or config file's JSON holds it
            object.__setattr__(self, "kernels", KernelChoices(**self.kernels))
        if isinstance(self.vision, Mapping):  # as a checkpoint's metadata holds it
            object.__setattr__(self, "vision", VisionConfig(**self.vision))
        if isinstance(self.remat, bool):
            object.__setattr__(self, "remat", "full" if self.remat else "none")
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        if self.mrope_section is not None:
            object.__setattr__(self, "mrope_section", _mrope_section(self.mrope_section))
        self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        def positive(*names: str) -> None:
            for n in names:
                if int(getattr(self, n)) < 1:
                    raise ValueError(f"Qwen35Config.{n} must be >= 1, got {getattr(self, n)}")

        positive("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim")
        if self.gdn_chunk_size != "auto" and (isinstance(self.gdn_chunk_size, (bool, str))
                                               or int(self.gdn_chunk_size) < 1):
            raise ValueError(f"Qwen35Config.gdn_chunk_size must be >= 1 or 'auto', got {self.gdn_chunk_size!r}")
        if self.hf_model_type not in MODEL_TYPES:
            raise ValueError(f"unsupported hf_model_type {self.hf_model_type!r}; expected one of {MODEL_TYPES}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is {self.num_hidden_layers}")
        for kind in self.layer_types:
            if kind not in LAYER_KINDS:
                raise ValueError(f"layer_types entry {kind!r} is not one of {LAYER_KINDS}")
        if "linear_attention" in self.layer_types:
            positive("linear_conv_kernel_dim", "linear_key_head_dim", "linear_value_head_dim",
                     "linear_num_key_heads", "linear_num_value_heads")
            if self.linear_num_value_heads % self.linear_num_key_heads:
                raise ValueError(
                    f"linear_num_value_heads ({self.linear_num_value_heads}) must be divisible by "
                    f"linear_num_key_heads ({self.linear_num_key_heads})")
        if not 0.0 < self.partial_rotary_factor <= 1.0:
            raise ValueError(f"partial_rotary_factor must be in (0, 1], got {self.partial_rotary_factor}")
        if self.rotary_dim % 2:
            raise ValueError(f"rotary dim head_dim*partial_rotary_factor = {self.rotary_dim} must be even")
        if self.mrope_section is not None and not self.mrope_interleaved:
            raise ValueError("mrope_interleaved=False is not implemented (Qwen3.5 uses interleaved mrope)")
        if self.is_moe:
            positive("num_experts_per_tok", "moe_intermediate_size", "shared_expert_intermediate_size")
            if self.num_experts_per_tok > self.num_experts:
                raise ValueError(
                    f"num_experts_per_tok ({self.num_experts_per_tok}) exceeds num_experts ({self.num_experts})")
            if not self.norm_topk_prob:
                raise ValueError("norm_topk_prob=False is not supported (Qwen3.5 MoE renormalises top-k weights)")
            if self.hf_model_type not in ("qwen3_5_moe_text", "qwen3_5_moe"):
                raise ValueError(f"num_experts > 0 needs an MoE model type, got {self.hf_model_type!r}")
        else:
            positive("intermediate_size")
            if self.hf_model_type not in ("qwen3_5_text", "qwen3_5"):
                raise ValueError(f"num_experts == 0 needs a dense model type, got {self.hf_model_type!r}")
        if not isinstance(self.scan_layers, bool) and self.scan_layers != "auto":
            raise ValueError(f"Qwen35Config.scan_layers must be True, False or 'auto', got {self.scan_layers!r}")
        if self.gdn_sp_mode not in GDN_SP_MODES:
            raise ValueError(f"Qwen35Config.gdn_sp_mode must be one of {GDN_SP_MODES}, got {self.gdn_sp_mode!r}")
        if not isinstance(self.kernels, KernelChoices):
            raise ValueError(f"Qwen35Config.kernels must be a KernelChoices, got {type(self.kernels).__name__}")
        if self.remat not in REMAT_POLICIES:
            raise ValueError(f"Qwen35Config.remat must be one of {REMAT_POLICIES} (or a bool), got {self.remat!r}")
        for n in ("dtype", "param_dtype"):
            if getattr(self, n) not in DTYPES:
                raise ValueError(f"Qwen35Config.{n} must be one of {DTYPES}, got {getattr(self, n)!r}")
        for n in VISION_TOKEN_IDS:
            value = getattr(self, n)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"Qwen35Config.{n} must be an int >= 0, got {value!r}")
        if self.image_token_id == self.video_token_id:
            raise ValueError(f"Qwen35Config.image_token_id and video_token_id are both {self.image_token_id}")
        if self.vision is not None:
            if not isinstance(self.vision, VisionConfig):
                raise ValueError(f"Qwen35Config.vision must be a VisionConfig or None, got {type(self.vision).__name__}")
            if self.hf_model_type not in VLM_TYPES:
                raise ValueError(f"a vision tower needs a VLM model type {VLM_TYPES}, got {self.hf_model_type!r}")

    def check_vision_fits(self) -> None:
        """One-line ValueError unless the vision tower's rows are as wide as the text model's hidden size.
        (transformers builds such configs, e.g. `Qwen3_5MoeConfig(text_config=...)` with its default
        3584-wide tower, so reading one is no error; building a model of it is.) Placeholder ids outside
        the vocabulary are allowed, as in transformers: no token can then carry an image."""
        if self.vision is not None and self.vision.out_hidden_size != self.hidden_size:
            raise ValueError(f"vision.out_hidden_size ({self.vision.out_hidden_size}) must equal the text "
                             f"hidden_size ({self.hidden_size})")

    # ------------------------------------------------------------------ derived
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    def gdn_chunk(self, platform: str | None = None) -> int:
        """`gdn_chunk_size` with "auto" resolved for `platform` ("cpu", "gpu", "tpu"; None: that of the
        kernel choices). On CPU heads of at most 64 take chunks of 32, faster there (docs/lab_log.md, 2026-12-05)."""
        if platform is None:
            platform = self.kernels.resolve().platform
        if self.gdn_chunk_size != "auto":
            return int(self.gdn_chunk_size)
        small_heads = max(self.linear_key_head_dim, self.linear_value_head_dim) <= 64
        return 32 if platform == "cpu" and small_heads else 64

    @property
    def block_period(self) -> int:
        """Smallest P dividing num_hidden_layers with layer_types[i] == layer_types[i % P]."""
        n = self.num_hidden_layers
        for p in range(1, n + 1):
            if n % p == 0 and all(self.layer_types[i] == self.layer_types[i % p] for i in range(n)):
                return p
        return n

    @property
    def num_blocks(self) -> int:
        return self.num_hidden_layers // self.block_period

    def replace(self, **changes: Any) -> "Qwen35Config":
        return dataclasses.replace(self, **changes)

    def text_only(self) -> "Qwen35Config":
        """This config without its vision tower (the same HF model type, so export writes the same config.json)."""
        return self.replace(vision=None)

    # ------------------------------------------------------------------ HF in
    @classmethod
    def from_hf(cls, source: Any, **overrides: Any) -> "Qwen35Config":
        """Build from a config.json path (file or directory), a dict, or a transformers config object."""
        if isinstance(source, (str, os.PathLike)):
            path = os.fspath(source)
            if os.path.isdir(path):
                path = os.path.join(path, "config.json")
            try:
                with open(path) as f:
                    raw = json.load(f)
            except FileNotFoundError:
                raise ValueError(f"config file not found: {path}") from None
            except json.JSONDecodeError as e:
                raise ValueError(f"{path} is not valid JSON: {e}") from None
        elif isinstance(source, Mapping):
            raw = dict(source)
        elif hasattr(source, "to_dict"):
            raw = source.to_dict()
        else:
            raise ValueError(f"from_hf expects a path, a dict or a transformers config, got {type(source).__name__}")
        from qwen35_jax.config_hf import parse_hf

        return cls(**{**parse_hf(raw), **overrides})

    # ------------------------------------------------------------------ HF out
    def to_hf_dict(self) -> dict[str, Any]:
        """A config.json dict of `hf_model_type` that transformers' AutoConfig accepts."""
        text_type = _TEXT_TYPE.get(self.hf_model_type, self.hf_model_type)
        rope: dict[str, Any] = {
            "rope_type": "default",
            "rope_theta": self.rope_theta,
            "partial_rotary_factor": self.partial_rotary_factor,
        }
        if self.mrope_section is not None:
            rope["mrope_section"] = list(self.mrope_section)
            rope["mrope_interleaved"] = self.mrope_interleaved
        text: dict[str, Any] = {
            "model_type": text_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "attention_bias": False,
            "rope_parameters": rope,
            "layer_types": list(self.layer_types),
            "linear_conv_kernel_dim": self.linear_conv_kernel_dim,
            "linear_key_head_dim": self.linear_key_head_dim,
            "linear_value_head_dim": self.linear_value_head_dim,
            "linear_num_key_heads": self.linear_num_key_heads,
            "linear_num_value_heads": self.linear_num_value_heads,
            "tie_word_embeddings": self.tie_word_embeddings,
            "dtype": self.param_dtype,
        }
        if self.is_moe:
            text.update(
                num_experts=self.num_experts,
                num_experts_per_tok=self.num_experts_per_tok,
                moe_intermediate_size=self.moe_intermediate_size,
                shared_expert_intermediate_size=self.shared_expert_intermediate_size,
            )
        else:
            text["intermediate_size"] = self.intermediate_size
        if text_type == self.hf_model_type:
            return {"architectures": [_ARCHITECTURES[self.hf_model_type]], **text}
        out: dict[str, Any] = {
            "architectures": [_ARCHITECTURES[self.hf_model_type]],
            "model_type": self.hf_model_type,
            "tie_word_embeddings": self.tie_word_embeddings,
            "text_config": text,
            **{n: getattr(self, n) for n in VISION_TOKEN_IDS},
        }
        if self.vision is not None:
            out["vision_config"] = {**self.vision.to_hf_dict(), "model_type": f"{self.hf_model_type}_vision"}
        return out

    # ------------------------------------------------------------------ presets
    @classmethod
    def preset(cls, name: str, **overrides: Any) -> "Qwen35Config":
        if name not in PRESETS:
            raise ValueError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}")
        return cls(**{**PRESETS[name], **overrides})


def _mrope_section(section: Any) -> tuple[int, int, int]:
    """(t, h, w) as 3 non-negative ints. Any sizes: like transformers, the interleaved layout stops at
    rotary_dim / 2 (see layers/rope.py), so sections wider than the rotary dims are accepted."""
    try:
        ints = tuple(operator.index(s) for s in section)
    except TypeError:
        ints = ()
    if len(ints) != 3 or min(ints) < 0:
        raise ValueError(f"mrope_section must be 3 non-negative integers (t, h, w), got {section!r}")
    return ints


def _published(*, hidden: int, layers: int, heads: int, kv_heads: int, linear_v_heads: int,
               linear_k_heads: int = 16, tied: bool, intermediate: int = 0, experts: int = 0, topk: int = 0,
               moe_intermediate: int = 0, shared_intermediate: int = 0) -> dict[str, Any]:
    """Common Qwen3.5 settings (vocab 248320, head_dim 256, GDN heads of 128, 3 GDN + 1 attention)."""
    return dict(
        vocab_size=248320, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=256, rms_norm_eps=1e-6,
        rope_theta=10_000_000.0, partial_rotary_factor=0.25, mrope_section=(11, 11, 10), mrope_interleaved=True,
        tie_word_embeddings=tied, layer_types=hybrid_layer_types(layers, 4), linear_conv_kernel_dim=4,
        linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=linear_k_heads,
        linear_num_value_heads=linear_v_heads, num_experts=experts, num_experts_per_tok=topk,
        moe_intermediate_size=moe_intermediate, shared_expert_intermediate_size=shared_intermediate,
        norm_topk_prob=experts > 0, hf_model_type="qwen3_5_moe" if experts else "qwen3_5",
    )


def _vlm(name: str, **text: Any) -> dict[str, Any]:
    """A published size: its text model and the vision tower of the same name."""
    return {**_published(**text), "vision": VisionConfig.preset(name)}


_TINY = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10_000_000.0, partial_rotary_factor=0.25,
    mrope_section=(1, 1, 0), mrope_interleaved=True, tie_word_embeddings=True,
    layer_types=hybrid_layer_types(4, 4), linear_conv_kernel_dim=4, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, num_experts=0,
    num_experts_per_tok=0, moe_intermediate_size=0, shared_expert_intermediate_size=0, norm_topk_prob=False,
    hf_model_type="qwen3_5_text",
)

# Published sizes: see docs/model.md for the source of each number.
PRESETS: dict[str, dict[str, Any]] = {
    "tiny": _TINY,
    "tiny-moe": {**_TINY, "intermediate_size": 0, "num_experts": 8, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 32, "shared_expert_intermediate_size": 64, "norm_topk_prob": True,
                 "hf_model_type": "qwen3_5_moe_text"},
    "0.8B": _vlm("0.8B", hidden=1024, layers=24, heads=8, kv_heads=2, linear_v_heads=16, tied=True,
                 intermediate=3584),
    "4B": _vlm("4B", hidden=2560, layers=32, heads=16, kv_heads=4, linear_v_heads=32, tied=True,
               intermediate=9216),
    "9B": _vlm("9B", hidden=4096, layers=32, heads=16, kv_heads=4, linear_v_heads=32, tied=False,
               intermediate=12288),
    "27B": _vlm("27B", hidden=5120, layers=64, heads=24, kv_heads=4, linear_v_heads=48, tied=False,
                intermediate=17408),
    "35B-A3B": _vlm("35B-A3B", hidden=2048, layers=40, heads=16, kv_heads=2, linear_v_heads=32, tied=False,
                    experts=256, topk=8, moe_intermediate=512, shared_intermediate=512),
    "397B-A17B": _vlm("397B-A17B", hidden=4096, layers=60, heads=32, kv_heads=2, linear_v_heads=64, tied=False,
                      experts=512, topk=10, moe_intermediate=1024, shared_intermediate=1024),
}
