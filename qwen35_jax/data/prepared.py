"""The prepared dataset: packed rows on disk, read memory-mapped.

    DIR/tokens.npy        int32 [N, S]
    DIR/segment_ids.npy   int32 [N, S]  documents 1, 2, ... within a row; 0 = padding
    DIR/loss_mask.npy     int32 [N, S]  1 = train the prediction of tokens[:, t + 1]
    DIR/manifest.json     format, seq_len, rows, sources (path, sha256, bytes, lines), tokenizer,
                          settings (seed, long_rows, bad_rows), counts (rows, tokens, loss tokens,
                          truncated / split / dropped / bad rows, images, padding tokens), max_token_id,
                          images (null, or count, patches, patch_dim, merge_size, processor settings)

Prepared with an image processor (a model with a vision tower), the images' patches sit beside the
rows, every image whole in the packed row whose pads it fills:

    DIR/patches.npy       float32 [total_P, patch_dim]  all images' patches, row after row
    DIR/grids_thw.npy     int64 [total_N, 3]            (t, h, w) of each image, in the same order
    DIR/row_images.npy    int64 [N, 2]                  [first, end) of row i's images in grids_thw
    DIR/row_patches.npy   int64 [N, 2]                  [first, end) of row i's patches in patches.npy

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
IMAGE_FIELDS = {"patches": "<f4", "grids_thw": "<i8", "row_images": "<i8", "row_patches": "<i8"}
MANIFEST = "manifest.json"
_HEADER_BYTES = 128  # fixed, so the row count can be filled in once known (a multiple of 64, as numpy aligns)


class NpyRowWriter:
    """Appends [k, width] blocks (int32 unless `dtype` says otherwise) to a .npy file whose row count is
    written at close."""

    def __init__(self, path: str, seq_len: int, dtype: str = "<i4"):
        self.path, self.seq_len, self.dtype, self.rows = path, seq_len, dtype, 0
        self._file = open(path, "wb")
        self._file.write(self._header(0))

    def _header(self, rows: int) -> bytes:
        text = repr({"descr": self.dtype, "fortran_order": False, "shape": (rows, self.seq_len)})
        text = text.ljust(_HEADER_BYTES - 10 - 1) + "\n"
        return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(text)) + text.encode("latin1")

    def write(self, block: np.ndarray) -> None:  # [k, S]
        assert block.ndim == 2 and block.shape[1] == self.seq_len, block.shape
        self._file.write(np.ascontiguousarray(block, dtype=self.dtype).tobytes())
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


def _load(directory: str, name: str) -> np.ndarray:
    path = os.path.join(directory, f"{name}.npy")
    try:
        return np.load(path, mmap_mode="r", allow_pickle=False)
    except (OSError, ValueError) as err:
        raise ValueError(f"{path}: not a readable .npy array ({err})") from None


def open_prepared(directory: str, vocab_size: int, *, images: bool = False
                  ) -> tuple[dict[str, np.ndarray], dict[str, Any]]:
    """The memory-mapped fields (each int32 [N, S]) and the manifest, checked against each other.
    `images`: also the image arrays (`IMAGE_FIELDS`) of a dataset prepared with an image processor;
    without it, a dataset that holds images is refused (its image pads would train without images)."""
    manifest = read_manifest(directory)
    arrays = {}
    for name in FIELDS:
        arrays[name] = _load(directory, name)
        expected = (manifest["rows"], manifest["seq_len"])
        if arrays[name].shape != expected or arrays[name].dtype != np.int32:
            raise ValueError(f"{directory}/{name}.npy: int32 {arrays[name].shape} does not match the "
                             f"manifest's {expected}")
    if manifest["rows"] < 1:
        raise ValueError(f"{directory}: the prepared dataset has no rows")
    if manifest["max_token_id"] >= vocab_size:
        raise ValueError(f"{directory}: token id {manifest['max_token_id']} is outside the model's vocabulary "
                         f"[0, {vocab_size}): prepare the data with the model's tokenizer")
    info = manifest.get("images")
    if info and info["count"] and not images:
        raise ValueError(f"{directory}: the prepared dataset holds {info['count']} images, which this reader "
                         f"does not feed to the model")
    if images and info:
        arrays.update(_open_images(directory, manifest))
    return arrays, manifest


def _open_images(directory: str, manifest: dict[str, Any]) -> dict[str, np.ndarray]:
    info, rows = manifest["images"], manifest["rows"]
    expected = {"patches": (info["patches"], info["patch_dim"]), "grids_thw": (info["count"], 3),
                "row_images": (rows, 2), "row_patches": (rows, 2)}
    arrays = {}
    for name, dtype in IMAGE_FIELDS.items():
        arrays[name] = _load(directory, name)
        if arrays[name].shape != expected[name] or arrays[name].dtype != np.dtype(dtype):
            raise ValueError(f"{directory}/{name}.npy: {arrays[name].dtype} {arrays[name].shape} does not match "
                             f"the manifest's {np.dtype(dtype)} {expected[name]}")
    return arrays


def prepared_row_images(arrays: dict[str, np.ndarray], row: int) -> tuple[np.ndarray, np.ndarray]:
    """Packed row `row`'s images from `open_prepared(..., images=True)` arrays: (patches float32
    [P, patch_dim], grids_thw int64 [N, 3]), memory-mapped slices (N = 0 for a row without images)."""
    first, end = arrays["row_images"][row]
    p_first, p_end = arrays["row_patches"][row]
    return arrays["patches"][p_first:p_end], arrays["grids_thw"][first:end]

