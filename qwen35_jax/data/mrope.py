"""Multimodal rotary positions (3-axis mrope) and vision-placeholder expansion, on the host (NumPy).

Matches transformers' Qwen3.5 (`Qwen3_5Model.get_rope_index`, `get_vision_position_ids`,
`compute_3d_position_ids`) and the Qwen3-VL processor Qwen3.5 uses (`Qwen3VLProcessor`):

Placeholders. A prompt carries one `<|image_pad|>` per image (the chat template writes
`<|vision_start|><|image_pad|><|vision_end|>`); the processor replaces each, in order, with
grid_t * grid_h * grid_w // merge_size**2 copies (`expand_image_placeholders`). A video's
`<|vision_start|><|video_pad|><|vision_end|>` (or a bare `<|video_pad|>`) becomes, per frame
(grid_t of them), the frame's timestamp text `<{seconds:.1f} seconds>` then
`<|vision_start|>` + grid_h * grid_w // merge_size**2 video pads + `<|vision_end|>`
(`expand_video_placeholders`, `video_timestamps`).

Positions. Token types come from the ids: image pad -> image, video pad -> video, anything else
-> text. Walking a document's runs of one type with `current` starting at 0:
- a text run of n tokens gets `current + 0..n-1` on all three axes; current += n;
- an image run takes the next image grid (t, h, w) and gets, for each merged patch (frame f, row r,
  column c) in t, h, w order: t-axis current + f, h-axis current + r, w-axis current + c;
  then current += max(h, w) // merge_size (not the number of tokens, and not t);
- a video is split into one grid (1, h, w) per frame (its timestamps separate the frames), and each
  video-pad run takes the next frame grid exactly as an image run does.
The run's length must be the grid's merged token count. Text-only documents get 0..S-1 on every
axis, the plain text positions. Two images (or frames) with no text between them are one run, as in
transformers, and fail that check: the processor always writes `<|vision_start|>`/`<|vision_end|>`
around each.

Generation. `next_position` = max position + 1 is what the first generated token gets, on all three
axes, and every later one adds 1. transformers keeps it as `rope_delta = next_position - prompt_len`
(`decode_position_offset`): the token at absolute index L + i (L prompt tokens) gets L + i + delta.

Packed rows. Each document (a run of one nonzero segment id) is positioned on its own, starting at
0; padding (segment 0) gets the text positions `model.default_positions` gives it (its index within
its run of padding, on every axis). Grids are consumed in order across the documents.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

TEXT, IMAGE, VIDEO = 0, 1, 2  # transformers' mm_token_type_ids
VIDEO_FPS_DEFAULT = 24  # the processor's fps when a video's metadata has none


def _grids(grids_thw: np.ndarray | Sequence[Sequence[int]] | None, merge_size: int, what: str
           ) -> np.ndarray:  # [N, 3] int64
    """Validated [N, 3] (t, h, w) grids: positive, h and w divisible by merge_size."""
    if merge_size < 1:
        raise ValueError(f"merge_size must be >= 1, got {merge_size}")
    if grids_thw is None:
        return np.zeros((0, 3), np.int64)
    grids = np.asarray(grids_thw)
    if grids.size == 0:
        return np.zeros((0, 3), np.int64)
    if grids.ndim != 2 or grids.shape[1] != 3 or not np.issubdtype(grids.dtype, np.integer):
        raise ValueError(f"{what} grids must be integer [N, 3] (t, h, w), got {grids.dtype} {grids.shape}")
    grids = grids.astype(np.int64)
    if (grids < 1).any():
        bad = int(np.argwhere((grids < 1).any(axis=1))[0, 0])
        raise ValueError(f"{what} grid {bad} {grids[bad].tolist()} has a dimension < 1")
    uneven = (grids[:, 1:] % merge_size != 0).any(axis=1)
    if uneven.any():
        bad = int(np.argwhere(uneven)[0, 0])
        raise ValueError(f"{what} grid {bad} {grids[bad].tolist()}: h and w must be divisible by "
                         f"merge_size {merge_size}")
    return grids


def merged_token_count(grid_thw: Sequence[int] | np.ndarray, merge_size: int) -> int:
    """The placeholder tokens one image (t, h, w) grid becomes: t * h * w // merge_size**2."""
    t, h, w = (int(x) for x in grid_thw)
    return t * h * w // merge_size**2


