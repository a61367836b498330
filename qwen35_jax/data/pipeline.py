"""The grain pipeline from JSONL lines to packed rows, and the counts it keeps on the way.

    lines (file order) -> shuffle by seed (a new order each epoch) -> repeat -> this process's rows
      -> parse + tokenise            (MapDataset.map: in grain worker processes when worker_count > 0)
      -> bad rows, long rows, counts (flat map, in this process)
      -> first-fit packing           (in this process)

Everything that drops or merges rows runs after the workers, so the rows that come out depend on the
seed, the files and the shard, never on the number of workers.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

import grain
import numpy as np

from qwen35_jax.data.image_rows import RowImages, image_spans, image_token_id
from qwen35_jax.data.packing import check_long_rows, fit_images_to_length, fit_to_length, pack
from qwen35_jax.data.rows import BadRow, RowEncoder, check_bad_rows
from qwen35_jax.data.sources import JsonlLines

BAD_ROW_EXAMPLES = 20  # bad rows quoted in a summary or manifest; the rest are only counted


@dataclasses.dataclass
class RowCounts:
    rows: int = 0  # input rows used (after bad and dropped rows)
    tokens: int = 0  # tokens of the rows as packed (after truncation)
    loss_tokens: int = 0
    truncated_rows: int = 0
    split_rows: int = 0
    dropped_rows: int = 0
    bad_rows: int = 0
    images: int = 0  # images of the pieces used (a truncated row's images after the cut are not)
    bad_row_examples: list[str] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> RowCounts:
        return cls(**{k: (list(v) if isinstance(v, list) else int(v)) for k, v in state.items()})


def _image_fields(images: RowImages | None, spans: np.ndarray | None = None) -> dict[str, np.ndarray]:
    if images is None:
        return {}
    out = {"patches": images.patches, "grids_thw": images.grids_thw}
    return out if spans is None else {**out, "image_spans": spans}


def _piece_images(images: RowImages | None) -> dict[str, np.ndarray]:
    """The packer's meta features: every row has them (empty without images)."""
    if images is None:
        return {"patches": np.zeros((0, 0), np.float32), "grids_thw": np.zeros((0, 3), np.int64)}
    return {"patches": images.patches, "grids_thw": images.grids_thw}


class EncodeLine:
    """grain map: a `Line` -> {"tokens", "loss_mask", "position"} (+ "patches", "grids_thw" and the pads'
    "image_spans" [N, 2] of a row with images) or {"bad": "file:line: why", ...}. Image paths are
    relative to the line's file's folder.

    Never raises for a bad row: a row removed inside a worker would make the output depend on the
    number of workers, so bad rows travel as markers to the flat map below.
    """

    def __init__(self, encoder: RowEncoder):
        self.encoder = encoder

    def __call__(self, item: tuple[int, Any]) -> dict[str, Any]:
        position, line = item
        try:
            tokens, loss_mask, images = self.encoder.encode_line(line.text, os.path.dirname(line.path))
        except BadRow as err:
            return {"bad": f"{line.where}: {err}", "position": position}
        spans = None if images is None else image_spans(tokens, image_token_id(self.encoder.tokenizer))
        return {"tokens": tokens, "loss_mask": loss_mask, "position": position, **_image_fields(images, spans)}


def _with_position(position: int, line: Any) -> tuple[int, Any]:
    return position, line


