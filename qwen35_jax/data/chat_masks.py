"""Which tokens of a rendered conversation the assistant wrote: the tokens a chat row trains on.

Two ways to find them, which agree on a template that supports both:
- `{% generation %}` markers in the chat template: transformers returns the mask itself
  (`apply_chat_template(..., return_assistant_tokens_mask=True)`).
- Without markers (Qwen's own templates have none): render the conversation prefix by prefix. The
  assistant's part of turn i is what `messages[:i + 1]` adds to `messages[:i]` plus the generation
  prompt. A template that renders a turn differently once later turns follow (Qwen3's drop the empty
  thinking block of earlier turns) is followed into the whole conversation: the turn then ends where
  its content, and what the template writes after it, end there.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np

GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


class ChatTemplateError(ValueError):
    """The template cannot render this conversation (a role it rejects, a missing field, ...)."""


def has_generation_markers(tokenizer: Any) -> bool:
    template = tokenizer.chat_template
    return isinstance(template, str) and bool(GENERATION_MARKER.search(template))


def _render(tokenizer: Any, messages: list[dict], *, generation_prompt: bool = False) -> str:
    try:
        return tokenizer.apply_chat_template(messages, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception as err:  # jinja2 raises TemplateError, UndefinedError, TypeError, ...
        raise ChatTemplateError(f"chat template rejects the conversation: {err}") from None


def assistant_mask_from_markers(tokenizer: Any, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, 1 where the assistant wrote the token) from the template's generation markers."""
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
    except Exception as err:
        raise ChatTemplateError(f"chat template rejects the conversation: {err}") from None
    return (np.asarray(out["input_ids"], np.int64),  # [L]
            np.asarray(out["assistant_masks"], np.int32))  # [L]


def assistant_spans_by_prefixes(tokenizer: Any, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character span [start, end) of each assistant turn."""
    full = _render(tokenizer, messages)
    spans = []
    for i, message in enumerate(messages):
        if message.get("role") != "assistant":
            continue
        before = _render(tokenizer, messages[:i], generation_prompt=True)
        through = _render(tokenizer, messages[:i + 1])
        if not (through.startswith(before) and full.startswith(before)):
            raise ChatTemplateError(
                f"chat template does not render message {i} as a continuation of the messages before it, "
                "so its assistant tokens cannot be found; use a template with {% generation %} markers")
        if full.startswith(through):
            spans.append((len(before), len(through)))
        else:
            spans.append((len(before), _turn_end_in_full(full, through, len(before), message["content"], i)))
    return full, spans


def _turn_end_in_full(full: str, through: str, start: int, content: str, index: int) -> int:
    """Where assistant message `index` ends in `full` when the template renders it differently once more
    messages follow (Qwen3's templates keep the empty thinking block only after the last user turn):
    the end of its content in `full` plus what the template writes after the content (`<|im_end|>\n`)."""
    at_through, at_full = through.rfind(content), full.find(content, start)
    if content and at_through >= 0 and at_full >= 0:
        tail = through[at_through + len(content):]
        end = at_full + len(content)
        if full.startswith(tail, end):
            return end + len(tail)
    raise ChatTemplateError(
        f"chat template renders assistant message {index} differently once later messages follow and its "
        "content cannot be found in the whole conversation; use a template with {% generation %} markers")


def assistant_mask_by_prefixes(tokenizer: Any, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """(token ids, 1 where the assistant wrote the token), found by rendering prefix by prefix."""
    text, spans = assistant_spans_by_prefixes(tokenizer, messages)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = np.asarray(encoded["input_ids"], np.int64)  # [L]
    token_starts = np.asarray([start for start, _ in encoded["offset_mapping"]], np.int64)  # [L]
    mask = np.zeros(len(ids), np.int32)
    for start, end in spans:
        mask[(token_starts >= start) & (token_starts < end)] = 1
    return ids, mask


def assistant_mask(tokenizer: Any, messages: list[dict]) -> tuple[np.ndarray, np.ndarray]:
    """The markers' mask when the template has them, else the prefix-by-prefix one."""
    if has_generation_markers(tokenizer):
        return assistant_mask_from_markers(tokenizer, messages)
    return assistant_mask_by_prefixes(tokenizer, messages)
