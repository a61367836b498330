"""What the model's vision tower reads for one call: `VisionInputs`, built on the host from images.

`build_vision_inputs` concatenates the images' flattened patches (transformers' `pixel_values` order, see
`vision/layout.py`), pads them to a bucket of P rows (one static shape per bucket, so jit compiles once per
bucket, not once per image size) and adds the per-patch layout of `vision_layout`. The tower turns the P
patches into P / merge_unit feature rows, the valid ones first in image order; the model writes them, in
order, over the image-pad and video-pad tokens of the batch taken row-major over [B, S]. So the images
(and videos) must be listed in the order their placeholders appear in the batch, and their merged token
counts must add up to the placeholders': `check_vision_tokens` says so on the host (inside jit the counts
are not known; a mismatch would silently reuse or drop rows).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from qwen35_jax.parallel.padding import padded_size
from qwen35_jax.vision.config import VisionConfig
from qwen35_jax.vision.layout import count_patches, vision_layout

if TYPE_CHECKING:
    from qwen35_jax.config import Qwen35Config


class VisionInputs(NamedTuple):
    """The tower's inputs for a bucket of P patches (a pytree of arrays, NumPy or jax)."""

    patches: np.ndarray  # [P, patch_dim] float: the images' flattened patches, then zero rows
    segment_ids: np.ndarray  # [P] int32: frame k of the call is k + 1, padding rows 0
    rope_rows_cols: np.ndarray  # [P, 2] int32: each patch's (row, col) in its frame
    interp_index: np.ndarray  # [P, 4] int32: learned-position taps
    interp_weight: np.ndarray  # [P, 4] float: their bilinear weights


def patch_bucket(num_patches: int, merge_unit: int) -> int:
    """The default bucket for `num_patches` patches: the next power of two (at least merge_unit), rounded up
    to a whole number of merge windows. Few distinct shapes, at most ~2x the patches."""
    p = max(int(num_patches), merge_unit, 1)
    p = 1 << (p - 1).bit_length()
    return padded_size(p, merge_unit)


def build_vision_inputs(images: Sequence[tuple[np.ndarray, Sequence[int]]], config: VisionConfig,
                        num_patches: int | None = None, *, dtype: np.dtype | str = np.float32) -> VisionInputs:
    """[(patches [t*h*w, patch_dim], grid_thw (t, h, w)), ...] in placeholder order -> `VisionInputs` padded
    to `num_patches` rows (default `patch_bucket`). Float arrays are `dtype`. A patch array whose shape does
    not match its grid, or a bucket too small, is a one-line ValueError."""
    if not images:
        raise ValueError("build_vision_inputs needs at least one image (pass vision=None for a text-only batch)")
    grids = np.asarray([list(g) for _, g in images], dtype=np.int64).reshape(len(images), -1)
    total = count_patches(grids, config)  # checks the grids
    for k, (patches, (t, h, w)) in enumerate(zip((p for p, _ in images), grids.tolist())):
        want = (t * h * w, config.patch_dim)
        if np.shape(patches) != want:
            raise ValueError(f"image {k} (grid {t}x{h}x{w}) has patches of shape {np.shape(patches)}, expected {want}")
    bucket = patch_bucket(total, config.merge_unit) if num_patches is None else int(num_patches)
    layout = vision_layout(grids, config, bucket)
    patches = np.zeros((bucket, config.patch_dim), dtype)
    patches[:total] = np.concatenate([np.asarray(p) for p, _ in images], axis=0)
    return VisionInputs(patches, layout.segment_ids, layout.rope_rows_cols, layout.interp_index,
                        layout.interp_weight.astype(dtype))


def feature_rows(vision: VisionInputs, merge_unit: int) -> int:
    """The number of valid feature rows (merged patches) the tower makes of `vision`."""
    return int(np.count_nonzero(np.asarray(vision.segment_ids) > 0)) // merge_unit


def count_placeholders(tokens: np.ndarray, config: "Qwen35Config") -> int:
    """Image-pad plus video-pad tokens in `tokens` (any shape)."""
    tokens = np.asarray(tokens)
    return int(np.count_nonzero((tokens == config.image_token_id) | (tokens == config.video_token_id)))


def check_vision_tokens(tokens: np.ndarray, vision: VisionInputs | None, config: "Qwen35Config") -> None:
    """One-line ValueError unless the placeholder tokens of `tokens` [B, S] (image and video pads) and the
    valid feature rows of `vision` are as many (none when `vision` is None). Host side: call it before jit."""
    placeholders = count_placeholders(tokens, config)
    if vision is None:
        if placeholders:
            raise ValueError(f"the tokens hold {placeholders} image/video placeholder tokens but no vision inputs "
                             f"were given")
        return
    if config.vision is None:
        raise ValueError("vision inputs were given but the config has no vision tower (vision=None)")
    rows = feature_rows(vision, config.vision.merge_unit)
    if rows != placeholders:
        raise ValueError(f"the tokens hold {placeholders} image/video placeholder tokens but the vision inputs "
                         f"make {rows} feature rows")
