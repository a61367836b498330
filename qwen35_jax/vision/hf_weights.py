"""transformers `Qwen3_5VisionModel` state dict -> `VisionTower` parameters (names without `model.visual.`).

The table (`hf_names`) is what `qwen35_jax/hf/names.py` will fold into the checkpoint loader; the layout
changes are in `to_ours`. See the module docstring of `vision/tower.py` for the mapping in words.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np
from flax import nnx

from qwen35_jax.vision.config import VisionConfig
from qwen35_jax.vision.tower import VisionTower

_LEAF = {"kernel": "weight", "scale": "weight", "embedding": "weight", "bias": "bias"}


def hf_name(path: tuple, block: int | None = None) -> str:
    """Our parameter path (block params without their [depth] axis: pass `block`) -> the HF tensor name."""
    parts = [str(p) for p in path[:-1]]
    if parts[0] == "blocks":
        if block is None:
            raise ValueError(f"{path} is a stacked block parameter: name one block")
        parts.insert(1, str(block))
    return ".".join(parts + [_LEAF[path[-1]]])


def hf_names(config: VisionConfig, path: tuple) -> list[str]:
    """The HF tensors that make our parameter at `path`: one, or one per block in block order."""
    if path[0] == "blocks":
        return [hf_name(path, i) for i in range(config.depth)]
    return [hf_name(path)]


def to_ours(config: VisionConfig, path: tuple, t: np.ndarray) -> np.ndarray:
    """One HF tensor -> our layout of the parameter at `path` (one block's slice for block params)."""
    if path == ("patch_embed", "proj", "kernel"):
        want = (config.hidden_size, config.in_channels, config.temporal_patch_size, config.patch_size,
                config.patch_size)
        if t.shape != want:
            raise ValueError(f"patch_embed.proj.weight has shape {t.shape}, expected {want}")
        return t.reshape(config.hidden_size, config.patch_dim).T  # [D, C, T, p, p] -> [patch_dim, D]
    if path[-1] == "kernel":
        return t.T  # Linear [out, in] -> [in, out]
    return t


def load_hf_state(tower: VisionTower, state: Mapping[str, np.ndarray]) -> None:
    """Copy a transformers vision state dict (`Qwen3_5VisionModel.state_dict()` as NumPy arrays, names without
    the `model.visual.` prefix) into `tower`, cast to each parameter's dtype. Every parameter must be found
    with its shape, and every tensor of `state` used; either failure is a ValueError naming the tensors."""
    cfg = tower.config
    used: set[str] = set()
    flat = nnx.to_flat_state(nnx.state(tower, nnx.Param))
    for path, var in flat:
        names = hf_names(cfg, path)
        missing = [n for n in names if n not in state]
        if missing:
            raise ValueError(f"HF state lacks {missing[:3]}{' ...' if len(missing) > 3 else ''} for {path}")
        arrays = [to_ours(cfg, path, np.asarray(state[n])) for n in names]
        new = np.stack(arrays) if path[0] == "blocks" else arrays[0]
        old = var.get_value()
        if new.shape != old.shape:
            raise ValueError(f"{names[0]}: shape {new.shape} in our layout, parameter {path} has {old.shape}")
        var.set_value(np.asarray(new, dtype=old.dtype))
        used.update(names)
    unused = sorted(set(state) - used)
    if unused:
        raise ValueError(f"HF tensors not copied into the tower: {unused}")
    nnx.update(tower, nnx.from_flat_state(flat))
