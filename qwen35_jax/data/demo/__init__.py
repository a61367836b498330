"""The embedded demo's data: a generated corpus, a held-out split and a byte-level BPE tokenizer.

    train_files, heldout_files, tokenizer_dir = demo_corpus("runs/demo/data")
"""

from __future__ import annotations

import json
import os
import random

from qwen35_jax.data.demo.corpus import conversation, probes, story
from qwen35_jax.data.demo.tokenizer import VOCAB_SIZE, build_demo_tokenizer
from qwen35_jax.files import write_text_atomically

__all__ = ["demo_corpus", "build_demo_tokenizer", "probes", "VOCAB_SIZE"]

TRAIN_STORIES, TRAIN_CHATS, HELDOUT_STORIES = 1200, 400, 60
TRAIN_SEED, HELDOUT_SEED = 1, 2


def _write_jsonl(path: str, rows: list[dict]) -> str:
    write_text_atomically(path, "".join(json.dumps(row) + "\n" for row in rows))
    return path


def demo_corpus(out_dir: str) -> tuple[list[str], list[str], str]:
    """Write the demo corpus and tokenizer into `out_dir`; the same files on every call and machine.

    Returns (training JSONL files, held-out JSONL files, tokenizer directory). The training files are
    text stories (`{"text"}`, ~300 KB) and chat conversations (`{"messages"}`); the held-out file holds
    stories generated with another seed, for scoring before and after training.
    """
    os.makedirs(out_dir, exist_ok=True)
    rng = random.Random(TRAIN_SEED)
    stories = [story(rng) for _ in range(TRAIN_STORIES)]
    chats = [conversation(rng) for _ in range(TRAIN_CHATS)]
    heldout_rng = random.Random(HELDOUT_SEED)
    heldout = [story(heldout_rng) for _ in range(HELDOUT_STORIES)]
    train_files = [
        _write_jsonl(os.path.join(out_dir, "stories.jsonl"), [{"text": s} for s in stories]),
        _write_jsonl(os.path.join(out_dir, "chats.jsonl"), [{"messages": m} for m in chats]),
    ]
    heldout_files = [_write_jsonl(os.path.join(out_dir, "heldout.jsonl"), [{"text": s} for s in heldout])]
    chat_texts = [" ".join(f"{m['role']}\n{m['content']}" for m in c) for c in chats]
    tokenizer_dir = build_demo_tokenizer(os.path.join(out_dir, "tokenizer"), stories + chat_texts)
    return train_files, heldout_files, tokenizer_dir