def _video_frame_grids(video_grids: np.ndarray) -> np.ndarray:  # [N, 3] -> [sum t, 3]
    """Each video (t, h, w) split into t frame grids (1, h, w), as get_rope_index does."""
    frames = np.repeat(video_grids, video_grids[:, 0], axis=0)
    frames[:, 0] = 1
    return frames


def expand_image_placeholders(tokens: Sequence[int] | np.ndarray, grids_thw: np.ndarray, image_token_id: int,
                              merge_size: int) -> list[int]:
    """tokens with one `image_token_id` per image -> each, in order, repeated to its grid's merged
    token count (t * h * w // merge_size**2), as the Qwen3-VL processor expands `<|image_pad|>`.

    Every image pad in `tokens` is one image (adjacent pads are adjacent images), so the ids must
    not be expanded already."""
    grids = _grids(grids_thw, merge_size, "image")
    ids = [int(x) for x in np.asarray(tokens).reshape(-1)]
    n_pads = sum(1 for x in ids if x == image_token_id)
    if n_pads != len(grids):
        raise ValueError(f"{n_pads} image placeholder tokens but {len(grids)} image grids")
    out: list[int] = []
    images = iter(grids)
    for x in ids:
        if x == image_token_id:
            out.extend([image_token_id] * merged_token_count(next(images), merge_size))
        else:
            out.append(x)
    return out


def video_timestamps(frames_indices: Sequence[int] | np.ndarray, fps: float | None,
                     temporal_patch_size: int = 2) -> list[float]:
    """Seconds of each merged frame of a video (the processor's `_calculate_timestamps`): the sampled
    frame indices padded with the last to a multiple of temporal_patch_size, / fps (24 when None),
    averaged over the first and last frame of each temporal patch."""
    indices = [int(i) for i in np.asarray(frames_indices).reshape(-1)]
    if not indices:
        raise ValueError("a video needs at least one frame index")
    fps = VIDEO_FPS_DEFAULT if fps is None else fps
    if len(indices) % temporal_patch_size:
        indices.extend(indices[-1] for _ in range(temporal_patch_size - len(indices) % temporal_patch_size))
    seconds = [i / fps for i in indices]
    return [(seconds[i] + seconds[i + temporal_patch_size - 1]) / 2
            for i in range(0, len(seconds), temporal_patch_size)]


def expand_video_placeholders(tokens: Sequence[int] | np.ndarray, video_grids_thw: np.ndarray,
                              timestamps: Sequence[Sequence[float]], *, video_token_id: int,
                              vision_start_id: int, vision_end_id: int, merge_size: int,
                              encode: Callable[[str], Sequence[int]]) -> list[int]:
    """tokens with one `video_token_id` per video -> each, in order, written out frame by frame as the
    Qwen3-VL processor does: a `vision_start, video pad, vision_end` wrapper around the pad is dropped,
    then for frame f < grid_t: encode(f"<{timestamps[v][f]:.1f} seconds>") + [vision_start_id] +
    [video_token_id] * (h * w // merge_size**2) + [vision_end_id].

    `timestamps[v]` are video v's frame times (`video_timestamps`), at least grid_t of them.
    `encode` tokenizes text without special tokens (e.g. `lambda s: tokenizer.encode(s,
    add_special_tokens=False)`). The processor tokenizes the expanded text as a whole; this matches it
    where the timestamp's `<` does not merge with the text before it in the tokenizer's pre-split: after
    a special token (every frame but the first), a newline, a letter or digit, or at the start it does
    not; after a space or punctuation (`: <`, `:<`) it may, and the ids can then differ."""
    grids = _grids(video_grids_thw, merge_size, "video")
    ids = [int(x) for x in np.asarray(tokens).reshape(-1)]
    n_pads = sum(1 for x in ids if x == video_token_id)
    if n_pads != len(grids):
        raise ValueError(f"{n_pads} video placeholder tokens but {len(grids)} video grids")
    if len(timestamps) != len(grids):
        raise ValueError(f"{len(timestamps)} video timestamp lists but {len(grids)} video grids")
    out: list[int] = []
    v = 0
    i = 0
    while i < len(ids):
        x = ids[i]
        if x != video_token_id:
            out.append(x)
            i += 1
            continue
        wrapped = bool(out) and out[-1] == vision_start_id and i + 1 < len(ids) and ids[i + 1] == vision_end_id
        if wrapped:
            out.pop()
        t, h, w = (int(d) for d in grids[v])
        if len(timestamps[v]) < t:
            raise ValueError(f"video {v} has {t} frames in its grid but {len(timestamps[v])} timestamps")
        frame_len = h * w // merge_size**2
        for f in range(t):
            out.extend(int(e) for e in encode(f"<{timestamps[v][f]:.1f} seconds>"))
            out.append(vision_start_id)
            out.extend([video_token_id] * frame_len)
            out.append(vision_end_id)
        v += 1
        i += 2 if wrapped else 1
    return out


