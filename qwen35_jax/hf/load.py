"""Hugging Face checkpoint directory -> model parameters, checked completely before anything is loaded.

`inspect_hf` reads config.json and every safetensors header and checks the whole checkpoint against
the name table (presence, shape and dtype of every tensor, no extra tensors) without reading any
tensor data. `load_hf` then builds the model abstractly (`nnx.eval_shape`), asserts that the table
and the model's parameters cover each other exactly, and loads tensor by tensor: read one HF tensor,
change its layout, cast, `device_put` with its target sharding. Stacked parameters [nb, ...] are
allocated sharded and filled one block slice at a time, so host memory stays near one layer's tensor.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qwen35_jax.config import Qwen35Config
from qwen35_jax.hf import names as N
from qwen35_jax.hf.safetensors_io import FLOAT_NAMES, FLOAT_NAMES_INV, DTYPE_TO_NP, SafetensorsCheckpoint

CONFIG_FILE = "config.json"


@dataclass
class HFCheckpoint:
    """A checked HF checkpoint: config, source layout, name table and open safetensors files."""

    directory: str
    raw_config: dict[str, Any]  # config.json as read
    config: Qwen35Config
    layout: N.Layout
    table: list[N.Entry]
    files: SafetensorsCheckpoint
    skipped: list[str]  # tensors not part of the model: MTP head, and the vision tower of a text-only import

    @property
    def default_param_dtype(self) -> str:
        """The checkpoint's dtype when all text tensors share one; else float32 (exact for all)."""
        return "float32" if self.layout.dtype_overrides else FLOAT_NAMES_INV[self.layout.dtype]


def read_hf_config(directory: str) -> tuple[dict[str, Any], Qwen35Config]:
    """config.json of an HF checkpoint and our config for it; every problem is a one-line ValueError."""
    path = os.path.join(os.fspath(directory), CONFIG_FILE)
    if not os.path.isdir(directory):
        raise ValueError(f"{directory}: not a directory")
    if not os.path.isfile(path):
        raise ValueError(f"{path}: not found (an HF checkpoint directory needs config.json)")
    try:
        with open(path) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object")
    try:
        config = Qwen35Config.from_hf(raw)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
    tied = N.hf_tied(raw)  # transformers' rule, which may differ from text_config's flag
    if config.tie_word_embeddings != tied:
        config = config.replace(tie_word_embeddings=tied)
    return raw, config


def _config_dtype(raw: Mapping[str, Any]) -> str | None:
    for d in (raw, raw.get("text_config") or {}):
        value = d.get("dtype") or d.get("torch_dtype")
        if isinstance(value, str):
            return FLOAT_NAMES.get(value.removeprefix("torch."))
    return None


