"""JSONL rows -> token ids: a training row's (tokens, loss mask), and a prompt row's prompt.

`RowEncoder` turns a training row (text, input_ids (+ loss_mask), messages, prompt/response) into
tokens and a loss mask aligned with the log-probs, as in the prepared dataset: `loss_mask[t] = 1`
trains the prediction of `tokens[t + 1]`, so it is 0 at the row's last token.

`PromptEncoder` turns a prompt row (prompt_ids, prompt or messages) into the ids generation and online
RL start from. It is also the tokenization `RowEncoder` goes through, so training rows and prompts are
tokenized one way: text as is, without special tokens (a prompt gets the ids a prompt/response
training row gives it, with BOS-adding tokenizers too); a conversation checked by `check_messages`
and rendered by the tokenizer's chat template; every id checked against the model's vocabulary.

A row that cannot be used raises `BadRow` with the reason; the caller adds the file and line.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Mapping
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


PROMPT_FIELDS = ("prompt_ids", "prompt", "messages")  # a prompt row gives exactly one of these


def check_vocabulary(ids: Any, vocab_size: int) -> None:
    """BadRow naming the first id of `ids` (a list or an array) outside [0, vocab_size)."""
    ids = np.asarray(ids, np.int64)
    outside = ids[(ids < 0) | (ids >= vocab_size)]
    if outside.size:
        raise BadRow(f"token id {int(outside[0])} is outside the vocabulary [0, {vocab_size})")


def check_messages(messages: Any) -> None:
    """BadRow unless `messages` is a conversation: a non-empty list of objects with a string 'role' and
    a string 'content'."""
    if not isinstance(messages, list) or not messages:
        raise BadRow("'messages' must be a non-empty list")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                or not isinstance(message.get("content"), str):
            raise BadRow(f"message {i} needs a string 'role' and a string 'content'")


def prediction_mask(target_mask: np.ndarray) -> np.ndarray:  # [L] -> [L]
    """Per-token "train on this token" -> aligned with the log-probs (entry t predicts token t + 1)."""
    return np.concatenate([target_mask[1:], [0]]).astype(np.int32)


class PromptEncoder:
    """Prompt row -> prompt token ids, and the tokenization `RowEncoder` goes through. `tokenizer` is
    an HF tokenizer (needed for text and chats) or None; `chat_template_kwargs` go to the chat template
    when it renders a prompt's 'messages'; `tokenizer_source` (its directory) names it in errors."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, chat_template_kwargs: Mapping[str, Any] | None = None,
                 tokenizer_source: str | None = None):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.source = tokenizer_source

    def encode(self, row: Any) -> list[int]:
        """The prompt ids of a prompt row: its `prompt_ids`, its `prompt` tokenized, or its `messages`
        rendered with the generation prompt; BadRow with the reason."""
        if not isinstance(row, dict):
            raise BadRow(f"expected a JSON object, got {type(row).__name__}")
        given = [f for f in PROMPT_FIELDS if f in row]
        if len(given) != 1:
            raise BadRow(f"needs exactly one of {', '.join(PROMPT_FIELDS)}; has {given or 'none'}")
        field = given[0]
        if field == "prompt_ids":
            ids = row["prompt_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
                raise BadRow("'prompt_ids' must be a list of integers")
        elif field == "prompt":
            ids = self.tokenize(row["prompt"], "prompt")
        else:
            ids = self.chat_prompt(row["messages"])
        if not ids:
            raise BadRow("the prompt is empty")
        check_vocabulary(ids, self.vocab_size)
        return list(ids)

    def decode(self, ids: list[int]) -> str | None:
        return None if self.tokenizer is None else self.tokenizer.decode(ids, skip_special_tokens=True)

    def tokenize(self, text: Any, field: str) -> list[int]:
        """The ids of the string `text` (row field `field`), without special tokens."""
        if not isinstance(text, str):
            raise BadRow(f"'{field}' must be a string, got {type(text).__name__}")
        return list(self._tokenizer(field)(text, add_special_tokens=False)["input_ids"])

    def chat_tokenizer(self) -> Any:
        """The tokenizer, which must have a chat template to render 'messages'."""
        tokenizer = self._tokenizer("messages")
        if not getattr(tokenizer, "chat_template", None):
            where = f" at {self.source}" if self.source else ""
            raise BadRow(f"'messages' need a chat template; the tokenizer{where} has none")
        return tokenizer

    def chat_prompt(self, messages: Any) -> list[int]:
        """A conversation rendered by the chat template with its generation prompt (and
        `chat_template_kwargs`), tokenized without special tokens: what the model continues."""
        check_messages(messages)
        tokenizer = self.chat_tokenizer()
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                                 **self.chat_template_kwargs)
        except Exception as err:  # the template's own errors (jinja, a missing role...) name the problem
            first = (str(err).splitlines() or [type(err).__name__])[0]
            raise BadRow(f"the chat template failed on 'messages' ({first})") from None
        return self.tokenize(text, "messages")

    def _tokenizer(self, field: str) -> Any:
        if self.tokenizer is None:
            raise BadRow(f"a '{field}' row needs a tokenizer (--tokenizer; none was found with the model)")
        return self.tokenizer


class RowEncoder:
    """Turns parsed JSONL rows into (tokens int32 [L], loss_mask int32 [L]), tokenizing through a
    `PromptEncoder`.

    Picklable for grain's worker processes: the tokenizer is loaded in each process on first use.
    """

    def __init__(self, tokenizer_dir: str | None, vocab_size: int, *, loaded: Any = None):
        self.tokenizer_dir, self.vocab_size = tokenizer_dir, vocab_size
        # the tokenizer of `tokenizer_dir`, when the caller has it already
        self._prompts = None if loaded is None else self._prompt_encoder(loaded)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_prompts": None}

    def _prompt_encoder(self, tokenizer: Any) -> PromptEncoder:
        return PromptEncoder(tokenizer, self.vocab_size, tokenizer_source=self.tokenizer_dir)

    @property
    def prompts(self) -> PromptEncoder:
        """The `PromptEncoder` of this row encoder's tokenizer (loaded on first use)."""
        if self._prompts is None:
            if self.tokenizer_dir is None:
                raise BadRow("text, messages and prompt/response rows need a tokenizer (--tokenizer)")
            prompts = self._prompt_encoder(load_tokenizer(self.tokenizer_dir))
            self._prompts = self._prompts or prompts  # another thread may have loaded it meanwhile
        return self._prompts

    @property
    def tokenizer(self) -> Any:
        return self.prompts.tokenizer

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
        check_vocabulary(tokens, self.vocab_size)
        if not loss_mask.any():
            raise BadRow("nothing to train on (no token has loss)")
        return tokens.astype(np.int32), loss_mask

    def _tokenize(self, text: Any, field: str) -> np.ndarray:
        return np.asarray(self.prompts.tokenize(text, field), np.int64)

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
        check_messages(messages)
        tokenizer = self.prompts.chat_tokenizer()
        try:
            tokens, assistant = assistant_mask(tokenizer, messages)
        except ChatTemplateError as err:
            raise BadRow(str(err)) from None
        return tokens, prediction_mask(assistant)
