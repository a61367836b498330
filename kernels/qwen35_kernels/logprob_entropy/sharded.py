"""Sequence-sharded log-prob/entropy inside `jax.shard_map`, with the lm_head sharded over vocabulary.

Each device holds its own tokens, hidden [T_loc, D] and labels [T_loc] (already shifted on the global
sequence by the caller, -1 where ignored), and a vocabulary shard weight [D, V_loc] of the lm_head,
split over `axis_names` in mesh order (the ZeRO-3 layout of qwen35_jax.parallel.mesh puts the lm_head's
vocabulary dim over ("fsdp", "sp")). The tokens must be split over the same axes.

Modes:
- "gather": all-gather the weight once ([D, V] on every device), then the local fused call. Its
  gradient is reduce-scattered back by all_gather's transpose.
- "vocab_parallel": all-gather the hidden states of the group instead ([n * T_loc, D]); every device
  reduces over its own vocabulary shard to per-token (lse_k, entropy_k, label_logit_k), and these are
  combined exactly with collectives:
      lse = log sum_k exp(lse_k),  w_k = exp(lse_k - lse),
      entropy = sum_k w_k * (entropy_k + lse - lse_k),  label_logit = sum_k label_logit_k.
  No device ever holds the whole lm_head. Everything is built from differentiable collectives and the
  core's custom VJP, so gradients flow back through the same collectives (the transpose of the hidden
  all-gather reduce-scatters dh).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from qwen35_kernels.choices import KernelChoices

from . import tiles
from .api import check_inputs, linear_logprob_entropy, log_probs_from_stats, token_stats

MODES = ("gather", "vocab_parallel")


def sharded_linear_logprob_entropy(
    hidden: jax.Array,  # [T_loc, D] this device's tokens
    weight: jax.Array,  # [D, V_loc] this device's vocabulary shard
    labels: jax.Array,  # [T_loc] int, < 0 = ignored
    *,
    mode: str = "vocab_parallel",
    axis_names: tuple[str, ...] = ("fsdp", "sp"),
    temperature: float = 1.0,
    backend: str | None = None,
    choices: KernelChoices | None = None,
) -> tuple[jax.Array, jax.Array]:  # (log_probs [T_loc] float32, entropy [T_loc] float32)
    """Call inside jax.shard_map over a mesh with `axis_names` manual; see the module docstring.
    `backend` and `choices` as `linear_logprob_entropy`'s."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    axis_names = tuple(axis_names)
    t = check_inputs(hidden, weight, labels, temperature)
    if mode == "gather":
        full = lax.all_gather(weight, axis_names, axis=1, tiled=True)  # [D, V]
        return linear_logprob_entropy(hidden, full, labels, temperature=t, backend=backend, choices=choices)

    n_tok, v_loc = hidden.shape[0], weight.shape[1]
    shard = lax.axis_index(axis_names)
    hidden_all = lax.all_gather(hidden, axis_names, axis=0, tiled=True)  # [n * T_loc, D]
    labels_all = lax.all_gather(labels, axis_names, axis=0, tiled=True)  # [n * T_loc]
    offset = shard * v_loc
    mine = (labels_all >= offset) & (labels_all < offset + v_loc)
    local_labels = jnp.where(mine, labels_all - offset, -1)
    lse_k, ent_k, zl_k = token_stats(
        hidden_all, weight, local_labels, temperature=t, backend=backend, choices=choices
    )  # 3 x [n * T_loc]: statistics over this vocabulary shard
    lse, entropy, label_logit = tiles.combine_stats(
        lse_k, ent_k, zl_k,
        max_fn=lambda x: lax.pmax(x, axis_names),
        sum_fn=lambda x: lax.psum(x, axis_names),
    )
    log_probs = log_probs_from_stats(lse, label_logit, labels_all)

    def own(x):  # [n * T_loc] -> this device's [T_loc]
        return lax.dynamic_slice_in_dim(x, shard * n_tok, n_tok)

    return own(log_probs), own(entropy)
