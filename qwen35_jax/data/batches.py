"""`open_batches`: this process's slice of every global training batch, from a prepared dataset or JSONL.

Both kinds of stream are endless (epochs repeat, reshuffled by seed) and resumable: `get_state()` is a
JSON-serialisable position and `set_state()` continues exactly where that stream was.

- A prepared dataset is random access: global batch b holds rows b*B ... (b+1)*B - 1 of the shuffled,
  repeated row order and process i reads its B/n of them, so the state is the number of rows consumed,
  the same on every process and for any process count.
- JSONL is tokenised and packed on the fly: each process reads only every n-th row of the shuffled
  order and packs its own rows, so the state is the process's grain iterator state, valid for the same
  process index and count only.

Images. Given an `ImageProcessor` (the model has a vision tower), every batch also carries its rows'
images (`IMAGE_BATCH_FIELDS`), the rows' images concatenated in row order, which is the order of their
placeholders in the batch taken row-major: "patches" float32 [P, patch_dim], "grids_thw" int64 [N, 3] and
"image_counts" int64 [B/n] (images of each row). A batch without images has P = N = 0. A prepared
dataset's images come from its image arrays; without a processor, a prepared dataset with images is
refused and a JSONL row with images is an error (`sources.find_image_row`).
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import grain
import numpy as np

from qwen35_jax.data.pipeline import RowCounts, packed_rows, stack_rows
from qwen35_jax.data.prepared import FIELDS, is_prepared, open_prepared, prepared_row_images, read_manifest
from qwen35_jax.data.rows import RowEncoder, check_tokenizer, load_tokenizer
from qwen35_jax.data.sources import JsonlLines, find_image_row, find_jsonl_files

if TYPE_CHECKING:
    from qwen35_jax.data.images import ImageProcessor
    from qwen35_jax.vision.config import VisionConfig

IMAGE_BATCH_FIELDS = ("patches", "grids_thw", "image_counts")


def batch_images(images: Sequence[tuple[np.ndarray, np.ndarray] | None], patch_dim: int) -> dict[str, np.ndarray]:
    """Each row's (patches [P_i, patch_dim], grids_thw [N_i, 3]) or None -> the `IMAGE_BATCH_FIELDS`."""
    rows = [(np.zeros((0, patch_dim), np.float32), np.zeros((0, 3), np.int64)) if r is None else r for r in images]
    return {"patches": np.concatenate([np.asarray(p, np.float32).reshape(-1, patch_dim) for p, _ in rows]),
            "grids_thw": np.concatenate([np.asarray(g, np.int64).reshape(-1, 3) for _, g in rows]),
            "image_counts": np.asarray([len(g) for _, g in rows], np.int64)}


def _check_processor_fits(info: dict[str, Any], processor: ImageProcessor, directory: str) -> None:
    """One-line ValueError unless a prepared dataset's images were cut as `processor` cuts them."""
    if info["patch_dim"] != processor.patch_dim or info["merge_size"] != processor.merge_size:
        raise ValueError(f"{directory}: its images have patch_dim {info['patch_dim']} and merge_size "
                         f"{info['merge_size']}, the model's vision tower takes {processor.patch_dim} and "
                         f"{processor.merge_size}: prepare the data with the model's checkpoint")


def image_processor_for(vision: VisionConfig | None, *model_dirs: str | None, min_pixels: int | None = None,
                        max_pixels: int | None = None) -> ImageProcessor | None:
    """The image processor of a model with the vision tower `vision` (None without one): the
    preprocessor_config.json of the first of `model_dirs` holding one (`preprocessor_dir`), else Qwen3.5's
    settings for the tower (a preset or random model, or one of our checkpoints); min/max pixels
    overridden when given."""
    from qwen35_jax.data.images import ImageProcessor, preprocessor_dir

    if vision is None:
        if min_pixels is not None or max_pixels is not None:
            raise ValueError("--min-pixels/--max-pixels size images, but the model has no vision tower")
        return None
    directory = preprocessor_dir(model_dirs)
    if directory is not None:
        return ImageProcessor.from_pretrained(directory, min_pixels=min_pixels, max_pixels=max_pixels, vision=vision)
    return ImageProcessor.from_vision_config(vision, min_pixels=min_pixels, max_pixels=max_pixels)


