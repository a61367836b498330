"""Long rows are truncated, split or dropped as asked; packing keeps documents apart; the counts add up."""

import numpy as np
import pytest

from data_testutil import VOCAB, demo_tokenizer_dir, write_jsonl
from qwen35_jax.data import open_batches
from qwen35_jax.data.packing import fit_to_length
from qwen35_jax.data.prepare import prepare_dataset


def _row(n: int) -> tuple[np.ndarray, np.ndarray]:
    tokens = np.arange(10, 10 + n, dtype=np.int32)
    return tokens, np.concatenate([np.ones(n - 1, np.int32), [0]])


def _trained_pairs(pieces) -> list[tuple[int, int]]:
    """(token, the token whose prediction it trains) for every loss-mask entry of the pieces."""
    return [(int(t[i]), int(t[i + 1])) for t, m in pieces for i in np.flatnonzero(m)]


@pytest.mark.parametrize("n", [9, 10, 11, 25])
def test_split_trains_every_prediction_exactly_once(n):
    tokens, loss_mask = _row(n)
    pieces = fit_to_length(tokens, loss_mask, 4, "split")
    assert all(len(t) <= 4 and m[-1] == 0 for t, m in pieces)
    assert _trained_pairs(pieces) == _trained_pairs([(tokens, loss_mask)])


def test_truncate_and_drop():
    tokens, loss_mask = _row(9)
    [(t, m)] = fit_to_length(tokens, loss_mask, 4, "truncate")
    assert t.tolist() == [10, 11, 12, 13] and m.tolist() == [1, 1, 1, 0]
    assert fit_to_length(tokens, loss_mask, 4, "drop") == []
    assert len(fit_to_length(tokens, loss_mask, 9, "drop")) == 1  # exactly seq_len fits


@pytest.mark.parametrize("policy, counted", [("truncate", "truncated_rows"), ("split", "split_rows"),
                                             ("drop", "dropped_rows")])
def test_packed_batches_and_counts(tmp_path, policy, counted):
    lengths = [3, 12, 5, 2, 7, 20, 4, 6]  # 12 and 20 exceed seq_len 8
    rows = [{"input_ids": list(range(1, n + 1))} for n in lengths]
    path = write_jsonl(str(tmp_path / "ids.jsonl"), rows)
    with open_batches(path, seq_len=8, batch_size=2, vocab_size=VOCAB, shuffle=False,
                      long_rows=policy) as stream:
        batches = [stream.next_batch() for _ in range(4)]
    tokens = np.concatenate([b["tokens"] for b in batches])
    segments = np.concatenate([b["segment_ids"] for b in batches])
    loss_mask = np.concatenate([b["loss_mask"] for b in batches])
    assert tokens.shape == (8, 8) and tokens.dtype == np.int32
    assert (tokens[segments == 0] == 0).all() and (loss_mask[segments == 0] == 0).all()
    for row_tokens, row_segments, row_mask in zip(tokens, segments, loss_mask):
        for s in set(row_segments.tolist()) - {0}:
            doc, mask = row_tokens[row_segments == s], row_mask[row_segments == s]
            assert doc[0] == 1 or policy == "split"  # documents start where their row starts
            assert np.all(np.diff(doc) == 1) and mask[-1] == 0 and mask[:-1].all()


@pytest.mark.parametrize("policy, counted", [("truncate", "truncated_rows"), ("split", "split_rows"),
                                             ("drop", "dropped_rows")])
def test_one_epoch_counts(tmp_path, policy, counted):
    lengths = [3, 12, 5, 2, 7, 20, 4, 6]  # 12 and 20 exceed seq_len 8
    rows = [{"input_ids": list(range(1, n + 1))} for n in lengths]
    path = write_jsonl(str(tmp_path / "ids.jsonl"), rows)
    manifest = prepare_dataset(path, str(tmp_path / "out"), tokenizer=demo_tokenizer_dir(), seq_len=8,
                               vocab_size=VOCAB, long_rows=policy)
    counts = manifest["counts"]
    assert counts[counted] == 2 and counts["bad_rows"] == 0
    assert counts["rows"] == (6 if policy == "drop" else 8)
    expected_tokens = {"truncate": 27 + 16, "split": 27 + 12 + 20 + 1 + 2, "drop": 27}[policy]
    assert counts["tokens"] == expected_tokens  # split pieces share one token: 12 -> 8 + 5, 20 -> 8 + 8 + 6
    assert counts["loss_tokens"] == expected_tokens - {"truncate": 8, "split": 11, "drop": 6}[policy]
    assert counts["padding_tokens"] == manifest["rows"] * 8 - expected_tokens
