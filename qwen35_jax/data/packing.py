"""Rows of tokens -> packed [seq_len] sequences with segment ids (grain's first-fit packing).

A row longer than seq_len is, by `long_rows`:
- truncate: cut to its first seq_len tokens;
- split: cut into pieces of seq_len tokens that overlap by one token, so every prediction of the row
  is trained exactly once (a piece's last token is the next piece's first);
- drop: left out.
Each piece is its own document (segment). Padding has segment 0, loss mask 0.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

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


def pack(rows: grain.IterDataset, seq_len: int, *, bins: int = PACKING_BINS) -> grain.IterDataset:
    """{"tokens", "loss_mask"} rows of length <= seq_len -> {"tokens", "segment_ids", "loss_mask"} [seq_len].

    Non-sequence fields of a row ("position") come out as the list of the packed rows' values.
    """
    import grain  # here: grain loads jax, and LONG_ROW_POLICIES is read before jax loads (train/options.py)

    packed = grain.experimental.FirstFitPackIterDataset(
        rows, length_struct={"tokens": seq_len, "loss_mask": seq_len}, num_packing_bins=bins,
        shuffle_bins=False, meta_features=("position",))
    return packed.map(_packed_fields)


def _packed_fields(row: dict) -> dict:
    return {"tokens": row["tokens"].astype(np.int32), "segment_ids": row["tokens_segment_ids"],
            "loss_mask": row["loss_mask"].astype(np.int32), "position": row["position"]}
