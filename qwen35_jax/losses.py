"""Training losses on per-token log-probs: SFT negative log-likelihood and the PPO/GRPO surrogate.

Log-probs and entropy come from the fused kernel (`token_log_probs`), so no [B, S, V] logits exist.
All losses take a 0/1 `loss_mask` [B, S] (prompt, padding and ignored positions are 0) and return
`(loss, metrics)`, metrics being scalars RL users log, without gradient.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from qwen35_kernels import linear_logprob_entropy
from qwen35_kernels.choices import KernelChoices

from qwen35_jax.loss_aggregation import ROLLOUT_IS_LEVELS

AGGREGATIONS = ("token_mean", "seq_mean")  # of `policy_loss`, the library function on one array


def token_log_probs(
    hidden: jax.Array,  # [B, S, D] final-normed hidden states
    weight: jax.Array,  # [D, V] lm_head
    labels: jax.Array,  # [B, S] int, < 0 = ignored
    *,
    temperature: float = 1.0,
    backend: str | None = None,
    choices: KernelChoices | None = None,
) -> tuple[jax.Array, jax.Array]:  # (log_probs [B, S] float32, entropy [B, S] float32)
    """Fused per-token log p(label) and entropy for a batch (flattens [B, S] to T and back); `backend`
    (None: the `choices`' log-prob backend) and `choices` (a model's `config.kernels`) as
    `qwen35_kernels.linear_logprob_entropy` takes them."""
    if hidden.ndim != 3 or labels.shape != hidden.shape[:2]:
        raise ValueError(
            f"hidden must be [B, S, D] and labels [B, S], got {tuple(hidden.shape)} and {tuple(labels.shape)}"
        )
    b, s, d = hidden.shape
    lp, ent = linear_logprob_entropy(
        hidden.reshape(b * s, d), weight, labels.reshape(b * s), temperature=temperature, backend=backend,
        choices=choices)
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


KL_ESTIMATORS = ("k1", "k2", "k3", "low_var_kl")


def kl_penalty(log_probs: jax.Array, ref_log_probs: jax.Array, estimator: str = "low_var_kl") -> jax.Array:
    """Per-token estimate of KL(policy || reference) from log-probs of the sampled tokens, [B, S]:
    k1 = log r, k2 = (log r)^2 / 2, k3 = 1/r - 1 + log r with r = p / p_ref ("low_var_kl" is k3 clamped
    to [-10, 10], as RL stacks run it; k3 itself is left unclamped)."""
    if estimator not in KL_ESTIMATORS:
        raise ValueError(f"KL estimator must be one of {KL_ESTIMATORS}, got {estimator!r}")
    log_ratio = log_probs - ref_log_probs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * jnp.square(log_ratio)
    neg = jnp.clip(-log_ratio, -20.0, 20.0)  # exp stays finite
    k3 = jnp.exp(neg) - neg - 1.0
    return jnp.clip(k3, -10.0, 10.0) if estimator == "low_var_kl" else k3


def policy_terms(
    log_probs: jax.Array,  # [B, S] current policy log p(label)
    old_log_probs: jax.Array,  # [B, S] behaviour policy log p(label)
    advantages: jax.Array,  # [B, S] per token, or [B] per sequence (GRPO)
    *,
    clip_low: float = 0.2,
    clip_high: float | None = None,
    dual_clip: float | None = None,
    entropy: jax.Array | None = None,  # [B, S]
    entropy_coef: float = 0.0,
    ref_log_probs: jax.Array | None = None,  # [B, S] reference policy log p(label)
    kl_coef: float = 0.0,
    kl_estimator: str = "low_var_kl",
    sequence_mask: jax.Array | None = None,  # [B, S] 0/1: GSPO's sequence ratios over these tokens
    is_weights: jax.Array | None = None,  # [B, S] rollout importance weights (`rollout_is_weights`)
) -> dict[str, jax.Array]:  # every value [B, S]
    """Per-token terms of the PPO/GRPO objective, before any aggregation over the mask:
    "loss" = clipped surrogate - entropy_coef * entropy + kl_coef * KL(policy || ref), and the terms
    RL users log (policy_loss, clip_fraction, dual_clip_fraction, approx_kl, ppo_kl, ratio_mean,
    entropy and kl when given). `policy_loss` aggregates them; the trainer sums them over micro-batches.

    With `sequence_mask` (GSPO, one sequence per row): every token of a row takes the row's ratio
    s = exp(mean over its masked tokens of logp - old_logp), clipped as the token ratio is, with the
    gradient of GSPO-token (s x d logp of that token): log_ratio = logp - sg(logp) + sg(mean).
    With `is_weights` the clipped surrogate of each token is multiplied by its weight (no gradient)."""
    clip_high = clip_low if clip_high is None else clip_high
    if not (clip_low > 0 and clip_high > 0):
        raise ValueError(f"clip_low and clip_high must be > 0, got {clip_low} and {clip_high}")
    if dual_clip is not None and not dual_clip > 1:
        raise ValueError(f"dual_clip must be > 1, got {dual_clip}")
    if kl_coef < 0 or entropy_coef < 0:
        raise ValueError(f"kl_coef and entropy_coef must be >= 0, got {kl_coef} and {entropy_coef}")
    if advantages.ndim == log_probs.ndim - 1:
        advantages = advantages[..., None] * jnp.ones_like(log_probs)
    _check_shapes(log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages)

    log_ratio = log_probs - old_log_probs
    if sequence_mask is not None:
        _check_shapes(log_probs=log_probs, sequence_mask=sequence_mask)
        m = sequence_mask.astype(jnp.float32)
        mean = jnp.sum(log_ratio * m, axis=-1, keepdims=True) / jnp.maximum(jnp.sum(m, axis=-1, keepdims=True), 1.0)
        log_ratio = log_probs - jax.lax.stop_gradient(log_probs) + jax.lax.stop_gradient(mean)  # [B, S]
    log_ratio = jnp.clip(log_ratio, -20.0, 20.0)  # exp stays finite
    ratio = jnp.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * jnp.clip(ratio, 1.0 - clip_low, 1.0 + clip_high)
    per_token = jnp.maximum(unclipped, clipped)
    dual_clipped = jnp.zeros_like(per_token, dtype=bool)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual_clipped = (advantages < 0) & (per_token > cap)
        per_token = jnp.where(advantages < 0, jnp.minimum(per_token, cap), per_token)
    if is_weights is not None:
        _check_shapes(log_probs=log_probs, is_weights=is_weights)
        per_token = per_token * jax.lax.stop_gradient(is_weights)
    terms = {
        "policy_loss": per_token,
        "clip_fraction": (clipped > unclipped).astype(jnp.float32),
        "dual_clip_fraction": dual_clipped.astype(jnp.float32),
        "approx_kl": ratio - 1.0 - log_ratio,
        "ppo_kl": -log_ratio,
        "ratio_mean": ratio,
    }
    loss = per_token
    if entropy is not None:
        _check_shapes(log_probs=log_probs, entropy=entropy)
        terms["entropy"] = entropy
        loss = loss - entropy_coef * entropy
    if ref_log_probs is not None:
        _check_shapes(log_probs=log_probs, ref_log_probs=ref_log_probs)
        terms["kl"] = kl_penalty(log_probs, ref_log_probs, kl_estimator)
        loss = loss + kl_coef * terms["kl"]
    elif kl_coef:
        raise ValueError("kl_coef > 0 needs ref_log_probs")
    terms["loss"] = loss
    return terms


def rollout_is_weights(
    old_log_probs: jax.Array,  # [B, S] the trainer's log p(label) before the update
    sampler_log_probs: jax.Array,  # [B, S] the rollout's log p(label), as sampled
    mask: jax.Array,  # [B, S] 0/1: the completion tokens, one completion per row
    *,
    level: str,
    threshold: float,
) -> tuple[jax.Array, jax.Array]:  # (weights [B, S], truncated [B, S] bool), no gradient
    """Truncated importance weights of the trainer's policy against the sampler's (verl's rollout_is,
    TRL's vllm_importance_sampling_correction): "token": min(exp(old - sampler), threshold) per token;
    "sequence": min(exp(sum over the row's tokens of old - sampler), threshold) on every token of the
    row. `truncated` marks the weights that hit the threshold. 0 where the mask is 0."""
    if level not in ROLLOUT_IS_LEVELS:
        raise ValueError(f"rollout importance sampling level must be token or sequence, got {level!r}")
    if not threshold > 0:
        raise ValueError(f"rollout importance sampling threshold must be > 0, got {threshold}")
    m = mask.astype(jnp.float32)
    log_w = (old_log_probs - sampler_log_probs) * m
    if level == "sequence":
        log_w = jnp.sum(log_w, axis=-1, keepdims=True) * jnp.ones_like(log_w)
    raw = jnp.exp(jnp.minimum(log_w, 30.0))  # finite; anything past e^30 is truncated anyway
    return jax.lax.stop_gradient(jnp.minimum(raw, threshold) * m), jax.lax.stop_gradient((raw > threshold) & (m > 0))


def policy_loss(
    log_probs: jax.Array,  # [B, S] current policy log p(label)
    old_log_probs: jax.Array,  # [B, S] behaviour policy log p(label)
    advantages: jax.Array,  # [B, S] per token, or [B] per sequence (GRPO)
    loss_mask: jax.Array,  # [B, S] 0/1
    *,
    aggregation: str = "token_mean",
    **terms_kwargs,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """PPO/GRPO clipped surrogate: ratio = exp(logp - old_logp),
    per token max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high)); with `dual_clip` = c > 1,
    tokens with A < 0 are also capped at -A * c; minus entropy_coef * entropy and plus kl_coef * KL to
    `ref_log_probs` when given (`policy_terms` takes these keyword arguments). Aggregated by `aggregation`.

    Metrics: policy_loss, clip_fraction (tokens whose clipped term is the larger), dual_clip_fraction,
    approx_kl (E[(r - 1) - log r], the k3 estimator of KL(old || new)), ppo_kl (E[old_logp - logp]),
    ratio_mean, entropy and kl (when given), loss; each aggregated like the loss.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"aggregation must be one of {AGGREGATIONS}, got {aggregation!r}")
    terms = policy_terms(log_probs, old_log_probs, advantages, **terms_kwargs)
    _check_shapes(log_probs=log_probs, loss_mask=loss_mask)
    metrics = {name: aggregate(x, loss_mask, aggregation) for name, x in terms.items()}
    return metrics["loss"], jax.lax.stop_gradient(metrics)
