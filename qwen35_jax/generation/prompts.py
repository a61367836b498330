"""Prompts from JSONL rows, and what a checkpoint says about its tokenizer and stop tokens.

A row gives its prompt as `prompt_ids` (token ids), `prompt` (text, tokenized as is) or `messages`
(a chat, rendered by the tokenizer's chat template with its generation prompt); `PromptEncoder`
(`qwen35_jax.data.rows`, the tokenization training rows go through too) turns it into ids. Every other
field is the caller's (kept in the output, read by a reward). Shared by `scripts/generate.py` and the
online RL loop.
"""

from __future__ import annotations

import json
import os
from typing import Any

import yaml

from qwen35_jax.checkpoint import is_checkpoint, read_metadata, resolve_checkpoint
from qwen35_jax.data.rows import PROMPT_FIELDS, BadRow, PromptEncoder, load_tokenizer
from qwen35_jax.run_layout import CONFIG_FILE, is_run_dir

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


__all__ = ["PROMPT_FIELDS", "BadRow", "PromptEncoder", "default_stop_token_ids", "load_tokenizer",
           "model_tokenizer", "parse_chat_template_kwargs", "parse_stop_token_ids", "read_prompt_rows",
           "stop_token_ids", "tokenizer_dir_for"]