def check_no_image_rows(lines: JsonlLines) -> None:
    """One-line ValueError naming the first row (file:line) with an image and its path: a model without
    a vision tower cannot use it, and that is a wrong model or wrong data, not one bad row to skip."""
    found = find_image_row(lines)
    if found is not None:
        where, path = found
        raise ValueError(f"{where}: the row has an image ({path}) but the model has no vision tower: "
                         f"train a vision-language checkpoint, or leave the image rows out")


def data_has_images(sources: Sequence[str]) -> bool:
    """Whether any of `sources` (prepared datasets, JSONL files or directories; other paths are
    ignored) holds an image: a prepared dataset's manifest, or a JSONL chat row with an image part."""
    import os

    names = [n for n in sources if is_prepared(n) or os.path.isdir(n) or n.endswith((".jsonl", ".jsonl.gz"))]
    for name in names:
        if is_prepared(name):
            info = read_manifest(name).get("images")
            if info and info["count"]:
                return True
    jsonl = [n for n in names if not is_prepared(n) and not os.path.isfile(os.path.join(n, "tokens.npy"))]
    return bool(jsonl) and find_image_row(JsonlLines(find_jsonl_files(jsonl))) is not None


def check_image_inputs(sources: str | Sequence[str], *, vision: bool) -> None:
    """Before anything is written: without a vision tower (`vision` False), a one-line ValueError for
    a prepared dataset holding images or a JSONL row with an image. Reads manifests and scans the JSONL
    bytes for image parts, tokenising nothing."""
    if vision:
        return
    names = [sources] if isinstance(sources, str) else list(sources)
    for name in names:
        if is_prepared(name):
            info = read_manifest(name).get("images")
            if info and info["count"]:
                raise ValueError(f"{name}: the prepared dataset holds {info['count']} images but the model has no "
                                 f"vision tower")
    jsonl = [n for n in names if not is_prepared(n)]
    if jsonl:
        check_no_image_rows(JsonlLines(find_jsonl_files(jsonl)))


class BatchStream(abc.ABC):
    """This process's rows of each global batch: {"tokens", "segment_ids", "loss_mask"} int32 [B/n, S]
    (and the `IMAGE_BATCH_FIELDS` when `images` is True)."""

    images: bool = False  # whether batches carry their rows' images

    seq_len: int

    @abc.abstractmethod
    def next_batch(self) -> dict[str, np.ndarray]:
        """The next batch; loss_mask[t] trains the prediction of tokens[t + 1]."""

    @property
    @abc.abstractmethod
    def epoch(self) -> float:
        """Epochs read so far."""

    @abc.abstractmethod
    def summary(self) -> dict[str, Any]:
        """Counts of rows, tokens, loss tokens, truncated / split / dropped and bad rows."""

    @abc.abstractmethod
    def get_state(self) -> dict[str, Any]:
        """The position in the stream, JSON-serialisable."""

    @abc.abstractmethod
    def set_state(self, state: dict[str, Any]) -> None:
        """Continue from a `get_state()` position."""

    def close(self) -> None:
        pass

    def __enter__(self) -> BatchStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _check_kind(state: dict[str, Any], kind: str) -> None:
    if not isinstance(state, dict) or state.get("kind") != kind:
        found = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise ValueError(f"data state is for a {found!r} source, this run reads a {kind!r} one")


