"""Online GRPO as a training objective (`scripts/train.py --objective grpo`). Each step:

1. the next prompts (`PromptStream`), `--batch-size / --group-size` of them;
2. `--group-size` completions each, sampled with the current parameters on the run's mesh (the
   random keys derive from --seed and the step, so a resumed run samples what the uninterrupted one
   would have);
3. the reward of every completion;
4. advantages per group (`--advantage`);
5. the old log-probs recomputed by the trainer's fused kernel on the sampled tokens (the sampler's own
   are kept for `logprob_mismatch`), the reference's when --kl-coef > 0 (`reference.py`), then
   `--ppo-epochs` clipped PPO updates, each over `--grad-accum` micro-batches.

Sampling and scoring both take the run's `StepOptions` (temperature, log-prob backend, lm_head mode),
so the old log-probs, the updates' and the sampler's agree on them.

Prompts with images (a VLM, docs/rl.md): the sampler gets each prompt's images, and each step's rows
carry them through `train/vision.py` (mrope positions [3, rows, S], each micro-batch's VisionInputs), so
the old log-probs, the reference's and the updates score the rows with the images the sampler saw.
"""

from __future__ import annotations

import functools
import math
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qwen35_jax.generation import generate
from qwen35_jax.generation.prompts import (
    PromptEncoder,
    model_tokenizer,
    parse_chat_template_kwargs,
    parse_stop_token_ids,
    stop_token_ids,
)
from qwen35_jax.loss_aggregation import loss_weights
from qwen35_jax.parallel.processes import gather_rows
from qwen35_jax.rl.advantages import zero_std_fraction
from qwen35_jax.rl.prompt_stream import PromptStream, check_prompt_images, load_prompts_with_images
from qwen35_jax.rl.reference import check_reference, kl_reference
from qwen35_jax.rl.reward_fn import call_reward, load_reward
from qwen35_jax.rl.rollout import RolloutOptions, reward_sample, row_length, sample_rollouts
from qwen35_jax.scoring import ScoreOptions, score_program, score_tokens
from qwen35_jax.train.data import place_batch
from qwen35_jax.train.metrics import plot_reward
from qwen35_jax.train.objective import Metrics, Objective, ObjectiveRun, RunSetup, TrainState, step_options_of
from qwen35_jax.train.optim import Params
from qwen35_jax.train.options import TrainOptions
from qwen35_jax.train.sources import run_image_processor
from qwen35_jax.train.step import StepOptions
from qwen35_jax.train.vision import carries_images, vision_batch
from qwen35_jax.xla_options import compiler_options


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of an optimizer step: a function of --seed and the step only."""
    return (seed * 1_000_003 + step) % 2**31


class OnlineGRPO(Objective):
    """--objective grpo: sample, reward, then the clipped surrogate (the "ppo" step) on the samples."""
    name = "grpo"

    def check(self, options: TrainOptions) -> None:
        if not options.data or options.synthetic:
            raise ValueError("--objective grpo needs --data: JSONL prompts (prompt_ids, prompt or messages per row)")
        if options.group_size < 2:  # rloo is refused by the options themselves
            raise ValueError(f"--group-size {options.group_size}: --advantage {options.advantage} compares the "
                             "completions of one prompt, and a group of one gets advantage 0 (nothing trains); "
                             "use --group-size 2 or more")
        if options.batch_size is not None and options.batch_size % options.group_size:
            raise ValueError(f"--batch-size {options.batch_size} counts completions: it must be a multiple of "
                             f"--group-size {options.group_size}")
        if options.stop_token_ids is not None:
            parse_stop_token_ids(options.stop_token_ids)
        parse_chat_template_kwargs(options.chat_template_kwargs)
        load_reward(options.reward)  # a bad spec fails before anything is built
        check_reference(options)
        check_prompt_images(options.data + options.eval_data)  # a missing image: before anything is written

    def default_batch_size(self, options: TrainOptions, fsdp: int) -> int:
        return math.lcm(fsdp * options.grad_accum, options.group_size)

    def updates_per_step(self, options: TrainOptions) -> int:
        return options.ppo_epochs

    def step_options(self, options: TrainOptions) -> StepOptions:
        # one update per rollout: the step's own log-probs are the old ones, with no forward beforehand
        return step_options_of(options, "ppo", on_policy=options.ppo_epochs == 1)

    def open(self, setup: RunSetup) -> ObjectiveRun:
        return OnlineRun(setup)


def _log_probs(program: Any, params: Params, tokens: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """The trainer's log-probs [K, b, S] of the placed batch's tokens and segment ids [K, b, S], by
    `scoring.score_program` (the fused kernel, as the train step computes them)."""
    k, b, s = tokens.shape
    log_probs, _ = program(params, tokens.reshape(k * b, s), segment_ids.reshape(k * b, s))
    return log_probs.reshape(k, b, s)


@functools.lru_cache(maxsize=16)
def _vision_score_program(graphdef: Any, kernels: Any, scoring: ScoreOptions) -> Any:
    """(params, placed VLM batch) -> the trainer's log-probs [K, b, S]: `score_tokens` on each of the K
    micro-batches with its mrope positions and VisionInputs, as the train step scores them."""

    def score(params: Params, batch: dict[str, Any]) -> jax.Array:
        def one(micro: dict[str, Any]) -> jax.Array:
            log_probs, _ = score_tokens(
                nnx.merge(graphdef, params), micro["tokens"], micro["segment_ids"], temperature=scoring.temperature,
                backend=scoring.backend, lm_head_mode=scoring.lm_head_mode, positions=micro["positions"],
                vision=micro.get("vision"))
            return log_probs

        # one micro-batch after the other (a loop, as the train step's): unrolled, the micro-batches'
        # collectives could run interleaved in different orders on different devices
        return jax.lax.map(one, batch)

    return jax.jit(score, compiler_options=compiler_options(kernels.resolve().platform))


_SCORED = ("tokens", "segment_ids", "positions", "vision")


@jax.jit
def _mismatch(sampler: jax.Array, trainer: jax.Array, mask: jax.Array) -> dict[str, jax.Array]:  # [K, b, S] each
    """logprob_mismatch (the mean over the mask of |sampler - trainer|) and logprob_mismatch_max, scalars."""
    m = mask.astype(jnp.float32)
    gap = jnp.abs(sampler - trainer) * m
    return {"logprob_mismatch": jnp.sum(gap) / jnp.maximum(jnp.sum(m), 1.0), "logprob_mismatch_max": jnp.max(gap)}


class OnlineRun(ObjectiveRun):
    """The prompts, reward, tokenizer, stop ids and KL reference of one run. Each of the `shard_count`
    processes (each holding its own rows of every batch) samples its `shard_index`-th share of every
    step's prompts."""

    def __init__(self, setup: RunSetup):
        options = setup.options
        per_step = setup.batch_size // options.group_size
        self.completions = setup.batch_size  # per step, over every process
        if setup.shard_count != jax.process_count() or per_step % setup.shard_count:
            raise ValueError(f"--objective grpo splits each step's {per_step} prompts over the processes, each "
                             f"sampling and training its own rows: put fsdp across processes (this mesh gives "
                             f"{setup.shard_count} row shards for {jax.process_count()} processes) and make the "
                             f"prompts per step a multiple of them")
        self.options, self.mesh, self.graphdef = options, setup.mesh, setup.graphdef
        self.shard_index, self.shard_count = setup.shard_index, setup.shard_count
        self.step_options = setup.step_options
        self.config = setup.config
        tokenizer, tokenizer_dir = model_tokenizer(options.model, options.tokenizer)
        self.encoder = PromptEncoder(tokenizer, setup.config.vocab_size, tokenizer_source=tokenizer_dir,
                                     chat_template_kwargs=parse_chat_template_kwargs(options.chat_template_kwargs),
                                     image_processor=run_image_processor(options, setup.config))
        self.rows, self.prompts, images = load_prompts_with_images(options.data, self.encoder)
        self.eval_rows, self.eval_prompts, eval_images = (load_prompts_with_images(options.eval_data, self.encoder)
                                                          if options.eval_data else ([], [], []))
        # each prompt's images, when any prompt has some (None: a text-only run, the text programs)
        with_images = any(x is not None for x in images + eval_images)
        if with_images and jax.process_count() > 1:
            raise ValueError("--objective grpo with prompts with images runs in one process for now (any mesh of "
                             "its devices): the rows' vision inputs are replicated and generation with images "
                             "is single-process")
        self.images = images if with_images else None
        self.eval_images = eval_images if with_images else None
        stop = stop_token_ids(options.stop_token_ids, options.model, tokenizer)
        self.rollout = RolloutOptions(group_size=options.group_size, max_new_tokens=options.max_new_tokens,
                                      temperature=setup.step_options.temperature, advantage=options.advantage,
                                      stop_token_ids=tuple(stop), mask_truncated=options.mask_truncated)
        self.stream = PromptStream(len(self.rows), per_step, seed=options.seed)
        self.reward = load_reward(options.reward)
        self.seq_len = row_length(self.prompts + self.eval_prompts, options.max_new_tokens)
        self.score = score_program(setup.graphdef, setup.config.kernels, setup.step_options.scoring)
        self.ref_params = kl_reference(setup) if options.kl_coef > 0 else None

    @property
    def evaluates(self) -> bool:
        return bool(self.eval_prompts)

    def _my_share(self, items: list[int]) -> tuple[list[int], int]:
        """(this process's share of `items`, the position of its first one)."""
        per = len(items) // self.shard_count
        start = self.shard_index * per
        return items[start:start + per], start

    def step(self, state: TrainState, step: int) -> tuple[Metrics, int]:
        o = self.options
        indices, first = self._my_share(self.stream.next_prompts())
        rollout = sample_rollouts(nnx.merge(self.graphdef, state.params), self.rows, self.prompts, indices,
                                  options=self.rollout, seed=step_seed(o.seed, step), mesh=self.mesh,
                                  reward=self.reward, encoder=self.encoder, seq_len=self.seq_len, first_row=first,
                                  images=self.images)
        start = time.perf_counter()
        host = {**rollout.batch, "sampler_log_probs": rollout.sampler_log_probs}
        if o.loss_agg != "token-mean":  # the aggregation's per-token weights (loss_aggregation.py)
            host["loss_weights"] = loss_weights(host["loss_mask"], o.loss_agg, completions=self.completions,
                                                max_new_tokens=o.max_new_tokens)
        if carries_images(host):  # mrope positions and each micro-batch's vision inputs (train/vision.py)
            host = vision_batch(host, self.config, grad_accum=o.grad_accum, max_patches=o.max_patches, step=step)
        placed = place_batch(host, self.mesh, o.grad_accum, self.shard_count)
        if not self.step_options.on_policy:  # several updates: the old log-probs are fixed before the first
            sampler = placed["sampler_log_probs"] if o.rollout_is else placed.pop("sampler_log_probs")
            placed["old_log_probs"] = self._log_probs(state.params, placed)
            gaps = _mismatch(sampler, placed["old_log_probs"], placed["loss_mask"])
            mismatch = {name: float(value) for name, value in gaps.items()}
        else:  # the step's own forward gives the old log-probs and their mismatch with the sampler's
            mismatch = {}
        if self.ref_params is not None:
            placed["ref_log_probs"] = self._log_probs(self.ref_params, placed)
        applied = 0
        for _ in range(o.ppo_epochs):
            state.params, state.opt_state, metrics = state.train_step(state.params, state.opt_state, placed)
            metrics = jax.device_get(metrics)
            applied += int(metrics["applied"])
        update_seconds = time.perf_counter() - start
        rewards, lengths, truncated = (gather_rows(x) for x in (rollout.rewards, rollout.completion_lengths,
                                                                 rollout.truncated))
        metrics = {**metrics, **mismatch, "applied": float(applied == o.ppo_epochs), "updates_applied": applied,
                   "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
                   "frac_reward_zero_std": zero_std_fraction(rewards.reshape(-1, o.group_size)),
                   "response_length_mean": float(lengths.mean()), "truncated_fraction": float(truncated.mean()),
                   "rollout_seconds": rollout.seconds,
                   "update_seconds": update_seconds,
                   "rollout_tokens_per_sec": float(lengths.sum()) / max(rollout.seconds, 1e-9),
                   "update_tokens_per_sec": o.ppo_epochs * float(metrics["batch_tokens"]) / max(update_seconds, 1e-9)}
        return metrics, self.seq_len

    def _log_probs(self, params: Params, placed: dict[str, Any]) -> jax.Array:
        """The trainer's log-probs [K, b, S] of a placed batch (with its positions and vision inputs)."""
        if "positions" not in placed:
            return _log_probs(self.score, params, placed["tokens"], placed["segment_ids"])
        program = _vision_score_program(self.graphdef, self.config.kernels, self.step_options.scoring)
        return program(params, {k: placed[k] for k in _SCORED if k in placed})

    def evaluate(self, params: Params) -> dict[str, float]:
        """Greedy mean reward on the --eval-data prompts, each process taking an equal share (the last
        prompt repeated to fill the shares, and counted once)."""
        n = len(self.eval_prompts)
        per = -(-n // self.shard_count)
        mine = list(range(self.shard_index * per, (self.shard_index + 1) * per))
        out = generate(nnx.merge(self.graphdef, params), [self.eval_prompts[min(i, n - 1)] for i in mine],
                       max_new_tokens=self.rollout.max_new_tokens, temperature=0,
                       stop_token_ids=list(self.rollout.stop_token_ids), mesh=self.mesh,
                       images=None if self.eval_images is None else [self.eval_images[min(i, n - 1)] for i in mine])
        rewards = np.zeros(per)
        for c in out:
            i = min(mine[c.prompt_index], n - 1)
            sample = reward_sample(self.eval_rows[i], self.eval_prompts[i], c.completion_ids, c.finish_reason,
                                   self.encoder)
            rewards[c.prompt_index] = call_reward(*self.reward, sample, self.eval_rows[i]["_source"])
        counted = gather_rows(np.array([i < n for i in mine]))
        return {"eval_reward": float(gather_rows(rewards)[counted].mean())}

    def get_state(self) -> dict[str, Any]:
        return self.stream.get_state()

    def set_state(self, state: dict[str, Any]) -> None:
        self.stream.set_state(state)

    def epoch(self) -> float:
        return float(self.stream.epoch)  # completed passes over the prompts

    def plots(self, run_dir: str) -> list[str]:
        return [p for p in (plot_reward(run_dir),) if p]

    def summary(self, trained: list[Metrics]) -> str:
        return f", sampled reward {trained[0]['reward_mean']:.3f} -> {trained[-1]['reward_mean']:.3f}"
