"""What the gated DeltaNet mixer does to its inputs before the delta rule, per head.

The depthwise short causal conv1d + SiLU whose window stops at document starts, the L2 norm of q and
k, and the gates beta and g; `rule_inputs` does all of it, with an optional conv halo. Shared by
`gated_deltanet.gdn_core` (whole sequences and their tiles) and `gdn_state_passing.py`
(sequence shards with a conv halo).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from qwen35_jax.layers import gdn_inputs_pallas
from qwen35_jax.layers.chunk_states import inside_recomputed_mixer, resolve_gdn_chunk_scan
from qwen35_jax.layers.delta_rule import document_index
from qwen35_jax.layers.gdn_arrays import GdnWeights
from qwen35_jax.layers.gdn_matmul import operand_dtype, resolve_gdn_precision
from qwen35_jax.layers.stored_cotangent import stored_cotangent


def causal_conv1d_silu(
    x: jax.Array,  # [B, S, H, D]
    kernel: jax.Array,  # [Kc, H, D]; kernel[-1] multiplies the current token
    doc: jax.Array | None,  # [B, S] document index (see delta_rule.document_index) or None
) -> jax.Array:  # [B, S, H, D]
    """Depthwise causal conv1d + SiLU whose window never reaches into the previous document.

    Accumulates in float32; one shifted slice of x per tap (Kc is 4 in every Qwen3.5 model).
    Checkpointed (its shifted copies and masks would keep some 200 KB a token and layer for the
    backward) unless the whole mixer around it is recomputed in the backward already
    (`chunk_states.inside_recomputed_mixer`), where its own checkpoint would run it a third time.
    """
    conv = _conv1d_silu if inside_recomputed_mixer() else jax.checkpoint(_conv1d_silu)
    return conv(x, kernel, doc)


def _conv1d_silu(x: jax.Array, kernel: jax.Array, doc: jax.Array | None) -> jax.Array:  # as causal_conv1d_silu
    Kc = kernel.shape[0]
    S = x.shape[1]
    xf = x.astype(jnp.float32)
    kf = kernel.astype(jnp.float32)
    padded = jnp.pad(xf, [(0, 0), (Kc - 1, 0), (0, 0), (0, 0)])  # [B, Kc - 1 + S, H, D]
    out = xf * kf[-1]
    for shift in range(1, min(Kc, S + 1)):
        past = padded[:, Kc - 1 - shift: Kc - 1 - shift + S]  # token t - shift (zeros before 0)
        if doc is not None:
            same = jnp.pad(doc, [(0, 0), (shift, 0)], constant_values=-1)[:, :S] == doc  # [B, S]
            past = jnp.where(same[..., None, None], past, 0.0)
        out = out + past * kf[Kc - 1 - shift]
    # The backward reads the pre-activation gradient once per tap: stored once (see stored_cotangent).
    return jax.nn.silu(stored_cotangent(out.astype(x.dtype)))


def l2_normalize(x: jax.Array, eps: float = gdn_inputs_pallas.L2_EPS) -> jax.Array:  # [..., d] -> [..., d] float32
    """x * rsqrt(sum(x^2) + eps), in float32 (transformers' / FLA's `l2norm`)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def gates(
    b: jax.Array,  # [B, S, Hv]
    a: jax.Array,  # [B, S, Hv]
    A_log: jax.Array,  # [Hv]
    dt_bias: jax.Array,  # [Hv]
) -> tuple[jax.Array, jax.Array]:  # beta, g: [B, S, Hv] float32 each
    """beta = sigmoid(b) (write strength), g = -exp(A_log) * softplus(a + dt_bias) (log-decay, <= 0)."""
    beta = jax.nn.sigmoid(b).astype(jnp.float32)
    g = -jnp.exp(A_log.astype(jnp.float32)) * jax.nn.softplus(a.astype(jnp.float32) + dt_bias.astype(jnp.float32))
    return beta, g


def rule_inputs(
    q: jax.Array,  # [B, T, Hk, Dk] raw in_proj_qkv output
    k: jax.Array,  # [B, T, Hk, Dk]
    v: jax.Array,  # [B, T, Hv, Dv]
    b: jax.Array,  # [B, T, Hv]
    a: jax.Array,  # [B, T, Hv]
    weights: GdnWeights,  # the conv kernels [Kc, H, d], A_log and dt_bias [Hv] (norm_weight unused)
    segment_ids: jax.Array | None,  # [B, T] document ids >= 1, 0 = padding
    halo: tuple[jax.Array, ...] | None = None,  # raw q, k, v [B, h, H, d] and ids [B, h] of the h tokens before
    kernels: bool | None = None,
) -> tuple[jax.Array, ...]:  # q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv]; q, k, g, beta float32
    """Padding zeroed, conv1d + SiLU, q and k L2-normalised (q scaled by Dk**-0.5), the gates.

    Without `halo` the conv window starts at the first token (zeros before it); with it the window
    reaches into the halo tokens, stopping at document starts. `kernels` (None: on a GPU with the
    Pallas chunk scan, whose fallback `gdn_chunk_scan("associative")` is then XLA throughout; where the
    sizes fit): without a halo, the conv, SiLU and norms by the Pallas kernels of `gdn_inputs_pallas`,
    q and k then in the dtype the delta rule stores them (`gdn_matmul.operand_dtype`: bfloat16 under
    bf16 GDN matmuls)."""
    B, T, _, Dk = q.shape
    conv_q, conv_k, conv_v, A_log, dt_bias = weights[:5]
    if kernels is None:
        kernels = jax.default_backend() == "gpu" and resolve_gdn_chunk_scan() == "pallas"
    if kernels and halo is None and all(gdn_inputs_pallas.fits(T, x.shape[-1]) for x in (q, v)):
        valid, doc = document_index(segment_ids, B, T)
        qk_dtype = operand_dtype(resolve_gdn_precision())
        q = gdn_inputs_pallas.pallas_conv_silu(q, conv_q, valid, doc, l2_scale=Dk**-0.5, l2_dtype=qk_dtype)
        k = gdn_inputs_pallas.pallas_conv_silu(k, conv_k, valid, doc, l2_scale=1.0, l2_dtype=qk_dtype)
        v = gdn_inputs_pallas.pallas_conv_silu(v, conv_v, valid, doc)
        beta, g = gates(b, a, A_log, dt_bias)
        return q, k, v, g, beta
    doc, h = None, 0
    if halo is not None:
        hq, hk, hv, hseg = halo
        h = hseg.shape[1]
        q, k, v = (jnp.concatenate([hx, x], axis=1) for hx, x in ((hq, q), (hk, k), (hv, v)))
        segment_ids = jnp.concatenate([hseg.astype(jnp.int32), segment_ids.astype(jnp.int32)], axis=1)
    if segment_ids is not None:
        valid, doc = document_index(segment_ids, B, h + T)
        keep = valid[..., None, None]
        q, k, v = (jnp.where(keep, x, jnp.zeros((), x.dtype)) for x in (q, k, v))
    q, k, v = (causal_conv1d_silu(x, w, doc)[:, h:] for x, w in ((q, conv_q), (k, conv_k), (v, conv_v)))
    q = l2_normalize(q) * Dk**-0.5
    k = l2_normalize(k)
    beta, g = gates(b, a, A_log, dt_bias)
    return q, k, v, g, beta
