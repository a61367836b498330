"""open_batches: bad rows reported by file and line, gzip and directories, determinism across worker and
process counts, resuming mid-epoch, memory-mapped prepared datasets."""

import json

import numpy as np
import pytest

from data_testutil import VOCAB, demo_tokenizer_dir, stories, write_jsonl
from qwen35_jax.data import open_batches
from qwen35_jax.data.prepare import prepare_dataset

FIELDS = ("tokens", "segment_ids", "loss_mask")


def _take(stream, n: int) -> list[dict[str, np.ndarray]]:
    return [stream.next_batch() for _ in range(n)]


def _same(a: list[dict], b: list[dict]) -> bool:
    return len(a) == len(b) and all(np.array_equal(x[k], y[k]) for x, y in zip(a, b) for k in FIELDS)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    root = tmp_path_factory.mktemp("corpus")
    write_jsonl(str(root / "a.jsonl"), stories(60, seed=1))
    write_jsonl(str(root / "sub" / "b.jsonl.gz"), stories(40, seed=2))
    return root


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("prepared") / "data")
    prepare_dataset(str(corpus), out, tokenizer=demo_tokenizer_dir(), seq_len=64, vocab_size=VOCAB)
    return out


def _open(source, **kw):
    args = dict(seq_len=64, batch_size=4, vocab_size=VOCAB, tokenizer=demo_tokenizer_dir(), seed=3)
    return open_batches(source, **{**args, **kw})


def test_bad_rows_are_skipped_and_reported_with_file_and_line(tmp_path):
    path = write_jsonl(str(tmp_path / "mixed.jsonl"), stories(6) + [{"input_ids": [1, 999]}],
                       raw_lines={2: "{not json", 4: '{"messages": []}'})
    with _open(path, shuffle=False) as stream:
        _take(stream, 2)
        summary = stream.summary()
    assert summary["bad_rows"] >= 3
    assert summary["bad_row_examples"][:3] == [
        f"{path}:3: invalid JSON (Expecting property name enclosed in double quotes: line 1 column 2 (char 1))",
        f"{path}:5: 'messages' must be a non-empty list",
        f"{path}:9: token id 999 is outside the vocabulary [0, 256)"]


def test_bad_rows_stop_names_the_row(tmp_path):
    path = write_jsonl(str(tmp_path / "bad.jsonl"), stories(3), raw_lines={1: '{"prompt": "x"}'})
    with _open(path, shuffle=False, bad_rows="stop") as stream, \
            pytest.raises(ValueError, match=rf"bad row {path}:2: 'response' is missing"):
        _take(stream, 2)


def test_only_bad_rows_is_an_error_not_a_hang(tmp_path):
    path = write_jsonl(str(tmp_path / "bad.jsonl"), [{"nothing": 1}] * 5)
    with _open(path) as stream, pytest.raises(ValueError, match="no usable rows: all 5 rows are bad"):
        stream.next_batch()


def test_gzip_and_directories_read_the_same_rows(corpus):
    with _open([str(corpus / "a.jsonl"), str(corpus / "sub" / "b.jsonl.gz")]) as files, _open(str(corpus)) as tree:
        assert _same(_take(files, 3), _take(tree, 3))
    with pytest.raises(ValueError, match="input not found: .*missing.jsonl"):
        _open(str(corpus / "missing.jsonl"))


def test_jsonl_resume_mid_epoch_reproduces_the_stream(corpus):
    with _open(str(corpus)) as stream:
        _take(stream, 3)
        state = json.loads(json.dumps(stream.get_state()))
        expected = _take(stream, 30)  # 30 batches of 4 rows run past the first epoch
        assert stream.epoch > 1
    with _open(str(corpus)) as resumed:
        resumed.set_state(state)
        assert _same(_take(resumed, 30), expected)
    with _open(str(corpus), batch_size=4, shard_count=2) as other, pytest.raises(ValueError, match="process 0 of 1"):
        other.set_state(state)
    with _open(str(corpus / "a.jsonl")) as other, pytest.raises(ValueError, match="for 100 input rows"):
        other.set_state(state)


def test_prepared_resume_mid_epoch_and_state_is_shard_independent(prepared):
    with _open(prepared) as stream:
        _take(stream, 5)
        state = json.loads(json.dumps(stream.get_state()))
        expected = _take(stream, 20)
    halves = []
    for i in range(2):
        with _open(prepared, shard_index=i, shard_count=2) as shard:
            shard.set_state(state)
            halves.append(_take(shard, 20))
    joined = [{k: np.concatenate([a[k], b[k]]) for k in FIELDS} for a, b in zip(*halves)]
    assert _same(joined, expected)


def test_prepared_epochs_are_reshuffled_and_memory_mapped(prepared):
    with _open(prepared, batch_size=1) as stream:
        assert isinstance(stream.arrays["tokens"], np.memmap)
        n = stream.n_rows
        first, second = _take(stream, n), _take(stream, n)
        assert stream.epoch == 2
    order = lambda rows: [r["tokens"].tobytes() for r in rows]
    assert sorted(order(first)) == sorted(order(second)) and order(first) != order(second)


def test_prepared_dataset_checks_the_vocabulary(prepared):
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        _open(prepared, vocab_size=100)


def test_tokenizer_larger_than_the_model_is_refused(corpus):
    with pytest.raises(ValueError, match="has 256 tokens but the model's vocabulary holds 128"):
        _open(str(corpus), vocab_size=128)


@pytest.mark.slow
def test_batches_do_not_depend_on_the_worker_count(corpus):
    with _open(str(corpus), worker_count=0) as inline:
        expected = _take(inline, 8)
    with _open(str(corpus), worker_count=2) as workers:
        got = _take(workers, 4)
        state = json.loads(json.dumps(workers.get_state()))
        got += _take(workers, 4)
        workers.set_state(state)
        again = _take(workers, 4)
    assert _same(got, expected)
    assert _same(again, expected[4:])


def test_jsonl_processes_read_disjoint_parts_that_cover_the_rows(tmp_path):
    rows = [{"input_ids": [k + 1] * 3} for k in range(24)]  # row k's tokens are all k + 1
    path = write_jsonl(str(tmp_path / "ids.jsonl"), rows)
    seen = []
    for i in range(2):
        with _open(path, shard_index=i, shard_count=2, seq_len=6, batch_size=4) as shard:
            tokens = np.concatenate([b["tokens"] for b in _take(shard, 3)])  # 6 rows of 2 docs: one epoch
            seen.append(set(tokens[tokens > 0].tolist()))
    assert not seen[0] & seen[1] and seen[0] | seen[1] == set(range(1, 25))
