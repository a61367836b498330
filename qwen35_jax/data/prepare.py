"""Write a prepared dataset: JSONL rows tokenised and packed once, staged and renamed into place.

The output directory appears complete or not at all: everything is written into a temporary directory
next to it, which is renamed only after the last byte is on disk.

With an `ImageProcessor` (a model with a vision tower), chat rows may hold images: their patches and
grids are written beside the rows (`prepared.IMAGE_FIELDS`), each image whole in its packed row.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from qwen35_jax.data.pipeline import packed_rows, stack_rows
from qwen35_jax.data.prepared import FIELDS, IMAGE_FIELDS, NpyRowWriter, write_manifest
from qwen35_jax.data.rows import RowEncoder, check_tokenizer, load_tokenizer
from qwen35_jax.data.sources import JsonlLines, file_sha256, find_jsonl_files
from qwen35_jax.files import staged_directory

if TYPE_CHECKING:
    from qwen35_jax.data.images import ImageProcessor

WRITE_ROWS = 256  # packed rows per write


def default_vocab_size(tokenizer_dir: str) -> int:
    """The vocabulary ids must fit when none is given: the directory's config.json (an HF checkpoint),
    else the tokenizer's own size."""
    config = os.path.join(tokenizer_dir, "config.json")
    if os.path.isfile(config):
        try:
            with open(config) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{config}: not readable JSON ({err})") from None
        size = data.get("vocab_size") or data.get("text_config", {}).get("vocab_size")
        if size:
            return int(size)
    return len(load_tokenizer(tokenizer_dir))


def _tokenizer_record(directory: str, tokenizer: Any) -> dict[str, Any]:
    files = {name: file_sha256(os.path.join(directory, name))
             for name in ("tokenizer.json", "tokenizer_config.json")
             if os.path.isfile(os.path.join(directory, name))}
    return {"path": os.path.abspath(directory), "tokens": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
            "sha256": files}


class _ImageWriter:
    """The image arrays of a prepared dataset, written packed row by packed row."""

    def __init__(self, stage: str, patch_dim: int):
        widths = {"patches": patch_dim, "grids_thw": 3, "row_images": 2, "row_patches": 2}
        self.writers = {name: NpyRowWriter(os.path.join(stage, f"{name}.npy"), widths[name], dtype)
                        for name, dtype in IMAGE_FIELDS.items()}
        self.patch_dim, self.images, self.patches = patch_dim, 0, 0

    def write(self, rows: list[dict[str, Any]]) -> None:
        spans = np.zeros((len(rows), 2, 2), np.int64)  # [k, (images, patches), (first, end)]
        for i, row in enumerate(rows):
            patches = row.get("patches", np.zeros((0, self.patch_dim), np.float32))  # [P, patch_dim]
            grids = row.get("grids_thw", np.zeros((0, 3), np.int64))  # [N, 3]
            spans[i] = [[self.images, self.images + len(grids)], [self.patches, self.patches + len(patches)]]
            self.writers["patches"].write(patches)
            self.writers["grids_thw"].write(grids)
            self.images, self.patches = self.images + len(grids), self.patches + len(patches)
        self.writers["row_images"].write(spans[:, 0])
        self.writers["row_patches"].write(spans[:, 1])

    def close(self) -> None:
        for writer in self.writers.values():
            writer.close()


def prepare_dataset(inputs: str | Sequence[str], out: str, *, tokenizer: str, seq_len: int, vocab_size: int,
                    seed: int = 0, long_rows: str = "split", bad_rows: str = "skip", worker_count: int = 0,
                    image_processor: ImageProcessor | None = None) -> dict[str, Any]:
    """Tokenise and pack every row of `inputs` (shuffled by `seed`) into `out`; returns the manifest.
    `image_processor`: the model's, when it has a vision tower (rows with images are bad rows without)."""
    if os.path.exists(out):
        raise ValueError(f"{out} already exists: choose a new output directory")
    files = find_jsonl_files(inputs)
    loaded = load_tokenizer(tokenizer)
    check_tokenizer(loaded, vocab_size, source=tokenizer)
    lines = JsonlLines(files)
    encoder = RowEncoder(tokenizer, vocab_size, loaded=loaded, image_processor=image_processor)
    rows, fit = packed_rows(lines, encoder, seq_len=seq_len, seed=seed, shuffle=True, epochs=1, shard_index=0,
                            shard_count=1, long_rows=long_rows, bad_rows=bad_rows, worker_count=worker_count)
    with staged_directory(out) as stage:
        writers = {name: NpyRowWriter(os.path.join(stage, f"{name}.npy"), seq_len) for name in FIELDS}
        image_writer = None if image_processor is None else _ImageWriter(stage, image_processor.patch_dim)
        max_token_id, padding = 0, 0
        iterator = iter(rows)
        try:
            while block := [row for _, row in zip(range(WRITE_ROWS), iterator)]:
                arrays = stack_rows(block)  # each [k, S]
                for name, writer in writers.items():
                    writer.write(arrays[name])
                if image_writer is not None:
                    image_writer.write(block)
                max_token_id = max(max_token_id, int(arrays["tokens"].max()))
                padding += int((arrays["segment_ids"] == 0).sum())
        finally:
            for writer in writers.values():
                writer.close()
            if image_writer is not None:
                image_writer.close()
            getattr(iterator, "close", lambda: None)()
        n_rows = writers["tokens"].rows
        if n_rows == 0:
            raise ValueError(f"no usable rows in {', '.join(files)}")
        manifest = {
            "seq_len": seq_len,
            "rows": n_rows,
            "max_token_id": max_token_id,
            "sources": [{"path": os.path.abspath(p), "sha256": file_sha256(p), "bytes": os.path.getsize(p),
                         "lines": n} for p, n in zip(files, lines.lines_per_file)],
            "tokenizer": _tokenizer_record(tokenizer, loaded),
            "settings": {"seed": seed, "long_rows": long_rows, "bad_rows": bad_rows},
            "counts": {"input_rows": len(lines), **fit.counts.to_dict(), "padding_tokens": padding},
            "images": None if image_writer is None else {
                "count": image_writer.images, "patches": image_writer.patches, "patch_dim": image_writer.patch_dim,
                "merge_size": image_processor.merge_size, "processor": json.loads(image_processor.to_json())},
        }
        write_manifest(stage, manifest)
    return manifest


def describe(manifest: dict[str, Any]) -> str:
    """A few lines for the terminal: what went in and what came out."""
    c = manifest["counts"]
    lines = [f"{c['input_rows']} input rows -> {manifest['rows']} packed rows of {manifest['seq_len']} tokens",
             f"rows used {c['rows']}, tokens {c['tokens']}, loss tokens {c['loss_tokens']}, "
             f"padding {c['padding_tokens']} "
             f"({c['padding_tokens'] / max(1, manifest['rows'] * manifest['seq_len']):.1%})",
             *([f"images {c['images']}, patches {manifest['images']['patches']}"] if manifest.get("images") else []),
             f"long rows: truncated {c['truncated_rows']}, split {c['split_rows']}, dropped {c['dropped_rows']}; "
             f"bad rows skipped: {c['bad_rows']}"]
    lines += [f"  bad row {example}" for example in c["bad_row_examples"][:5]]
    return "\n".join(lines)
