"""VLM batches on the host: each row's mrope positions and each micro-batch's `VisionInputs`.

A batch of a run whose data carries images (`data.batches.IMAGE_BATCH_FIELDS`: the rows' images in row
order) becomes, before it is placed on the mesh:

- "positions" int32 [3, rows, S]: `packed_mrope_positions` of every row, text-only rows too, so a
  batch's program does not depend on which rows have images;
- "vision": the `VisionInputs` of each of the K micro-batches stacked on a leading axis [K, P, ...],
  every micro-batch's images in row-major placeholder order (what the model's `merge_vision` reads),
  padded to one bucket of P patches: `max_patches` when given (one program), else the next power of two
  of the largest micro-batch's patches (`patch_bucket`: a few programs). A micro-batch without images
  gets only padding patches. A batch with no image at all gets no "vision" (None: no tower in that
  step's program).

`check_vision_tokens` runs here, on the host, for every micro-batch: a mismatch would put image
features on the wrong tokens silently inside jit.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from qwen35_jax.config import Qwen35Config
from qwen35_jax.data.mrope import packed_mrope_positions
from qwen35_jax.vision.inputs import VisionInputs, build_vision_inputs, check_vision_tokens, patch_bucket

IMAGE_FIELDS = ("patches", "grids_thw", "image_counts")


def carries_images(host: dict[str, Any]) -> bool:
    """Whether a host batch comes from a stream that carries images (a VLM run's data pipeline)."""
    return "image_counts" in host


def _padding_inputs(bucket: int, patch_dim: int) -> VisionInputs:
    """Vision inputs of P padding patches: no valid feature row (a micro-batch without images)."""
    return VisionInputs(np.zeros((bucket, patch_dim), np.float32), np.zeros((bucket,), np.int32),
                        np.zeros((bucket, 2), np.int32), np.zeros((bucket, 4), np.int32),
                        np.zeros((bucket, 4), np.float32))


def vision_batch(host: dict[str, np.ndarray], config: Qwen35Config, *, grad_accum: int = 1,
                 max_patches: int | None = None, step: int | None = None) -> dict[str, Any]:
    """A host batch with `IMAGE_FIELDS` -> the same batch without them, with "positions" [3, rows, S]
    and (when any row has an image) "vision" [K, P, ...]. One-line ValueError naming the step and the
    rows of a micro-batch whose placeholders and images disagree, or whose patches exceed `max_patches`."""
    if config.vision is None:
        raise ValueError("the batch carries images but the model has no vision tower")
    vision_config = config.vision
    tokens, segment_ids = host["tokens"], host["segment_ids"]
    rows, _ = tokens.shape
    counts = np.asarray(host["image_counts"], np.int64)  # [rows]
    grids = np.asarray(host["grids_thw"], np.int64).reshape(-1, 3)  # [N, 3]
    patches = np.asarray(host["patches"], np.float32).reshape(-1, vision_config.patch_dim)  # [P, patch_dim]
    image_first = np.concatenate([[0], np.cumsum(counts)])  # [rows + 1]
    sizes = np.prod(grids, axis=1)  # [N]
    patch_first = np.concatenate([[0], np.cumsum(sizes)])  # [N + 1]
    where = "" if step is None else f"step {step}: "
    micro = rows // grad_accum

    positions = []
    for r in range(rows):
        try:
            positions.append(packed_mrope_positions(
                tokens[r], segment_ids[r], grids[image_first[r]:image_first[r + 1]],
                image_token_id=config.image_token_id, video_token_id=config.video_token_id,
                merge_size=vision_config.spatial_merge_size))
        except ValueError as err:
            raise ValueError(f"{where}row {r} of the batch: {err}") from None
    out = {k: v for k, v in host.items() if k not in IMAGE_FIELDS}
    out["positions"] = np.stack(positions, axis=1)  # [3, rows, S]
    if not len(grids):
        for k in range(grad_accum):  # no images: no placeholder may remain either
            _check(tokens[k * micro:(k + 1) * micro], None, config, where, k * micro, micro)
        return out

    per_micro = []  # each micro-batch's images: [(patches, grid)] in row-major placeholder order
    for k in range(grad_accum):
        first, end = image_first[k * micro], image_first[(k + 1) * micro]
        per_micro.append([(patches[patch_first[i]:patch_first[i + 1]], grids[i]) for i in range(first, end)])
    most = max(sum(int(np.prod(g)) for _, g in images) for images in per_micro)
    bucket = patch_bucket(most, vision_config.merge_unit) if max_patches is None else int(max_patches)
    if max_patches is not None and most > max_patches:
        raise ValueError(f"{where}a micro-batch of rows holds {most} image patches, more than --max-patches "
                         f"{max_patches}: raise it or lower --max-pixels")
    stacked = []
    for k, images in enumerate(per_micro):
        vision = build_vision_inputs(images, vision_config, bucket) if images else \
            _padding_inputs(bucket, vision_config.patch_dim)
        _check(tokens[k * micro:(k + 1) * micro], vision if images else None, config, where, k * micro, micro)
        stacked.append(vision)
    out["vision"] = VisionInputs(*(np.stack(parts) for parts in zip(*stacked)))  # each [K, P, ...]
    return out


def _check(tokens: np.ndarray, vision: VisionInputs | None, config: Qwen35Config, where: str, first: int,
           rows: int) -> None:
    try:
        check_vision_tokens(tokens, vision, config)
    except ValueError as err:
        raise ValueError(f"{where}rows {first}-{first + rows - 1} of the batch: {err}") from None


def check_max_patches(max_patches: int | None, config: Qwen35Config) -> None:
    """One-line ValueError unless --max-patches fits the tower: a whole number of merge windows."""
    if max_patches is None:
        return
    if config.vision is None:
        raise ValueError("--max-patches sizes the images' patch bucket, but the model has no vision tower")
    unit = config.vision.merge_unit
    if max_patches % unit:
        raise ValueError(f"--max-patches {max_patches} must be a multiple of the tower's merge window of {unit} "
                         f"patches")
