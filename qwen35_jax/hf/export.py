"""Model parameters -> a Hugging Face checkpoint directory in the source layout.

Names, expert storage (fused or per expert), tying and every tensor's dtype follow the `Layout`
recorded at import, so import then export gives back each text-model tensor bit for bit. Tensors are
produced and written one at a time (one layer's slice of a stacked parameter on the host at most),
into shards of at most `max_shard_bytes` with `model.safetensors.index.json` when there are several.
The directory appears under its final name only when complete. Under jax.distributed every process
runs the export (gathering sharded parameters is collective) and process 0 writes the files.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import jax
import numpy as np
from flax import nnx

from qwen35_jax.config import Qwen35Config
from qwen35_jax.hf import names as N
from qwen35_jax.hf.load import check_coverage, param_paths
from qwen35_jax.hf.safetensors_io import (DTYPE_TO_NP, FLOAT_NAMES, INDEX_FILE, MAX_SHARD_BYTES, SINGLE_FILE,
                                          SafetensorsCheckpoint, TensorToWrite, write_checkpoint)
from qwen35_jax.parallel.processes import is_lead_process, sync_processes



def check_new_output(out_dir: str) -> str:
    """The absolute output path, which must not exist yet and whose parent must exist."""
    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.lexists(out_dir):
        raise ValueError(f"{out_dir}: output path already exists")
    parent = os.path.dirname(out_dir)
    if not os.path.isdir(parent):
        raise ValueError(f"{parent}: parent directory of the output does not exist")
    return out_dir


def _shared_token() -> str:
    token = np.frombuffer(uuid.uuid4().bytes[:4], np.uint32).astype(np.int64)
    if jax.process_count() > 1:  # every process must name the same temporary directory
        from jax.experimental import multihost_utils

        token = multihost_utils.broadcast_one_to_all(token)
    return f"{int(np.asarray(token)[0]):08x}"


@contextlib.contextmanager
def staged_dir(out_dir: str) -> Iterator[str]:
    """A temporary sibling of `out_dir`, renamed to it on success and removed on any failure."""
    out_dir = check_new_output(out_dir)
    parent = os.path.dirname(out_dir)
    tmp = os.path.join(parent, f".{os.path.basename(out_dir)}.partial-{_shared_token()}")
    lead = is_lead_process()
    try:
        if lead:
            os.mkdir(tmp)
        sync_processes("qwen35_staged_dir_created")
        yield tmp
        sync_processes("qwen35_staged_dir_written")
        if lead:
            if os.path.lexists(out_dir):
                raise ValueError(f"{out_dir}: output path appeared while writing")
            os.rename(tmp, out_dir)
        sync_processes("qwen35_staged_dir_renamed")
    finally:
        if lead and os.path.lexists(tmp):
            shutil.rmtree(tmp, ignore_errors=True)


def _param_tensors(params: Mapping[str, Any], config: Qwen35Config, layout: N.Layout) -> list[TensorToWrite]:
    """Every text-model HF tensor, ordered layer by layer, each produced lazily from `params`."""
    flat = param_paths(params)
    table = N.build_table(config, layout)
    check_coverage(table, params)  # every parameter written, each with the shape the table expects
    cache: dict[tuple[str, int], list[np.ndarray]] = {}

    def slot_arrays(entry: N.Entry, b: int) -> list[np.ndarray]:
        key = (entry.path, b)
        if key not in cache:
            cache.clear()  # one layer slice on the host at a time
            x = flat[entry.path]
            x = x[b] if entry.stacked else x
            if isinstance(x, jax.Array) and not x.is_fully_addressable:  # collective: every process
                from jax.experimental import multihost_utils

                x = multihost_utils.process_allgather(x, tiled=True)
            host = np.asarray(jax.device_get(x))
            cache[key] = N.to_hf(entry.kind, host)
        return cache[key]

    ordered: list[tuple[tuple[int, int, int, int, int], TensorToWrite]] = []
    period = config.block_period
    for idx, entry in enumerate(table):
        for b, slot in enumerate(entry.hf_names):
            # embedding first, then layer by layer, then final norm and lm_head, then the vision tower
            if entry.path.startswith("visual."):
                group, layer = 3, b
            elif entry.stacked:
                group, layer = 1, b * period + int(entry.path.split(".")[2])
            else:
                group, layer = (0 if entry.path == "embed_tokens.embedding" else 2), 0
            for k, (name, shape) in enumerate(zip(slot, entry.hf_shapes)):
                dtype = layout.dtype_of(name)

                def produce(entry: N.Entry = entry, b: int = b, k: int = k, dtype: str = dtype,
                            shape: tuple[int, ...] = shape) -> np.ndarray:
                    return np.asarray(slot_arrays(entry, b)[k], dtype=DTYPE_TO_NP[dtype]).reshape(shape)

                ordered.append(((group, layer, idx, b, k), TensorToWrite(name, dtype, shape, produce)))
    ordered.sort(key=lambda t: t[0])
    return [t for _, t in ordered]


def _with_dtype(hf_config: Mapping[str, Any], dtype: str) -> dict[str, Any]:
    """config.json with its dtype fields (top level and text_config) set to `dtype`."""
    out = json.loads(json.dumps(hf_config))
    for d in (out, out.get("text_config")):
        if isinstance(d, dict):
            d["dtype"] = dtype
            d.pop("torch_dtype", None)
    return out


def export_hf(params: Mapping[str, Any], config: Qwen35Config, out_dir: str, *, layout: N.Layout | None = None,
              hf_config: Mapping[str, Any] | None = None, dtype: str | None = None,
              max_shard_bytes: int = MAX_SHARD_BYTES, extra_from: str | None = None,
              progress: bool = False) -> list[str]:
    """Write `params` (a pure dict or nnx State of our parameters) as an HF checkpoint at `out_dir`.

    `layout` defaults to what transformers writes for `config`; `hf_config` (the source config.json)
    defaults to `config.to_hf_dict()`. `dtype` ("float32", "bfloat16", "float16") writes every text
    tensor in that dtype instead of the source's, and says so in config.json.
    `extra_from`: an HF checkpoint whose tensors we do not model (MTP head; the vision tower when the
    model has none) and side files (tokenizer, generation config) are copied over unchanged.
    Returns the file names written.
    """
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    check_new_output(out_dir)
    layout = layout or N.Layout.default(config)
    if dtype is not None:
        if dtype not in FLOAT_NAMES:
            raise ValueError(f"dtype must be one of {sorted(FLOAT_NAMES)}, got {dtype!r}")
        layout = dataclasses.replace(layout, dtype=FLOAT_NAMES[dtype], dtype_overrides={})
        hf_config = _with_dtype(hf_config if hf_config is not None else config.to_hf_dict(), dtype)
    if layout.tied != config.tie_word_embeddings:
        raise ValueError(f"layout says tied={layout.tied} but config.tie_word_embeddings={config.tie_word_embeddings}")
    tensors = _param_tensors(params, config, layout)
    extra_files: list[str] = []
    source = None
    if extra_from is not None:
        source = SafetensorsCheckpoint(extra_from)
        ours = {t.name for t in tensors}  # a model with a vision tower writes its own model.visual.*
        for info in source.tensors.values():
            if N.is_skipped(info.name) and info.name not in ours:
                tensors.append(TensorToWrite(info.name, info.dtype, info.shape,
                                             lambda name=info.name: source.read(name)))
        extra_files = [f for f in sorted(os.listdir(extra_from)) if os.path.isfile(os.path.join(extra_from, f))
                       and not f.endswith(".safetensors") and f not in (INDEX_FILE, "config.json")]
    with staged_dir(out_dir) as tmp, contextlib.ExitStack() as stack:
        bar = None
        if progress:
            from tqdm import tqdm

            bar = stack.enter_context(tqdm(total=len(tensors), desc="writing", unit="tensor"))
        lead = is_lead_process()
        written = write_checkpoint(tmp, tensors, max_shard_bytes=max_shard_bytes, write_files=lead,
                                   on_written=None if bar is None else lambda _: bar.update(1))
        if lead:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(dict(hf_config) if hf_config is not None else config.to_hf_dict(), f, indent=2)
                f.write("\n")
            for fname in extra_files:
                shutil.copy2(os.path.join(extra_from, fname), os.path.join(tmp, fname))
    return written + ["config.json"] + extra_files
