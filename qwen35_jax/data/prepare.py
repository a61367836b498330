"""Write a prepared dataset: JSONL rows tokenised and packed once, staged and renamed into place.

The output directory appears complete or not at all: everything is written into a temporary directory
next to it, which is renamed only after the last byte is on disk.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from qwen35_jax.data.pipeline import packed_rows, stack_rows
from qwen35_jax.data.prepared import FIELDS, NpyRowWriter, write_manifest
from qwen35_jax.data.rows import RowEncoder, check_tokenizer, load_tokenizer
from qwen35_jax.data.sources import JsonlLines, file_sha256, find_jsonl_files
from qwen35_jax.files import staged_directory

WRITE_ROWS = 256  # packed rows per write


def default_vocab_size(tokenizer_dir: str) -> int:
    """The vocabulary ids must fit when none is given: the directory's config.json (an HF checkpoint),
    else the tokenizer's own size."""
    config = os.path.join(tokenizer_dir, "config.json")
    if os.path.isfile(config):
        try:
            with open(config) as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as err:
            raise ValueError(f"{config}: not readable JSON ({err})") from None
        size = data.get("vocab_size") or data.get("text_config", {}).get("vocab_size")
        if size:
            return int(size)
    return len(load_tokenizer(tokenizer_dir))


def _tokenizer_record(directory: str, tokenizer: Any) -> dict[str, Any]:
    files = {name: file_sha256(os.path.join(directory, name))
             for name in ("tokenizer.json", "tokenizer_config.json")
             if os.path.isfile(os.path.join(directory, name))}
    return {"path": os.path.abspath(directory), "tokens": len(tokenizer), "eos_token_id": tokenizer.eos_token_id,
            "sha256": files}


def prepare_dataset(inputs: str | Sequence[str], out: str, *, tokenizer: str, seq_len: int, vocab_size: int,
                    seed: int = 0, long_rows: str = "split", bad_rows: str = "skip",
                    worker_count: int = 0) -> dict[str, Any]:
    """Tokenise and pack every row of `inputs` (shuffled by `seed`) into `out`; returns the manifest."""
    if os.path.exists(out):
        raise ValueError(f"{out} already exists: choose a new output directory")
    files = find_jsonl_files(inputs)
    loaded = load_tokenizer(tokenizer)
    check_tokenizer(loaded, vocab_size, source=tokenizer)
    lines = JsonlLines(files)
    encoder = RowEncoder(tokenizer, vocab_size, loaded=loaded)
    rows, fit = packed_rows(lines, encoder, seq_len=seq_len, seed=seed, shuffle=True, epochs=1, shard_index=0,
                            shard_count=1, long_rows=long_rows, bad_rows=bad_rows, worker_count=worker_count)
    with staged_directory(out) as stage:
        writers = {name: NpyRowWriter(os.path.join(stage, f"{name}.npy"), seq_len) for name in FIELDS}
        max_token_id, padding = 0, 0
        iterator = iter(rows)
        try:
            while block := [row for _, row in zip(range(WRITE_ROWS), iterator)]:
                arrays = stack_rows(block)  # each [k, S]
                for name, writer in writers.items():
                    writer.write(arrays[name])
                max_token_id = max(max_token_id, int(arrays["tokens"].max()))
                padding += int((arrays["segment_ids"] == 0).sum())
        finally:
            for writer in writers.values():
                writer.close()
            getattr(iterator, "close", lambda: None)()
        n_rows = writers["tokens"].rows
        if n_rows == 0:
            raise ValueError(f"no usable rows in {', '.join(files)}")
        manifest = {
            "seq_len": seq_len,
            "rows": n_rows,
            "max_token_id": max_token_id,
            "sources": [{"path": os.path.abspath(p), "sha256": file_sha256(p), "bytes": os.path.getsize(p),
                         "lines": n} for p, n in zip(files, lines.lines_per_file)],
            "tokenizer": _tokenizer_record(tokenizer, loaded),
            "settings": {"seed": seed, "long_rows": long_rows, "bad_rows": bad_rows},
            "counts": {"input_rows": len(lines), **fit.counts.to_dict(), "padding_tokens": padding},
        }
        write_manifest(stage, manifest)
    return manifest


def describe(manifest: dict[str, Any]) -> str:
    """A few lines for the terminal: what went in and what came out."""
    c = manifest["counts"]
    lines = [f"{c['input_rows']} input rows -> {manifest['rows']} packed rows of {manifest['seq_len']} tokens",
             f"rows used {c['rows']}, tokens {c['tokens']}, loss tokens {c['loss_tokens']}, "
             f"padding {c['padding_tokens']} "
             f"({c['padding_tokens'] / max(1, manifest['rows'] * manifest['seq_len']):.1%})",
             f"long rows: truncated {c['truncated_rows']}, split {c['split_rows']}, dropped {c['dropped_rows']}; "
             f"bad rows skipped: {c['bad_rows']}"]
    lines += [f"  bad row {example}" for example in c["bad_row_examples"][:5]]
    return "\n".join(lines)
