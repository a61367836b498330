"""What the gated DeltaNet mixer does to its inputs before the delta rule, per head.

The depthwise short causal conv1d + SiLU whose window stops at document starts and the L2 norm of q
and k (the kernels of `qwen35_kernels.gdn_inputs`), and the gates beta and g; `rule_inputs` does all
of it, with an optional conv halo. Shared by
`gated_deltanet.gdn_core` (whole sequences and their tiles) and `gdn_state_passing.py`
(sequence shards with a conv halo).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from qwen35_kernels.choices import KernelChoices, resolved
from qwen35_kernels.gated_delta_rule.matmul import operand_dtype, resolve_gdn_precision
from qwen35_kernels.gated_delta_rule.reference import document_index
from qwen35_kernels.gdn_inputs import api as gdn_inputs_api
from qwen35_kernels.gdn_inputs.xla import causal_conv1d_silu, l2_normalize

from qwen35_jax.layers.gdn_arrays import GdnWeights


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
    *,
    choices: KernelChoices | None,
    recomputed: bool = False,
) -> tuple[jax.Array, ...]:  # q, k [B, T, Hk, Dk], v [B, T, Hv, Dv], g, beta [B, T, Hv]; q, k, g, beta float32
    """Padding zeroed, conv1d + SiLU, q and k L2-normalised (q scaled by Dk**-0.5), the gates.

    Without `halo` the conv window starts at the first token (zeros before it); with it the window
    reaches into the halo tokens, stopping at document starts. The `choices`' `gdn_inputs` (None: the
    defaults for jax's backend; "auto" is "pallas" on a GPU with the Pallas chunk scan, whose
    alternative, the "associative" scan, is then XLA throughout) picks the kernels: with "pallas",
    without a halo and where the sizes fit, the conv, SiLU and norms by the Pallas kernels of
    `qwen35_kernels.gdn_inputs`, q and k then in the dtype the delta rule stores them
    (`qwen35_kernels.gated_delta_rule.matmul.operand_dtype`: bfloat16 under bf16 GDN matmuls).
    `recomputed`: traced inside a mixer that `apply_gdn_remat` recomputes in the backward, so the
    conv needs no checkpoint of its own."""
    B, T, _, Dk = q.shape
    conv_q, conv_k, conv_v, A_log, dt_bias = weights[:5]
    choices = resolved(choices)
    kernels = choices.gdn_inputs
    if kernels != "xla" and halo is None and all(gdn_inputs_api.fits(kernels, T, x.shape[-1]) for x in (q, v)):
        valid, doc = document_index(segment_ids, B, T)
        qk_dtype = operand_dtype(resolve_gdn_precision(choices))
        conv = functools.partial(gdn_inputs_api.conv_silu, choices=choices)
        q = conv(q, conv_q, valid, doc, l2_scale=Dk**-0.5, l2_dtype=qk_dtype)
        k = conv(k, conv_k, valid, doc, l2_scale=1.0, l2_dtype=qk_dtype)
        v = conv(v, conv_v, valid, doc)
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
    q, k, v = (causal_conv1d_silu(x, w, doc, checkpoint=not recomputed, choices=choices)[:, h:]
               for x, w in ((q, conv_q), (k, conv_k), (v, conv_v)))
    q = l2_normalize(q) * Dk**-0.5
    k = l2_normalize(k)
    beta, g = gates(b, a, A_log, dt_bias)
    return q, k, v, g, beta
