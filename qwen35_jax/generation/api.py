"""`generate`: completions of token-id prompts from a model's own (sharded) weights.

Rows (prompt x sample) go in batches, longest first; each batch is padded to the mesh (rows to a
multiple of fsdp * sp, prompt length to a multiple of 16 * sp, padding rows never sampled) and run
as one prefill and one decode loop (`programs.py`). Results come back in input order.

Prompts with images (a VLM): `images[i]` holds prompt i's images (patches [P, patch_dim], grids [N, 3],
as `PromptEncoder.encode_with_images` gives them) in the order of its image-pad runs, the pads already
expanded. A batch holding any image runs the vision programs: the rows' mrope positions and the
batch's images (every row's, row after row, a prompt's repeated for each of its samples) go into the
prefill, and each row decodes from its own next_position (`data/mrope.py`). A batch without images,
and every call without `images`, runs the text programs unchanged.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from tqdm import tqdm

from qwen35_jax.data.mrope import mrope_positions
from qwen35_jax.generation.cache import describe_cache
from qwen35_jax.generation.programs import programs
from qwen35_jax.generation.sampling import SamplingOptions
from qwen35_jax.parallel.mesh import SP, mesh_axis_size, rows_spec
from qwen35_jax.parallel.padding import padded_size
from qwen35_jax.parallel.processes import gather_values
from qwen35_jax.vision.inputs import VisionInputs, build_vision_inputs, check_vision_tokens, count_placeholders

PROMPT_MULTIPLE = 16  # prompt lengths are padded to a multiple of this (times sp): fewer compiled shapes


@dataclasses.dataclass(frozen=True)
class Completion:
    prompt_index: int  # position of the prompt in the input
    sample: int  # 0 .. num_samples - 1
    completion_ids: list[int]  # the new tokens, a stop token included
    log_probs: list[float]  # log_softmax(logits / T)[token] of each (T = 1 when greedy)
    finish_reason: str  # "stop" (a stop token) or "length" (max_new_tokens reached)


@dataclasses.dataclass
class GenerationStats:
    """Totals over one `generate` call (or several, passed again)."""

    prompt_tokens: int = 0
    generated_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    cache: str = ""  # the last batch's cache size, in words

    def summary(self) -> str:
        def rate(n: int, s: float) -> str:
            return f"{n / s:,.1f} tokens/s" if s > 0 else "n/a"

        return (f"prefill {self.prompt_tokens:,} tokens in {self.prefill_seconds:.2f}s "
                f"({rate(self.prompt_tokens, self.prefill_seconds)}), decode {self.generated_tokens:,} tokens in "
                f"{self.decode_seconds:.2f}s ({rate(self.generated_tokens, self.decode_seconds)})")


def check_prompts(prompts: Sequence[Sequence[int]], vocab_size: int, max_new_tokens: int,
                  max_length: int | None) -> list[np.ndarray]:
    """The prompts as int32 arrays; one-line ValueError naming the first bad row."""
    if isinstance(prompts, (str, bytes)) or not isinstance(prompts, Sequence) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
    arrays = []
    for i, prompt in enumerate(prompts):
        ids = np.asarray(prompt)
        if ids.ndim != 1 or ids.size == 0:
            raise ValueError(f"prompt {i}: must be a non-empty list of token ids")
        if not np.issubdtype(ids.dtype, np.integer):
            raise ValueError(f"prompt {i}: token ids must be integers, got {ids.dtype}")
        bad = ids[(ids < 0) | (ids >= vocab_size)]
        if bad.size:
            raise ValueError(f"prompt {i}: token id {int(bad[0])} is outside the vocabulary [0, {vocab_size})")
        if max_length is not None and ids.size + max_new_tokens > max_length:
            raise ValueError(f"prompt {i}: {ids.size} tokens + max_new_tokens {max_new_tokens} exceed the maximum "
                             f"length {max_length}")
        arrays.append(ids.astype(np.int32))
    return arrays


@dataclasses.dataclass(frozen=True)
class PromptVision:
    """What a prompt with images adds to its tokens."""

    images: list[tuple[np.ndarray, tuple[int, int, int]]]  # (patches [t*h*w, patch_dim], grid) per image
    positions: np.ndarray  # [3, L] int32 mrope positions of the prompt
    next_position: int  # the first generated token's position (all three axes)


def check_images(arrays: Sequence[np.ndarray], images: Sequence[Any] | None, config: Any
                 ) -> list[PromptVision | None]:
    """Each prompt's images checked against its tokens -> `PromptVision` (None: a text prompt); one-line
    ValueError naming the first bad prompt. `images` None: every prompt is text."""
    if images is None:
        images = [None] * len(arrays)
    elif isinstance(images, (str, bytes)) or not isinstance(images, Sequence) or len(images) != len(arrays):
        raise ValueError(f"images must be a list with one entry (None or (patches, grids)) per prompt; got "
                         f"{len(images) if isinstance(images, Sequence) else type(images).__name__} for "
                         f"{len(arrays)} prompts")
    out: list[PromptVision | None] = []
    for i, (ids, row_images) in enumerate(zip(arrays, images)):
        if row_images is None or len(row_images[1]) == 0:
            if config.vision is not None and count_placeholders(ids, config):
                raise ValueError(f"prompt {i}: holds {count_placeholders(ids, config)} image/video placeholder "
                                 f"tokens but no images were given")
            out.append(None)
            continue
        if config.vision is None:
            raise ValueError(f"prompt {i}: has images but the model has no vision tower")
        patches, grids = row_images[0], np.asarray(row_images[1])
        if grids.ndim != 2 or grids.shape[1] != 3:
            raise ValueError(f"prompt {i}: image grids must be [N, 3] (t, h, w), got shape {grids.shape}")
        starts = np.cumsum([0] + [int(np.prod(g)) for g in grids])
        if np.ndim(patches) != 2 or np.shape(patches) != (starts[-1], config.vision.patch_dim):
            raise ValueError(f"prompt {i}: image patches have shape {np.shape(patches)}, expected "
                             f"({starts[-1]}, {config.vision.patch_dim}) for grids {grids.tolist()}")
        try:
            positions, next_position = mrope_positions(
                ids, grids, image_token_id=config.image_token_id, video_token_id=config.video_token_id,
                merge_size=config.vision.spatial_merge_size)
        except ValueError as err:
            raise ValueError(f"prompt {i}: {err}") from None
        out.append(PromptVision(images=[(np.asarray(patches[a:b]), tuple(int(x) for x in g))
                                        for a, b, g in zip(starts[:-1], starts[1:], grids)],
                                positions=positions, next_position=next_position))
    return out


def vision_batch(tokens: np.ndarray, lengths: np.ndarray, vision: Sequence[PromptVision | None], config: Any
                 ) -> tuple[np.ndarray, VisionInputs, np.ndarray]:
    """The vision inputs of a batch whose row j holds prompt row `vision[j]` (None: text or padding):
    (positions [B, 3, S] int32, the images of every row in row order, offsets [B] int32 =
    next_position - prompt length). Padding slots continue each row's positions."""
    b, s = tokens.shape
    positions = np.broadcast_to(np.arange(s, dtype=np.int32), (b, 3, s)).copy()
    offsets = np.zeros((b,), np.int32)
    images: list[tuple[np.ndarray, tuple[int, int, int]]] = []
    for j, row in enumerate(vision):
        if row is None:
            continue
        n = int(lengths[j])
        positions[j, :, :n] = row.positions
        positions[j, :, n:] = row.next_position + np.arange(s - n, dtype=np.int32)
        offsets[j] = row.next_position - n
        images += row.images
    inputs = build_vision_inputs(images, config.vision)
    check_vision_tokens(np.where(np.arange(s)[None] < lengths[:, None], tokens, -1), inputs, config)
    return positions, inputs, offsets


