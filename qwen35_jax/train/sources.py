"""Where a run's batches come from: --synthetic rows, a .npy directory, or the data pipeline
(prepared datasets and JSONL, `qwen35_jax.data`), each as a `BatchStream`."""

from __future__ import annotations

import math
import os
from typing import Any

import jax
import numpy as np
from flax import nnx

from qwen35_jax.config import Qwen35Config
from qwen35_jax.files import staged_directory
from qwen35_jax.parallel.processes import is_lead_process, sync_processes
from qwen35_jax.run_layout import SYNTHETIC_DIR
from qwen35_jax.scoring import ScoreOptions, score_batches
from qwen35_jax.train.data import ArrayBatches, BatchStream, load_npy_dir, synthetic_data
from qwen35_jax.train.options import TrainOptions



def is_npy_dir(path: str) -> bool:
    """A directory of training arrays (tokens.npy, ...) that is not a prepared dataset (manifest.json)."""
    return (os.path.isdir(path) and os.path.isfile(os.path.join(path, "tokens.npy"))
            and not os.path.isfile(os.path.join(path, "manifest.json")))


def _synthetic(options: TrainOptions, config: Qwen35Config, batch_size: int, mesh: jax.sharding.Mesh,
               graphdef: nnx.GraphDef, params: Any, scoring: ScoreOptions) -> dict[str, np.ndarray]:
    """The run's random rows, made once and kept in RUN/synthetic/ (PPO's old log-probs come from the
    starting model, which a resumed run no longer has)."""
    directory = os.path.join(options.out, SYNTHETIC_DIR)
    written = os.path.isfile(os.path.join(directory, "tokens.npy"))
    # Every process looks before the lead writes: one that looked after would skip the sync below.
    sync_processes("qwen35_synthetic_checked")
    if written:
        return {k: np.asarray(v) for k, v in load_npy_dir(directory).items()}
    data = synthetic_data(batch_size, options.seq_len, config.vocab_size, objective=options.objective,
                          seed=options.seed)
    if options.objective == "ppo":  # on-policy: the behaviour policy is the starting model
        data["old_log_probs"], _ = score_batches(  # the graph's config carries the run's kernel choices
            nnx.merge(graphdef, params), data["tokens"], None, mesh=mesh, scoring=scoring)
        data["ref_log_probs"] = data["old_log_probs"]
    if is_lead_process():
        with staged_directory(directory) as stage:
            for name, x in data.items():
                np.save(os.path.join(stage, f"{name}.npy"), x)
    sync_processes("qwen35_synthetic_written")
    return data


def _open(paths: list[str], options: TrainOptions, *, config: Qwen35Config, batch_size: int, shard_index: int,
          shard_count: int, fields: tuple[str, ...], shuffle: bool) -> BatchStream:
    if len(paths) == 1 and is_npy_dir(paths[0]):
        return ArrayBatches(load_npy_dir(paths[0]), batch_size, vocab_size=config.vocab_size, fields=fields,
                            shard_index=shard_index, shard_count=shard_count, source=paths[0])
    if any(is_npy_dir(p) for p in paths):
        raise ValueError(f"a .npy data directory must be the only --data/--eval-data path, got {paths}")
    if fields:
        raise ValueError(f"--objective {options.objective} needs {', '.join(fields)} per token: give a .npy "
                         "directory (docs/training.md), not text or a prepared dataset")
    from qwen35_jax.data import open_batches
    from qwen35_jax.data.prepared import is_prepared
    if jax.process_count() > 1 and not all(is_prepared(p) for p in paths):
        raise ValueError("JSONL data is read on the fly by one process only; for a multi-process run, "
                         "pack it once with scripts/prepare_data.py and pass that directory")
    return open_batches(paths, seq_len=options.seq_len, batch_size=batch_size, vocab_size=config.vocab_size,
                        tokenizer=options.tokenizer or options.model, seed=options.seed, shuffle=shuffle,
                        shard_index=shard_index, shard_count=shard_count, long_rows=options.long_rows,
                        bad_rows=options.bad_rows, worker_count=options.data_workers,
                        image_processor=run_image_processor(options, config))


def run_image_processor(options: TrainOptions, config: Qwen35Config) -> Any:
    """The run's `ImageProcessor` (None for a model without a vision tower): --model's
    preprocessor_config.json when it has one, else Qwen3.5's settings for the tower; --min-pixels and
    --max-pixels override both."""
    from qwen35_jax.data.batches import image_processor_for

    model_dir = options.model if options.model is not None and os.path.isdir(options.model) else None
    return image_processor_for(config.vision, model_dir, min_pixels=options.min_pixels,
                               max_pixels=options.max_pixels)


def _pipeline_paths(options: TrainOptions) -> list[str]:
    """The --data and --eval-data paths the data pipeline reads (not .npy directories)."""
    return [p for p in options.data + options.eval_data if not is_npy_dir(p)]


def data_has_images(options: TrainOptions) -> bool:
    """Whether the run's data holds images (then an HF VLM checkpoint is loaded with its vision tower)."""
    from qwen35_jax.data.batches import data_has_images as has_images

    return has_images(_pipeline_paths(options))


def check_model_inputs(options: TrainOptions, config: Qwen35Config) -> None:
    """The checks between the model and the data that need no devices, run before the run directory is
    written; one-line ValueErrors: --freeze-vision / --max-patches / pixels without a tower, and images
    (a JSONL row, a prepared dataset) for a model without one."""
    from qwen35_jax.data.batches import check_image_inputs
    from qwen35_jax.train.vision import check_max_patches

    if options.freeze_vision and config.vision is None:
        raise ValueError("--freeze-vision freezes the vision tower, but the model has none")
    check_max_patches(options.max_patches, config)
    run_image_processor(options, config)  # its settings are checked against the tower
    check_image_inputs(_pipeline_paths(options), vision=config.vision is not None)


def open_train_stream(options: TrainOptions, *, config: Qwen35Config, mesh: jax.sharding.Mesh, batch_size: int,
                      shard_index: int, shard_count: int, fields: tuple[str, ...], graphdef: nnx.GraphDef,
                      params: Any, scoring: ScoreOptions) -> BatchStream:
    """This process's stream of training batches (`scoring`: the run's `StepOptions.scoring`, with which
    a --synthetic PPO run scores its old log-probs)."""
    if options.synthetic:
        data = _synthetic(options, config, batch_size, mesh, graphdef, params, scoring)
        return ArrayBatches(data, batch_size, vocab_size=config.vocab_size, fields=fields, shard_index=shard_index,
                            shard_count=shard_count, source="synthetic data")
    return _open(options.data, options, config=config, batch_size=batch_size, shard_index=shard_index,
                 shard_count=shard_count, fields=fields, shuffle=True)


def open_eval_stream(options: TrainOptions, *, config: Qwen35Config, batch_size: int, shard_index: int,
                     shard_count: int, fields: tuple[str, ...]) -> tuple[BatchStream | None, int]:
    """(the held-out stream or None, batches per evaluation: --eval-batches, at most one pass over
    a .npy directory)."""
    if not options.eval_data:
        return None, 0
    stream = _open(options.eval_data, options, config=config, batch_size=batch_size, shard_index=shard_index,
                   shard_count=shard_count, fields=fields, shuffle=False)
    batches = options.eval_batches
    if isinstance(stream, ArrayBatches):
        batches = min(batches, math.ceil(stream.rows / batch_size))
    return stream, batches
