"""The train step: sequence-sharded forward, fused per-token log-probs, SFT or PPO loss, AdamW update.

Parameters are ZeRO-3 sharded over (fsdp, sp) and the AdamW moments get exactly the same shardings
(`create_optimizer`), so each device holds 1/(F*sp) of parameters, gradients and optimizer state. The
batch is P('fsdp', 'sp'): rows over fsdp, positions over sp. Log-probs come from
`scoring.score_tokens`, so labels are built on the global sequence and no [tokens x vocab] logits exist.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qwen35_jax.labels import IGNORE, next_token_labels
from qwen35_jax.losses import policy_loss, sft_loss
from qwen35_jax.scoring import score_tokens

OBJECTIVES = ("sft", "ppo")
Batch = dict[str, jax.Array]  # every entry [B, S], sharded P('fsdp', 'sp')


def make_schedule(lr: float, total_steps: int, warmup_steps: int = 0, final_lr_ratio: float = 0.1) -> optax.Schedule:
    """Linear warmup to `lr` over the first `warmup_steps` updates (the first at lr / warmup_steps),
    then cosine decay towards `lr * final_lr_ratio`, reached after `total_steps` updates."""
    if not lr > 0:
        raise ValueError(f"learning rate must be > 0, got {lr}")
    if total_steps < 1 or not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"need total_steps >= 1 and 0 <= warmup_steps <= total_steps, "
                         f"got {total_steps} and {warmup_steps}")
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=warmup_steps,
        decay_steps=max(total_steps, warmup_steps + 1), end_value=lr * final_lr_ratio)
    offset = 1 if warmup_steps else 0  # update 0 already learns: lr / warmup_steps, not 0
    return lambda count: base(count + offset)


def make_optimizer(schedule: optax.Schedule, *, weight_decay: float = 0.0, clip_norm: float | None = 1.0,
                   b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8) -> optax.GradientTransformation:
    """AdamW on `schedule`, after clipping the gradients to global norm `clip_norm` (None: no clipping)."""
    if clip_norm is not None and not clip_norm > 0:
        raise ValueError(f"clip_norm must be > 0 or None, got {clip_norm}")
    adamw = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay)
    return adamw if clip_norm is None else optax.chain(optax.clip_by_global_norm(clip_norm), adamw)


def _key_names(path: tuple[Any, ...]) -> tuple[Any, ...]:
    return tuple(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k))) for k in path)


def create_optimizer(model: nnx.Module, tx: optax.GradientTransformation, mesh: Mesh) -> nnx.Optimizer:
    """`nnx.Optimizer` over the model's `nnx.Param`s whose state follows the parameters: every moment
    gets the sharding of the parameter it belongs to, scalars (step, count) are replicated on `mesh`."""
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)
    params = {_key_names(p): x.sharding for p, x in jax.tree.flatten_with_path(nnx.state(model, nnx.Param))[0]}
    replicated = NamedSharding(mesh, P())

    def sharding(path: tuple[Any, ...], leaf: jax.Array) -> jax.sharding.Sharding:
        names = _key_names(path)
        for start in range(len(names)):  # a moment's path ends with its parameter's path
            if names[start:] in params:
                return params[names[start:]]
        return replicated

    state = nnx.state(optimizer)
    nnx.update(optimizer, jax.device_put(state, jax.tree.map_with_path(sharding, state)))
    return optimizer


def loss_mask_of(batch: Batch) -> jax.Array:  # [B, S] float32
    """1 where log_probs[b, t] (the prediction of tokens[b, t + 1]) is trained on: it has a label in
    the same document and the batch's own `loss_mask` (prompt / ignored tokens 0), if any, is 1."""
    labels = next_token_labels(batch["tokens"], batch["segment_ids"])  # [B, S]
    mask = (labels != IGNORE).astype(jnp.float32)
    if "loss_mask" in batch:
        mask = mask * batch["loss_mask"].astype(jnp.float32)
    return mask


def make_train_step(
    schedule: optax.Schedule,
    *,
    objective: str = "sft",
    temperature: float = 1.0,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    entropy_coef: float = 0.0,
    backend: str = "auto",
    lm_head_mode: str = "gather",
) -> Callable[[nnx.Module, nnx.Optimizer, Batch], dict[str, jax.Array]]:
    """`train_step(model, optimizer, batch) -> metrics`, jitted, updating model and optimizer in place.
    Their old buffers are donated: arrays shared with another object (an `nnx.clone`) are deleted.

    Call it with the mesh set (`jax.set_mesh(mesh)`). The batch holds `tokens`, `segment_ids` (>= 1,
    0 = padding) and optionally `loss_mask`; PPO also `old_log_probs` and `advantages`, all [B, S] and
    aligned with the log-probs: entry t belongs to the prediction of tokens[t + 1].
    Metrics: loss, grad_norm (before clipping), lr (of this update), tokens, and the loss's own metrics.
    """
    if objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")

    def loss_fn(model: nnx.Module, batch: Batch) -> tuple[jax.Array, dict[str, jax.Array]]:
        log_probs, entropy = score_tokens(  # [B, S] each
            model, batch["tokens"], batch["segment_ids"], temperature=temperature, backend=backend,
            lm_head_mode=lm_head_mode)
        mask = loss_mask_of(batch)
        if objective == "sft":
            loss, metrics = sft_loss(log_probs, mask)
        else:
            loss, metrics = policy_loss(
                log_probs, batch["old_log_probs"], batch["advantages"], mask, clip_low=clip_low,
                clip_high=clip_high, entropy=entropy, entropy_coef=entropy_coef)
        metrics = {**metrics, "loss": loss, "tokens": jnp.sum(mask)}
        return loss, metrics

    @nnx.jit(donate_argnums=(0, 1))
    def train_step(model: nnx.Module, optimizer: nnx.Optimizer, batch: Batch) -> dict[str, jax.Array]:
        if objective == "ppo" and not {"old_log_probs", "advantages"} <= batch.keys():
            raise ValueError(f"objective 'ppo' needs old_log_probs and advantages in the batch, got {sorted(batch)}")
        lr = schedule(optimizer.step[...])
        grads, metrics = nnx.grad(loss_fn, has_aux=True)(model, batch)
        grad_norm = optax.tree.norm(grads)
        optimizer.update(model, grads)
        return {**metrics, "grad_norm": grad_norm, "lr": jnp.asarray(lr, jnp.float32)}

    return train_step
