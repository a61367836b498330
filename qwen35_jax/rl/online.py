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
import json
import time
from typing import Any

import jax
import numpy as np
from flax import nnx

from qwen35_jax.generation import generate
from qwen35_jax.generation.prompts import PromptEncoder, default_stop_token_ids, load_tokenizer, tokenizer_dir_for
from qwen35_jax.rl.prompt_stream import PromptStream, load_prompts
from qwen35_jax.rl.reward_fn import RewardFn, call_reward, load_reward
from qwen35_jax.rl.rollout import RolloutOptions, reward_sample, row_length, sample_rollouts
from qwen35_jax.scoring import score_batches
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
    if jax.process_count() > 1:
        raise ValueError("--objective grpo runs in one process (multi-process sampling is not supported yet)")
    if options.stop_token_ids is not None:
        _stop_ids(options.stop_token_ids)
    load_reward(options.reward)  # a bad spec fails before anything is built


def _stop_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"--stop-token-ids must be comma-separated integers, got {text!r}") from None


def open_online_rl(options: TrainOptions, *, vocab_size: int, batch_size: int, graphdef: nnx.GraphDef,
                   ref_params: Any) -> OnlineRL:
    tokenizer_dir = options.tokenizer or (tokenizer_dir_for(options.model) if options.model else None)
    tokenizer = load_tokenizer(tokenizer_dir) if tokenizer_dir else None
    kwargs = json.loads(options.chat_template_kwargs) if options.chat_template_kwargs else {}
    if not isinstance(kwargs, dict):
        raise ValueError("--chat-template-kwargs must be a JSON object")
    encoder = PromptEncoder(tokenizer, vocab_size, chat_template_kwargs=kwargs, tokenizer_source=tokenizer_dir)
    rows, prompts = load_prompts(options.data, encoder)
    eval_rows, eval_prompts = load_prompts(options.eval_data, encoder) if options.eval_data else ([], [])
    if options.stop_token_ids is not None:
        stop = _stop_ids(options.stop_token_ids)
    else:
        stop = default_stop_token_ids(options.model, tokenizer) if options.model else []
    rollout = RolloutOptions(group_size=options.group_size, max_new_tokens=options.max_new_tokens,
                             temperature=options.temperature, advantage=options.advantage,
                             stop_token_ids=tuple(stop))
    stream = PromptStream(len(rows), batch_size // options.group_size, seed=options.seed)
    return OnlineRL(rows=rows, prompts=prompts, stream=stream, encoder=encoder, rollout=rollout,
                    reward=load_reward(options.reward), seq_len=row_length(prompts + eval_prompts,
                                                                            options.max_new_tokens),
                    graphdef=graphdef, ref_params=ref_params, eval_rows=eval_rows, eval_prompts=eval_prompts)


def _score(rl: OnlineRL, params: Any, batch: dict[str, np.ndarray], run: Any) -> np.ndarray:  # [N, S]
    o = run.options
    log_probs, _ = score_batches(nnx.merge(rl.graphdef, params), batch["tokens"], batch["segment_ids"],
                                 mesh=run.mesh, temperature=o.temperature, backend=o.logprob_backend,
                                 lm_head_mode=o.lm_head)
    return log_probs


def rl_step(run: Any, step: int) -> tuple[dict[str, Any], int]:
    """One online step on `run` (a `train.loop.Run`): (metrics, row length). Updates run.params and
    run.opt_state."""
    rl, o = run.rl, run.options
    indices = rl.stream.next_prompts()
    model = nnx.merge(rl.graphdef, run.params)
    rollout = sample_rollouts(model, rl.rows, rl.prompts, indices, options=rl.rollout,
                              seed=step_seed(o.seed, step), mesh=run.mesh, reward=rl.reward, encoder=rl.encoder,
                              seq_len=rl.seq_len)
    start = time.perf_counter()
    batch = dict(rollout.batch)
    batch["old_log_probs"] = _score(rl, run.params, batch, run)
    mask = batch["loss_mask"].astype(bool)
    mismatch = float(np.abs(rollout.sampler_log_probs - batch["old_log_probs"])[mask].mean())
    if o.kl_coef > 0:
        batch["ref_log_probs"] = _score(rl, rl.ref_params, batch, run)
    placed = place_batch(batch, run.mesh, o.grad_accum, run.shard_count)
    applied = 0
    for _ in range(o.ppo_epochs):
        run.params, run.opt_state, metrics = run.train_step(run.params, run.opt_state, placed)
        metrics = jax.device_get(metrics)
        applied += int(metrics["applied"])
    update_seconds = time.perf_counter() - start
    generated = int(rollout.completion_lengths.sum())
    metrics = {**metrics, "applied": float(applied == o.ppo_epochs), "updates_applied": applied,
               "reward_mean": float(rollout.rewards.mean()), "reward_std": float(rollout.rewards.std()),
               "response_length_mean": float(rollout.completion_lengths.mean()),
               "truncated_fraction": float(rollout.truncated.mean()), "logprob_mismatch": mismatch,
               "rollout_seconds": rollout.seconds, "update_seconds": update_seconds,
               "rollout_tokens_per_sec": generated / max(rollout.seconds, 1e-9),
               "update_tokens_per_sec": o.ppo_epochs * float(metrics["batch_tokens"]) / max(update_seconds, 1e-9)}
    return metrics, rl.seq_len


def rl_evaluate(run: Any) -> dict[str, float]:
    """Greedy mean reward on the --eval-data prompts."""
    rl = run.rl
    model = nnx.merge(rl.graphdef, run.params)
    out = generate(model, rl.eval_prompts, max_new_tokens=rl.rollout.max_new_tokens, temperature=0,
                   stop_token_ids=list(rl.rollout.stop_token_ids), mesh=run.mesh)
    rewards = [call_reward(*rl.reward, reward_sample(rl.eval_rows[c.prompt_index], rl.eval_prompts[c.prompt_index],
                                                     c.completion_ids, c.finish_reason, rl.encoder),
                           rl.eval_rows[c.prompt_index]["_source"]) for c in out]
    return {"eval_reward": float(np.mean(rewards))}
