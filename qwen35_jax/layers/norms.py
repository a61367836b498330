"""Zero-centred RMSNorm (`x * (1 + w)`) and the gated RMSNorm of the Gated DeltaNet, both in float32."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """Zero-centred RMSNorm over the last axis: `norm(x) * (1 + w)` in float32, cast back to x.dtype.

    x: [..., d], weight: [d] -> [..., d]
    """
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    return (xf * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def gated_rms_norm(x: jax.Array, z: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
    """`w * norm(x) * silu(z)` over the last axis (weight initialised to ones), in float32.

    x, z: [..., d], weight: [d] -> [..., d] in x.dtype
    """
    xf = x.astype(jnp.float32)
    xf = xf * jax.lax.rsqrt(jnp.mean(xf * xf, axis=-1, keepdims=True) + eps)
    # Transformers rounds the normalised value to the input dtype before the weight; keep that rounding.
    y = weight.astype(jnp.float32) * xf.astype(x.dtype).astype(jnp.float32)
    return (y * jax.nn.silu(z.astype(jnp.float32))).astype(x.dtype)


class RMSNorm(nnx.Module):
    """Zero-centred RMSNorm; `weight` starts at zeros (scale 1)."""

    def __init__(self, dim: int, *, eps: float, param_dtype: str = "float32", rngs: nnx.Rngs | None = None):
        self.eps = eps
        self.weight = nnx.Param(jnp.zeros((dim,), jnp.dtype(param_dtype)))

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., d] -> [..., d]
        return rms_norm(x, self.weight[...], self.eps)


class GatedRMSNorm(nnx.Module):
    """`weight * norm(x) * silu(z)`; `weight` starts at ones."""

    def __init__(self, dim: int, *, eps: float, param_dtype: str = "float32", rngs: nnx.Rngs | None = None):
        self.eps = eps
        self.weight = nnx.Param(jnp.ones((dim,), jnp.dtype(param_dtype)))

    def __call__(self, x: jax.Array, z: jax.Array) -> jax.Array:  # [..., d], [..., d] -> [..., d]
        return gated_rms_norm(x, z, self.weight[...], self.eps)
