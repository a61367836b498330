"""What the gated DeltaNet mixer does to its inputs before the delta rule, per head.

The depthwise short causal conv1d + SiLU whose window stops at document starts, the L2 norm of q and
k, and the gates beta and g. Shared by `gated_deltanet.gdn_core` (whole sequences) and
`parallel/gdn_state_passing.py` (sequence shards with a conv halo).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def causal_conv1d_silu(
    x: jax.Array,  # [B, S, H, D]
    kernel: jax.Array,  # [Kc, H, D]; kernel[-1] multiplies the current token
    doc: jax.Array | None,  # [B, S] document index (see delta_rule.document_index) or None
) -> jax.Array:  # [B, S, H, D]
    """Depthwise causal conv1d + SiLU whose window never reaches into the previous document.

    Accumulates in float32; one shifted slice of x per tap (Kc is 4 in every Qwen3.5 model).
    """
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
    return jax.nn.silu(out.astype(x.dtype))


def l2_normalize(x: jax.Array, eps: float = 1e-6) -> jax.Array:  # [..., d] -> [..., d] float32
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
