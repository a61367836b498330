"""An identity whose gradient XLA:CPU computes once and stores before anything reads it.

XLA fuses an elementwise producer into each of its consumers. When the consumers of a gradient
are several shifted reads (the taps of a causal conv's backward) and its producer is the long
elementwise chain of the layers after it (L2-norm and SiLU backward, and transposes out of the
delta rule's chunked layout), every tap recomputes that chain: the conv input's
gradient costs the whole chain once per tap.

`jax.lax.optimization_barrier` stops this only under our compiler options (`xla_options`): by
default XLA:CPU removes barriers before fusing, and a user's own `jax.jit` has the defaults.
`materialized` routes the gradient through a reduction instead, which XLA:CPU does not fuse into its
readers: the sum over a new leading axis of [g, 0], which is g exactly, for one extra pass over the
gradient (docs/lab_log.md has what it saves). Other backends get the plain identity (`materialize`
False: the caller says which, from its kernel choices' platform).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp


def materialized(g: jax.Array) -> jax.Array:  # any shape -> the same values, out of a fusion of their own
    return jnp.sum(jnp.stack([g, jnp.zeros_like(g)]), axis=0)  # [2, ...] -> [...]


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def stored_cotangent(x: jax.Array, materialize: bool) -> jax.Array:  # any shape -> x
    """x; its cotangent `materialized` when `materialize` (on CPU), else passed on as it is."""
    return x


def _fwd(x: jax.Array, materialize: bool) -> tuple[jax.Array, None]:
    return x, None


def _bwd(materialize: bool, _: None, g: jax.Array) -> tuple[jax.Array]:
    return (materialized(g) if materialize else g,)


stored_cotangent.defvjp(_fwd, _bwd)
