"""Rows of tokens -> packed [seq_len] sequences with segment ids (grain's first-fit packing).

A row longer than seq_len is, by `long_rows`:
- truncate: cut to its first seq_len tokens;
- split: cut into pieces of seq_len tokens that overlap by one token, so every prediction of the row
  is trained exactly once (a piece's last token is the next piece's first);
- drop: left out.
Each piece is its own document (segment). Padding has segment 0, loss mask 0.

Images are never cut (`fit_images_to_length`): a piece that would end inside an image's pads ends
just before them instead, and the image goes whole to the next piece (split) or is left out with
everything after it (truncate). A row one of whose images has more than seq_len - 2 pads cannot keep
it whole and is dropped under split (counted with the dropped rows). First-fit packing never cuts a
piece, so a packed row holds whole images only: its documents' patches and grids, concatenated in
document order, come with it ("patches" [P, patch_dim], "grids_thw" [N, 3], only when it has images).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from qwen35_jax.data.image_rows import RowImages

if TYPE_CHECKING:
    import grain

LONG_ROW_POLICIES = ("truncate", "split", "drop")
PACKING_BINS = 16  # more bins pack tighter but mix rows from further apart in the order


def check_long_rows(policy: str) -> None:
    if policy not in LONG_ROW_POLICIES:
        raise ValueError(f"long rows policy must be one of {', '.join(LONG_ROW_POLICIES)}, got {policy!r}")


def _ended(loss_mask: np.ndarray) -> np.ndarray:  # [L] -> [L]
    """A document's last token predicts nothing within it."""
    out = loss_mask.copy()
    out[-1] = 0
    return out


def fit_to_length(tokens: np.ndarray, loss_mask: np.ndarray, seq_len: int,
                  policy: str) -> list[tuple[np.ndarray, np.ndarray]]:
    """The pieces (tokens [l], loss_mask [l], l <= seq_len) a row becomes under `policy`."""
    n = len(tokens)
    if n <= seq_len:
        return [(tokens, loss_mask)]
    if policy == "drop":
        return []
    if policy == "truncate":
        return [(tokens[:seq_len], _ended(loss_mask[:seq_len]))]
    stride = seq_len - 1
    return [(tokens[a:a + seq_len], _ended(loss_mask[a:a + seq_len])) for a in range(0, n - 1, stride)]


def _image_piece_ranges(n: int, spans: np.ndarray, seq_len: int, policy: str) -> list[tuple[int, int]]:
    """[a, b) of each piece of a row of n tokens whose images' pads are at `spans` [N, 2] ([start, end)),
    so that no piece ends inside an image and split pieces overlap by one token that is not a pad."""
    if n <= seq_len:
        return [(0, n)]
    if policy == "drop":
        return []
    run_start = np.full(n, -1, np.int64)  # [n]: the first pad of the image a pad belongs to
    for s, e in spans.tolist():
        run_start[s:e] = s
    ranges, a = [], 0
    while True:
        b = min(a + seq_len, n)
        if b < n and run_start[b - 1] >= 0:
            b = int(run_start[b - 1])  # end before the image that does not fit
        if b <= a + 1:  # an image too long to share a piece with the token before it
            return []
        ranges.append((a, b))
        if b == n or policy == "truncate":
            return ranges
        a = b - 1


def fit_images_to_length(tokens: np.ndarray, loss_mask: np.ndarray, images: RowImages, spans: np.ndarray,
                         seq_len: int, policy: str) -> list[tuple[np.ndarray, np.ndarray, RowImages | None]]:
    """`fit_to_length` for a row with images (pads at `spans` [N, 2], one per image, in order): the
    pieces (tokens [l], loss_mask [l], the images whole inside them or None), no image cut."""
    if policy == "split" and len(tokens) > seq_len and len(spans) \
            and int((spans[:, 1] - spans[:, 0]).max()) > seq_len - 2:
        return []
    patch_offsets = np.concatenate([[0], np.cumsum(np.prod(images.grids_thw, axis=1))])  # [N + 1]
    ranges = _image_piece_ranges(len(tokens), spans, seq_len, policy)
    pieces = []
    for a, b in ranges:
        inside = np.flatnonzero((spans[:, 0] >= a) & (spans[:, 1] <= b))  # whole images of the piece
        piece_images = None
        if inside.size:
            first, last = int(inside[0]), int(inside[-1]) + 1
            piece_images = RowImages(images.patches[patch_offsets[first]:patch_offsets[last]],
                                     images.grids_thw[first:last])
        mask = loss_mask[a:b] if (a, b) == (0, len(tokens)) else _ended(loss_mask[a:b])
        pieces.append((tokens[a:b], mask, piece_images))
    return pieces


def pack(rows: grain.IterDataset, seq_len: int, *, bins: int = PACKING_BINS) -> grain.IterDataset:
    """{"tokens", "loss_mask"} rows of length <= seq_len -> {"tokens", "segment_ids", "loss_mask"} [seq_len].

    Non-sequence fields of a row ("position") come out as the list of the packed rows' values; a row's
    images ("patches", "grids_thw") come out concatenated, only in packed rows that have images.
    """
    import grain  # here: grain loads jax, and LONG_ROW_POLICIES is read before jax loads (train/options.py)

    packed = grain.experimental.FirstFitPackIterDataset(
        rows, length_struct={"tokens": seq_len, "loss_mask": seq_len}, num_packing_bins=bins,
        shuffle_bins=False, meta_features=("position", "patches", "grids_thw"))
    return packed.map(_packed_fields)


def _packed_fields(row: dict) -> dict:
    out = {"tokens": row["tokens"].astype(np.int32), "segment_ids": row["tokens_segment_ids"],
           "loss_mask": row["loss_mask"].astype(np.int32), "position": row["position"]}
    patches = [p for p in row["patches"] if len(p)]  # the documents' images, in document order
    grids = [g for g in row["grids_thw"] if len(g)]
    if patches:
        out["patches"] = np.concatenate(patches)  # [P, patch_dim]
        out["grids_thw"] = np.concatenate(grids)  # [N, 3]
    return out
