"""The naive per-token statistics: full [T, V] logits, plain autodiff. The truth for tests.

Every backend implements the same contract, `token_stats(hidden, weight, labels, temperature)`:
with z = hidden @ weight / temperature (float32) and p = softmax(z),
- lse [T]: logsumexp(z),
- entropy [T]: -sum p log p,
- label_logit [T]: z[label], 0 where the label is outside [0, V).
The public log-prob is `label_logit - lse` where the label is >= 0 (see api.py); keeping these three
as the differentiable core lets the vocab-parallel path combine per-shard statistics with ordinary
differentiable collectives.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def scaled_logits(hidden: jax.Array, weight: jax.Array, temperature: float) -> jax.Array:
    """[T, D] x [D, V] -> [T, V] float32 logits divided by the temperature."""
    z = jnp.dot(hidden, weight, preferred_element_type=jnp.float32)
    return z / jnp.float32(temperature)


def token_stats(
    hidden: jax.Array,  # [T, D]
    weight: jax.Array,  # [D, V]
    labels: jax.Array,  # [T] int
    temperature: float = 1.0,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # 3 x [T] float32
    z = scaled_logits(hidden, weight, temperature)  # [T, V]
    lse = jax.nn.logsumexp(z, axis=-1)
    logp = z - lse[:, None]
    entropy = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
    vocab = z.shape[-1]
    valid = (labels >= 0) & (labels < vocab)
    picked = jnp.take_along_axis(z, jnp.where(valid, labels, 0)[:, None], axis=-1)[:, 0]
    label_logit = jnp.where(valid, picked, 0.0)
    return lse, entropy, label_logit
