"""JSONL rows -> token ids: a training row's (tokens, loss mask), and a prompt row's prompt.

`RowEncoder` turns a training row (text, input_ids (+ loss_mask), messages, prompt/response) into
tokens and a loss mask aligned with the log-probs, as in the prepared dataset: `loss_mask[t] = 1`
trains the prediction of `tokens[t + 1]`, so it is 0 at the row's last token.

`PromptEncoder` turns a prompt row (prompt_ids, prompt or messages) into the ids generation and online
RL start from. It is also the tokenization `RowEncoder` goes through, so training rows and prompts are
tokenized one way: text as is, without special tokens (a prompt gets the ids a prompt/response
training row gives it, with BOS-adding tokenizers too); a conversation checked by `check_messages`
and rendered by the tokenizer's chat template; every id checked against the model's vocabulary.

A conversation's messages may hold images (`data/image_rows.py`): the row then also carries their
patches and grids (`Encoded.images`), its image pads expanded to the images' sizes. That needs an
`ImageProcessor` (the model's vision tower); text-only runs tokenise without one.

A row that cannot be used raises `BadRow` with the reason; the caller adds the file and line.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
from collections.abc import Iterator, Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from qwen35_jax.data.chat_masks import ChatTemplateError, assistant_mask
from qwen35_jax.data.image_rows import (BadContent, RowImages, content_images, expand_images, image_loss_mask,
                                        image_token_id, row_images, template_messages)

if TYPE_CHECKING:
    from qwen35_jax.data.images import ImageProcessor

_LOADING = threading.Lock()  # grain maps rows on several threads; transformers' lazy imports are not thread-safe


BAD_ROW_POLICIES = ("skip", "stop")  # what the pipeline does with a BadRow: skip it (counted) or stop


class BadRow(ValueError):
    """A row that cannot be trained on; the message says why."""


class Encoded(NamedTuple):
    """An encoded training row."""

    tokens: np.ndarray  # int32 [L]
    loss_mask: np.ndarray  # int32 [L]: entry t trains the prediction of tokens[t + 1]
    images: RowImages | None  # patches [P, patch_dim] and grids_thw [N, 3] of the row's images; None: none


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


def check_messages(messages: Any) -> list[str]:
    """BadRow unless `messages` is a conversation: a non-empty list of objects with a string 'role' and
    a 'content' that is a string or a list of text and image parts. Returns the image paths in order."""
    if not isinstance(messages, list) or not messages:
        raise BadRow("'messages' must be a non-empty list")
    paths = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise BadRow(f"message {i} needs a string 'role' and a string 'content'")
        with _as_bad_row():
            paths += content_images(i, message.get("content"))
    return paths


@contextlib.contextmanager
def _as_bad_row() -> Iterator[None]:
    """image_rows' BadContent as a BadRow."""
    try:
        yield
    except BadContent as err:
        raise BadRow(str(err)) from None


def _chat_messages(messages: list[dict]) -> list[dict]:
    with _as_bad_row():
        return template_messages(messages)


def _need_vision(paths: list[str], base_dir: str | None, processor: ImageProcessor | None) -> None:
    """BadRow naming the first image when there are images and no vision tower (no processor)."""
    if paths and processor is None:
        with _as_bad_row():
            row_images(paths, base_dir, None)


def _with_images(tokens: np.ndarray, target: np.ndarray, tokenizer: Any, paths: list[str], base_dir: str | None,
                 processor: ImageProcessor) -> tuple[np.ndarray, np.ndarray, RowImages]:
    """(tokens [L], target mask [L]) of a rendered row with one pad per image -> expanded [L'], and the
    images; BadRow naming the path of an image that cannot be used."""
    with _as_bad_row():
        images = row_images(paths, base_dir, processor)
        tokens, target = expand_images(tokens, target, images.grids_thw, image_token_id(tokenizer),
                                       processor.merge_size)
    return tokens, target, images


def prediction_mask(target_mask: np.ndarray) -> np.ndarray:  # [L] -> [L]
    """Per-token "train on this token" -> aligned with the log-probs (entry t predicts token t + 1)."""
    return np.concatenate([target_mask[1:], [0]]).astype(np.int32)


