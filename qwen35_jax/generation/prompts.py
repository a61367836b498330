"""Prompts from JSONL rows, and what a checkpoint says about its tokenizer and stop tokens.

A row gives its prompt as `prompt_ids` (token ids), `prompt` (text, tokenized as is) or `messages`
(a chat, rendered by the tokenizer's chat template with its generation prompt). Every other field is
the caller's (kept in the output, read by a reward). Shared by `scripts/generate.py` and the online
RL loop.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any

import yaml

from qwen35_jax.checkpoint import is_checkpoint, read_metadata, resolve_checkpoint
from qwen35_jax.data.rows import BadRow, load_tokenizer
from qwen35_jax.run_layout import CONFIG_FILE, is_run_dir

PROMPT_FIELDS = ("prompt_ids", "prompt", "messages")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


def read_prompt_rows(path: str) -> list[dict[str, Any]]:
    """The JSON objects of a JSONL file (blank lines skipped); ValueError naming the file and line."""
    if not os.path.isfile(path):
        raise ValueError(f"prompts file not found: {path}")
    rows = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise ValueError(f"{path} line {number}: invalid JSON ({err})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path} line {number}: expected a JSON object, got {type(row).__name__}")
            rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows


class PromptEncoder:
    """JSONL row -> prompt token ids. `tokenizer` (an HF tokenizer or None) is needed for text and chats."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, chat_template_kwargs: Mapping[str, Any] | None = None,
                 tokenizer_source: str | None = None):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.source = tokenizer_source

    def encode(self, row: Mapping[str, Any]) -> list[int]:
        """The row's prompt ids; BadRow with the reason."""
        given = [f for f in PROMPT_FIELDS if f in row]
        if len(given) != 1:
            raise BadRow(f"needs exactly one of {', '.join(PROMPT_FIELDS)}; has {given or 'none'}")
        field = given[0]
        if field == "prompt_ids":
            ids = row["prompt_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise BadRow("'prompt_ids' must be a list of integers")
        elif field == "prompt":
            if not isinstance(row["prompt"], str):
                raise BadRow(f"'prompt' must be a string, got {type(row['prompt']).__name__}")
            ids = self._tokenizer("prompt").encode(row["prompt"])
        else:
            ids = self._chat(row["messages"])
        if not ids:
            raise BadRow("the prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise BadRow(f"token id {bad[0]} is outside the vocabulary [0, {self.vocab_size})")
        return list(ids)

    def decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def _tokenizer(self, field: str) -> Any:
        if self.tokenizer is None:
            raise BadRow(f"a '{field}' row needs a tokenizer (--tokenizer; none was found with the model)")
        return self.tokenizer

    def _chat(self, messages: Any) -> list[int]:
        tokenizer = self._tokenizer("messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise BadRow("'messages' must be a list of objects with 'role' and 'content'")
        if not getattr(tokenizer, "chat_template", None):
            where = f" at {self.source}" if self.source else ""
            raise BadRow(f"'messages' need a chat template; the tokenizer{where} has none")
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 **self.chat_template_kwargs)
        except Exception as err:  # the template's own errors (jinja, a missing role...) name the problem
            raise BadRow(f"the chat template failed on 'messages' ({str(err).splitlines()[0]})") from None
        return tokenizer.encode(text, add_special_tokens=False)


def run_dir_of(path: str) -> str | None:
    """The run directory `path` is, or whose checkpoint it is (RUN/checkpoints/<step>), else None."""
    path = os.path.abspath(path)
    if is_run_dir(path):
        return path
    parent = os.path.dirname(os.path.dirname(path))
    return parent if is_checkpoint(path) and is_run_dir(parent) else None


def run_options(run_dir: str) -> dict[str, Any]:
    config = os.path.join(run_dir, CONFIG_FILE)
    if not os.path.isfile(config):
        return {}
    with open(config) as f:
        return yaml.safe_load(f) or {}


def has_tokenizer(path: str | None) -> bool:
    return bool(path) and any(os.path.isfile(os.path.join(path, n)) for n in TOKENIZER_FILES)


def tokenizer_dir_for(model_path: str) -> str | None:
    """Where the model's tokenizer lives: its own directory (HF checkpoints), else for a run (or one of
    its checkpoints) the run's --tokenizer, else the run's --model directory; None when unknown."""
    if has_tokenizer(model_path):
        return model_path
    run = run_dir_of(model_path)
    if run is not None:
        options = run_options(run)
        for candidate in (options.get("tokenizer"), options.get("model")):
            if has_tokenizer(candidate):
                return candidate
    return None


def model_tokenizer(model_path: str | None, explicit: str | None) -> tuple[Any, str | None]:
    """(the HF tokenizer or None, its directory): `explicit` (--tokenizer), else `tokenizer_dir_for`."""
    directory = explicit or (tokenizer_dir_for(model_path) if model_path else None)
    return (load_tokenizer(directory) if directory else None), directory


def parse_stop_token_ids(text: str) -> list[int]:
    """--stop-token-ids "1,2" -> [1, 2] ("" -> none); one-line ValueError otherwise."""
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--stop-token-ids must be comma-separated integers, got {text!r}") from None


def stop_token_ids(text: str | None, model_path: str | None, tokenizer: Any) -> list[int]:
    """--stop-token-ids when given, else the checkpoint's eos ids (`default_stop_token_ids`), else none."""
    if text is not None:
        return parse_stop_token_ids(text)
    return default_stop_token_ids(model_path, tokenizer) if model_path else []


def parse_chat_template_kwargs(text: str | None) -> dict[str, Any]:
    """--chat-template-kwargs: a JSON object (None -> {}); one-line ValueError otherwise."""
    if text is None:
        return {}
    try:
        kwargs = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"--chat-template-kwargs is not JSON ({err})") from None
    if not isinstance(kwargs, dict):
        raise ValueError("--chat-template-kwargs must be a JSON object")
    return kwargs


def _eos_ids(value: Any) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in (value if isinstance(value, list) else [value])]


def default_stop_token_ids(model_path: str, tokenizer: Any) -> list[int]:
    """The checkpoint's end-of-sequence ids: generation_config.json, else config.json (the HF config an
    imported checkpoint keeps), else the tokenizer's eos token; [] when none says."""
    candidates = [model_path]
    run = run_dir_of(model_path)
    if run is not None:
        candidates.append(run_options(run).get("model"))
    for directory in filter(None, candidates):
        generation = os.path.join(directory, "generation_config.json")
        if os.path.isfile(generation):
            with open(generation) as f:
                ids = _eos_ids(json.load(f).get("eos_token_id"))
            if ids:
                return ids
        config = os.path.join(directory, "config.json")
        if os.path.isfile(config):
            with open(config) as f:
                raw = json.load(f)
            ids = _eos_ids(raw.get("eos_token_id", raw.get("text_config", {}).get("eos_token_id")))
            if ids:
                return ids
    checkpoint = resolve_checkpoint(model_path)
    if is_checkpoint(checkpoint):
        hf_config = read_metadata(checkpoint).get("hf_config") or {}
        ids = _eos_ids(hf_config.get("eos_token_id", (hf_config.get("text_config") or {}).get("eos_token_id")))
        if ids:
            return ids
    eos = getattr(tokenizer, "eos_token_id", None) if tokenizer is not None else None
    return [] if eos is None else [int(eos)]


__all__ = ["BadRow", "PromptEncoder", "default_stop_token_ids", "load_tokenizer", "model_tokenizer",
           "parse_chat_template_kwargs", "parse_stop_token_ids", "read_prompt_rows", "stop_token_ids",
           "tokenizer_dir_for"]
