"""Tiny random transformers Qwen3.5 models and a local HF -> ours weight copy that follows the
parameter table in docs/architecture.md (the real loader lives in qwen35_jax/hf/)."""

from __future__ import annotations

import numpy as np
import torch
import transformers
from flax import nnx

from float64_reference import float64_copy
from qwen35_jax.config import Qwen35Config
from qwen35_jax.model import Qwen35ForCausalLM


def build_hf(config: Qwen35Config, seed: int = 0):
    """A transformers model of `config` (via to_hf_dict) in float64, every parameter a random float32 value, so
    that our float32 copy holds exactly its numbers."""
    d = config.to_hf_dict()
    d.pop("architectures")
    hf_config = transformers.AutoConfig.for_model(d.pop("model_type"), **d)
    hf_config._attn_implementation = "eager"
    cls = transformers.Qwen3_5MoeForCausalLM if config.is_moe else transformers.Qwen3_5ForCausalLM
    torch.manual_seed(seed)
    model = cls(hf_config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.rand_like(p) * 2 - 1)
            elif name.endswith("norm.weight") and "linear_attn" not in name:
                p.copy_(torch.randn_like(p) * 0.1)
            else:
                p.copy_(torch.randn_like(p) * (0.1 if p.ndim < 2 else 0.05))
    return float64_copy(model), hf_config


def _hf_name(path: tuple, block: int, period: int) -> str:
    """Our param path (without the leading blocks axis) -> HF tensor name."""
    if path[0] == "blocks":
        layer = block * period + int(path[2])
        rest = ".".join(str(p) for p in path[3:-1])
        leaf = path[-1]
        if leaf == "kernel" or leaf == "embedding":
            leaf = "weight"
        return f"model.layers.{layer}.{rest}.{leaf}" if rest else f"model.layers.{layer}.{leaf}"
    if path[0] == "lm_head":
        return "lm_head.weight"
    leaf = "weight" if path[-1] in ("kernel", "embedding") else path[-1]
    return "model." + ".".join(str(p) for p in path[:-1]) + "." + leaf


def to_ours(path: tuple, t: np.ndarray) -> np.ndarray:
    """HF tensor -> our layout for the parameter at `path`."""
    if path[-1] == "kernel" and "conv1d" in path:
        return t[:, 0, :].T  # [C, 1, Kc] -> [Kc, C]
    if path[-1] == "kernel":
        return t.T  # Linear [out, in] -> [in, out]
    if path[-1] in ("gate_up_proj", "down_proj") and "experts" in path:
        return np.swapaxes(t, -1, -2)
    return t


def load_hf_weights(model: Qwen35ForCausalLM, hf_model) -> dict[tuple, str]:
    """Copy every HF tensor into `model`; returns our path -> HF name template (block 0)."""
    cfg = model.config
    sd = {k: v.detach().cpu().numpy() for k, v in hf_model.state_dict().items()}
    used = set()
    flat = nnx.to_flat_state(nnx.state(model, nnx.Param))
    names = {}
    for path, var in flat:
        if path[0] == "blocks":
            arrs = []
            for b in range(cfg.num_blocks):
                name = _hf_name(path, b, cfg.block_period)
                arrs.append(to_ours(path, sd[name]))
                used.add(name)
            new = np.stack(arrs)
        else:
            name = _hf_name(path, 0, cfg.block_period)
            new = to_ours(path, sd[name])
            used.add(name)
        names[path] = _hf_name(path, 0, cfg.block_period)
        old = var.get_value()
        assert new.shape == old.shape, (path, new.shape, old.shape)
        var.set_value(new.astype(old.dtype))
    nnx.update(model, nnx.from_flat_state(flat))
    missing = set(sd) - used - ({"lm_head.weight"} if cfg.tie_word_embeddings else set())
    assert not missing, f"HF tensors not copied: {sorted(missing)}"
    return names
