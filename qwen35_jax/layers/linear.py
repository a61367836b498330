"""A dense projection whose matmul always sees one flat token axis."""

from __future__ import annotations

import jax
from flax import nnx


class Linear(nnx.Linear):
    """`nnx.Linear` (same parameters, same results) applied to x reshaped to [tokens, in].

    On [B, S, in] the weight gradient contracts two axes (B and S). XLA:CPU lowers such a dot by
    first copying its [B, S, out] operand into a transposed layout, with the producer's elementwise
    work fused into the copy, and that copy costs more than the matmul itself. With one token axis the
    dot reads both operands as they are. The reshape only merges
    leading axes, so it is free, and sharded axes stay in their order.
    """

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., in] -> [..., out]
        y = super().__call__(x.reshape(-1, x.shape[-1]))  # [tokens, out]
        return y.reshape(*x.shape[:-1], y.shape[-1])

    def parts(self, x: jax.Array, sizes: tuple[int, ...]) -> tuple[jax.Array, ...]:  # [..., in] -> [..., size] each
        """The projection's consecutive output column blocks of `sizes`, each a matmul with the weight's
        columns rather than a slice of the whole output. XLA may merge such dots again, but its slices
        of the merged output cost fewer copies than slicing this projection's own output does
        (docs/lab_log.md)."""
        if sum(sizes) != self.out_features or self.bias is not None:
            raise ValueError(f"parts {sizes} must split the {self.out_features} outputs of a projection "
                             f"without bias")
        tokens = x.reshape(-1, x.shape[-1])
        kernel = self.kernel[...]
        outs, start = [], 0
        for size in sizes:
            xt, w = self.promote_dtype((tokens, kernel[:, start:start + size]), dtype=self.dtype)
            y = self.dot_general(xt, w, (((1,), (0,)), ((), ())), precision=self.precision)  # [tokens, size]
            outs.append(y.reshape(*x.shape[:-1], size))
            start += size
        return tuple(outs)
