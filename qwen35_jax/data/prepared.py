"""The prepared dataset: packed rows on disk, read memory-mapped.

    DIR/tokens.npy        int32 [N, S]
    DIR/segment_ids.npy   int32 [N, S]  documents 1, 2, ... within a row; 0 = padding
    DIR/loss_mask.npy     int32 [N, S]  1 = train the prediction of tokens[:, t + 1]
    DIR/manifest.json     format, seq_len, rows, sources (path, sha256, bytes, lines), tokenizer,
                          settings (seed, long_rows, bad_rows), counts (rows, tokens, loss tokens,
                          truncated / split / dropped / bad rows, padding tokens), max_token_id

The arrays are written row by row (`NpyRowWriter`), so preparing a dataset needs memory for a few rows,
not the whole dataset; reading maps the files, so a dataset larger than RAM trains.
"""

from __future__ import annotations

import json
import os
import struct
from typing import Any

import numpy as np

FORMAT = "qwen35-jax packed rows v1"
FIELDS = ("tokens", "segment_ids", "loss_mask")
MANIFEST = "manifest.json"
_HEADER_BYTES = 128  # fixed, so the row count can be filled in once known (a multiple of 64, as numpy aligns)


class NpyRowWriter:
    """Appends int32 [k, S] blocks to a .npy file whose row count is written at close."""

    def __init__(self, path: str, seq_len: int):
        self.path, self.seq_len, self.rows = path, seq_len, 0
        self._file = open(path, "wb")
        self._file.write(self._header(0))

    def _header(self, rows: int) -> bytes:
        text = repr({"descr": "<i4", "fortran_order": False, "shape": (rows, self.seq_len)})
        text = text.ljust(_HEADER_BYTES - 10 - 1) + "\n"
        return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode("latin1")

    def write(self, block: np.ndarray) -> None:  # [k, S]
        assert block.ndim == 2 and block.shape[1] == self.seq_len, block.shape
        self._file.write(np.ascontiguousarray(block, dtype="<i4").tobytes())
        self.rows += block.shape[0]

    def close(self) -> None:
        self._file.seek(0)
        self._file.write(self._header(self.rows))
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()


def is_prepared(path: str) -> bool:
    return os.path.isfile(os.path.join(path, MANIFEST))


def write_manifest(directory: str, manifest: dict[str, Any]) -> None:
    with open(os.path.join(directory, MANIFEST), "w") as f:
        json.dump({"format": FORMAT, **manifest}, f, indent=1)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def read_manifest(directory: str) -> dict[str, Any]:
    path = os.path.join(directory, MANIFEST)
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, json.JSONDecodeError) as err:
        raise ValueError(f"{path}: not a readable manifest ({err})") from None
    if manifest.get("format") != FORMAT:
        raise ValueError(f"{path}: format {manifest.get('format')!r} is not {FORMAT!r}")
    return manifest


def open_prepared(directory: str, vocab_size: int) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The memory-mapped fields (each int32 [N, S]) and the manifest, checked against each other."""
    manifest = read_manifest(directory)
    arrays = {}
    for name in FIELDS:
        path = os.path.join(directory, f"{name}.npy")
        try:
            arrays[name] = np.load(path, mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: not a readable .npy array ({err})") from None
        expected = (manifest["rows"], manifest["seq_len"])
        if arrays[name].shape != expected or arrays[name].dtype != np.int32:
            raise ValueError(f"{path}: int32 {arrays[name].shape} does not match the manifest's {expected}")
    if manifest["rows"] < 1:
        raise ValueError(f"{directory}: the prepared dataset has no rows")
    if manifest["max_token_id"] >= vocab_size:
        raise ValueError(f"{directory}: token id {manifest['max_token_id']} is outside the model's vocabulary "
                         f"[0, {vocab_size}): prepare the data with the model's tokenizer")
    return arrays, manifest

