"""The gated DeltaNet mixer on T consecutive tokens of a sequence: conv1d + SiLU, L2 norms and gates
(`gdn_inputs.rule_inputs`), the chunked delta rule from a given state, the gated RMSNorm.

The unit that `gated_deltanet.gdn_core` runs on a whole sequence, `gdn_tiling.tiled_gdn_core` tile
by tile and `gdn_state_passing` on sequence shards.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name
from qwen35_kernels.choices import KernelChoices, resolved
from qwen35_kernels.gated_delta_rule.chunk_states import RULE_OUTPUT_NAME, apply_gdn_remat
from qwen35_kernels.gated_delta_rule.chunked import chunked_gated_delta_rule

from qwen35_jax.layers.gdn_arrays import GdnTokens, GdnWeights
from qwen35_jax.layers.gdn_inputs import rule_inputs
from qwen35_jax.layers.norms import gated_rms_norm


def gdn_segment(
    tokens: GdnTokens,  # [B, T, ...] raw projections of T consecutive tokens of a sequence
    weights: GdnWeights,
    segment_ids: jax.Array | None,  # [B, T]
    *,
    eps: float,
    chunk_size: int,
    choices: KernelChoices | None,
    halo: tuple[jax.Array, ...] | None = None,  # raw q, k, v [B, h, H, d] and ids [B, h] of the h tokens before
    initial_state: jax.Array | None = None,  # [B, Hv, Dk, Dv] the delta-rule state entering the segment
) -> tuple[jax.Array, jax.Array]:  # [B, T, Hv, Dv] in q.dtype, final state [B, Hv, Dk, Dv] float32
    """`gdn_core` on T consecutive tokens: without `halo` the conv window starts at the first token
    (zeros before it); with it, the conv reads the halo tokens (stopping at document starts). The
    kernels are the `choices`' (None: the defaults for jax's backend); what the backward pass keeps of
    it is their `gdn_remat`."""
    choices = resolved(choices)

    def segment(tokens: GdnTokens, weights: GdnWeights, segment_ids: jax.Array | None,
                halo: tuple[jax.Array, ...] | None, initial_state: jax.Array | None, *, recomputed: bool
                ) -> tuple[jax.Array, jax.Array]:
        dtype = tokens.q.dtype
        q, k, v, g, beta = rule_inputs(tokens.q, tokens.k, tokens.v, tokens.b, tokens.a, weights, segment_ids, halo,
                                       choices=choices, recomputed=recomputed)
        out, state = chunked_gated_delta_rule(q, k, v, g, beta, segment_ids=segment_ids, initial_state=initial_state,
                                              chunk_size=chunk_size, out_dtype=dtype, choices=choices)
        out = checkpoint_name(out, RULE_OUTPUT_NAME)  # [B, T, Hv, Dv]
        return gated_rms_norm(out, tokens.z, weights.norm_weight, eps), state

    return apply_gdn_remat(segment, choices)(tokens, weights, segment_ids, halo, initial_state)
