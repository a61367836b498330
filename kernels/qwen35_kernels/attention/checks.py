"""Input checks and the block padding the flash kernels share (`pallas_gpu.py`, `pallas_tpu.py`, `cudnn.py`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from qwen35_kernels.choices import ATTENTION_IMPLEMENTATIONS

IMPLEMENTATIONS = ATTENTION_IMPLEMENTATIONS


def check_implementation(name: str) -> None:
    """One-line ValueError unless `name` is one of IMPLEMENTATIONS."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation must be one of {IMPLEMENTATIONS}, got {name!r}")


def check_attention_inputs(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array) -> None:
    """One-line ValueError naming the argument whose shape does not fit q [B, S, H, Dh]."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, S, H, Dh], got shape {tuple(q.shape)}")
    b, s, h, dh = q.shape
    if k.ndim != 4 or k.shape[:2] != (b, s) or k.shape[3] != dh:
        raise ValueError(f"k must be [B, S, K, Dh] = [{b}, {s}, K, {dh}], got shape {tuple(k.shape)}")
    if v.shape != k.shape:
        raise ValueError(f"v must have the shape of k {tuple(k.shape)}, got {tuple(v.shape)}")
    if h % k.shape[2]:
        raise ValueError(f"query heads H = {h} are not a multiple of kv heads K = {k.shape[2]}")
    if segment_ids.shape != (b, s):
        raise ValueError(f"segment_ids must be [B, S] = [{b}, {s}], got shape {tuple(segment_ids.shape)}")
    if not jnp.issubdtype(segment_ids.dtype, jnp.integer):
        raise ValueError(f"segment_ids must be integers, got dtype {segment_ids.dtype}")


def is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def pad_to_blocks(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, multiple: int
                   ) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """kv heads repeated to the query heads, S padded to a multiple of `multiple` (segment -1).

    q: [B, S, H, Dh], k/v: [B, S, K, Dh], segment_ids: [B, S]
    -> q/k/v: [B, Sp, H, Dh], segment_ids: [B, Sp] int32
    """
    g = q.shape[2] // k.shape[2]
    k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)  # head h <- kv head h // g
    pad = -q.shape[1] % multiple
    widths = ((0, 0), (0, pad), (0, 0), (0, 0))
    seg = jnp.pad(segment_ids.astype(jnp.int32), ((0, 0), (0, pad)), constant_values=-1)
    return jnp.pad(q, widths), jnp.pad(k, widths), jnp.pad(v, widths), seg
