"""Shared pieces of the data-pipeline tests: the demo tokenizer (built once) and JSONL writing."""

import atexit
import functools
import gzip
import json
import os
import shutil
import tempfile

from qwen35_jax.data.demo.corpus import conversation, story
from qwen35_jax.data.demo.tokenizer import build_demo_tokenizer

VOCAB = 256


@functools.cache
def demo_tokenizer_dir() -> str:
    import random

    rng = random.Random(0)
    texts = [story(rng) for _ in range(200)] + [" ".join(m["content"] for m in conversation(rng))
                                                for _ in range(50)]
    path = tempfile.mkdtemp(prefix="demo-tokenizer-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return build_demo_tokenizer(path, texts)


@functools.cache
def demo_tokenizer():
    from qwen35_jax.data.rows import load_tokenizer

    return load_tokenizer(demo_tokenizer_dir())


def write_jsonl(path: str, rows: list, *, raw_lines: dict[int, str] | None = None) -> str:
    """Rows as JSON lines; `raw_lines` puts literal text at given 0-based line indices instead."""
    lines = [json.dumps(r) for r in rows]
    for index, text in (raw_lines or {}).items():
        lines.insert(index, text)
    data = ("\n".join(lines) + "\n").encode()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if path.endswith(".gz"):
        with gzip.open(path, "wb") as f:
            f.write(data)
    else:
        with open(path, "wb") as f:
            f.write(data)
    return path


def stories(n: int, seed: int = 0) -> list[dict]:
    import random

    rng = random.Random(seed)
    return [{"text": story(rng)} for _ in range(n)]
