"""The arrays a gated DeltaNet mixer runs on, named: its per-token projections and its weights.

Both are NamedTuples, hence pytrees: they pass whole through `jax.shard_map`, `jax.checkpoint`,
`lax.scan` and `jax.grad`, and a PartitionSpec or Ulysses argument kind can be given per field with
the same tuple type. Every mixer function (`gdn_core`, `gdn_segment`, `tiled_gdn_core`,
`gdn_state_passing`, `ulysses_gdn`) takes `(tokens, weights, segment_ids)`.
"""

from __future__ import annotations

from typing import Any, NamedTuple


# Fields are typed Any: the same tuples carry a PartitionSpec or a Ulysses argument kind per array.
class GdnTokens(NamedTuple):
    """The mixer's per-token inputs, raw from the layer's projections (the conv has not run).
    Shapes as the whole sequence has them; shards and tiles keep the layout with fewer tokens."""

    q: Any  # [B, S, Hk, Dk]
    k: Any  # [B, S, Hk, Dk]
    v: Any  # [B, S, Hv, Dv]
    z: Any  # [B, S, Hv, Dv] output gate
    b: Any  # [B, S, Hv] write strength, before its sigmoid
    a: Any  # [B, S, Hv] decay, before its softplus


class GdnWeights(NamedTuple):
    """The mixer's own weights (the projections stay in the layer)."""

    conv_q: Any  # [Kc, Hk, Dk] depthwise causal conv kernel; [-1] multiplies the current token
    conv_k: Any  # [Kc, Hk, Dk]
    conv_v: Any  # [Kc, Hv, Dv]
    A_log: Any  # [Hv]
    dt_bias: Any  # [Hv]
    norm_weight: Any  # [Dv] gated RMSNorm, zero-centred


def check_gdn_arrays(tokens: GdnTokens, weights: GdnWeights, what: str) -> None:
    """One-line errors for mixer arrays whose shapes do not agree with each other."""
    q, k, v, z, b, a = tokens
    B, S, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    if k.shape != q.shape or v.shape[:2] != (B, S) or z.shape != v.shape:
        raise ValueError(f"{what}: q {q.shape}, k {k.shape}, v {v.shape}, z {z.shape} do not agree")
    if b.shape != (B, S, Hv) or a.shape != (B, S, Hv):
        raise ValueError(f"{what}: b {b.shape} and a {a.shape} must be [B, S, Hv] = {(B, S, Hv)}")
    if Hv % Hk:
        raise ValueError(f"{what}: value heads ({Hv}) must be a multiple of key heads ({Hk})")
    conv_q, conv_k, conv_v = weights.conv_q, weights.conv_k, weights.conv_v
    if conv_q.shape[1:] != (Hk, Dk) or conv_k.shape != conv_q.shape or conv_v.shape[1:] != (Hv, Dv):
        raise ValueError(
            f"{what}: conv kernels q {conv_q.shape}, k {conv_k.shape}, v {conv_v.shape} do not match the heads")
    if weights.A_log.shape != (Hv,) or weights.dt_bias.shape != (Hv,) or weights.norm_weight.shape != (Dv,):
        raise ValueError(f"{what}: A_log {weights.A_log.shape}, dt_bias {weights.dt_bias.shape} must be [Hv] = "
                         f"[{Hv}] and norm_weight {weights.norm_weight.shape} [Dv] = [{Dv}]")


def conv_halo(weights: GdnWeights) -> int:
    """Kc - 1: how many tokens before a segment its conv window reads."""
    return weights.conv_q.shape[0] - 1

