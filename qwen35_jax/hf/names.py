"""The name table: Hugging Face tensor names and layouts <-> our parameter paths and layouts.

One row per tensor kind (see docs/architecture.md, "Parameter tree"). Decoder layer N is stored in
the scanned block stack at block `N // P`, position `j = N % P` (P = `config.block_period`), so every
per-layer tensor becomes one slice of a stacked parameter `blocks.layers.{j}.<path>` [nb, ...].

A VLM config (`config.vision` set) adds the vision tower's tensors, `model.visual.*` (names from
`vision/hf_weights.py`): tower block i is slice i of a stacked parameter `visual.blocks.<path>` [depth, ...].
With `config.vision` None those tensors are skipped, as are the MTP head's.

The table is computed from the config alone, so a checkpoint can be checked completely (names,
shapes) before any model or tensor exists; `load.py` then asserts that the table and the model's
parameter tree cover each other exactly.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from qwen35_jax.config import Qwen35Config
from qwen35_jax.hf.safetensors_io import FLOAT_NAMES
from qwen35_jax.vision import hf_weights
from qwen35_jax.vision.config import VisionConfig

CAUSAL_PREFIX = "model."  # Qwen3_5(Moe)ForCausalLM
CONDITIONAL_PREFIX = "model.language_model."  # Qwen3_5(Moe)ForConditionalGeneration
VISUAL_PREFIX = "model.visual."  # the vision tower of a ForConditionalGeneration checkpoint
MTP_PREFIX = "mtp."  # multi-token prediction head (never loaded)
SKIPPED_PREFIXES = (MTP_PREFIX, VISUAL_PREFIX)  # what a text-only model skips
EXPERT_LAYOUTS = ("none", "fused", "per_expert")
_ARCHITECTURES = {
    (False, False): "Qwen3_5ForCausalLM",
    (False, True): "Qwen3_5ForConditionalGeneration",
    (True, False): "Qwen3_5MoeForCausalLM",
    (True, True): "Qwen3_5MoeForConditionalGeneration",
}


class Kind(enum.Enum):
    """How one layer's HF tensor(s) become our per-layer array (shapes without the stack axis)."""

    COPY = "copy"  # same layout: embeddings, norm weights, A_log, dt_bias
    LINEAR = "linear"  # nn.Linear [out, in] -> kernel [in, out]
    CONV = "conv"  # depthwise Conv1d [C, 1, Kc] -> [Kc, C]
    EXPERTS_FUSED = "experts_fused"  # [E, a, b] -> [E, b, a]
    EXPERTS_GATE_UP = "experts_gate_up"  # E x gate [I, D] then E x up [I, D] -> [E, D, 2I]
    EXPERTS_DOWN = "experts_down"  # E x down [D, I] -> [E, I, D]
    PATCH_EMBED = "patch_embed"  # the tower's Conv3d [D, C, T, p, p] -> [C*T*p*p, D] (kernel = stride: a Linear)


