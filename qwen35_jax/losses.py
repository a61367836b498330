"""Training losses on per-token log-probs: SFT negative log-likelihood and the PPO/GRPO surrogate.

Log-probs and entropy come from the fused kernel (`token_log_probs`), so no [B, S, V] logits exist.
All losses take a 0/1 `loss_mask` [B, S] (prompt, padding and ignored positions are 0) and return
`(loss, metrics)`, metrics being scalars RL users log, without gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from qwen35_kernels import linear_logprob_entropy

AGGREGATIONS = ("token_mean", "seq_mean")


def token_log_probs(
    hidden: jax.Array,  # [B, S, D] final-normed hidden states
    weight: jax.Array,  # [D, V] lm_head
    labels: jax.Array,  # [B, S] int, < 0 = ignored
    *,
    temperature: float = 1.0,
    backend: str = "auto",
) -> tuple[jax.Array, jax.Array]:  # (log_probs [B, S] float32, entropy [B, S] float32)
    """Fused per-token log p(label) and entropy for a batch (flattens [B, S] to T and back)."""
    if hidden.ndim != 3 or labels.shape != hidden.shape[:2]:
        raise ValueError(
            f"hidden must be [B, S, D] and labels [B, S], got {tuple(hidden.shape)} and {tuple(labels.shape)}"
        )
    b, s, d = hidden.shape
    lp, ent = linear_logprob_entropy(
        hidden.reshape(b * s, d), weight, labels.reshape(b * s), temperature=temperature, backend=backend
    )
    return lp.reshape(b, s), ent.reshape(b, s)


def masked_mean(x: jax.Array, mask: jax.Array, axis=None) -> jax.Array:
    """sum(x * mask) / sum(mask) over `axis`; 0 where the mask is empty."""
    mask = mask.astype(jnp.float32)
    total = jnp.sum(mask, axis=axis)
    return jnp.sum(x * mask, axis=axis) / jnp.maximum(total, 1.0)


def aggregate(x: jax.Array, mask: jax.Array, aggregation: str) -> jax.Array:
    """x [B, S] -> scalar: "token_mean" over every unmasked token, or "seq_mean": the mean over
    sequences (with at least one unmasked token) of each sequence's token mean."""
    if aggregation == "token_mean":
        return masked_mean(x, mask)
    if aggregation == "seq_mean":
        if x.ndim < 2:
            raise ValueError(f"aggregation 'seq_mean' needs [B, S] inputs, got shape {tuple(x.shape)}")
        per_seq = masked_mean(x, mask, axis=-1)  # [B]
        has_tokens = jnp.any(mask > 0, axis=-1)
        return masked_mean(per_seq, has_tokens)
    raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")


def _check_shapes(**arrays: jax.Array) -> None:
    shapes = {name: tuple(x.shape) for name, x in arrays.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"inputs must have one shape, got {shapes}")


def sft_loss(
    log_probs: jax.Array,  # [B, S] log p(label)
    loss_mask: jax.Array,  # [B, S] 0/1
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Token-mean negative log-likelihood over the unmasked tokens."""
    _check_shapes(log_probs=log_probs, loss_mask=loss_mask)
    nll = masked_mean(-log_probs, loss_mask)
    metrics = {"nll": nll, "tokens": jnp.sum(loss_mask.astype(jnp.float32))}
    return nll, jax.lax.stop_gradient(metrics)


def policy_loss(
    log_probs: jax.Array,  # [B, S] current policy log p(label)
    old_log_probs: jax.Array,  # [B, S] behaviour policy log p(label)
    advantages: jax.Array,  # [B, S] per token, or [B] per sequence (GRPO)
    loss_mask: jax.Array,  # [B, S] 0/1
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    aggregation: str = "token_mean",
    entropy: jax.Array | None = None,  # [B, S]
    entropy_coef: float = 0.0,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO/GRPO clipped surrogate: ratio = exp(logp - old_logp),
    per token max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)); with `dual_clip` = c > 1,
    tokens with A < 0 are also capped at -A * c. Aggregated by `aggregation`, minus
    entropy_coef * aggregate(entropy) when entropy is given.

    Metrics: policy_loss, clip_fraction (tokens whose clipped term is the larger), dual_clip_fraction,
    approx_kl (E[(r - 1) - log r], the k3 estimator of KL(old || new)), ppo_kl (E[old_logp - logp]),
    ratio_mean, entropy (when given), loss; token means over the mask.
    """
    clip_high = clip_low if clip_high is None else clip_high
    if not (clip_low > 0 and clip_high > 0):
        raise ValueError(f"clip_low and clip_high must be > 0, got {clip_low} and {clip_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    if advantages.ndim == log_probs.ndim - 1:
        advantages = advantages[..., None] * jnp.ones_like(log_probs)
    _check_shapes(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages, loss_mask=loss_mask)

    log_ratio = jnp.clip(log_probs - old_log_probs, -20.0, 20.0)  # exp stays finite
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = jnp.maximum(unclipped, clipped)
    dual_clipped = jnp.zeros_like(per_token, dtype=bool)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (per_token > cap)
        per_token = jnp.where(advantages < 0, jnp.minimum(per_token, cap), per_token)
    pg = aggregate(per_token, loss_mask, aggregation)
    loss = pg
    metrics = {
        "policy_loss": pg,
        "clip_fraction": masked_mean((clipped > unclipped).astype(jnp.float32), loss_mask),
        "dual_clip_fraction": masked_mean(dual_clipped.astype(jnp.float32), loss_mask),
        "approx_kl": masked_mean(ratio - 1.0 - log_ratio, loss_mask),
        "ppo_kl": masked_mean(-log_ratio, loss_mask),
        "ratio_mean": masked_mean(ratio, loss_mask),
    }
    if entropy is not None:
        _check_shapes(log_probs=log_probs, entropy=entropy)
        ent = aggregate(entropy, loss_mask, aggregation)
        loss = loss - entropy_coef * ent
        metrics["entropy"] = ent
    metrics["loss"] = loss
    return loss, jax.lax.stop_gradient(metrics)
