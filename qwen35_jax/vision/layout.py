"""Host-side (NumPy) per-patch inputs of the vision tower for a padded bucket of patches.

Images vary in size, so everything that depends on `grid_thw` is computed here, outside jit, and the
tower sees arrays of one static shape [P, ...] per bucket. Patches are in transformers' order: image by
image, frame by frame, and inside a frame merge window by merge window (row-major over windows, row-major
inside each spatial_merge_size x spatial_merge_size window), the order the Qwen3-VL image processor
flattens them in. Each function reproduces its transformers counterpart in `transformers/vision_utils.py`:
`get_vision_attention_seqlens` (one attention segment per frame), `get_vision_position_ids` and
`get_vision_interpolation_indices_and_weights(mode="bilinear", align_corners=True)`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from qwen35_jax.vision.config import VisionConfig


class VisionLayout(NamedTuple):
    segment_ids: np.ndarray  # [P] int32: frame k of the call (over all images) is k + 1; padding rows 0
    rope_rows_cols: np.ndarray  # [P, 2] int32: each patch's (row, col) in its frame; padding (0, 0)
    interp_index: np.ndarray  # [P, 4] int32: bilinear taps into the grid_side**2 position table
    interp_weight: np.ndarray  # [P, 4] float64: their weights (rows of padding: 0)
    num_valid: int  # patches of the images; rows num_valid.. are padding


def check_grid_thw(grid_thw: np.ndarray | list, config: VisionConfig) -> np.ndarray:
    """[N, 3] ints (frames, rows, cols of patches per image), each >= 1, rows and cols whole merge windows."""
    grid = np.asarray(grid_thw)
    if grid.ndim != 2 or grid.shape[1] != 3 or not np.issubdtype(grid.dtype, np.integer):
        raise ValueError(f"grid_thw must be an [N, 3] integer array, got shape {grid.shape} dtype {grid.dtype}")
    if grid.size and grid.min() < 1:
        raise ValueError(f"grid_thw entries must be >= 1, got {grid.tolist()}")
    m = config.spatial_merge_size
    if np.any(grid[:, 1:] % m):
        raise ValueError(f"grid_thw rows and cols must be multiples of spatial_merge_size {m}, got {grid.tolist()}")
    return grid.astype(np.int64)


def count_patches(grid_thw: np.ndarray | list, config: VisionConfig) -> int:
    """Patches of the images: sum of t * h * w."""
    grid = check_grid_thw(grid_thw, config)
    return int(np.sum(np.prod(grid, axis=1)))


def frame_rows_cols(h: int, w: int, merge: int) -> np.ndarray:
    """[h * w, 2] int64: (row, col) of a frame's patches in merge-window order (`get_vision_position_ids`)."""
    rows, cols = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")  # [h, w] each
    block = (h // merge, merge, w // merge, merge)
    rows = rows.reshape(block).transpose(0, 2, 1, 3).reshape(-1)  # [h * w]
    cols = cols.reshape(block).transpose(0, 2, 1, 3).reshape(-1)  # [h * w]
    return np.stack([rows, cols], axis=-1)


def _axis_taps(index: np.ndarray, size: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """index [n] positions on an axis of `size` -> (taps [n, 2] int64, weights [n, 2] float64) into a
    `side`-long table: bilinear, align_corners=True, taps clamped to the border (transformers'
    `_interpolation_axis_taps_weights`, the same operations in the same order, in float64)."""
    src = index.astype(np.float64) * (side - 1) / max(size - 1, 1)  # [n]
    floor = np.floor(src)  # [n]
    offsets = np.arange(2)  # [2]
    taps = np.clip(floor.astype(np.int64)[:, None] + offsets, 0, side - 1)  # [n, 2]
    distance = np.abs(src[:, None] - floor[:, None] - offsets)  # [n, 2]
    return taps, np.maximum(1.0 - distance, 0.0)


def frame_interpolation(rows_cols: np.ndarray, h: int, w: int, side: int) -> tuple[np.ndarray, np.ndarray]:
    """rows_cols [n, 2] of one h x w frame -> (index [n, 4] int64, weight [n, 4] float64): the 2 x 2 taps
    (row-tap major) that resample the side x side learned table to the frame's grid."""
    h_taps, h_weights = _axis_taps(rows_cols[:, 0], h, side)  # [n, 2] each
    w_taps, w_weights = _axis_taps(rows_cols[:, 1], w, side)  # [n, 2] each
    index = (h_taps[:, :, None] * side + w_taps[:, None, :]).reshape(-1, 4)  # [n, 4]
    weight = (h_weights[:, :, None] * w_weights[:, None, :]).reshape(-1, 4)  # [n, 4]
    return index, weight


def vision_layout(grid_thw: np.ndarray | list, config: VisionConfig, num_patches: int | None = None
                  ) -> VisionLayout:
    """The tower's per-patch inputs for the images of `grid_thw` [N, 3], padded to a bucket of
    `num_patches` rows (default: no padding). The bucket must hold every patch and be a whole number of
    merge windows, so that the merger never mixes a padding row into a valid output row; the tower's
    first num_valid / merge_unit output rows are then the images'."""
    valid = count_patches(grid_thw, config)
    grid = check_grid_thw(grid_thw, config)
    total = valid if num_patches is None else int(num_patches)
    if total < valid:
        raise ValueError(f"num_patches {total} is smaller than the images' {valid} patches")
    if total % config.merge_unit:
        raise ValueError(f"num_patches {total} must be a multiple of merge_unit {config.merge_unit}")
    segment_ids = np.zeros((total,), np.int32)
    rope_rows_cols = np.zeros((total, 2), np.int32)
    interp_index = np.zeros((total, 4), np.int32)
    interp_weight = np.zeros((total, 4), np.float64)
    start, frame = 0, 0
    for t, h, w in grid.tolist():
        rows_cols = frame_rows_cols(h, w, config.spatial_merge_size)  # [h * w, 2]
        index, weight = frame_interpolation(rows_cols, h, w, config.grid_side)  # [h * w, 4] each
        for _ in range(t):  # every frame of an image has the same positions, its own segment
            frame += 1
            rows = slice(start, start + h * w)
            segment_ids[rows] = frame
            rope_rows_cols[rows] = rows_cols
            interp_index[rows] = index
            interp_weight[rows] = weight
            start += h * w
    return VisionLayout(segment_ids, rope_rows_cols, interp_index, interp_weight, valid)