def mm_token_types(tokens: np.ndarray, image_token_id: int, video_token_id: int) -> np.ndarray:  # [S] int32
    """transformers' mm_token_type_ids of one sequence: 1 image pad, 2 video pad, 0 anything else."""
    tokens = np.asarray(tokens)
    types = np.zeros(tokens.shape, np.int32)
    types[tokens == image_token_id] = IMAGE
    types[tokens == video_token_id] = VIDEO
    return types


def _runs(values: np.ndarray) -> list[tuple[int, int, int]]:
    """[S] -> (value, start, end) of each run of equal values."""
    if values.size == 0:
        return []
    starts = np.flatnonzero(np.concatenate([[True], values[1:] != values[:-1]]))
    ends = np.concatenate([starts[1:], [values.size]])
    return [(int(values[a]), int(a), int(b)) for a, b in zip(starts, ends)]


def _vision_positions(start: int, grid: np.ndarray, merge_size: int) -> np.ndarray:  # [3, t*h*w/m^2]
    """get_vision_position_ids: (t, h, w) axes of the merged patches, t-major, offset by start."""
    t, h, w = int(grid[0]), int(grid[1]) // merge_size, int(grid[2]) // merge_size
    tt, hh, ww = np.meshgrid(np.arange(t), np.arange(h), np.arange(w), indexing="ij")
    return np.stack([tt, hh, ww]).reshape(3, -1) + start


class _GridQueue:
    """The image grids and the video frame grids, consumed in order (across documents too)."""

    def __init__(self, grids_thw: np.ndarray | None, video_grids_thw: np.ndarray | None, merge_size: int):
        self.grids = {IMAGE: _grids(grids_thw, merge_size, "image"),
                      VIDEO: _video_frame_grids(_grids(video_grids_thw, merge_size, "video"))}
        self.used = {IMAGE: 0, VIDEO: 0}

    def take(self, kind: int) -> np.ndarray:  # [3]
        name = "image" if kind == IMAGE else "video frame"
        if self.used[kind] == len(self.grids[kind]):
            raise ValueError(f"more {name} placeholder runs than the {len(self.grids[kind])} {name} grids")
        grid = self.grids[kind][self.used[kind]]
        self.used[kind] += 1
        return grid

    def check_all_used(self) -> None:
        for kind, name in ((IMAGE, "image"), (VIDEO, "video frame")):
            if self.used[kind] != len(self.grids[kind]):
                raise ValueError(f"{self.used[kind]} {name} placeholder runs but {len(self.grids[kind])} "
                                 f"{name} grids")


