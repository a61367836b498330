"""The optimizer: learning-rate schedule, AdamW with weight decay masked off vectors, clipping, and
optimizer-state shardings that follow the parameters (ZeRO-3 for the moments too)."""

from __future__ import annotations

from typing import Any

import jax
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

Params = dict[str, Any]  # the model's parameters as a pure dict (nnx.to_pure_dict)
NO_DECAY_NAMES = ("A_log", "dt_bias", "bias")  # besides every norm's `weight`


def make_schedule(lr: float, total_steps: int, warmup_steps: int = 0, final_lr_ratio: float = 0.1) -> optax.Schedule:
    """Linear warmup to `lr` over the first `warmup_steps` updates (the first at lr / warmup_steps),
    then cosine decay towards `lr * final_lr_ratio`, reached after `total_steps` updates."""
    if not lr > 0:
        raise ValueError(f"learning rate must be > 0, got {lr}")
    if total_steps < 1 or not 0 <= warmup_steps <= total_steps:
        raise ValueError(f"need total_steps >= 1 and 0 <= warmup_steps <= total_steps, "
                         f"got {total_steps} and {warmup_steps}")
    if not 0 <= final_lr_ratio <= 1:
        raise ValueError(f"final_lr_ratio must be in [0, 1], got {final_lr_ratio}")
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0, peak_value=lr, warmup_steps=warmup_steps,
        decay_steps=max(total_steps, warmup_steps + 1), end_value=lr * final_lr_ratio)
    offset = 1 if warmup_steps else 0  # update 0 already learns: lr / warmup_steps, not 0
    return lambda count: base(count + offset)


def _names(path: tuple[Any, ...]) -> tuple[str, ...]:
    return tuple(str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))) for k in path)


def decays(path: tuple[Any, ...]) -> bool:
    """Whether weight decay applies to the parameter at `path`: matrices and embeddings yes; norm
    weights (every `weight` in this model is a norm's: linears hold `kernel`), biases, A_log, dt_bias no."""
    name = _names(path)[-1]
    return name != "weight" and name not in NO_DECAY_NAMES


def weight_decay_mask(params: Params) -> Any:
    """The bool tree of `decays` over `params` (optax's `mask=` argument)."""
    return jax.tree_util.tree_map_with_path(lambda path, _: decays(path), params)


def frozen_labels(frozen: tuple[str, ...]) -> Any:
    """params -> the tree of "frozen" (a parameter under one of the top-level `frozen` modules) or "train"."""
    return lambda params: jax.tree_util.tree_map_with_path(
        lambda path, _: "frozen" if _names(path)[0] in frozen else "train", params)


def make_optimizer(schedule: optax.Schedule, *, weight_decay: float = 0.0, clip_norm: float | None = 1.0,
                   b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8,
                   frozen: tuple[str, ...] = ()) -> optax.GradientTransformation:
    """AdamW on `schedule` after clipping gradients to global norm `clip_norm` (None: no clipping);
    weight decay only where `decays` says so. `frozen`: top-level modules ("visual": the vision tower)
    whose parameters get zero updates and no optimizer state (the clipping norm is the trained ones')."""
    if clip_norm is not None and not clip_norm > 0:
        raise ValueError(f"clip_norm must be > 0 or None, got {clip_norm}")
    if weight_decay < 0:
        raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
    adamw = optax.adamw(schedule, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay, mask=weight_decay_mask)
    tx = adamw if clip_norm is None else optax.chain(optax.clip_by_global_norm(clip_norm), adamw)
    if not frozen:
        return tx
    return optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, frozen_labels(tuple(frozen)))


def opt_state_shardings(abstract_opt_state: Any, params: Params, mesh: Mesh) -> Any:
    """Shardings for an optimizer state: every leaf whose path ends with a parameter's path (Adam's
    moments) gets that parameter's sharding, the rest (counts) is replicated on `mesh`."""
    by_path = {_names(p): x.sharding for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    replicated = NamedSharding(mesh, P())

    def one(path: tuple[Any, ...], _: Any) -> jax.sharding.Sharding:
        names = _names(path)
        for start in range(len(names)):
            if names[start:] in by_path:
                return by_path[names[start:]]
        return replicated

    return jax.tree_util.tree_map_with_path(one, abstract_opt_state)


def init_opt_state(tx: optax.GradientTransformation, params: Params, mesh: Mesh) -> Any:
    """`tx.init(params)` placed with `opt_state_shardings` (each device holds only its shard)."""
    abstract = jax.eval_shape(tx.init, params)
    return jax.jit(tx.init, out_shardings=opt_state_shardings(abstract, params, mesh))(params)
