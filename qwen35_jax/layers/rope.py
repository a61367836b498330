"""Rotary position embedding: partial rotary on the first `rotary_dim` dims, interleaved 3-D mrope."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_jax.config import Qwen35Config


def inverse_frequencies(config: Qwen35Config) -> np.ndarray:
    """[rotary_dim / 2] float32, computed like transformers (float32 exponent, float32 power)."""
    dim = config.rotary_dim
    exponent = np.arange(0, dim, 2, dtype=np.float32) / np.float32(dim)
    return (np.float32(1.0) / np.power(np.float32(config.rope_theta), exponent)).astype(np.float32)


def mrope_axis_of_frequency(config: Qwen35Config) -> np.ndarray:
    """[rotary_dim / 2] int: which position axis (0=t, 1=h, 2=w) drives each rotary frequency.

    Interleaved layout: frequency i uses h when i % 3 == 1 and i < 3*sections[1], w when i % 3 == 2 and
    i < 3*sections[2], else t (transformers' `recomposition_frequencies`).
    """
    half = config.rotary_dim // 2
    axis = np.zeros((half,), np.int32)
    if config.mrope_section is not None:
        for a, offset in ((1, 1), (2, 2)):
            axis[offset:min(3 * config.mrope_section[a], half):3] = a
    return axis


def rope_cos_sin(positions: jax.Array, config: Qwen35Config) -> tuple[jax.Array, jax.Array]:
    """positions [B, S] or [3, B, S] -> (cos, sin), each [B, S, rotary_dim] float32.

    [B, S] are text positions: under mrope t = h = w, whose rotary is the plain one (every frequency
    reads the same position), so they need no broadcast to three axes."""
    inv_freq = jnp.asarray(inverse_frequencies(config))  # [R/2]
    if positions.ndim == 2:
        freqs = positions.astype(jnp.float32)[..., None] * inv_freq  # [B, S, R/2]
    elif positions.ndim == 3 and positions.shape[0] == 3:
        if config.mrope_section is None:
            raise ValueError("positions [3, B, S] need config.mrope_section; this config has plain rotary")
        axis = jnp.asarray(mrope_axis_of_frequency(config))  # [R/2]
        pos = jnp.moveaxis(positions.astype(jnp.float32), 0, -1)  # [B, S, 3]
        freqs = jnp.take(pos, axis, axis=-1) * inv_freq  # [B, S, R/2]
    else:
        raise ValueError(f"positions must be [B, S] or [3, B, S], got shape {positions.shape}")
    emb = jnp.concatenate([freqs, freqs], axis=-1)  # [B, S, R]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate the first R dims of each head (rotate-half convention); the rest pass through.

    x: [B, S, H, Dh], cos/sin: [B, S, R] -> [B, S, H, Dh]
    """
    r = cos.shape[-1]
    cos = cos[:, :, None, :].astype(x.dtype)
    sin = sin[:, :, None, :].astype(x.dtype)
    x_rot, x_pass = x[..., :r], x[..., r:]
    x1, x2 = x_rot[..., : r // 2], x_rot[..., r // 2:]
    rotated = jnp.concatenate([-x2, x1], axis=-1)
    return jnp.concatenate([x_rot * cos + rotated * sin, x_pass], axis=-1)
