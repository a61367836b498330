"""The online GRPO step inside the training loop (`scripts/train.py --objective grpo`):

1. the next prompts (`PromptStream`), `--batch-size / --group-size` of them;
2. `--group-size` completions each, sampled with the current parameters on the run's mesh (the
   random keys derive from --seed and the step, so a resumed run samples what the uninterrupted one
   would have);
3. the reward of every completion;
4. advantages per group (`--advantage`);
5. the old log-probs recomputed by the trainer's fused kernel on the sampled tokens (the sampler's own
   are kept for `logprob_mismatch`), the reference's when --kl-coef > 0, then `--ppo-epochs` clipped
   PPO updates, each over `--grad-accum` micro-batches.
"""

from __future__ import annotations

import dataclasses
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
from qwen35_jax.parallel.processes import gather_rows
from qwen35_jax.rl.prompt_stream import PromptStream, load_prompts
from qwen35_jax.rl.reward_fn import RewardFn, call_reward, load_reward
from qwen35_jax.rl.rollout import RolloutOptions, reward_sample, row_length, sample_rollouts
from qwen35_jax.scoring import score_program
from qwen35_jax.train.data import place_batch
from qwen35_jax.train.options import TrainOptions


@dataclasses.dataclass
class OnlineRL:
    rows: list[dict[str, Any]]
    prompts: list[list[int]]
    stream: PromptStream
    encoder: PromptEncoder
    rollout: RolloutOptions
    reward: tuple[RewardFn, str]
    seq_len: int
    graphdef: nnx.GraphDef
    ref_params: Any  # the starting parameters (sharded), when --kl-coef > 0
    eval_rows: list[dict[str, Any]]
    eval_prompts: list[list[int]]
    shard_index: int  # this process's share of every step's prompts (and of the batch's rows)
    shard_count: int


def step_seed(seed: int, step: int) -> int:
    """The sampling seed of an optimizer step: a function of --seed and the step only."""
    return (seed * 1_000_003 + step) % 2**31


def check_grpo_options(options: TrainOptions) -> None:
    """The checks of --objective grpo that need no devices; one-line ValueErrors."""
    if not options.data or options.synthetic:
        raise ValueError("--objective grpo needs --data: JSONL prompts (prompt_ids, prompt or messages per row)")
    if options.batch_size is not None and options.batch_size % options.group_size:
        raise ValueError(f"--batch-size {options.batch_size} counts completions: it must be a multiple of "
                         f"--group-size {options.group_size}")
    if options.stop_token_ids is not None:
        parse_stop_token_ids(options.stop_token_ids)
    parse_chat_template_kwargs(options.chat_template_kwargs)
    load_reward(options.reward)  # a bad spec fails before anything is built