class FitRows(grain.experimental.FlatMapTransform):
    """grain flat map: applies the bad-rows and long-rows policies, counting what it does."""

    max_fan_out = 1 << 30  # a split row's piece count is unbounded

    def __init__(self, seq_len: int, long_rows: str, bad_rows: str, rows_per_epoch: int):
        self.seq_len, self.long_rows, self.bad_rows = seq_len, long_rows, bad_rows
        self.rows_per_epoch = rows_per_epoch
        self.counts = RowCounts()
        self.unusable_in_a_row = 0  # bad or dropped; a whole epoch of them and nothing ever comes out

    def _unusable(self) -> None:
        self.unusable_in_a_row += 1
        if self.unusable_in_a_row >= self.rows_per_epoch:
            first = self.counts.bad_row_examples[:1] or [f"rows longer than {self.seq_len} tokens dropped"]
            raise ValueError(f"no usable rows: all {self.rows_per_epoch} rows are bad or dropped "
                             f"(first: {first[0]})")

    def flat_map(self, row: dict[str, Any]) -> Sequence[dict[str, Any]]:
        counts = self.counts
        if "bad" in row:
            if self.bad_rows == "stop":
                raise ValueError(f"bad row {row['bad']}")
            counts.bad_rows += 1
            if len(counts.bad_row_examples) < BAD_ROW_EXAMPLES:
                counts.bad_row_examples.append(row["bad"])
            self._unusable()
            return []
        if "patches" in row:
            pieces = fit_images_to_length(row["tokens"], row["loss_mask"], RowImages(row["patches"], row["grids_thw"]),
                                          row["image_spans"], self.seq_len, self.long_rows)
        else:
            pieces = [(t, m, None) for t, m in fit_to_length(row["tokens"], row["loss_mask"], self.seq_len,
                                                             self.long_rows)]
        if len(row["tokens"]) > self.seq_len:
            name = {"truncate": "truncated_rows", "split": "split_rows", "drop": "dropped_rows"}[self.long_rows]
            name = name if pieces else "dropped_rows"  # a row whose image cannot be kept whole is dropped
            setattr(counts, name, getattr(counts, name) + 1)
        if not pieces:
            self._unusable()
            return []
        self.unusable_in_a_row = 0
        counts.rows += 1
        for tokens, loss_mask, images in pieces:
            counts.tokens += len(tokens)
            counts.loss_tokens += int(loss_mask.sum())
            counts.images += 0 if images is None else len(images.grids_thw)
        return [{"tokens": t, "loss_mask": m, "position": row["position"], **_piece_images(i)} for t, m, i in pieces]


def packed_rows(lines: JsonlLines, encoder: RowEncoder, *, seq_len: int, seed: int, shuffle: bool,
                epochs: int | None, shard_index: int, shard_count: int, long_rows: str, bad_rows: str,
                worker_count: int) -> tuple[grain.IterDataset, FitRows]:
    """Packed rows {"tokens", "segment_ids", "loss_mask": int32 [seq_len], "position": [int]} (+ "patches"
    [P, patch_dim], "grids_thw" [N, 3] in a row with images) of this shard, and the flat map whose
    `.counts` tally the rows read so far.

    "position" holds the index, in the repeated (all-shard) order, of each input row in the packed row.
    """
    check_long_rows(long_rows)
    check_bad_rows(bad_rows)
    if seq_len < 2:
        raise ValueError(f"sequence length must be at least 2, got {seq_len}")
    ds = grain.MapDataset.source(lines)
    if shuffle:
        ds = ds.shuffle(seed=seed)
    ds = ds.repeat(epochs)
    ds = ds.map_with_index(_with_position)
    ds = ds[shard_index::shard_count]
    ds = ds.map(EncodeLine(encoder))
    rows = ds.to_iter_dataset()
    if worker_count > 0:
        _use_absl_flag_defaults()
        rows = rows.mp_prefetch(grain.MultiprocessingOptions(num_workers=worker_count))
    fit = FitRows(seq_len, long_rows, bad_rows, rows_per_epoch=-(-len(lines) // shard_count))
    rows = grain.experimental.FlatMapIterDataset(rows, fit)
    return pack(rows, seq_len), fit


def _use_absl_flag_defaults() -> None:
    """grain's worker processes read absl flags, which only an absl `app.run` program has parsed."""
    from absl import flags

    if not flags.FLAGS.is_parsed():
        flags.FLAGS.mark_as_parsed()


def stack_rows(rows: list[dict[str, Any]]) -> dict[str, np.ndarray]:  # each field [len(rows), S]
    return {name: np.stack([r[name] for r in rows]) for name in ("tokens", "segment_ids", "loss_mask")}
