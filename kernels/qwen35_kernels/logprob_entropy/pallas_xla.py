"""The Pallas forward with the XLA backward: backend "pallas_xla".

The Pallas (Triton) forward is one pass that never writes a logit tile; the Pallas backward adds every
tile's dh and dW into float32 memory with atomic adds, which costs more than the XLA backend's
backward (logit tiles written to memory, XLA's GEMMs; docs/kernels.md). This backend pairs the Pallas
forward with the XLA backward: the kernel's statistics are that backward's residuals. Whether the
pair beats XLA's own forward depends on D (the 0.8B's is 1024; docs/lab_log.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from qwen35_kernels.choices import KernelChoices, resolved

from . import pallas, xla


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _stats(hidden, weight, labels, temperature, blk, platform):
    return _forward(hidden, weight, labels, temperature, blk)


def _forward(hidden, weight, labels, temperature, blk):
    # the kernel's tile matmuls take one element type: mixed dtypes multiply in the promoted one
    common = jnp.promote_types(hidden.dtype, weight.dtype)
    return pallas.forward_stats(hidden.astype(common), weight.astype(common), labels, temperature, blk)


def _stats_fwd(hidden, weight, labels, temperature, blk, platform):
    lse, ent, zl = _forward(hidden, weight, labels, temperature, blk)
    return (lse, ent, zl), (hidden, weight, labels, lse, ent)


def _stats_bwd(temperature, blk, platform, res, cts):
    return xla.stats_backward(*res, cts, temperature, *xla.default_blocks(platform), platform == "cpu")


_stats.defvjp(_stats_fwd, _stats_bwd)


def token_stats(
    hidden: jax.Array,  # [T, D]
    weight: jax.Array,  # [D, V]
    labels: jax.Array,  # [T] int
    temperature: float = 1.0,
    *,
    blocks: pallas.Blocks | None = None,
    choices: KernelChoices | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # (lse, entropy, label_logit), 3 x [T] float32
    """See reference.token_stats for the contract; `blocks`: the forward kernel's (default: the `choices`'
    platform's; None choices: jax's backend), the XLA backward's blocks that platform's too.
    Gradients come back in each input's own dtype, as the xla backend gives them."""
    platform = resolved(choices).platform
    return _stats(hidden, weight, labels, float(temperature), blocks or pallas.make_blocks(choices=choices), platform)