class PreparedBatches(BatchStream):
    """Batches from a prepare_data.py directory, read memory-mapped."""

    def __init__(self, directory: str, *, batch_size: int, vocab_size: int, seed: int, shuffle: bool,
                 shard_index: int, shard_count: int, image_processor: ImageProcessor | None = None):
        self.directory = directory
        self.images = image_processor is not None
        self.arrays, self.manifest = open_prepared(directory, vocab_size, images=self.images)
        info = self.manifest.get("images")
        self.has_images = bool(self.images and info)
        if self.has_images:
            _check_processor_fits(info, image_processor, directory)
        self.patch_dim = image_processor.patch_dim if self.images else 0
        self.seq_len = int(self.manifest["seq_len"])
        self.n_rows = int(self.manifest["rows"])
        order = grain.MapDataset.range(self.n_rows)
        if shuffle:
            order = order.shuffle(seed=seed)
        self.order = order.repeat()
        self.batch_size, self.local_rows = batch_size, batch_size // shard_count
        self.first = shard_index * self.local_rows  # this process's offset within a global batch
        self.next_row = 0  # rows of the global order consumed, all processes together

    def next_batch(self) -> dict[str, np.ndarray]:
        start = self.next_row + self.first
        rows = np.asarray([self.order[k] for k in range(start, start + self.local_rows)])
        self.next_row += self.batch_size
        batch = {name: np.asarray(self.arrays[name][rows]) for name in FIELDS}  # each [B/n, S]
        if self.images:
            images = [prepared_row_images(self.arrays, int(r)) if self.has_images else None for r in rows]
            batch.update(batch_images(images, self.patch_dim))
        return batch

    @property
    def epoch(self) -> float:
        return self.next_row / self.n_rows

    def summary(self) -> dict[str, Any]:
        return {"source": self.directory, "packed_rows": self.n_rows, "seq_len": self.seq_len,
                **self.manifest["counts"], "epoch": self.epoch}

    def get_state(self) -> dict[str, Any]:
        return {"kind": "prepared", "next_row": self.next_row}

    def set_state(self, state: dict[str, Any]) -> None:
        _check_kind(state, "prepared")
        self.next_row = int(state["next_row"])


class JsonlBatches(BatchStream):
    """Batches tokenised and packed on the fly from JSONL files."""

    def __init__(self, files: list[str], *, seq_len: int, batch_size: int, vocab_size: int,
                 tokenizer: str | None, seed: int, shuffle: bool, shard_index: int, shard_count: int,
                 long_rows: str, bad_rows: str, worker_count: int, image_processor: ImageProcessor | None = None):
        loaded = None if tokenizer is None else load_tokenizer(tokenizer)
        if loaded is not None:
            check_tokenizer(loaded, vocab_size, source=tokenizer)
        self.files, self.seq_len, self.worker_count = files, seq_len, worker_count
        self.shard_index, self.shard_count = shard_index, shard_count
        self.local_rows = batch_size // shard_count
        self.lines = JsonlLines(files)
        self.images = image_processor is not None
        self.patch_dim = image_processor.patch_dim if self.images else 0
        if not self.images:
            check_no_image_rows(self.lines)
        encoder = RowEncoder(tokenizer, vocab_size, loaded=loaded, image_processor=image_processor)
        rows, self.fit = packed_rows(
            self.lines, encoder, seq_len=seq_len, seed=seed, shuffle=shuffle, epochs=None,
            shard_index=shard_index, shard_count=shard_count, long_rows=long_rows, bad_rows=bad_rows,
            worker_count=worker_count)
        self.iterator = iter(rows)
        self.last_position = -1

    def next_batch(self) -> dict[str, np.ndarray]:
        rows = [next(self.iterator) for _ in range(self.local_rows)]
        self.last_position = max(self.last_position, *(max(r["position"]) for r in rows))
        batch = stack_rows(rows)
        if self.images:
            batch.update(batch_images([(r["patches"], r["grids_thw"]) if "patches" in r else None for r in rows],
                                      self.patch_dim))
        return batch

    @property
    def epoch(self) -> float:
        return (self.last_position + 1) / len(self.lines)

    def summary(self) -> dict[str, Any]:
        return {"source": ", ".join(self.files), "input_rows": len(self.lines), "seq_len": self.seq_len,
                **self.fit.counts.to_dict(), "epoch": self.epoch}

    def get_state(self) -> dict[str, Any]:
        return {"kind": "jsonl", "shard_index": self.shard_index, "shard_count": self.shard_count,
                "worker_count": self.worker_count, "input_rows": len(self.lines),
                "grain": self.iterator.get_state(), "counts": self.fit.counts.to_dict(),
                "unusable_in_a_row": self.fit.unusable_in_a_row, "last_position": self.last_position}

    def set_state(self, state: dict[str, Any]) -> None:
        _check_kind(state, "jsonl")
        saved = (state["shard_index"], state["shard_count"])
        if saved != (self.shard_index, self.shard_count):
            raise ValueError(f"data state is for process {saved[0]} of {saved[1]}, this is process "
                             f"{self.shard_index} of {self.shard_count}: a JSONL stream resumes only with "
                             "the same process count (prepare the data with prepare_data.py to change it)")
        if state["worker_count"] != self.worker_count:
            raise ValueError(f"data state was saved with {state['worker_count']} data workers, this run has "
                             f"{self.worker_count}: a JSONL stream resumes with the same worker count")
        if state["input_rows"] != len(self.lines):
            raise ValueError(f"data state is for {state['input_rows']} input rows, {', '.join(self.files)} "
                             f"hold {len(self.lines)}: the files changed")
        self.iterator.set_state(state["grain"])
        self.fit.counts = RowCounts.from_dict(state["counts"])  # after set_state, which re-reads rows
        self.fit.unusable_in_a_row = int(state["unusable_in_a_row"])
        self.last_position = int(state["last_position"])

    def close(self) -> None:
        close = getattr(self.iterator, "close", None)
        if close is not None:
            close()


