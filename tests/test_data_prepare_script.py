"""scripts/prepare_data.py end to end: the dataset it writes trains through open_batches, and bad input
leaves nothing behind."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from data_testutil import VOCAB, demo_tokenizer_dir, stories, write_jsonl
from qwen35_jax.data import open_batches
from qwen35_jax.data.prepare import prepare_dataset

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "prepare_data.py")


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "kernels")])}
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, env=env)


def test_help():
    result = _run("--help")
    assert result.returncode == 0 and "--long-rows" in result.stdout and "--bad-rows" in result.stdout


def test_prepare_then_train_batches(tmp_path):
    text = write_jsonl(str(tmp_path / "in" / "text.jsonl"), stories(30))
    chat = write_jsonl(str(tmp_path / "in" / "chat.jsonl"), [
        {"messages": [{"role": "user", "content": "Where does the owl live?"},
                      {"role": "assistant", "content": "The owl lives in the barn."}]}] * 5,
        raw_lines={3: "{broken"})
    out = str(tmp_path / "packed")
    result = _run(text, chat, "--tokenizer", demo_tokenizer_dir(), "--seq-len", "96", "--out", out,
                  "--vocab-size", str(VOCAB), "--workers", "0", "--seed", "4")
    assert result.returncode == 0, result.stderr
    assert "bad rows skipped: 1" in result.stdout and f"{chat}:4: invalid JSON" in result.stdout
    manifest = json.load(open(os.path.join(out, "manifest.json")))
    assert manifest["counts"]["input_rows"] == 36 and manifest["counts"]["rows"] == 35
    assert [s["lines"] for s in manifest["sources"]] == [30, 6]
    assert manifest["tokenizer"]["tokens"] == VOCAB and set(manifest["tokenizer"]["sha256"]) == {
        "tokenizer.json", "tokenizer_config.json"}
    tokens = np.load(os.path.join(out, "tokens.npy"), mmap_mode="r")
    assert tokens.shape == (manifest["rows"], 96) and tokens.dtype == np.int32
    loss = np.load(os.path.join(out, "loss_mask.npy"))
    assert loss.sum() == manifest["counts"]["loss_tokens"]
    with open_batches(out, seq_len=1, batch_size=2, vocab_size=VOCAB) as stream:
        assert stream.seq_len == 96 and stream.next_batch()["tokens"].shape == (2, 96)
    assert not [name for name in os.listdir(tmp_path) if name.startswith(".")]  # no staging left


def test_bad_input_leaves_nothing_at_out(tmp_path):
    bad = write_jsonl(str(tmp_path / "bad.jsonl"), stories(3), raw_lines={2: '{"text": 5}'})
    out = str(tmp_path / "packed")
    result = _run(bad, "--tokenizer", demo_tokenizer_dir(), "--seq-len", "64", "--out", out,
                  "--bad-rows", "stop")
    assert result.returncode == 1
    assert result.stderr.strip() == f"prepare_data.py: error: bad row {bad}:3: 'text' must be a string, got int"
    assert os.listdir(tmp_path) == ["bad.jsonl"]
    with pytest.raises(ValueError, match="input not found: .*nope.jsonl"):
        prepare_dataset(str(tmp_path / "nope.jsonl"), out, tokenizer=demo_tokenizer_dir(), seq_len=64,
                        vocab_size=VOCAB)
    assert os.listdir(tmp_path) == ["bad.jsonl"]
