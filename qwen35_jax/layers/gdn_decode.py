"""The gated DeltaNet mixer one token at a time, continuing from a cache (decoding), and the cache a
whole prompt leaves behind (prefill).

The decode step is the per-token form of `gdn_segment`: the conv continues from the window of the last
Kc - 1 raw inputs (`causal_conv1d_update`), the delta rule makes one state update
(`fused_recurrent_gated_delta_rule`, q and k L2-normalised in it and q scaled by Dk**-0.5, as
`gdn_inputs.rule_inputs` does before the chunked form), then the gated RMSNorm.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from qwen35_kernels.choices import KernelChoices
from qwen35_kernels.gated_delta_rule.api import fused_recurrent_gated_delta_rule
from qwen35_kernels.gdn_inputs.xla import causal_conv1d_update

from qwen35_jax.layers.cache import GdnCache
from qwen35_jax.layers.gdn_arrays import GdnTokens, GdnWeights, conv_halo
from qwen35_jax.layers.gdn_inputs import gates
from qwen35_jax.layers.norms import gated_rms_norm


def raw_conv_inputs(tokens: GdnTokens) -> jax.Array:  # [B, S, C], channels q | k | v
    """The conv's inputs as `in_proj_qkv` gave them, heads flattened."""
    b, s = tokens.q.shape[:2]
    return jnp.concatenate([x.reshape(b, s, -1) for x in (tokens.q, tokens.k, tokens.v)], axis=-1)


def prompt_conv_window(
    tokens: GdnTokens,  # [B, S, ...] raw projections of right-padded prompts
    weights: GdnWeights,
    lengths: jax.Array,  # [B] int: row b's prompt is its first lengths[b] tokens
) -> jax.Array:  # [B, Kc - 1, C]
    """Each row's last Kc - 1 raw conv inputs before position lengths[b]; zeros before its first token."""
    raw = raw_conv_inputs(tokens)  # [B, S, C]
    idx = lengths[:, None] - conv_halo(weights) + jnp.arange(conv_halo(weights))[None, :]  # [B, Kc - 1]
    window = jnp.take_along_axis(raw, jnp.maximum(idx, 0)[..., None], axis=1)
    return jnp.where((idx >= 0)[..., None], window, jnp.zeros((), raw.dtype))


def gdn_decode_step(
    tokens: GdnTokens,  # [B, 1, ...] raw projections of each row's new token
    weights: GdnWeights,
    cache: GdnCache,  # conv [B, Kc - 1, C], state [B, Hv, Dk, Dv] float32
    *,
    eps: float,
    choices: KernelChoices | None = None,
) -> tuple[jax.Array, GdnCache]:  # out [B, 1, Hv, Dv] in q's dtype, the cache after the token
    """The mixer on one more token of every row (XLA throughout; `choices`, None: the defaults for jax's
    backend, give the platform the conv is traced for)."""
    q, k, v = tokens.q, tokens.k, tokens.v
    b, kc1 = q.shape[0], conv_halo(weights)
    sizes = [x.shape[2] * x.shape[3] for x in (q, k, v)]
    windows = jnp.split(cache.conv, [sizes[0], sizes[0] + sizes[1]], axis=-1)  # [B, Kc - 1, H * d] each
    convolved, new_windows = [], []
    for x, window, kernel in zip((q, k, v), windows, (weights.conv_q, weights.conv_k, weights.conv_v)):
        y, window = causal_conv1d_update(x, window.reshape(b, kc1, *x.shape[2:]), kernel, choices=choices)
        convolved.append(y)
        new_windows.append(window.reshape(b, kc1, -1))
    beta, g = gates(tokens.b, tokens.a, weights.A_log, weights.dt_bias)  # [B, 1, Hv] float32 each
    out, state = fused_recurrent_gated_delta_rule(
        *convolved, g, beta, initial_state=cache.state, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out = gated_rms_norm(out, tokens.z, weights.norm_weight, eps)
    return out, GdnCache(conv=jnp.concatenate(new_windows, axis=-1), state=state)
