"""The matmul precision of the delta rule's chunked form, and the einsum that applies it.

"auto" is "highest" on CPU (float32 matmuls cost the same at any precision there) and "default"
elsewhere. "default" passes no precision, so `jax_default_matmul_precision` decides: on a GPU float32
operands then go through TF32 tensor cores ("highest" would run them as several bf16 passes or
without tensor cores). "bf16" rounds both operands to bfloat16 and accumulates in float32, as FLA's
kernels feed their matmuls: the arrays between the matmuls are then stored at half the bytes. On CPU
"bf16" resolves to its own value (BF16_ROUNDED): the operands rounded to bfloat16 and multiplied in
float32, the same products (see `gdn_einsum`).
Whatever the setting, the carried state, every sum and the triangular inverse are computed and kept
in float32; "bf16" rounds only what enters a matmul.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from qwen35_kernels.choices import KernelChoices, overridden

BF16_OPERANDS = "bf16"  # the resolved value of "bf16" (the others resolve to a jax.lax.Precision or None)
BF16_ROUNDED = "bf16_rounded"  # ... and of "bf16" on CPU: rounded to bfloat16, multiplied in float32
GdnPrecision = jax.lax.Precision | str | None
_PRECISION_OF = {"highest": jax.lax.Precision.HIGHEST, "high": jax.lax.Precision.HIGH, "default": None,
                 "bf16": BF16_OPERANDS}


def resolve_gdn_precision(choices: KernelChoices | None = None, precision: str | None = None) -> GdnPrecision:
    """What `gdn_einsum` takes for `choices` (None: the defaults for jax's backend) with the per-call
    `precision` (None: the choices' own; "auto" resolved for their platform)."""
    choices = overridden(choices, gdn_precision=precision)
    prec = _PRECISION_OF[choices.gdn_precision]
    return BF16_ROUNDED if prec == BF16_OPERANDS and choices.platform == "cpu" else prec


def bf16_operands(prec: GdnPrecision) -> bool:
    return isinstance(prec, str) and prec in (BF16_OPERANDS, BF16_ROUNDED)


def operand_dtype(prec: GdnPrecision) -> jnp.dtype:
    """The dtype in which an array that is only ever a matmul operand at `prec` can be stored without
    changing a product: bfloat16 under "bf16" (every product rounds it to that), else float32."""
    return jnp.dtype(jnp.bfloat16) if bf16_operands(prec) else jnp.dtype(jnp.float32)


def round_to_bf16(x: jax.Array) -> jax.Array:
    """x rounded to bfloat16 and held as float32: a product of two such values is exact in float32, so
    a float32 matmul of them equals a bf16 x bf16 -> float32 one (up to summation order)."""
    return x.astype(jnp.bfloat16).astype(jnp.float32)


def gdn_einsum(spec: str, a: jax.Array, b: jax.Array, prec: GdnPrecision) -> jax.Array:
    """`jnp.einsum(spec, a, b)` of float32 operands at `prec` (a `resolve_gdn_precision` value), float32 out.

    bf16 operands on CPU (BF16_ROUNDED) are rounded and multiplied in float32 (the same values): XLA:CPU's
    dot thunk has no bf16 x bf16 -> float32 form for some of these einsums outside a fused program."""
    if bf16_operands(prec):
        if prec == BF16_ROUNDED:
            return jnp.einsum(spec, round_to_bf16(a), round_to_bf16(b), precision=jax.lax.Precision.HIGHEST)
        return jnp.einsum(spec, a.astype(jnp.bfloat16), b.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    return jnp.einsum(spec, a, b, precision=prec)
