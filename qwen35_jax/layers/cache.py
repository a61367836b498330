"""What one token mixer keeps between decode steps. NamedTuples, hence pytrees: stacked over blocks
like the parameters, scanned over with them, sharded per field.

- Attention: the keys and values of every cached position, after the norm and rotary.
- Gated DeltaNet: the conv window (the last Kc - 1 raw q|k|v inputs, as `in_proj_qkv` gave them)
  and the delta-rule state. Its size does not depend on the sequence length.
"""

from __future__ import annotations

from typing import Any, NamedTuple


class AttentionCache(NamedTuple):
    k: Any  # [B, L, K, Dh] compute dtype; slot t holds position t's key (normed, rotated)
    v: Any  # [B, L, K, Dh]


class GdnCache(NamedTuple):
    conv: Any  # [B, Kc - 1, C] compute dtype: the last Kc - 1 raw inputs, channels q | k | v (zeros before the row)
    state: Any  # [B, Hv, Dk, Dv] float32: the delta-rule state after the last token