def inspect_hf(directory: str, *, text_only: bool = True) -> HFCheckpoint:
    """Check an HF checkpoint completely from its headers; raise one ValueError naming the first problem.

    `text_only` (the default): the text model; a VLM's `model.visual.*` tensors are skipped and the
    config has vision None. False: a VLM config (one with a vision_config) also takes the vision tower,
    whose tensors must all be there."""
    directory = os.fspath(directory)
    raw, config = read_hf_config(directory)
    if text_only:
        config = config.text_only()
    files = SafetensorsCheckpoint(directory)
    tensors = files.tensors
    vision = config.vision is not None
    if vision:
        try:
            config.check_vision_fits()
        except ValueError as e:
            raise ValueError(f"{os.path.join(directory, CONFIG_FILE)}: {e}") from None
        if not any(n.startswith(N.VISUAL_PREFIX) for n in tensors):
            raise ValueError(f"{directory}: config.json has a vision_config but the checkpoint has no "
                             f"{N.VISUAL_PREFIX}* tensors; import it with --text-only (text_only=True) for the "
                             f"text model alone")
    text = [n for n in tensors if not N.is_skipped(n, vision)]
    skipped = sorted(n for n in tensors if N.is_skipped(n, vision))

    layout = N.detect_layout(text, config, raw, dtype="F32")
    table = N.build_table(config, layout)
    expected_dtype = _config_dtype(raw)
    if expected_dtype is None:
        emb = tensors.get(table[0].hf_names[0][0])
        expected_dtype = emb.dtype if emb is not None and emb.dtype in FLOAT_NAMES_INV else "F32"

    problems: list[str] = []
    overrides: dict[str, str] = {}
    where = os.path.join(directory, "model.safetensors.index.json" if len(files.files) > 1 else "model.safetensors")
    expected: set[str] = set()
    for entry in table:
        for slot in entry.hf_names:
            for name, shape in zip(slot, entry.hf_shapes):
                expected.add(name)
                info = tensors.get(name)
                if info is None:
                    problems.append(f"{where}: missing tensor {name} (expected shape {list(shape)})")
                    continue
                if info.shape != shape:
                    problems.append(f"{info.file}: tensor {name} has shape {list(info.shape)}, expected {list(shape)}")
                if info.dtype != expected_dtype:
                    # float32 keeps every value of a lower-precision checkpoint (some keep A_log etc. in it)
                    if info.dtype == "F32":
                        overrides[name] = info.dtype
                    else:
                        also = " or F32" if expected_dtype != "F32" else ""
                        problems.append(f"{info.file}: tensor {name} has dtype {info.dtype}, expected "
                                        f"{expected_dtype} (the checkpoint's dtype){also}")
    for name in text:
        if name not in expected:
            problems.append(f"{tensors[name].file}: unexpected tensor {name} (not part of a "
                            f"{layout.architecture} with this config.json)")
    if problems:
        more = f" (and {len(problems) - 1} more problems)" if len(problems) > 1 else ""
        raise ValueError(problems[0] + more)
    layout = N.Layout(layout.architecture, layout.prefix, layout.experts, layout.tied, expected_dtype, overrides)
    return HFCheckpoint(directory, raw, config, layout, table, files, skipped)


# ------------------------------------------------------------------------------------------ model side
def path_str(path: tuple[Any, ...]) -> str:
    """A pytree key path as the table writes it: "blocks.layers.0.mlp.gate_proj.kernel"."""
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


def param_paths(pure: Mapping[str, Any]) -> dict[str, Any]:
    """Flatten a pure-dict param tree into {"a.b.0.kernel": leaf}."""
    flat, _ = jax.tree_util.tree_flatten_with_path(pure)
    return {path_str(path): leaf for path, leaf in flat}


def check_coverage(table: list[N.Entry], abstract: Mapping[str, Any]) -> None:
    """Every model parameter comes from exactly one table entry with the same shape, and vice versa."""
    model = param_paths(abstract)
    ours = {e.path: e for e in table}
    for path, leaf in model.items():
        if path not in ours:
            raise ValueError(f"model parameter {path} {list(leaf.shape)} has no Hugging Face tensor in the name table")
        if tuple(leaf.shape) != ours[path].shape:
            raise ValueError(f"model parameter {path} has shape {list(leaf.shape)} but the name table "
                             f"builds {list(ours[path].shape)} from {ours[path].hf_names[0][0]}")
    for path, e in ours.items():
        if path not in model:
            raise ValueError(f"Hugging Face tensor {e.hf_names[0][0]} maps to {path}, which the model does not have")


def abstract_model(config: Qwen35Config) -> tuple[nnx.GraphDef, nnx.State, Any]:
    """(graphdef, param State of ShapeDtypeStructs, the non-param state, built concretely)."""
    from qwen35_jax.model import Qwen35ForCausalLM

    def factory() -> nnx.Module:
        return Qwen35ForCausalLM(config, rngs=nnx.Rngs(0))

    graphdef, params, rest = nnx.split(nnx.eval_shape(factory), nnx.Param, ...)
    if jax.tree.leaves(rest):  # buffers that are not parameters: computed, never loaded
        rest = jax.jit(lambda: nnx.split(factory(), nnx.Param, ...)[2])()
    return graphdef, params, rest


