"""The gated DeltaNet's input ops in XLA: the depthwise causal conv1d + SiLU whose window stops at
document starts, its continuation from a conv state (decoding), and the L2 norm (`pallas.py` fuses
the conv and the norm into one GPU kernel)."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from qwen35_kernels.choices import KernelChoices, resolved
from qwen35_kernels.gdn_inputs.pallas import L2_EPS
from qwen35_kernels.gdn_inputs.stored_cotangent import stored_cotangent


def causal_conv1d_silu(
    x: jax.Array,  # [B, S, H, D]
    kernel: jax.Array,  # [Kc, H, D]; kernel[-1] multiplies the current token
    doc: jax.Array | None,  # [B, S] document index (see gated_delta_rule.reference.document_index) or None
    *,
    checkpoint: bool = True,
    choices: KernelChoices | None = None,
) -> jax.Array:  # [B, S, H, D]
    """Depthwise causal conv1d + SiLU whose window never reaches into the previous document.

    Accumulates in float32; one shifted slice of x per tap (Kc is 4 in every Qwen3.5 model).
    `checkpoint`: recomputed in the backward (its shifted copies and masks would keep some 200 KB a
    token and layer); a caller that recomputes the whole mixer around it already passes False, since
    its own checkpoint would then run it a third time. `choices` (None: the defaults for jax's
    backend): their platform decides how the backward stores a gradient (`stored_cotangent`).
    """
    conv = functools.partial(_conv1d_silu, materialize=resolved(choices).platform == "cpu")
    return (jax.checkpoint(conv) if checkpoint else conv)(x, kernel, doc)


def _conv1d_silu(x: jax.Array, kernel: jax.Array, doc: jax.Array | None, *, materialize: bool
                 ) -> jax.Array:  # as causal_conv1d_silu
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
    return jax.nn.silu(stored_cotangent(out.astype(x.dtype), materialize))


def causal_conv1d_update(
    x: jax.Array,  # [B, T, H, D] the next T raw inputs of one document per row
    conv_state: jax.Array,  # [B, Kc - 1, H, D] the Kc - 1 raw inputs before them (zeros before a document)
    kernel: jax.Array,  # [Kc, H, D]
    *,
    choices: KernelChoices | None = None,
) -> tuple[jax.Array, jax.Array]:  # y [B, T, H, D] in x.dtype, the new conv state [B, Kc - 1, H, D]
    """`causal_conv1d_silu` of T tokens that continue a sequence (transformers' `causal_conv1d_update`
    with SiLU): the window reads `conv_state` before the first token. The new state is the last Kc - 1
    inputs of [conv_state, x], so prefill hands decoding its last Kc - 1 raw inputs and every decode
    step (T = 1) its own. Accumulates in float32, as the whole-sequence conv does."""
    kc = kernel.shape[0]
    if conv_state.shape != (x.shape[0], kc - 1, *x.shape[2:]):
        raise ValueError(f"conv_state must be [B, Kc - 1, H, D] = {(x.shape[0], kc - 1, *x.shape[2:])}, "
                         f"got {conv_state.shape}")
    window = jnp.concatenate([conv_state.astype(x.dtype), x], axis=1)  # [B, Kc - 1 + T, H, D]
    materialize = resolved(choices).platform == "cpu"
    y = _conv1d_silu(window, kernel, None, materialize=materialize)[:, kc - 1:]  # the zeros it pads before the window are never read
    return y, window[:, window.shape[1] - (kc - 1):]


def l2_normalize(x: jax.Array, eps: float = L2_EPS) -> jax.Array:  # [..., d] -> [..., d] float32
    """x * rsqrt(sum(x^2) + eps), in float32 (transformers' / FLA's `l2norm`)."""
    x = x.astype(jnp.float32)
    return x * jax.lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)