def hf_shapes(kind: Kind, ours: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Shapes of the HF tensors that make up one per-layer array of shape `ours`."""
    if kind is Kind.COPY:
        return [ours]
    if kind is Kind.LINEAR:
        return [(ours[1], ours[0])]
    if kind is Kind.CONV:
        return [(ours[1], 1, ours[0])]
    if kind is Kind.EXPERTS_FUSED:
        return [(ours[0], ours[2], ours[1])]
    if kind is Kind.EXPERTS_GATE_UP:
        e, d, i2 = ours
        return [(i2 // 2, d)] * (2 * e)
    if kind is Kind.EXPERTS_DOWN:
        e, i, d = ours
        return [(d, i)] * e
    if kind is Kind.PATCH_EMBED:
        raise ValueError("the patch embedding's HF shape [D, C, T, p, p] needs the vision config (`vision_entries`)")
    raise AssertionError(kind)


def to_ours(kind: Kind, tensors: list[np.ndarray]) -> np.ndarray:
    """HF tensors of one layer -> our per-layer array (a view where possible)."""
    if kind is Kind.COPY:
        return tensors[0]
    if kind is Kind.LINEAR:
        return tensors[0].T
    if kind is Kind.CONV:
        return tensors[0][:, 0, :].T
    if kind is Kind.EXPERTS_FUSED:
        return np.swapaxes(tensors[0], 1, 2)
    if kind is Kind.EXPERTS_GATE_UP:
        e = len(tensors) // 2
        return np.stack([np.concatenate([tensors[k], tensors[e + k]], axis=0).T for k in range(e)])  # [E, D, 2I]
    if kind is Kind.EXPERTS_DOWN:
        return np.stack([t.T for t in tensors])  # [E, I, D]
    if kind is Kind.PATCH_EMBED:
        return tensors[0].reshape(tensors[0].shape[0], -1).T  # [D, C, T, p, p] -> [C*T*p*p, D]
    raise AssertionError(kind)


def read_ours(kind: Kind, names: Sequence[str], read: Callable[[str], np.ndarray], shape: tuple[int, ...],
              dtype: np.dtype) -> np.ndarray:
    """`to_ours` reading the HF tensors one at a time: per-expert tensors go straight into the output,
    so host memory holds the result plus one expert's tensor, not every expert twice."""
    if kind is Kind.EXPERTS_GATE_UP:
        e, _, i2 = shape
        out = np.empty(shape, dtype)  # [E, D, 2I]
        for k in range(e):
            out[k, :, : i2 // 2] = read(names[k]).T
            out[k, :, i2 // 2:] = read(names[e + k]).T
        return out
    if kind is Kind.EXPERTS_DOWN:
        out = np.empty(shape, dtype)  # [E, I, D]
        for k in range(shape[0]):
            out[k] = read(names[k]).T
        return out
    return np.ascontiguousarray(to_ours(kind, [read(n) for n in names]), dtype=dtype)


def to_hf(kind: Kind, ours: np.ndarray) -> list[np.ndarray]:
    """Inverse of `to_ours`: our per-layer array -> the HF tensors (views; the writer copies each)."""
    if kind is Kind.COPY:
        return [ours]
    if kind is Kind.LINEAR:
        return [ours.T]
    if kind is Kind.CONV:
        return [ours.T[:, None, :]]
    if kind is Kind.EXPERTS_FUSED:
        return [np.swapaxes(ours, 1, 2)]
    if kind is Kind.EXPERTS_GATE_UP:
        i = ours.shape[2] // 2
        return [ours[k, :, :i].T for k in range(ours.shape[0])] + [ours[k, :, i:].T for k in range(ours.shape[0])]
    if kind is Kind.EXPERTS_DOWN:
        return [ours[k].T for k in range(ours.shape[0])]
    if kind is Kind.PATCH_EMBED:
        return [ours.T]  # [D, C*T*p*p]: the writer reshapes it to the table's [D, C, T, p, p] (same bytes)
    raise AssertionError(kind)


@dataclass(frozen=True)
class Layout:
    """How the source checkpoint named and stored its text-model tensors; export reproduces it."""

    architecture: str  # e.g. "Qwen3_5ForConditionalGeneration"
    prefix: str  # CAUSAL_PREFIX or CONDITIONAL_PREFIX
    experts: str  # "none" (dense), "fused" or "per_expert"
    tied: bool  # no lm_head.weight; the embedding is the output projection
    dtype: str = "F32"  # safetensors dtype of the text tensors
    dtype_overrides: Mapping[str, str] = field(default_factory=dict)  # HF name -> dtype where it differs

    def __post_init__(self) -> None:
        if self.prefix not in (CAUSAL_PREFIX, CONDITIONAL_PREFIX):
            raise ValueError(f"layout prefix must be {CAUSAL_PREFIX!r} or {CONDITIONAL_PREFIX!r}, got {self.prefix!r}")
        if self.experts not in EXPERT_LAYOUTS:
            raise ValueError(f"layout experts must be one of {EXPERT_LAYOUTS}, got {self.experts!r}")

    def dtype_of(self, hf_name: str) -> str:
        return self.dtype_overrides.get(hf_name, self.dtype)

    def to_dict(self) -> dict[str, Any]:
        return {"architecture": self.architecture, "prefix": self.prefix, "experts": self.experts,
                "tied": self.tied, "dtype": self.dtype, "dtype_overrides": dict(self.dtype_overrides)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Layout":
        return cls(architecture=d["architecture"], prefix=d["prefix"], experts=d["experts"], tied=bool(d["tied"]),
                   dtype=d.get("dtype", "F32"), dtype_overrides=dict(d.get("dtype_overrides", {})))

    @classmethod
    def default(cls, config: Qwen35Config, *, dtype: str | None = None) -> "Layout":
        """The layout transformers writes for `config.hf_model_type` (used for models made from scratch)."""
        conditional = config.hf_model_type in ("qwen3_5", "qwen3_5_moe")
        return cls(architecture=_ARCHITECTURES[(config.is_moe, conditional)],
                   prefix=CONDITIONAL_PREFIX if conditional else CAUSAL_PREFIX,
                   experts="per_expert" if config.is_moe else "none", tied=config.tie_word_embeddings,
                   dtype=dtype or FLOAT_NAMES[config.param_dtype])


@dataclass(frozen=True)
class Entry:
    """One of our parameters and the HF tensors it is made of."""

    path: str  # our parameter path, e.g. "blocks.layers.3.self_attn.q_proj.kernel"
    shape: tuple[int, ...]  # our full shape; [nb, ...] when stacked
    kind: Kind
    stacked: bool
    hf_names: tuple[tuple[str, ...], ...]  # per block (one slot when not stacked): the HF tensors
    hf_shapes: tuple[tuple[int, ...], ...]  # shapes of one slot's HF tensors

    @property
    def layer_shape(self) -> tuple[int, ...]:
        return self.shape[1:] if self.stacked else self.shape


Row = tuple[str, str | list[str], Kind, tuple[int, ...]]  # our suffix, HF suffix(es), kind, our shape


def _layer_rows(config: Qwen35Config, kind: str, experts: str) -> list[Row]:
    """(our suffix, HF suffix or suffixes, kind, our per-layer shape) for one decoder layer."""
    c = config
    d = c.hidden_size
    rows: list[Row] = [
        ("input_layernorm.weight", "input_layernorm.weight", Kind.COPY, (d,)),
        ("post_attention_layernorm.weight", "post_attention_layernorm.weight", Kind.COPY, (d,)),
    ]
    if kind == "linear_attention":
        kd, vd = c.linear_num_key_heads * c.linear_key_head_dim, c.linear_num_value_heads * c.linear_value_head_dim
        conv = 2 * kd + vd
        hv = c.linear_num_value_heads
        rows += [
            ("linear_attn.in_proj_qkv.kernel", "linear_attn.in_proj_qkv.weight", Kind.LINEAR, (d, conv)),
            ("linear_attn.in_proj_z.kernel", "linear_attn.in_proj_z.weight", Kind.LINEAR, (d, vd)),
            ("linear_attn.in_proj_b.kernel", "linear_attn.in_proj_b.weight", Kind.LINEAR, (d, hv)),
            ("linear_attn.in_proj_a.kernel", "linear_attn.in_proj_a.weight", Kind.LINEAR, (d, hv)),
            ("linear_attn.conv1d.kernel", "linear_attn.conv1d.weight", Kind.CONV, (c.linear_conv_kernel_dim, conv)),
            ("linear_attn.A_log", "linear_attn.A_log", Kind.COPY, (hv,)),
            ("linear_attn.dt_bias", "linear_attn.dt_bias", Kind.COPY, (hv,)),
            ("linear_attn.norm.weight", "linear_attn.norm.weight", Kind.COPY, (c.linear_value_head_dim,)),
            ("linear_attn.out_proj.kernel", "linear_attn.out_proj.weight", Kind.LINEAR, (vd, d)),
        ]
    else:
        h, k, dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
        rows += [
            ("self_attn.q_proj.kernel", "self_attn.q_proj.weight", Kind.LINEAR, (d, 2 * h * dh)),  # query + gate
            ("self_attn.k_proj.kernel", "self_attn.k_proj.weight", Kind.LINEAR, (d, k * dh)),
            ("self_attn.v_proj.kernel", "self_attn.v_proj.weight", Kind.LINEAR, (d, k * dh)),
            ("self_attn.o_proj.kernel", "self_attn.o_proj.weight", Kind.LINEAR, (h * dh, d)),
            ("self_attn.q_norm.weight", "self_attn.q_norm.weight", Kind.COPY, (dh,)),
            ("self_attn.k_norm.weight", "self_attn.k_norm.weight", Kind.COPY, (dh,)),
        ]
    if not c.is_moe:
        i = c.intermediate_size
        rows += [(f"mlp.{p}.kernel", f"mlp.{p}.weight", Kind.LINEAR, shape)
                 for p, shape in (("gate_proj", (d, i)), ("up_proj", (d, i)), ("down_proj", (i, d)))]
        return rows
    e, i, s = c.num_experts, c.moe_intermediate_size, c.shared_expert_intermediate_size
    rows.append(("mlp.gate.kernel", "mlp.gate.weight", Kind.LINEAR, (d, e)))
    if experts == "fused":
        rows += [("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj", Kind.EXPERTS_FUSED, (e, d, 2 * i)),
                 ("mlp.experts.down_proj", "mlp.experts.down_proj", Kind.EXPERTS_FUSED, (e, i, d))]
    elif experts == "per_expert":
        per = lambda p: [f"mlp.experts.{x}.{p}.weight" for x in range(e)]  # noqa: E731
        rows += [("mlp.experts.gate_up_proj", per("gate_proj") + per("up_proj"), Kind.EXPERTS_GATE_UP, (e, d, 2 * i)),
                 ("mlp.experts.down_proj", per("down_proj"), Kind.EXPERTS_DOWN, (e, i, d))]
    else:
        raise ValueError(f"an MoE config needs experts layout 'fused' or 'per_expert', got {experts!r}")
    rows += [(f"mlp.shared_expert.{p}.kernel", f"mlp.shared_expert.{p}.weight", Kind.LINEAR, shape)
             for p, shape in (("gate_proj", (d, s)), ("up_proj", (d, s)), ("down_proj", (s, d)))]
    rows.append(("mlp.shared_expert_gate.kernel", "mlp.shared_expert_gate.weight", Kind.LINEAR, (d, 1)))
    return rows


def _vision_rows(vc: VisionConfig) -> list[tuple[tuple[str, ...], Kind, tuple[int, ...]]]:
    """(our path under `visual`, kind, our shape without the [depth] axis) for every tower parameter."""
    d, i, mu_d = vc.hidden_size, vc.intermediate_size, vc.hidden_size * vc.merge_unit
    rows: list[tuple[tuple[str, ...], Kind, tuple[int, ...]]] = [
        (("patch_embed", "proj", "kernel"), Kind.PATCH_EMBED, (vc.patch_dim, d)),
        (("patch_embed", "proj", "bias"), Kind.COPY, (d,)),
        (("pos_embed", "embedding"), Kind.COPY, (vc.num_position_embeddings, d)),
    ]
    norms = [("blocks", "norm1"), ("blocks", "norm2"), ("merger", "norm")]
    linears = [(("blocks", "attn", "qkv"), d, 3 * d), (("blocks", "attn", "proj"), d, d),
               (("blocks", "mlp", "linear_fc1"), d, i), (("blocks", "mlp", "linear_fc2"), i, d),
               (("merger", "linear_fc1"), mu_d, mu_d), (("merger", "linear_fc2"), mu_d, vc.out_hidden_size)]
    for norm in norms:
        rows += [((*norm, "scale"), Kind.COPY, (d,)), ((*norm, "bias"), Kind.COPY, (d,))]
    for path, n_in, n_out in linears:
        rows += [((*path, "kernel"), Kind.LINEAR, (n_in, n_out)), ((*path, "bias"), Kind.COPY, (n_out,))]
    return rows


def vision_entries(vc: VisionConfig) -> list[Entry]:
    """The tower's parameters (`visual.*`) with their `model.visual.*` tensors; blocks stacked over depth."""
    entries = []
    for path, kind, shape in _vision_rows(vc):
        stacked = path[0] == "blocks"
        names = tuple((VISUAL_PREFIX + n,) for n in hf_weights.hf_names(vc, path))
        if kind is Kind.PATCH_EMBED:
            hf_shape = (vc.hidden_size, vc.in_channels, vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        else:
            (hf_shape,) = hf_shapes(kind, shape)
        entries.append(Entry("visual." + ".".join(path), (vc.depth, *shape) if stacked else shape, kind, stacked,
                             names, (hf_shape,)))
    return entries


def build_table(config: Qwen35Config, layout: Layout) -> list[Entry]:
    """Every parameter of the model with the HF tensors it comes from, in a stable order (the vision
    tower's last)."""
    c, pre = config, layout.prefix
    v, d = c.vocab_size, c.hidden_size
    entries = [
        Entry("embed_tokens.embedding", (v, d), Kind.COPY, False, ((f"{pre}embed_tokens.weight",),), ((v, d),)),
        Entry("norm.weight", (d,), Kind.COPY, False, ((f"{pre}norm.weight",),), ((d,),)),
    ]
    if not layout.tied:
        entries.append(Entry("lm_head.kernel", (d, v), Kind.LINEAR, False, (("lm_head.weight",),), ((v, d),)))
    period, nb = c.block_period, c.num_blocks
    for j in range(period):
        for ours, hf, kind, shape in _layer_rows(c, c.layer_types[j], layout.experts):
            suffixes = [hf] if isinstance(hf, str) else hf
            names = tuple(tuple(f"{pre}layers.{b * period + j}.{s}" for s in suffixes) for b in range(nb))
            entries.append(Entry(f"blocks.layers.{j}.{ours}", (nb, *shape), kind, True, names,
                                 tuple(hf_shapes(kind, shape))))
    if c.vision is not None:
        if pre != CONDITIONAL_PREFIX:
            raise ValueError(f"a model with a vision tower is stored as a ForConditionalGeneration checkpoint "
                             f"(prefix {CONDITIONAL_PREFIX!r}), but the layout has prefix {pre!r}")
        entries += vision_entries(c.vision)
    return entries


def is_skipped(name: str, vision: bool = False) -> bool:
    """Tensors of the checkpoint that are not part of the model: the MTP head, and the vision tower unless
    the model has one (`vision`)."""
    return name.startswith(MTP_PREFIX if vision else SKIPPED_PREFIXES)


_FUSED_RE = re.compile(r"\.layers\.\d+\.mlp\.experts\.(gate_up_proj|down_proj)$")


def detect_layout(names: Iterable[str], config: Qwen35Config, raw_config: Mapping[str, Any], *,
                  dtype: str, dtype_overrides: Mapping[str, str] | None = None) -> Layout:
    """The layout of a checkpoint from its tensor names and config.json (missing tensors are found later)."""
    names = [n for n in names if not is_skipped(n)]
    conditional = any(n.startswith(CONDITIONAL_PREFIX) for n in names)
    experts = "none"
    if config.is_moe:
        experts = "fused" if any(_FUSED_RE.search(n) for n in names) else "per_expert"
    archs = raw_config.get("architectures") or []
    arch = archs[0] if archs and isinstance(archs[0], str) else _ARCHITECTURES[(config.is_moe, conditional)]
    return Layout(architecture=arch, prefix=CONDITIONAL_PREFIX if conditional else CAUSAL_PREFIX,
                  experts=experts, tied=hf_tied(raw_config), dtype=dtype, dtype_overrides=dict(dtype_overrides or {}))


def hf_tied(raw_config: Mapping[str, Any]) -> bool:
    """Whether transformers ties lm_head to the embedding for this config.json.

    transformers reads `tie_word_embeddings` of the model's own config, i.e. the top level, also for
    ConditionalGeneration configs whose `text_config` may say otherwise (default False for all four).
    """
    return bool(raw_config.get("tie_word_embeddings", False))