def generate(
    model: nnx.Module,
    prompts: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int = 0,
    stop_token_ids: Sequence[int] | None = None,
    mesh: Mesh | None = None,
    num_samples: int = 1,
    batch_size: int | None = None,
    max_length: int | None = None,
    first_row: int = 0,
    progress: bool = False,
    stats: GenerationStats | None = None,
    images: Sequence[Any] | None = None,
) -> list[Completion]:
    """Sample `num_samples` completions of every prompt (token-id lists) from `model`.

    temperature 0 is greedy; top_k 0 and top_p 1 leave the vocabulary whole (rules in `sampling.py`).
    `stop_token_ids` end a row (None: none; the tool reads the checkpoint's eos ids). On `mesh` the
    rows are split over all its devices and the parameters stay as they are sharded; without one,
    the model's own devices. `batch_size` rows (prompt x sample) run at a time (None: all).
    `first_row` offsets the prompt index the random keys use (a shard of a larger input). Returns
    one `Completion` per (prompt, sample), prompt-major.

    `images` (a VLM): one entry per prompt, None or (patches [P, patch_dim], grids_thw [N, 3]) of its
    images in placeholder order (`RowImages`); its image pads must be expanded to the grids already.

    In a multi-process run each process passes its own prompts (as many as every other process) and
    gets its own completions; the rows are split over the devices of each process."""
    config = model.config
    arrays = check_prompts(prompts, config.vocab_size, max_new_tokens, max_length)
    options = SamplingOptions(temperature=float(temperature), top_k=int(top_k), top_p=float(top_p))
    if not isinstance(num_samples, int) or num_samples < 1:
        raise ValueError(f"num_samples must be a positive integer, got {num_samples!r}")
    if batch_size is not None and batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    stop = np.asarray(sorted(set(int(t) for t in (stop_token_ids or ()))), np.int32)
    if stop.size and (stop.min() < 0 or stop.max() >= config.vocab_size):
        raise ValueError(f"stop token ids {stop.tolist()} must lie in [0, {config.vocab_size})")
    stats = GenerationStats() if stats is None else stats
    vision = check_images(arrays, images, config)
    if any(v is not None for v in vision) and jax.process_count() > 1:
        raise ValueError("prompts with images are not supported in a multi-process run yet")

    rows = [(i, s) for i in range(len(arrays)) for s in range(num_samples)]
    order = sorted(range(len(rows)), key=lambda r: -arrays[rows[r][0]].size)  # longest first: less padding
    step = len(order) if batch_size is None else batch_size
    batches = [order[i:i + step] for i in range(0, len(order), step)]
    graphdef, state = nnx.split(model)
    prefill_fn, decode_fn = programs(graphdef, options, max_new_tokens, mesh)
    n_dev = local_device_count(mesh)
    _check_same_work_everywhere(len(batches), mesh)
    sp = mesh_axis_size(mesh, SP)
    results: list[Completion | None] = [None] * len(rows)
    bar = tqdm(total=len(rows), desc="generating", unit="row", disable=not progress)
    for batch in batches:
        b = padded_size(len(batch), n_dev)
        s = padded_size(_longest_everywhere(max(arrays[rows[r][0]].size for r in batch), mesh), PROMPT_MULTIPLE * sp)
        tokens = np.zeros((b, s), np.int32)
        lengths = np.ones((b,), np.int32)  # padding rows: one token 0, never sampled
        prompt_ids = np.zeros((b,), np.int32)
        samples = np.zeros((b,), np.int32)
        for j, r in enumerate(batch):
            prompt = arrays[rows[r][0]]
            tokens[j, :prompt.size], lengths[j] = prompt, prompt.size
            prompt_ids[j], samples[j] = first_row + rows[r][0], rows[r][1]
        active = np.arange(b) < len(batch)
        stats.cache = describe_cache(config, b, s + max_new_tokens - 1)
        rows_vision = [vision[rows[r][0]] for r in batch]
        with _mesh_context(mesh):
            start = time.perf_counter()
            if any(v is not None for v in rows_vision):
                positions, inputs, offsets = vision_batch(tokens, lengths, rows_vision, config)
                logits, cache = prefill_fn(state, _put(tokens, mesh), _put(lengths, mesh), _put(positions, mesh),
                                           _replicated(inputs, mesh))
                extra = (_put(offsets, mesh),)
            else:  # the text programs
                logits, cache = prefill_fn(state, _put(tokens, mesh), _put(lengths, mesh))
                extra = ()
            jax.block_until_ready(logits)
            middle = time.perf_counter()
            out = decode_fn(state, logits, cache, *(_put(x, mesh) for x in (prompt_ids, samples, active)),
                            np.asarray(stop), np.int32(seed), *extra)
            tokens_out, log_probs, generated, stopped = (_local_rows(x) for x in
                                                         (out.tokens, out.log_probs, out.generated, out.stopped))
            end = time.perf_counter()
        stats.prompt_tokens += int(lengths[active].sum())
        stats.generated_tokens += int(generated[active].sum())
        stats.prefill_seconds += middle - start
        stats.decode_seconds += end - middle
        for j, r in enumerate(batch):
            n = int(generated[j])
            results[r] = Completion(prompt_index=rows[r][0], sample=rows[r][1],
                                    completion_ids=tokens_out[j, :n].tolist(),
                                    log_probs=log_probs[j, :n].astype(float).tolist(),
                                    finish_reason="stop" if stopped[j] else "length")
        bar.update(len(batch))
    bar.close()
    return results  # type: ignore[return-value]


