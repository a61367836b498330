"""How the trainer's step makes one number of a batch's per-token policy losses (verl's
`loss_agg_mode`s), as per-token weights.

A rollout batch holds one completion per row. With `n_i` loss tokens in row i, `N` completions in the
step (every process's) and `L` = --max-new-tokens:

- token-mean (the default; TRL "dapo"): sum over every loss token / the step's loss tokens; the
  trainer normalises by its token count itself, so there are no weights.
- seq-mean-token-mean (TRL "grpo"): each completion's token mean, averaged over the N completions;
  weight 1 / (n_i N).
- seq-mean-token-sum-norm (TRL "dr_grpo"): each completion's token sum / L, averaged over the N
  completions; weight 1 / (L N).

A row without loss tokens (e.g. `--mask-truncated`) contributes 0 and still counts in N, as in verl
(its global batch size) and TRL. The weights are computed on the host from the rows' masks and fed as
the batch's "loss_weights"; the step's loss is then sum(loss x mask x weights), summed over
micro-batches and processes like any token sum.

NumPy only: the option lists load without jax.
"""

from __future__ import annotations

import numpy as np

LOSS_AGGREGATIONS = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
# Rollout importance sampling (`losses.rollout_is_weights`): the policy loss weighted per token or per
# completion by the trainer's / the sampler's probability of the sampled tokens, truncated.
ROLLOUT_IS_LEVELS = ("token", "sequence")


def loss_weights(loss_mask: np.ndarray, aggregation: str, *, completions: int,
                 max_new_tokens: int) -> np.ndarray:  # [N_local, S] -> [N_local, S] float32
    """The per-token weights of `aggregation` (not token-mean) for this process's rows: `loss_mask`
    0/1 [rows, S], `completions` the step's completions over every process."""
    if aggregation not in LOSS_AGGREGATIONS[1:]:
        raise ValueError(f"loss weights are for {' or '.join(LOSS_AGGREGATIONS[1:])}, got {aggregation!r}")
    mask = np.asarray(loss_mask, np.float64)
    if aggregation == "seq-mean-token-mean":
        per_row = 1.0 / (np.maximum(mask.sum(axis=1, keepdims=True), 1.0) * completions)  # [rows, 1]
    else:
        per_row = np.full((mask.shape[0], 1), 1.0 / (max_new_tokens * completions))
    return (mask * per_row).astype(np.float32)