def open_online_rl(options: TrainOptions, *, vocab_size: int, batch_size: int, graphdef: nnx.GraphDef,
                   ref_params: Any, shard_index: int, shard_count: int) -> OnlineRL:
    """The prompts, reward, tokenizer and stop ids of a run. Each of the `shard_count` processes (each
    holding its own rows of every batch) samples its `shard_index`-th share of every step's prompts."""
    per_step = batch_size // options.group_size
    if shard_count != jax.process_count() or per_step % shard_count:
        raise ValueError(f"--objective grpo splits each step's {per_step} prompts over the processes, each sampling "
                         f"and training its own rows: put fsdp across processes (this mesh gives {shard_count} "
                         f"row shards for {jax.process_count()} processes) and make the prompts per step a "
                         f"multiple of them")
    tokenizer, tokenizer_dir = model_tokenizer(options.model, options.tokenizer)
    encoder = PromptEncoder(tokenizer, vocab_size, tokenizer_source=tokenizer_dir,
                            chat_template_kwargs=parse_chat_template_kwargs(options.chat_template_kwargs))
    rows, prompts = load_prompts(options.data, encoder)
    eval_rows, eval_prompts = load_prompts(options.eval_data, encoder) if options.eval_data else ([], [])
    stop = stop_token_ids(options.stop_token_ids, options.model, tokenizer)
    rollout = RolloutOptions(group_size=options.group_size, max_new_tokens=options.max_new_tokens,
                             temperature=options.temperature, advantage=options.advantage,
                             stop_token_ids=tuple(stop))
    stream = PromptStream(len(rows), batch_size // options.group_size, seed=options.seed)
    return OnlineRL(rows=rows, prompts=prompts, stream=stream, encoder=encoder, rollout=rollout,
                    reward=load_reward(options.reward), seq_len=row_length(prompts + eval_prompts,
                                                                            options.max_new_tokens),
                    graphdef=graphdef, ref_params=ref_params, eval_rows=eval_rows, eval_prompts=eval_prompts,
                    shard_index=shard_index, shard_count=shard_count)


def _log_probs(program: Any, params: Any, tokens: jax.Array, segment_ids: jax.Array) -> jax.Array:
    """The trainer's log-probs [K, b, S] of the placed batch's tokens and segment ids [K, b, S], by
    `scoring.score_program` (the fused kernel, as the train step computes them)."""
    k, b, s = tokens.shape
    log_probs, _ = program(params, tokens.reshape(k * b, s), segment_ids.reshape(k * b, s))
    return log_probs.reshape(k, b, s)


@jax.jit
def _mismatch(sampler: jax.Array, trainer: jax.Array, mask: jax.Array) -> jax.Array:  # [K, b, S] each -> []
    m = mask.astype(jnp.float32)
    return jnp.sum(jnp.abs(sampler - trainer) * m) / jnp.maximum(jnp.sum(m), 1.0)


def _my_share(items: list[int], rl: OnlineRL) -> tuple[list[int], int]:
    """(this process's share of `items`, the position of its first one)."""
    per = len(items) // rl.shard_count
    start = rl.shard_index * per
    return items[start:start + per], start


def rl_step(run: Any, step: int) -> tuple[dict[str, Any], int]:
    """One online step on `run` (a `train.loop.Run`): (metrics, row length). Updates run.params and
    run.opt_state."""
    rl, o = run.rl, run.options
    indices, first = _my_share(rl.stream.next_prompts(), rl)
    model = nnx.merge(rl.graphdef, run.params)
    rollout = sample_rollouts(model, rl.rows, rl.prompts, indices, options=rl.rollout,
                              seed=step_seed(o.seed, step), mesh=run.mesh, reward=rl.reward, encoder=rl.encoder,
                              seq_len=rl.seq_len, first_row=first)
    start = time.perf_counter()
    placed = place_batch({**rollout.batch, "sampler_log_probs": rollout.sampler_log_probs}, run.mesh, o.grad_accum,
                         run.shard_count)
    sampler = placed.pop("sampler_log_probs")
    score = score_program(rl.graphdef, run.config.kernels, o.temperature, o.logprob_backend, o.lm_head)
    placed["old_log_probs"] = _log_probs(score, run.params, placed["tokens"], placed["segment_ids"])
    mismatch = float(_mismatch(sampler, placed["old_log_probs"], placed["loss_mask"]))
    if o.kl_coef > 0:
        placed["ref_log_probs"] = _log_probs(score, rl.ref_params, placed["tokens"], placed["segment_ids"])
    applied = 0
    for _ in range(o.ppo_epochs):
        run.params, run.opt_state, metrics = run.train_step(run.params, run.opt_state, placed)
        metrics = jax.device_get(metrics)
        applied += int(metrics["applied"])
    update_seconds = time.perf_counter() - start
    rewards, lengths, truncated = (gather_rows(x) for x in (rollout.rewards, rollout.completion_lengths,
                                                           rollout.truncated))
    metrics = {**metrics, "applied": float(applied == o.ppo_epochs), "updates_applied": applied,
               "reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()),
               "response_length_mean": float(lengths.mean()), "truncated_fraction": float(truncated.mean()),
               "logprob_mismatch": mismatch, "rollout_seconds": rollout.seconds, "update_seconds": update_seconds,
               "rollout_tokens_per_sec": float(lengths.sum()) / max(rollout.seconds, 1e-9),
               "update_tokens_per_sec": o.ppo_epochs * float(metrics["batch_tokens"]) / max(update_seconds, 1e-9)}
    return metrics, rl.seq_len


def rl_evaluate(run: Any) -> dict[str, float]:
    """Greedy mean reward on the --eval-data prompts, each process taking an equal share (the last
    prompt repeated to fill the shares, and counted once)."""
    rl = run.rl
    n = len(rl.eval_prompts)
    per = -(-n // rl.shard_count)
    mine = list(range(rl.shard_index * per, (rl.shard_index + 1) * per))
    out = generate(nnx.merge(rl.graphdef, run.params), [rl.eval_prompts[min(i, n - 1)] for i in mine],
                   max_new_tokens=rl.rollout.max_new_tokens, temperature=0,
                   stop_token_ids=list(rl.rollout.stop_token_ids), mesh=run.mesh)
    rewards = np.zeros(per)
    for c in out:
        i = min(mine[c.prompt_index], n - 1)
        sample = reward_sample(rl.eval_rows[i], rl.eval_prompts[i], c.completion_ids, c.finish_reason, rl.encoder)
        rewards[c.prompt_index] = call_reward(*rl.reward, sample, rl.eval_rows[i]["_source"])
    counted = gather_rows(np.array([i < n for i in mine]))
    return {"eval_reward": float(gather_rows(rewards)[counted].mean())}
