"""The gated DeltaNet's conv1d + SiLU (and L2 norm) behind one function, its implementation chosen by
argument: "xla" (`xla.py`, the reference and the CPU path) or "pallas" (`pallas.py`, Triton kernels
on GPU, interpreted elsewhere)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from qwen35_kernels.choices import KernelChoices, overridden
from qwen35_kernels.gdn_inputs import pallas
from qwen35_kernels.gdn_inputs.xla import causal_conv1d_silu, l2_normalize


def xla_conv_silu(x: jax.Array, kernel: jax.Array, valid: jax.Array, doc: jax.Array, *,
                  l2_scale: float | None = None, l2_dtype: jnp.dtype = jnp.float32,
                  choices: KernelChoices) -> jax.Array:
    """`conv_silu` in XLA: padding zeroed, `causal_conv1d_silu`, then with `l2_scale` the L2 norm
    (float32; `l2_dtype` is the Pallas kernel's storage, not needed here) times it."""
    del l2_dtype
    x = jnp.where(valid[..., None, None], x, jnp.zeros((), x.dtype))
    y = causal_conv1d_silu(x, kernel, doc, choices=choices)
    if l2_scale is None:
        return y
    y = l2_normalize(y)
    return y if l2_scale == 1.0 else y * l2_scale


def pallas_conv_silu(x: jax.Array, kernel: jax.Array, valid: jax.Array, doc: jax.Array, *,
                     l2_scale: float | None = None, l2_dtype: jnp.dtype = jnp.float32,
                     choices: KernelChoices) -> jax.Array:
    return pallas.pallas_conv_silu(x, kernel, valid, doc, l2_scale=l2_scale, l2_dtype=l2_dtype, choices=choices)


IMPLEMENTATIONS = {"xla": xla_conv_silu, "pallas": pallas_conv_silu}


def fits(implementation: str, seq: int, d: int) -> bool:
    """Whether `implementation` takes these sizes (the Triton kernels: D a power of two >= 16, S a
    multiple of 16; XLA: any)."""
    return implementation != "pallas" or pallas.fits(seq, d)


def conv_silu(
    x: jax.Array,  # [B, S, H, D] raw projection output
    kernel: jax.Array,  # [Kc, H, D]; kernel[-1] multiplies the current token
    valid: jax.Array,  # [B, S] bool: not padding (padding is zeroed before the conv)
    doc: jax.Array,  # [B, S] int32 document index (`gated_delta_rule.reference.document_index`)
    *,
    l2_scale: float | None = None,
    l2_dtype: jnp.dtype = jnp.float32,
    choices: KernelChoices | None = None,
    implementation: str | None = None,
) -> jax.Array:  # [B, S, H, D]: x's dtype, or with l2_scale float32 (XLA) / l2_dtype (Pallas)
    """Depthwise causal conv1d + SiLU whose window stops at document starts and, with `l2_scale`, the
    L2 norm times l2_scale. `implementation` ("xla", "pallas"; None: the `choices`' `gdn_inputs`, "auto"
    resolved for their platform; None choices: the defaults for jax's backend)."""
    choices = overridden(choices, gdn_inputs=implementation)
    return IMPLEMENTATIONS[choices.gdn_inputs](x, kernel, valid, doc, l2_scale=l2_scale, l2_dtype=l2_dtype,
                                               choices=choices)