class PromptEncoder:
    """Prompt row -> prompt token ids, and the tokenization `RowEncoder` goes through. `tokenizer` is
    an HF tokenizer (needed for text and chats) or None; `chat_template_kwargs` go to the chat template
    when it renders a prompt's 'messages'; `tokenizer_source` (its directory) names it in errors;
    `image_processor` processes the images of 'messages' (None: the model has no vision tower)."""

    def __init__(self, tokenizer: Any, vocab_size: int, *, chat_template_kwargs: Mapping[str, Any] | None = None,
                 tokenizer_source: str | None = None, image_processor: ImageProcessor | None = None):
        self.tokenizer, self.vocab_size = tokenizer, vocab_size
        self.chat_template_kwargs = dict(chat_template_kwargs or {})
        self.source = tokenizer_source
        self.image_processor = image_processor

    def encode(self, row: Any, base_dir: str | None = None) -> list[int]:
        """The prompt ids of a prompt row: its `prompt_ids`, its `prompt` tokenized, or its `messages`
        rendered with the generation prompt; BadRow with the reason. Image pads come expanded; a
        caller that feeds images uses `encode_with_images` for their patches."""
        return self.encode_with_images(row, base_dir)[0]

    def encode_with_images(self, row: Any, base_dir: str | None = None) -> tuple[list[int], RowImages | None]:
        """`encode`, and the images of a 'messages' prompt (None without images); image paths are
        relative to `base_dir` (the prompt file's folder)."""
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
        images = None
        if field == "prompt":
            ids = self.tokenize(row["prompt"], "prompt")
        elif field == "messages":
            ids, images = self.chat_prompt_with_images(row["messages"], base_dir)
        if not ids:
            raise BadRow("the prompt is empty")
        check_vocabulary(ids, self.vocab_size)
        return list(ids), images

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
        return self.chat_prompt_with_images(messages)[0]

    def chat_prompt_with_images(self, messages: Any, base_dir: str | None = None
                                ) -> tuple[list[int], RowImages | None]:
        """`chat_prompt`, its image pads expanded, and its images (None without images)."""
        paths = check_messages(messages)
        _need_vision(paths, base_dir, self.image_processor)
        tokenizer = self.chat_tokenizer()
        try:
            text = tokenizer.apply_chat_template(_chat_messages(messages), tokenize=False,
                                                 add_generation_prompt=True, **self.chat_template_kwargs)
        except BadRow:
            raise
        except Exception as err:  # the template's own errors (jinja, a missing role...) name the problem
            first = (str(err).splitlines() or [type(err).__name__])[0]
            raise BadRow(f"the chat template failed on 'messages' ({first})") from None
        ids = self.tokenize(text, "messages")
        if not paths:
            return ids, None
        tokens = np.asarray(ids, np.int64)
        tokens, _, images = _with_images(tokens, np.zeros(len(tokens), np.int32), tokenizer, paths, base_dir,
                                         self.image_processor)
        return tokens.tolist(), images

    def _tokenizer(self, field: str) -> Any:
        if self.tokenizer is None:
            raise BadRow(f"a '{field}' row needs a tokenizer (--tokenizer; none was found with the model)")
        return self.tokenizer


class RowEncoder:
    """Turns parsed JSONL rows into (tokens int32 [L], loss_mask int32 [L]) (`encode`) or an `Encoded`
    row with its images too (`encode_example`), tokenizing through a `PromptEncoder`.
    `image_processor` processes the images of chat rows (None: the model has no vision tower, and a row
    with an image is a BadRow).

    Picklable for grain's worker processes: the tokenizer is loaded in each process on first use.
    """

    def __init__(self, tokenizer_dir: str | None, vocab_size: int, *, loaded: Any = None,
                 image_processor: ImageProcessor | None = None):
        self.tokenizer_dir, self.vocab_size = tokenizer_dir, vocab_size
        self.image_processor = image_processor
        # the tokenizer of `tokenizer_dir`, when the caller has it already
        self._prompts = None if loaded is None else self._prompt_encoder(loaded)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_prompts": None}

    def _prompt_encoder(self, tokenizer: Any) -> PromptEncoder:
        return PromptEncoder(tokenizer, self.vocab_size, tokenizer_source=self.tokenizer_dir,
                             image_processor=self.image_processor)

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

    def encode_line(self, text: bytes, base_dir: str | None = None) -> Encoded:
        """A JSONL line -> `Encoded`; image paths are relative to `base_dir` (the file's folder)."""
        try:
            row = json.loads(text)
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise BadRow(f"invalid JSON ({err})") from None
        return self.encode_example(row, base_dir)

    def encode(self, row: Any, base_dir: str | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(tokens int32 [L], loss_mask int32 [L]) of a row; `encode_example` also gives its images."""
        tokens, loss_mask, _ = self.encode_example(row, base_dir)
        return tokens, loss_mask

    def encode_example(self, row: Any, base_dir: str | None = None) -> Encoded:
        if not isinstance(row, dict):
            raise BadRow(f"expected a JSON object, got {type(row).__name__}")
        images = None
        if "messages" in row:
            tokens, loss_mask, images = self._messages(row["messages"], base_dir)
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
        return Encoded(tokens.astype(np.int32), loss_mask, images)

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

    def _messages(self, messages: Any, base_dir: str | None
                  ) -> tuple[np.ndarray, np.ndarray, RowImages | None]:
        paths = check_messages(messages)
        _need_vision(paths, base_dir, self.image_processor)
        tokenizer = self.prompts.chat_tokenizer()
        try:
            tokens, assistant = assistant_mask(tokenizer, _chat_messages(messages))
        except ChatTemplateError as err:
            raise BadRow(str(err)) from None
        if not paths:
            return tokens, prediction_mask(assistant), None
        tokens, target, images = _with_images(tokens, assistant, tokenizer, paths, base_dir, self.image_processor)
        loss_mask = image_loss_mask(tokens, prediction_mask(target), image_token_id(tokenizer))
        return tokens, loss_mask, images
