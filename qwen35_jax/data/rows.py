"""One JSONL row -> (token ids, loss mask): text, input_ids (+ loss_mask), messages, prompt/response.

The loss mask is aligned with the log-probs, as in the prepared dataset: `loss_mask[t] = 1` trains the
prediction of `tokens[t + 1]`, so it is 0 at the row's last token. A row that cannot be used raises
`BadRow` with the reason; the caller adds the file and line.
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any

import numpy as np

from qwen35_jax.data.chat_masks import ChatTemplateError, assistant_mask

_LOADING = threading.Lock()  # grain maps rows on several threads; transformers' lazy imports are not thread-safe


BAD_ROW_POLICIES = ("skip", "stop")  # what the pipeline does with a BadRow: skip it (counted) or stop


class BadRow(ValueError):
    """A row that cannot be trained on; the message says why."""


def check_bad_rows(policy: str) -> None:
    if policy not in BAD_ROW_POLICIES:
        raise ValueError(f"bad rows policy must be one of {', '.join(BAD_ROW_POLICIES)}, got {policy!r}")


def load_tokenizer(directory: str) -> Any:
    """An HF tokenizer from a checkpoint or tokenizer directory (tokenizer.json, tokenizer_config.json)."""
    if not os.path.isdir(directory):
        raise ValueError(f"tokenizer directory not found: {directory}")
    try:
        with _LOADING:
            from transformers import AutoTokenizer  # slow to import: only when a tokenizer is needed

            return AutoTokenizer.from_pretrained(directory)
    except Exception as err:  # transformers raises OSError, ValueError, KeyError, ... for a bad directory
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ValueError(f"{directory}: cannot load the tokenizer ({message})") from None


def check_tokenizer(tokenizer: Any, vocab_size: int, *, source: str) -> None:
    """One-line ValueError unless every id the tokenizer can produce fits the model's vocabulary."""
    if len(tokenizer) > vocab_size:
        raise ValueError(f"tokenizer {source} has {len(tokenizer)} tokens but the model's vocabulary holds "
                         f"{vocab_size}: use the model's own tokenizer")


def prediction_mask(target_mask: np.ndarray) -> np.ndarray:  # [L] -> [L]
    """Per-token "train on this token" -> aligned with the log-probs (entry t predicts token t + 1)."""
    return np.concatenate([target_mask[1:], [0]]).astype(np.int32)


class RowEncoder:
    """Turns parsed JSONL rows into (tokens int32 [L], loss_mask int32 [L]).

    Picklable for grain's worker processes: the tokenizer is loaded in each process on first use.
    """

    def __init__(self, tokenizer_dir: str | None, vocab_size: int, *, loaded: Any = None):
        self.tokenizer_dir, self.vocab_size = tokenizer_dir, vocab_size
        self._tokenizer = loaded  # the tokenizer of `tokenizer_dir`, when the caller has it already

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokenizer": None}

    @property
    def tokenizer(self) -> Any:
        if self._tokenizer is None:
            if self.tokenizer_dir is None:
                raise BadRow("text, messages and prompt/response rows need a tokenizer (--tokenizer)")
            tokenizer = load_tokenizer(self.tokenizer_dir)
            self._tokenizer = self._tokenizer or tokenizer
        return self._tokenizer

    def encode_line(self, text: bytes) -> tuple[np.ndarray, np.ndarray]:
        try:
            row = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise BadRow(f"invalid JSON ({err})") from None
        return self.encode(row)

    def encode(self, row: Any) -> tuple[np.ndarray, np.ndarray]:
        if not isinstance(row, dict):
            raise BadRow(f"expected a JSON object, got {type(row).__name__}")
        if "messages" in row:
            tokens, loss_mask = self._messages(row["messages"])
        elif "prompt" in row or "response" in row:
            tokens, loss_mask = self._prompt_response(row)
        elif "text" in row:
            tokens, loss_mask = self._text(row["text"])
        elif "input_ids" in row:
            tokens, loss_mask = self._input_ids(row["input_ids"], row.get("loss_mask"))
        else:
            raise BadRow("no 'text', 'input_ids', 'messages' or 'prompt'/'response' field")
        if len(tokens) and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            bad = int(tokens[(tokens < 0) | (tokens >= self.vocab_size)][0])
            raise BadRow(f"token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        if not loss_mask.any():
            raise BadRow("nothing to train on (no token has loss)")
        return tokens.astype(np.int32), loss_mask

    def _tokenize(self, text: Any, field: str) -> np.ndarray:
        if not isinstance(text, str):
            raise BadRow(f"'{field}' must be a string, got {type(text).__name__}")
        return np.asarray(self.tokenizer(text, add_special_tokens=False)["input_ids"], np.int64)

    def _eos(self) -> np.ndarray:
        eos = self.tokenizer.eos_token_id
        if eos is None:
            raise BadRow(f"tokenizer {self.tokenizer_dir} has no EOS token, needed to end text rows")
        return np.asarray([eos], np.int64)

    def _text(self, text: Any) -> tuple[np.ndarray, np.ndarray]:
        tokens = np.concatenate([self._tokenize(text, "text"), self._eos()])
        return tokens, prediction_mask(np.ones(len(tokens), np.int32))

    def _prompt_response(self, row: dict) -> tuple[np.ndarray, np.ndarray]:
        for field in ("prompt", "response"):
            if field not in row:
                raise BadRow(f"'{field}' is missing (prompt/response rows need both)")
        prompt = self._tokenize(row["prompt"], "prompt")
        response = np.concatenate([self._tokenize(row["response"], "response"), self._eos()])
        target = np.concatenate([np.zeros(len(prompt), np.int32), np.ones(len(response), np.int32)])
        return np.concatenate([prompt, response]), prediction_mask(target)

    def _input_ids(self, ids: Any, loss_mask: Any) -> tuple[np.ndarray, np.ndarray]:
        tokens = self._int_list(ids, "input_ids")
        if loss_mask is None:
            return tokens, prediction_mask(np.ones(len(tokens), np.int32))
        mask = self._int_list(loss_mask, "loss_mask")
        if len(mask) != len(tokens):
            raise BadRow(f"loss_mask has {len(mask)} entries, input_ids {len(tokens)}")
        if not np.isin(mask, (0, 1)).all():
            raise BadRow("loss_mask must hold only 0 and 1")
        if mask[-1]:
            raise BadRow("loss_mask ends in 1, but entry t trains the prediction of token t + 1 "
                         "and the last token has none: shift the mask left by one")
        return tokens, mask.astype(np.int32)

    @staticmethod
    def _int_list(value: Any, field: str) -> np.ndarray:
        if not isinstance(value, list) or not value:
            raise BadRow(f"'{field}' must be a non-empty list of integers")
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            raise BadRow(f"'{field}' must hold only integers")
        return np.asarray(value, np.int64)

    def _messages(self, messages: Any) -> tuple[np.ndarray, np.ndarray]:
        if not isinstance(messages, list) or not messages:
            raise BadRow("'messages' must be a non-empty list")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                    or not isinstance(message.get("content"), str):
                raise BadRow(f"message {i} needs a string 'role' and a string 'content'")
        if self.tokenizer.chat_template is None:
            raise BadRow(f"tokenizer {self.tokenizer_dir} has no chat template, needed for 'messages' rows")
        try:
            tokens, assistant = assistant_mask(self.tokenizer, messages)
        except ChatTemplateError as err:
            raise BadRow(str(err)) from None
        return tokens, prediction_mask(assistant)
