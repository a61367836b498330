"""Our checkpoint format: an orbax directory with the parameters and a JSON metadata item.

    CKPT_DIR/params   orbax PyTree item: the parameter pure dict (sharded arrays, restored sharded)
    CKPT_DIR/meta     {"format", "version", "config": Qwen35Config fields,
                       "layout": names.Layout of the HF source or null, "hf_config": its config.json or null}

The layout and the original config.json are what `export_hf` needs to write the checkpoint back in
the form it came in. `load_model` accepts this format or an HF directory.
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from qwen35_jax.config import DTYPES, Qwen35Config
from qwen35_jax.hf.export import staged_dir
from qwen35_jax.hf.load import CONFIG_FILE, abstract_model, default_shardings, load_hf
from qwen35_jax.hf.names import Layout
from qwen35_jax.parallel.processes import is_lead_process, sync_processes
from qwen35_jax.run_layout import CHECKPOINTS_DIR, is_run_dir

FORMAT = "qwen35_jax"
VERSION = 1
HOST_GB_IN_FLIGHT = 1  # orbax copies arrays through host memory; cap what it holds at once (GB)
# Orbax splits the writing of a replicated array among its replicas by slicing each replica's part on
# the device: one compiled slice program per shape and sharding. A ZeRO-3 state's replicated arrays
# are its small vectors (norm weights, biases), so on a CPU or TPU mesh (where orbax does this by
# default) a save compiled dozens of slices for parts of a few kB. Only arrays with at least this many
# bytes per replica part are written that way.
REPLICA_PARALLEL_MIN_BYTES = 16 << 20


def tree_handler(**kwargs: Any) -> ocp.PyTreeCheckpointHandler:
    """Orbax's PyTree handler as our checkpoints use it: uncompressed (compressing random-looking
    weights gains nothing, and the compressor's buffers held a second copy of the model in host
    memory), replica-parallel writes for large replicated arrays only; `kwargs` go to the handler."""
    th = ocp.type_handlers
    registry = th.create_type_handler_registry(
        (int, th.ScalarHandler()), (float, th.ScalarHandler()), (np.number, th.ScalarHandler()),
        (np.ndarray, th.NumpyHandler()), (str, th.StringHandler()),
        (jax.Array, th.ArrayHandler(min_slice_bytes_for_replica_parallel=REPLICA_PARALLEL_MIN_BYTES)))
    return ocp.PyTreeCheckpointHandler(use_compression=False, type_handler_registry=registry, **kwargs)


def _checkpointer(arrays: Any = None) -> ocp.Checkpointer:
    """Orbax holding at most ~HOST_GB_IN_FLIGHT of array shards on the host at once (orbax refuses a
    single shard larger than its cap, so the cap grows to the largest shard of `arrays`); the
    parameters through `tree_handler` (docs/results.md, "Checkpoint import", for the compression)."""
    def shard_bytes(a: Any) -> int:
        sharding = getattr(a, "sharding", None)
        shape = sharding.shard_shape(a.shape) if sharding is not None else a.shape
        return math.prod(shape) * jnp.dtype(a.dtype).itemsize

    largest = max((shard_bytes(a) for a in jax.tree.leaves(arrays)), default=0)
    gb = max(HOST_GB_IN_FLIGHT, math.ceil(largest / 1e9))
    return ocp.Checkpointer(ocp.CompositeCheckpointHandler(
        params=tree_handler(save_concurrent_gb=gb, restore_concurrent_gb=gb),
        meta=ocp.JsonCheckpointHandler()))


def _config_dict(config: Qwen35Config) -> dict[str, Any]:
    d = dataclasses.asdict(config)
    return {k: list(v) if isinstance(v, tuple) else v for k, v in d.items()}


def save_checkpoint(path: str, params: Any, config: Qwen35Config, *, layout: Layout | None = None,
                    hf_config: Mapping[str, Any] | None = None, extra: Mapping[str, Any] | None = None) -> None:
    """Write `params` (a model, an nnx State or a pure dict) with our metadata to the new directory `path`."""
    if isinstance(params, nnx.Module):
        params = nnx.state(params, nnx.Param)
    if isinstance(params, nnx.State):
        params = nnx.to_pure_dict(params)
    meta = {"format": FORMAT, "version": VERSION, "config": _config_dict(config),
            "layout": layout.to_dict() if layout is not None else None,
            "hf_config": dict(hf_config) if hf_config is not None else None, **(extra or {})}
    with staged_dir(path) as tmp:
        target = os.path.join(tmp, "ckpt")  # orbax creates this directory itself
        with _checkpointer(params) as ckptr:
            ckptr.save(target, args=ocp.args.Composite(params=ocp.args.PyTreeSave(params),
                                                       meta=ocp.args.JsonSave(meta)))
        sync_processes("qwen35_checkpoint_saved")
        if is_lead_process():
            for name in os.listdir(target):
                os.rename(os.path.join(target, name), os.path.join(tmp, name))
            os.rmdir(target)


def is_checkpoint(path: str) -> bool:
    return os.path.isdir(os.path.join(path, "meta")) and os.path.isdir(os.path.join(path, "params"))


def latest_run_checkpoint(run_dir: str) -> str | None:
    """The newest complete step directory of a run directory, or None. Orbax renames a step's
    directory to its number only once it is completely written."""
    directory = os.path.join(run_dir, CHECKPOINTS_DIR)
    steps = [int(n) for n in os.listdir(directory) if n.isdigit() and is_checkpoint(os.path.join(directory, n))]
    return os.path.join(directory, str(max(steps))) if steps else None


def resolve_checkpoint(path: str) -> str:
    """`path` itself if it is a checkpoint, the newest checkpoint of a run directory otherwise."""
    if is_run_dir(path) and not is_checkpoint(path):
        latest = latest_run_checkpoint(path)
        if latest is None:
            raise ValueError(f"{path}: run directory without a complete checkpoint yet")
        return latest
    return path


def is_hf_dir(path: str) -> bool:
    return os.path.isfile(os.path.join(path, CONFIG_FILE))


def read_metadata(path: str) -> dict[str, Any]:
    """The metadata item of one of our checkpoints (config, layout, hf_config)."""
    path = os.path.abspath(os.fspath(path))
    if not is_checkpoint(path):
        raise ValueError(f"{path}: not a qwen35_jax checkpoint (no params/ and meta/ inside)")
    with _checkpointer() as ckptr:
        meta = ckptr.restore(path, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))["meta"]
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ValueError(f"{path}: metadata is not of format {FORMAT!r}")
    if meta.get("version") != VERSION:
        raise ValueError(f"{path}: checkpoint version {meta.get('version')} is not supported (expected {VERSION})")
    return meta


def load_checkpoint(path: str, *, dtype: str | None = None, mesh: jax.sharding.Mesh | None = None,
                    shardings: Any = None) -> tuple[nnx.Module, Qwen35Config, dict[str, Any]]:
    """Restore one of our checkpoints (or a run directory's newest) straight into its target
    shardings: (model, config, metadata)."""
    path = resolve_checkpoint(os.path.abspath(os.fspath(path)))
    if dtype is not None and dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    meta = read_metadata(path)
    config = Qwen35Config(**meta["config"])
    graphdef, params, rest = abstract_model(config)
    abstract = nnx.to_pure_dict(params)
    if shardings is None:
        shardings = default_shardings(abstract, mesh)
    target = jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings)
    with _checkpointer(target) as ckptr:
        restore_args = ocp.checkpoint_utils.construct_restore_args(target)
        restored = ckptr.restore(path, args=ocp.args.Composite(
            params=ocp.args.PyTreeRestore(target, restore_args=restore_args)))["params"]
    if dtype is not None and dtype != config.param_dtype:
        restored = jax.tree.map(lambda x: x.astype(dtype), restored)
        config = config.replace(param_dtype=dtype)
        graphdef, params, rest = abstract_model(config)
    nnx.replace_by_pure_dict(params, restored)
    return nnx.merge(graphdef, params, rest), config, meta


def load_model(path: str, *, dtype: str | None = None,
               mesh: jax.sharding.Mesh | None = None) -> tuple[nnx.Module, Qwen35Config]:
    """A `Qwen35ForCausalLM` from an HF checkpoint directory or one of ours; params in `dtype`
    (default: as stored), ZeRO-3 sharded on `mesh` when given, else on the first device."""
    path = resolve_checkpoint(os.fspath(path))
    if is_checkpoint(path):
        model, config, _ = load_checkpoint(path, dtype=dtype, mesh=mesh)
        return model, config
    if is_hf_dir(path) or not os.path.isdir(path):
        model, config, _ = load_hf(path, dtype=dtype, mesh=mesh)
        return model, config
    raise ValueError(f"{path}: neither a Hugging Face checkpoint (config.json), a qwen35_jax checkpoint "
                     "nor a run directory")
