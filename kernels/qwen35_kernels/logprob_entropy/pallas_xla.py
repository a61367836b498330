"""The Pallas forward with the XLA backward: backend "pallas_xla".

On an H200 (T = 8192, D = 4096, V = 248,320, bf16) the Pallas (Triton) forward ran at 387 TFLOP/s
(0.043 s), one pass that never writes a logit tile; its backward adds every tile's dh and dW into
float32 memory with atomic adds, 1.25 s forward+backward in all, against 0.27 s for the XLA backend's
(logit tiles written to memory, XLA's GEMMs). This backend pairs the Pallas forward with the XLA
backward: the kernel's statistics are that backward's residuals. Whether the pair beats XLA's own
forward depends on D (the 0.8B's 1024: XLA's forward loop took 27 ms of the measured step).
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
