"""Tiny random Hugging Face Qwen3.5 checkpoints made by transformers, and helpers to edit them."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import sys
from typing import Any

import numpy as np
from compile_flags import COMPILE_FLAGS
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPTS = os.path.join(REPO, "scripts")

ROPE = dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5, mrope_section=[1, 1, 2],
            mrope_interleaved=True)
TEXT = dict(vocab_size=128, hidden_size=32, intermediate_size=48, num_hidden_layers=8, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=8, linear_value_head_dim=8, linear_conv_kernel_dim=4, rope_parameters=ROPE)
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
              spatial_merge_size=2, temporal_patch_size=2, num_position_embeddings=16)
KINDS = ("dense", "moe_tied", "conditional")


def make_hf(path: str, kind: str, dtype: str = "float32", *, num_layers: int = 8, seed: int = 0) -> str:
    """save_pretrained of a tiny random model; every parameter random so no two tensors coincide."""
    import torch
    import transformers as tf

    torch.manual_seed(seed)
    text = {**TEXT, "num_hidden_layers": num_layers}
    if kind == "dense":
        model = tf.Qwen3_5ForCausalLM(tf.Qwen3_5TextConfig(**text))
    elif kind == "moe_tied":
        model = tf.Qwen3_5MoeForCausalLM(tf.Qwen3_5MoeTextConfig(**text, **MOE, tie_word_embeddings=True))
    elif kind == "conditional":
        model = tf.Qwen3_5ForConditionalGeneration(tf.Qwen3_5Config(text_config=text, vision_config=VISION))
    else:
        raise AssertionError(kind)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.to(getattr(torch, dtype)).save_pretrained(path)
    return path


def edit_tensors(path: str, fn: Any, file: str = "model.safetensors") -> None:
    """Rewrite one safetensors file of `path` with `fn(dict name -> array)` applied (a new dict)."""
    full = os.path.join(path, file)
    tensors = fn(load_file(full))
    save_file(tensors, full, metadata={"format": "pt"})


def to_fused(path: str) -> None:
    """Per-expert MoE tensors -> fused `mlp.experts.gate_up_proj` [E, 2I, D] and `down_proj` [E, D, I]."""
    pat = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")

    def fuse(t: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        out, groups = {}, {}
        for name, arr in t.items():
            m = pat.match(name)
            if m:
                groups.setdefault(m.group(1), {})[(m.group(3), int(m.group(2)))] = arr
            else:
                out[name] = arr
        for prefix, g in groups.items():
            e = 1 + max(i for _, i in g)
            out[f"{prefix}.gate_up_proj"] = np.stack(
                [np.concatenate([g["gate_proj", i], g["up_proj", i]], axis=0) for i in range(e)])
            out[f"{prefix}.down_proj"] = np.stack([g["down_proj", i] for i in range(e)])
        return out

    edit_tensors(path, fuse)


def edit_config(path: str, **changes: Any) -> None:
    full = os.path.join(path, "config.json")
    with open(full) as f:
        raw = json.load(f)
    raw.update(changes)
    with open(full, "w") as f:
        json.dump(raw, f)


def all_tensors(path: str) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> (dtype, shape, raw bytes) over every safetensors file of a checkpoint directory."""
    out = {}
    for fname in sorted(os.listdir(path)):
        if fname.endswith(".safetensors"):
            with safe_open(os.path.join(path, fname), "np") as f:
                for name in f.keys():
                    arr = f.get_tensor(name)
                    out[name] = (f.get_slice(name).get_dtype(), tuple(arr.shape), arr.tobytes())
    return out


def text_tensors(path: str) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    return {k: v for k, v in all_tensors(path).items() if not k.startswith(("mtp.", "model.visual."))}


def load_script(name: str) -> Any:
    """A script under scripts/ as a module, to call its main(argv) in-process."""
    spec = importlib.util.spec_from_file_location(f"_script_{name}", os.path.join(SCRIPTS, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def script_cmd(name: str, *args: str) -> list[str]:
    return [sys.executable, os.path.join(SCRIPTS, f"{name}.py"), *args]


def subprocess_env() -> dict[str, str]:
    env = dict(os.environ)
    env["JAX_PLATFORMS"] = "cpu"
    env["XLA_FLAGS"] = COMPILE_FLAGS
    return env