def _mesh_context(mesh: Mesh | None) -> Any:
    return contextlib.nullcontext() if mesh is None else jax.set_mesh(mesh)


def local_device_count(mesh: Mesh | None) -> int:
    """How many of `mesh`'s devices this process holds (1 without a mesh): its rows' multiple."""
    if mesh is None:
        return 1
    return sum(d.process_index == jax.process_index() for d in mesh.devices.flat)


def _check_same_work_everywhere(batches: int, mesh: Mesh | None) -> None:
    """In a multi-process run every process runs each program together: the same number of batches."""
    if mesh is None or jax.process_count() == 1:
        return
    counts = gather_values(np.int32(batches))
    if len(set(np.asarray(counts).tolist())) != 1:
        raise ValueError(f"every process must generate the same number of batches, got {np.asarray(counts).tolist()}: "
                         "give each process as many prompts")


def _longest_everywhere(n: int, mesh: Mesh | None) -> int:
    """The longest prompt of this batch over every process (their prompt shapes must agree)."""
    if mesh is None or jax.process_count() == 1:
        return n
    return int(np.max(gather_values(np.int32(n))))


def _put(x: np.ndarray, mesh: Mesh | None) -> Any:
    """This process's rows [b, ...] -> the global array, rows split over every device of `mesh` (each
    process's devices hold one contiguous block: `make_mesh` orders devices by process)."""
    if mesh is None:
        return x
    sharding = NamedSharding(mesh, rows_spec(x.ndim))
    if jax.process_count() == 1:
        return jax.device_put(x, sharding)
    return jax.make_array_from_process_local_data(sharding, x, (x.shape[0] * jax.process_count(), *x.shape[1:]))


def _replicated(tree: Any, mesh: Mesh | None) -> Any:
    """Arrays every device of `mesh` holds whole (the batch's images: the model finds their rows on the
    whole batch)."""
    if mesh is None:
        return tree
    return jax.device_put(tree, NamedSharding(mesh, jax.sharding.PartitionSpec()))


def _local_rows(x: jax.Array) -> np.ndarray:
    """This process's rows of a row-split global array, in order."""
    if jax.process_count() == 1:
        return np.asarray(jax.device_get(x))
    shards = sorted(x.addressable_shards, key=lambda s: s.index[0].start or 0)  # one row block per device
    return np.concatenate([np.asarray(s.data) for s in shards])