def default_shardings(abstract: Mapping[str, Any], mesh: jax.sharding.Mesh | None) -> Any:
    """ZeRO-3 shardings on `mesh` (qwen35_jax.parallel.mesh), else everything on the first device."""
    if mesh is not None:
        from qwen35_jax.parallel.mesh import state_shardings

        return state_shardings(abstract, mesh)
    single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda _: single, abstract)


def _slice_sharding(s: jax.sharding.Sharding) -> jax.sharding.Sharding:
    """Sharding of one block slice of a stacked array (the stack axis is never split)."""
    if isinstance(s, jax.sharding.NamedSharding):
        return jax.sharding.NamedSharding(s.mesh, jax.sharding.PartitionSpec(*tuple(s.spec)[1:]))
    return s


@functools.lru_cache(maxsize=None)
def _zeros_fn(shape: tuple[int, ...], dtype: Any, sharding: jax.sharding.Sharding) -> Callable[[], jax.Array]:
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=sharding)


@functools.lru_cache(maxsize=None)
def _update_fn(sharding: jax.sharding.Sharding) -> Callable[..., jax.Array]:
    # [nb, ...] <- [...] at block i, in place (donated)
    return jax.jit(lambda a, x, i: jax.lax.dynamic_update_index_in_dim(a, x, i, 0),
                   donate_argnums=0, out_shardings=sharding)


def _place(host: np.ndarray, sharding: jax.sharding.Sharding) -> jax.Array:
    """Host array -> device array with `sharding`; under jax.distributed every process passes the
    same host value and keeps the shards of its own devices."""
    if sharding.is_fully_addressable:
        return jax.device_put(host, sharding)
    return jax.make_array_from_callback(host.shape, sharding, lambda index: host[index])


def _load_entry(files: SafetensorsCheckpoint, entry: N.Entry, dtype: np.dtype,
                sharding: jax.sharding.Sharding) -> jax.Array:
    def host(slot: tuple[str, ...]) -> np.ndarray:
        return N.read_ours(entry.kind, slot, files.read, entry.layer_shape, dtype)

    if not entry.stacked:
        return _place(host(entry.hf_names[0]), sharding)
    out = _zeros_fn(entry.shape, dtype, sharding)()
    slice_sharding, update = _slice_sharding(sharding), _update_fn(sharding)
    for b, slot in enumerate(entry.hf_names):
        out = update(out, _place(host(slot), slice_sharding), np.int32(b))
    return out


def load_hf(directory: str, *, dtype: str | None = None, mesh: jax.sharding.Mesh | None = None,
            shardings: Any = None, progress: bool = False, text_only: bool = True
            ) -> tuple[nnx.Module, Qwen35Config, HFCheckpoint]:
    """Load an HF checkpoint into a `Qwen35ForCausalLM` (params in `dtype`, default: the checkpoint's).
    `text_only=False` loads a VLM's vision tower too (`inspect_hf`).

    `shardings`: a pure-dict pytree of target shardings matching the model's parameters; default
    ZeRO-3 on `mesh` when given, else the first device.
    """
    ckpt = inspect_hf(directory, text_only=text_only)
    param_dtype = dtype or ckpt.default_param_dtype
    if param_dtype not in FLOAT_NAMES:
        raise ValueError(f"dtype must be one of {sorted(FLOAT_NAMES)}, got {param_dtype!r}")
    config = ckpt.config.replace(param_dtype=param_dtype)
    graphdef, params, rest = abstract_model(config)
    abstract = nnx.to_pure_dict(params)
    check_coverage(ckpt.table, abstract)
    if shardings is None:
        shardings = default_shardings(abstract, mesh)
    target = param_paths(shardings)
    np_dtype = DTYPE_TO_NP[FLOAT_NAMES[param_dtype]]
    entries = ckpt.table
    if progress:
        from tqdm import tqdm

        entries = tqdm(entries, desc="loading", unit="param")
    loaded = {e.path: _load_entry(ckpt.files, e, np_dtype, target[e.path]) for e in entries}
    pure = jax.tree_util.tree_map_with_path(lambda path, _: loaded[path_str(path)], abstract)
    nnx.replace_by_pure_dict(params, pure)
    ckpt.config = config
    return nnx.merge(graphdef, params, rest), config, ckpt
