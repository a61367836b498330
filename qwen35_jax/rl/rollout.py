"""One step's rollouts: sample a group of completions per prompt with the current weights, score
them with the reward, and lay them out as the PPO step's rows.

Row layout (the trainer's): tokens = prompt + completion, segment id 1 on them and 0 after, every
row padded to the run's fixed length (the longest prompt + --max-new-tokens, so every step compiles
nothing new). Per-token fields are aligned with the log-probs: entry t is the prediction of token
t + 1, so a completion of n tokens after a prompt of L has its loss mask and its sampler log-probs at
L - 1 .. L + n - 2.

Prompts with images (a VLM): each prompt's images go to the sampler with its prompt (one set per
sample), and every row of the batch carries its prompt's images as `train/vision.py` reads them
("patches" [P, patch_dim], "grids_thw" [N, 3] of every row's images, row after row, and "image_counts"
[rows]), so the trainer scores the same tokens with the same images and mrope positions.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from typing import Any

import numpy as np
from flax import nnx
from jax.sharding import Mesh

from qwen35_jax.data.image_rows import RowImages
from qwen35_jax.generation import generate
from qwen35_jax.generation.prompts import PromptEncoder
from qwen35_jax.parallel.padding import padded_size
from qwen35_jax.rl.advantages import group_advantages
from qwen35_jax.rl.reward_fn import RewardFn, call_reward

ROW_MULTIPLE = 16  # the fixed row length is a multiple of this


@dataclasses.dataclass(frozen=True)
class RolloutOptions:
    group_size: int
    max_new_tokens: int
    temperature: float
    advantage: str
    stop_token_ids: tuple[int, ...]
    mask_truncated: bool = False  # a completion cut at max_new_tokens gets no loss tokens


@dataclasses.dataclass
class Rollout:
    batch: dict[str, np.ndarray]  # tokens, segment_ids, loss_mask [N, S] int32; advantages [N] float32 (and
    # with images: patches [P, patch_dim] float32, grids_thw [I, 3] int64, image_counts [N] int32)
    sampler_log_probs: np.ndarray  # [N, S] float32, aligned like the loss mask (0 elsewhere)
    rewards: np.ndarray  # [N] float64
    completion_lengths: np.ndarray  # [N] int
    truncated: np.ndarray  # [N] bool: cut at max_new_tokens
    seconds: float  # sampling + rewards


def row_length(prompts: list[list[int]], max_new_tokens: int) -> int:
    """The fixed row length of a run: its longest prompt plus the budget, rounded up."""
    return padded_size(max(len(p) for p in prompts) + max_new_tokens, ROW_MULTIPLE)


def reward_sample(row: Mapping[str, Any], prompt: list[int], completion: list[int], finish_reason: str,
                  encoder: PromptEncoder) -> dict[str, Any]:
    """The dict a reward function receives (see `reward_fn`)."""
    sample = {k: v for k, v in row.items() if k != "_source"}
    sample.update(prompt_ids=list(prompt), completion_ids=list(completion), finish_reason=finish_reason)
    if encoder.tokenizer is not None:
        sample["prompt"] = encoder.tokenizer.decode(prompt, skip_special_tokens=False)
        sample["completion"] = encoder.decode(completion)
    return sample


def sample_rollouts(
    model: nnx.Module,
    rows: list[dict[str, Any]],
    prompts: list[list[int]],
    indices: list[int],  # this step's prompts (indices into rows / prompts)
    *,
    options: RolloutOptions,
    seed: int,
    mesh: Mesh | None,
    reward: tuple[RewardFn, str],
    encoder: PromptEncoder,
    seq_len: int,
    first_row: int = 0,  # the position of indices[0] in the step's prompts (this process's share)
    images: list[RowImages | None] | None = None,  # each prompt's images (None: a text-only run)
) -> Rollout:
    """`images` given (a run whose prompts hold images): the batch carries every row's images."""
    start = time.perf_counter()
    chosen = [prompts[i] for i in indices]
    chosen_images = None if images is None else [images[i] for i in indices]
    completions = generate(model, chosen, max_new_tokens=options.max_new_tokens, temperature=options.temperature,
                           seed=seed, stop_token_ids=list(options.stop_token_ids), mesh=mesh,
                           num_samples=options.group_size, first_row=first_row,
                           images=None if chosen_images is None else [None if x is None else tuple(x)
                                                                      for x in chosen_images])
    n, g = len(completions), options.group_size
    tokens = np.zeros((n, seq_len), np.int32)
    segment_ids = np.zeros((n, seq_len), np.int32)
    loss_mask = np.zeros((n, seq_len), np.int32)
    sampler = np.zeros((n, seq_len), np.float32)
    rewards = np.zeros((n,), np.float64)
    placeholders = (() if chosen_images is None
                    else (model.config.image_token_id, model.config.video_token_id))
    for j, c in enumerate(completions):
        prompt, done = chosen[c.prompt_index], c.completion_ids
        # an image run's rows end before a sampled image/video pad: the trainer would read it as an image
        # placeholder (no image of its own), the sampler as text
        kept = next((done[:i] for i, t in enumerate(done) if t in placeholders), done)
        L, m = len(prompt), len(kept)
        tokens[j, :L + m] = prompt + kept
        segment_ids[j, :L + m] = 1
        loss_mask[j, L - 1:L - 1 + m] = not (options.mask_truncated and c.finish_reason == "length")
        sampler[j, L - 1:L - 1 + m] = c.log_probs[:m]
        row = rows[indices[c.prompt_index]]
        sample = reward_sample(row, prompt, done, c.finish_reason, encoder)
        rewards[j] = call_reward(*reward, sample, f"{row['_source']} (sample {c.sample})")
    advantages = group_advantages(rewards.reshape(n // g, g), options.advantage).reshape(n)
    batch = {"tokens": tokens, "segment_ids": segment_ids, "loss_mask": loss_mask,
             "advantages": advantages.astype(np.float32)}
    if chosen_images is not None:
        batch.update(row_images([chosen_images[c.prompt_index] for c in completions],
                                model.config.vision.patch_dim))
    return Rollout(batch=batch, sampler_log_probs=sampler, rewards=rewards,
                   completion_lengths=np.array([len(c.completion_ids) for c in completions]),
                   truncated=np.array([c.finish_reason == "length" for c in completions]),
                   seconds=time.perf_counter() - start)


def row_images(images: list[RowImages | None], patch_dim: int) -> dict[str, np.ndarray]:
    """The image fields `train/vision.py` reads, of rows whose images are `images` (None: a text row)."""
    present = [x for x in images if x is not None and len(x.grids_thw)]
    patches = [np.asarray(x.patches, np.float32).reshape(-1, patch_dim) for x in present]
    grids = [np.asarray(x.grids_thw, np.int64).reshape(-1, 3) for x in present]
    return {"patches": np.concatenate(patches) if patches else np.zeros((0, patch_dim), np.float32),
            "grids_thw": np.concatenate(grids) if grids else np.zeros((0, 3), np.int64),
            "image_counts": np.array([0 if x is None else len(x.grids_thw) for x in images], np.int32)}
