"""Training data: JSONL text, token ids and chat turned into packed, masked, resumable batches.

    from qwen35_jax.data import open_batches
    with open_batches("data/", seq_len=2048, batch_size=8, vocab_size=cfg.vocab_size) as stream:
        batch = stream.next_batch()  # {"tokens", "segment_ids", "loss_mask"}: int32 [B/n, S]

See docs/data.md for the input formats, masks, packing and the prepared-dataset layout.

Names are loaded on first use: the pipeline loads grain (and with it jax), while the choice lists of
`data.packing` and `data.rows` are read by the training options before jax loads.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {"BatchStream": "batches", "open_batches": "batches"}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'qwen35_jax.data' has no attribute {name!r}")
    return getattr(importlib.import_module(f"qwen35_jax.data.{_EXPORTS[name]}"), name)