def _document_positions(tokens: np.ndarray, queue: _GridQueue, image_token_id: int, video_token_id: int,
                        merge_size: int, offset: int = 0) -> tuple[np.ndarray, int]:  # ([3, S] int64, int)
    """get_rope_index for one document; `offset` is where the document starts in the row (errors)."""
    pieces: list[np.ndarray] = []
    current = 0
    for kind, a, b in _runs(mm_token_types(tokens, image_token_id, video_token_id)):
        if kind == TEXT:
            pieces.append(np.broadcast_to(np.arange(current, current + b - a), (3, b - a)))
            current += b - a
            continue
        grid = queue.take(kind)
        count = merged_token_count(grid, merge_size)
        if b - a != count:
            name = "image" if kind == IMAGE else "video frame"
            raise ValueError(f"{name} pad run at tokens {offset + a}..{offset + b - 1} has {b - a} tokens but "
                             f"its grid {grid.tolist()} needs {count} (merge_size {merge_size})")
        pieces.append(_vision_positions(current, grid, merge_size))
        current += int(max(grid[1], grid[2])) // merge_size
    if not pieces:
        return np.zeros((3, 0), np.int64), 0
    positions = np.concatenate(pieces, axis=1)
    return positions, int(positions.max()) + 1


def mrope_positions(tokens: Sequence[int] | np.ndarray, grids_thw: np.ndarray | None, *, image_token_id: int,
                    video_token_id: int, merge_size: int, video_grids_thw: np.ndarray | None = None
                    ) -> tuple[np.ndarray, int]:
    """One document's expanded tokens [S] -> (positions [3, S] int32 (t, h, w), next_position).

    transformers' get_rope_index for one sequence without padding. `grids_thw` [N, 3] are the image
    grids in order, `video_grids_thw` [M, 3] the videos' (each split into its frames). Every grid
    must be used by exactly one pad run of its merged size. `next_position` (max + 1) is the position
    of the first generated token on all three axes (`decode_position_offset`)."""
    tokens = np.asarray(tokens).reshape(-1)
    queue = _GridQueue(grids_thw, video_grids_thw, merge_size)
    positions, next_position = _document_positions(tokens, queue, image_token_id, video_token_id, merge_size)
    queue.check_all_used()
    return positions.astype(np.int32), next_position


def decode_position_offset(next_position: int, prompt_length: int) -> int:
    """transformers' rope_delta: the token at absolute index prompt_length + i (generated or cached)
    gets position prompt_length + i + offset = next_position + i on all three axes."""
    return next_position - prompt_length


def decode_positions(next_position: int, count: int) -> np.ndarray:  # [3, count] int32
    """The positions of the next `count` tokens after a prompt whose mrope_positions gave next_position."""
    return np.broadcast_to(np.arange(next_position, next_position + count, dtype=np.int32), (3, count)).copy()


def packed_mrope_positions(tokens: Sequence[int] | np.ndarray, segment_ids: Sequence[int] | np.ndarray,
                           grids_thw: np.ndarray | None, *, image_token_id: int, video_token_id: int,
                           merge_size: int, video_grids_thw: np.ndarray | None = None
                           ) -> np.ndarray:  # [3, S] int32
    """A packed row (tokens [S], segment_ids [S], 0 = padding) -> positions [3, S] int32.

    Each document (a run of one nonzero segment id) gets `mrope_positions` from 0; padding gets its
    index within its run of padding on all three axes (what `model.default_positions` gives it), and
    its tokens are never read as placeholders. The image grids and video grids are used in order
    across the documents; all of them must be used. For a batch, stack rows on axis 1 -> [3, B, S]."""
    tokens = np.asarray(tokens).reshape(-1)
    segment_ids = np.asarray(segment_ids).reshape(-1)
    if tokens.shape != segment_ids.shape:
        raise ValueError(f"tokens {tokens.shape} and segment_ids {segment_ids.shape} differ in shape")
    queue = _GridQueue(grids_thw, video_grids_thw, merge_size)
    out = np.zeros((3, tokens.size), np.int64)
    for segment, a, b in _runs(segment_ids):
        if segment == 0:
            out[:, a:b] = np.arange(b - a)
        else:
            out[:, a:b], _ = _document_positions(tokens[a:b], queue, image_token_id, video_token_id, merge_size,
                                                 offset=a)
    queue.check_all_used()
    return out.astype(np.int32)
