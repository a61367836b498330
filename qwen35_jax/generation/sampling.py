"""Choosing each row's next token from its logits, and the random key it draws with.

- temperature 0: greedy (the first index of the largest logit); the reported log-prob is at T = 1.
- temperature T > 0: logits / T, then top-k (keep the k largest; ties broken towards the lower token
  id), then top-p (of what remains, renormalised: keep the tokens in descending probability while
  the probability of those before them is below p, so the smallest set whose mass reaches p), then one
  draw from the kept tokens in proportion to their probabilities.
- The reported log-prob of every token is log_softmax(logits / T) over the whole vocabulary, also
  when top-k/top-p truncated the draw: what the trainer's fused kernel computes for that token at T.
- Keys: key(seed) folded with the row's index in the caller's input, its sample index and the step.
  The same seed thus gives the same draws whatever batch a row sits in, and on any mesh.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class SamplingOptions:
    """How tokens are chosen; static for a compiled generation program."""

    temperature: float = 1.0  # 0: greedy
    top_k: int = 0  # 0: the whole vocabulary
    top_p: float = 1.0  # 1: no nucleus cut

    def __post_init__(self) -> None:
        if not self.temperature >= 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0 or int(self.top_k) != self.top_k:
            raise ValueError(f"top_k must be a non-negative integer (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def row_keys(seed: jax.Array, rows: jax.Array, samples: jax.Array, step: jax.Array) -> jax.Array:
    """seed [] int, rows [B] and samples [B] int, step [] int -> [B] keys, one per (row, sample, step)."""
    base = jax.random.key(seed)

    def one(row: jax.Array, sample: jax.Array) -> jax.Array:
        return jax.random.fold_in(jax.random.fold_in(jax.random.fold_in(base, row), sample), step)

    return jax.vmap(one)(rows, samples)


def kept_tokens(scaled: jax.Array, top_k: int, top_p: float) -> jax.Array:
    """scaled logits [B, V] float32 -> [B, V] bool: the tokens top-k and then top-p keep."""
    b, v = scaled.shape
    if top_k == 0 and top_p >= 1.0:
        return jnp.ones((b, v), bool)
    k = v if top_k == 0 or top_k >= v else top_k
    values, order = jax.lax.top_k(scaled, k)  # [B, k] descending, ties by lower id
    keep = jnp.ones((b, k), bool)
    if top_p < 1.0:
        probs = jax.nn.softmax(values, axis=-1)  # renormalised over the top-k
        before = jnp.cumsum(probs, axis=-1) - probs  # mass ranked above each token
        keep = before < top_p
    rows = jnp.arange(b)[:, None]
    return jnp.zeros((b, v), bool).at[rows, order].set(keep)


def sample_tokens(
    logits: jax.Array,  # [B, V] float32
    keys: jax.Array,  # [B] keys
    options: SamplingOptions,
) -> tuple[jax.Array, jax.Array]:  # tokens [B] int32, their log-probs [B] float32
    """Each row's next token and its log-prob under log_softmax(logits / T) (T = 1 when greedy)."""
    logits = logits.astype(jnp.float32)
    if options.greedy:
        tokens = jnp.argmax(logits, axis=-1).astype(jnp.int32)
        log_probs = jax.nn.log_softmax(logits, axis=-1)
    else:
        scaled = logits / options.temperature
        log_probs = jax.nn.log_softmax(scaled, axis=-1)
        kept = kept_tokens(scaled, options.top_k, options.top_p)
        masked = jnp.where(kept, scaled, -jnp.inf)
        tokens = jax.vmap(jax.random.categorical)(keys, masked).astype(jnp.int32)
    return tokens, jnp.take_along_axis(log_probs, tokens[:, None], axis=-1)[:, 0]
