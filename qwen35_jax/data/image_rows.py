"""Chat rows with images: message parts, the images' patches, and the image-pad tokens they become.

A message's `content` is a string or a list of parts in the HF chat format: `{"type": "text", "text":
STR}` and `{"type": "image", "image": PATH}`, PATH absolute or relative to the JSONL file's folder. The
tokenizer's chat template renders each image part as `<|vision_start|><|image_pad|><|vision_end|>` (one
pad per image, in message and part order); `expand_images` then repeats each pad to its image's merged
token count, t * h * w / merge_size**2 (`mrope.expand_image_placeholders`), and the row carries the
images' patches [P, patch_dim] and grids [N, 3] beside its tokens.

Loss on images. The model never predicts an image pad (it cannot write images) and nothing is
predicted from one: `loss_mask[t] = 0` where tokens[t] or tokens[t + 1] is an image pad. Images sit in
user turns, which carry no loss anyway; the rule also holds for a template that places them elsewhere.
The `<|vision_end|>` after an image is predicted from the image's last pad, so it has no loss either.

An assistant message must be text: its list of text parts is joined into one string before rendering
(how Qwen's templates render it), so the assistant-token masks of `chat_masks` work on it unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np

from qwen35_jax.data.images import ImageError, resolve_image_path
from qwen35_jax.data.mrope import expand_image_placeholders, merged_token_count

if TYPE_CHECKING:
    from qwen35_jax.data.images import ImageProcessor

IMAGE_PAD = "<|image_pad|>"  # the token the Qwen3.5 chat template writes once per image
PART_TYPES = ("text", "image")


class BadContent(ValueError):
    """A message part that is not text or an image (rows.py turns it into a BadRow)."""


class RowImages(NamedTuple):
    patches: np.ndarray  # float32 [P, patch_dim], image after image, in transformers' order
    grids_thw: np.ndarray  # int64 [N, 3]: (t, h, w) patches of each image


def content_images(index: int, content: Any) -> list[str]:
    """The image paths of message `index`'s content (a string has none); BadContent for a malformed
    list of parts."""
    if isinstance(content, str):
        return []
    if not isinstance(content, list) or not content:
        raise BadContent(f"message {index} needs a string 'role' and a string 'content' or a non-empty list "
                         f"of text and image parts")
    paths = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in PART_TYPES:
            raise BadContent(f"message {index} part {j} must be an object with 'type' text or image")
        if not isinstance(part.get(kind), str) or (kind == "image" and not part[kind]):
            raise BadContent(f"message {index} part {j} ({kind}) needs a string '{kind}'")
        if kind == "image":
            paths.append(part["image"])
    return paths


def template_messages(messages: list[dict]) -> list[dict]:
    """The messages as the chat template gets them: an assistant message's text parts joined into one
    string content (other messages as they are). BadContent for an image in an assistant message."""
    out = []
    for i, message in enumerate(messages):
        content = message["content"]
        if message["role"] == "assistant" and isinstance(content, list):
            if any(part["type"] != "text" for part in content):
                raise BadContent(f"message {i}: an assistant message cannot hold images (the model does not "
                                 f"write them)")
            message = {**message, "content": "".join(part["text"] for part in content)}
        out.append(message)
    return out


def image_token_id(tokenizer: Any) -> int:
    """The id of `<|image_pad|>` in the tokenizer; BadContent when it has none."""
    token_id = tokenizer.get_vocab().get(IMAGE_PAD)
    if token_id is None:
        raise BadContent(f"rows with images need the tokenizer's {IMAGE_PAD} token; this tokenizer has none")
    return int(token_id)


def row_images(paths: list[str], base_dir: str | None, processor: ImageProcessor | None) -> RowImages:
    """The images of a row, loaded and processed; BadContent (one line, naming the path) for an image
    that cannot be read or processed, or when the run's model has no vision tower (no processor)."""
    if processor is None:
        raise BadContent(f"image {resolve_image_path(paths[0], base_dir)}: the model has no vision tower, "
                         f"so rows with images cannot be used")
    try:
        return RowImages(*processor.process_paths(paths, base_dir))
    except ImageError as err:
        raise BadContent(str(err)) from None


def expand_images(tokens: np.ndarray, target: np.ndarray, grids_thw: np.ndarray, pad_id: int,
                  merge_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [L], per-token target mask [L]) with one pad per image -> both with each pad repeated to
    its image's merged token count [L'], the target 0 on every pad. BadContent when the rendered row's
    pads do not match the images one to one (a template that does not write one pad per image part,
    or a pad written in the text)."""
    pads = tokens == pad_id  # [L]
    if int(pads.sum()) != len(grids_thw):
        raise BadContent(f"the chat template wrote {int(pads.sum())} {IMAGE_PAD} tokens for {len(grids_thw)} "
                         f"images (it must write one per image part)")
    if np.any(pads[1:] & pads[:-1]):
        raise BadContent(f"two {IMAGE_PAD} tokens with nothing between them: the chat template must wrap each "
                         f"image in <|vision_start|> ... <|vision_end|>")
    counts = np.ones(len(tokens), np.int64)  # [L]
    counts[pads] = [merged_token_count(grid, merge_size) for grid in grids_thw]
    expanded = np.asarray(expand_image_placeholders(tokens, grids_thw, pad_id, merge_size), np.int64)  # [L']
    target = np.repeat(target, counts).astype(np.int32)  # [L']
    assert len(expanded) == len(target)
    target[expanded == pad_id] = 0
    return expanded, target


def image_loss_mask(tokens: np.ndarray, loss_mask: np.ndarray, pad_id: int) -> np.ndarray:  # [L] -> [L]
    """A prediction-aligned loss mask with nothing predicted from an image pad (loss_mask[t] = 0 where
    tokens[t] is a pad); predictions of a pad are 0 already when the target mask was 0 on pads."""
    out = loss_mask.copy()
    out[tokens == pad_id] = 0
    return out


def image_spans(tokens: np.ndarray, pad_id: int) -> np.ndarray:  # [N, 2] int64
    """[start, end) of each run of image pads in `tokens` (one run per image in a rendered row)."""
    pads = np.concatenate([[False], np.asarray(tokens) == pad_id, [False]]).astype(np.int8)
    edges = np.flatnonzero(np.diff(pads))
    return edges.reshape(-1, 2).astype(np.int64)
