"""The demo corpus and tokenizer: generated the same way every time, fitting the tiny preset."""

import filecmp
import json
import os

from qwen35_jax.config import Qwen35Config
from qwen35_jax.data.demo import demo_corpus, probes
from qwen35_jax.data.rows import load_tokenizer


def test_demo_corpus_is_deterministic_and_fits_the_tiny_model(tmp_path):
    first = demo_corpus(str(tmp_path / "a"))
    second = demo_corpus(str(tmp_path / "b"))
    for x, y in zip(first[0] + first[1] + [os.path.join(first[2], "tokenizer.json")],
                    second[0] + second[1] + [os.path.join(second[2], "tokenizer.json")]):
        assert filecmp.cmp(x, y, shallow=False), x
    train, heldout, tokenizer_dir = first
    size = sum(os.path.getsize(p) for p in train)
    assert 200_000 < size < 600_000
    heldout_texts = {json.loads(line)["text"] for line in open(heldout[0])}
    train_texts = {json.loads(line).get("text") for line in open(train[0])}
    assert len(heldout_texts - train_texts) > 0.9 * len(heldout_texts)
    tokenizer = load_tokenizer(tokenizer_dir)
    assert len(tokenizer) <= Qwen35Config.preset("tiny").vocab_size
    text = open(heldout[0]).readline()
    assert tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"]) == text
    assert tokenizer.eos_token_id is not None and tokenizer.chat_template
    for prompt, right, wrong in probes():
        assert right != wrong and prompt.startswith("The ")


def test_demo_corpus_trains_through_open_batches(tmp_path):
    from qwen35_jax.data import open_batches

    train, _, tokenizer_dir = demo_corpus(str(tmp_path))
    with open_batches(train, seq_len=128, batch_size=8, vocab_size=256, tokenizer=tokenizer_dir) as stream:
        batch = stream.next_batch()
        summary = stream.summary()
    assert batch["tokens"].shape == (8, 128) and summary["bad_rows"] == 0
    assert 0 < batch["loss_mask"].sum() < (batch["segment_ids"] > 0).sum()