def open_batches(
    sources: str | Sequence[str],
    *,
    seq_len: int,
    batch_size: int,
    vocab_size: int,
    tokenizer: str | None = None,
    seed: int = 0,
    shuffle: bool = True,
    shard_index: int = 0,
    shard_count: int = 1,
    long_rows: str = "split",
    bad_rows: str = "skip",
    worker_count: int = 0,
    image_processor: ImageProcessor | None = None,
) -> BatchStream:
    """This process's slice of every global batch of `batch_size` packed rows.

    `sources`: a prepared dataset directory (its own seq_len wins; read it back from `.seq_len`), or
    JSONL files / directories of them. Process `shard_index` of `shard_count` gets rows
    [i*B/n, (i+1)*B/n) of each global batch. `worker_count` grain worker processes tokenise JSONL rows;
    the batches do not depend on it. `image_processor`: the model's, when it has a vision tower; the
    batches then carry their rows' images (`IMAGE_BATCH_FIELDS`).
    """
    if shard_count < 1 or not 0 <= shard_index < shard_count:
        raise ValueError(f"shard index {shard_index} is not in [0, {shard_count})")
    if batch_size < 1 or batch_size % shard_count:
        raise ValueError(f"batch size {batch_size} must be a positive multiple of the process count "
                         f"{shard_count}")
    if worker_count < 0:
        raise ValueError(f"worker count must be >= 0, got {worker_count}")
    names = [sources] if isinstance(sources, str) else list(sources)
    prepared = [p for p in names if is_prepared(p)]
    if prepared:
        if len(names) > 1:
            raise ValueError(f"{prepared[0]} is a prepared dataset: pass it alone, not with other inputs")
        return PreparedBatches(prepared[0], batch_size=batch_size, vocab_size=vocab_size, seed=seed,
                               shuffle=shuffle, shard_index=shard_index, shard_count=shard_count,
                               image_processor=image_processor)
    return JsonlBatches(find_jsonl_files(names), seq_len=seq_len, batch_size=batch_size,
                        vocab_size=vocab_size, tokenizer=tokenizer, seed=seed, shuffle=shuffle,
                        shard_index=shard_index, shard_count=shard_count, long_rows=long_rows,
                        bad_rows=bad_rows, worker_count=worker_count, image_processor=image_processor)
