"""The Qwen3.5 vision tower (transformers' `Qwen3_5VisionModel`) as NNX modules, on a static bucket of P patches.

patches [P, patch_dim] -> patch embedding (a Linear: the Conv3d's kernel equals its stride) + bilinearly
interpolated learned positions -> `depth` pre-norm blocks (LayerNorm, attention with 2-D axial rotary
inside each frame, LayerNorm, GELU-tanh MLP) -> merger (LayerNorm, every merge_unit consecutive patches
concatenated, fc1, exact GELU, fc2) -> [P / merge_unit, out_hidden_size]. The per-patch inputs that depend
on the image sizes come from `vision/layout.py` (host side).

Parameters and their transformers names (under `model.visual.`; `hf_weights.load_hf_state` copies them):
  patch_embed.proj.kernel [patch_dim, D]  <- patch_embed.proj.weight [D, C, T, p, p]: reshape to [D, patch_dim]
                                             (flattened C, T, p, p, as transformers' `view(-1, C, T, p, p)`
                                             flattens a patch) and transpose
  patch_embed.proj.bias [D]               <- patch_embed.proj.bias
  pos_embed.embedding [side**2, D]        <- pos_embed.weight
  blocks.<name> [depth, ...]              <- blocks.{i}.<name>, stacked over i, for <name> in
                                             norm1/norm2 (.scale <- .weight, .bias), attn.qkv, attn.proj,
                                             mlp.linear_fc1, mlp.linear_fc2 (.kernel <- .weight.T, .bias)
  merger.norm (.scale, .bias), merger.linear_fc1, merger.linear_fc2 (.kernel <- .weight.T, .bias)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qwen35_jax.layers.linear import Linear
from qwen35_jax.parallel.patches import attend_all_keys, constrain_rows, pad_rows, patch_shards
from qwen35_jax.vision.config import VisionConfig

INIT = nnx.initializers.normal(0.02)  # transformers' initializer_range


def math_dtype(dtype: jnp.dtype) -> jnp.dtype:
    """Norm statistics, softmax and rotary run in float32, or wider when the compute dtype is (float64)."""
    return jnp.promote_types(dtype, jnp.float32)


def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float) -> jax.Array:
    """LayerNorm over the last axis with statistics in `math_dtype`; [..., D] -> [..., D] in x.dtype."""
    xf = x.astype(math_dtype(x.dtype))
    mean = jnp.mean(xf, axis=-1, keepdims=True)
    var = jnp.mean(jnp.square(xf - mean), axis=-1, keepdims=True)
    y = (xf - mean) * jax.lax.rsqrt(var + eps) * scale.astype(xf.dtype) + bias.astype(xf.dtype)
    return y.astype(x.dtype)


class LayerNorm(nnx.Module):
    """nn.LayerNorm with weight (`scale`, ones) and bias (zeros)."""

    def __init__(self, dim: int, *, eps: float, param_dtype: jnp.dtype):
        self.eps = eps
        self.scale = nnx.Param(jnp.ones((dim,), param_dtype))
        self.bias = nnx.Param(jnp.zeros((dim,), param_dtype))

    def __call__(self, x: jax.Array) -> jax.Array:  # [..., D] -> [..., D]
        return layer_norm(x, self.scale[...], self.bias[...], self.eps)


def _linear(n_in: int, n_out: int, dtype: jnp.dtype, param_dtype: jnp.dtype, rngs: nnx.Rngs) -> Linear:
    return Linear(n_in, n_out, use_bias=True, dtype=dtype, param_dtype=param_dtype, rngs=rngs, kernel_init=INIT)


def inverse_frequencies(config: VisionConfig, dtype: jnp.dtype) -> np.ndarray:
    """[head_dim / 4]: transformers' `compute_axial_rope_parameters`, `1 / theta**(arange(0, Dh/2, 2) / (Dh/2))`,
    computed in `dtype` (float32 rounds as transformers does; float64 is the exact value)."""
    dt = np.dtype(dtype)
    half = config.head_dim // 2
    exponent = np.arange(0, half, 2, dtype=dt) / dt.type(half)
    return (dt.type(1.0) / np.power(dt.type(config.rope_theta), exponent)).astype(dt)


def rope_cos_sin(rows_cols: jax.Array, config: VisionConfig, dtype: jnp.dtype) -> tuple[jax.Array, jax.Array]:
    """rows_cols [P, 2] -> (cos, sin), each [P, head_dim] in `dtype`: angles [rows * f, cols * f] repeated
    twice (transformers' `recomposition_frequencies`), for the rotate-half convention."""
    inv_freq = jnp.asarray(inverse_frequencies(config, dtype))  # [Dh/4]
    freqs = rows_cols.astype(dtype)[:, :, None] * inv_freq  # [P, 2, Dh/4]
    half = freqs.reshape(freqs.shape[0], -1)  # [P, Dh/2]: row angles, then column angles
    emb = jnp.concatenate([half, half], axis=-1)  # [P, Dh]
    return jnp.cos(emb), jnp.sin(emb)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x [P, H, Dh], cos/sin [P, Dh] -> [P, H, Dh] in cos.dtype (rotate half over the whole head)."""
    x = x.astype(cos.dtype)
    x1, x2 = jnp.split(x, 2, axis=-1)  # [P, H, Dh/2] each
    rotated = jnp.concatenate([-x2, x1], axis=-1)  # [P, H, Dh]
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class VisionAttention(nnx.Module):
    """Fused qkv, axial rotary on q and k, softmax attention masked to the query's segment, proj."""

    def __init__(self, config: VisionConfig, dtype: jnp.dtype, param_dtype: jnp.dtype, *, rngs: nnx.Rngs):
        d = config.hidden_size
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.qkv = _linear(d, 3 * d, dtype, param_dtype, rngs)
        self.proj = _linear(d, d, dtype, param_dtype, rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array) -> jax.Array:
        """x [P, D], cos/sin [P, Dh] (math dtype), segment_ids [P] -> [P, D]. Every row attends to the rows
        of its own segment, itself included, so padding rows (segment 0) stay finite."""
        p = x.shape[0]
        qkv = self.qkv(x).reshape(p, 3, self.num_heads, self.head_dim)  # [P, 3, H, Dh]
        q, k, v = qkv[:, 0], qkv[:, 1], qkv[:, 2]  # [P, H, Dh] each
        q = apply_rope(q, cos, sin).astype(x.dtype)  # [P, H, Dh]
        k = apply_rope(k, cos, sin).astype(x.dtype)  # [P, H, Dh]
        out = attend_all_keys(frame_attention, q, k, v, segment_ids)  # [P, H, Dh], rows split over the mesh
        return self.proj(out.reshape(p, -1))  # [P, D]


def frame_attention(q: jax.Array, k: jax.Array, v: jax.Array, q_segments: jax.Array,
                    k_segments: jax.Array) -> jax.Array:
    """Softmax attention of q [Pq, H, Dh] over k, v [Pk, H, Dh], each query masked to the keys of its
    segment (q_segments [Pq], k_segments [Pk]); scores and sums in `math_dtype` -> [Pq, H, Dh]."""
    acc = math_dtype(q.dtype)
    scores = jnp.einsum("qhd,khd->hqk", q, k, preferred_element_type=acc) * (q.shape[-1] ** -0.5)  # [H, Pq, Pk]
    same = q_segments[:, None] == k_segments[None, :]  # [Pq, Pk]
    scores = jnp.where(same[None], scores, jnp.finfo(acc).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype)  # [H, Pq, Pk]
    return jnp.einsum("hqk,khd->qhd", probs, v, preferred_element_type=acc).astype(q.dtype)  # [Pq, H, Dh]


class VisionMLP(nnx.Module):
    def __init__(self, config: VisionConfig, dtype: jnp.dtype, param_dtype: jnp.dtype, *, rngs: nnx.Rngs):
        self.linear_fc1 = _linear(config.hidden_size, config.intermediate_size, dtype, param_dtype, rngs)
        self.linear_fc2 = _linear(config.intermediate_size, config.hidden_size, dtype, param_dtype, rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # [P, D] -> [P, D]
        return self.linear_fc2(jax.nn.gelu(self.linear_fc1(x), approximate=True))  # gelu_pytorch_tanh


class VisionBlock(nnx.Module):
    """x + attn(norm1(x)), then + mlp(norm2(.)); stacked over `depth` by the tower."""

    def __init__(self, config: VisionConfig, dtype: jnp.dtype, param_dtype: jnp.dtype, *, rngs: nnx.Rngs):
        eps = config.layer_norm_eps
        self.norm1 = LayerNorm(config.hidden_size, eps=eps, param_dtype=param_dtype)
        self.norm2 = LayerNorm(config.hidden_size, eps=eps, param_dtype=param_dtype)
        self.attn = VisionAttention(config, dtype, param_dtype, rngs=rngs)
        self.mlp = VisionMLP(config, dtype, param_dtype, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array, segment_ids: jax.Array) -> jax.Array:
        x = x + self.attn(self.norm1(x), cos, sin, segment_ids)  # [P, D]
        return x + self.mlp(self.norm2(x))  # [P, D]


class PatchEmbed(nnx.Module):
    """Conv3d with kernel = stride over one patch = a Linear on the flattened (C, T, p, p) patch."""

    def __init__(self, config: VisionConfig, dtype: jnp.dtype, param_dtype: jnp.dtype, *, rngs: nnx.Rngs):
        self.proj = _linear(config.patch_dim, config.hidden_size, dtype, param_dtype, rngs)

    def __call__(self, patches: jax.Array) -> jax.Array:  # [P, patch_dim] -> [P, D]
        return self.proj(patches)


class PatchMerger(nnx.Module):
    """LayerNorm over D, merge_unit consecutive patches -> one row, fc1, exact GELU, fc2."""

    def __init__(self, config: VisionConfig, dtype: jnp.dtype, param_dtype: jnp.dtype, *, rngs: nnx.Rngs):
        merged = config.hidden_size * config.merge_unit
        self.norm = LayerNorm(config.hidden_size, eps=config.layer_norm_eps, param_dtype=param_dtype)
        self.linear_fc1 = _linear(merged, merged, dtype, param_dtype, rngs)
        self.linear_fc2 = _linear(merged, config.out_hidden_size, dtype, param_dtype, rngs)
        self.merged = merged

    def __call__(self, x: jax.Array) -> jax.Array:  # [P, D] -> [P / merge_unit, out_hidden_size]
        x = self.norm(x).reshape(-1, self.merged)  # [P / mu, mu * D]
        return self.linear_fc2(jax.nn.gelu(self.linear_fc1(x), approximate=False))


class VisionTower(nnx.Module):
    """remat: each block recomputed in the backward, only its input kept (the text model's remat
    policies other than "none" ask for it: a 1024 x 1024 image is 4,096 patch rows through 27 blocks)."""

    def __init__(self, config: VisionConfig, dtype: str | jnp.dtype = "float32",
                 param_dtype: str | jnp.dtype = "float32", *, remat: bool = False, rngs: nnx.Rngs):
        self.config = config
        self.remat = remat
        dt, pd = jnp.dtype(dtype), jnp.dtype(param_dtype)
        self.dtype = dt
        self.patch_embed = PatchEmbed(config, dt, pd, rngs=rngs)
        self.pos_embed = nnx.Embed(config.num_position_embeddings, config.hidden_size, dtype=dt, param_dtype=pd,
                                   rngs=rngs, embedding_init=INIT)

        @nnx.split_rngs(splits=config.depth)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make_blocks(rngs: nnx.Rngs) -> VisionBlock:
            return VisionBlock(config, dt, pd, rngs=rngs)

        self.blocks = make_blocks(rngs)  # every block param gains a leading [depth] axis
        self.merger = PatchMerger(config, dt, pd, rngs=rngs)

    def __call__(self, patches: jax.Array, segment_ids: jax.Array, rope_rows_cols: jax.Array,
                 interp_index: jax.Array, interp_weight: jax.Array) -> jax.Array:
        """patches [P, patch_dim], segment_ids [P], rope_rows_cols [P, 2], interp_index [P, 4],
        interp_weight [P, 4] (`vision_layout`) -> [P / merge_unit, out_hidden_size] in the compute dtype.
        Output rows of padding windows are garbage-but-finite; callers keep the first num_valid / merge_unit."""
        cfg = self.config
        p = patches.shape[0]
        if patches.shape != (p, cfg.patch_dim):
            raise ValueError(f"patches must be [P, {cfg.patch_dim}], got shape {patches.shape}")
        if p % cfg.merge_unit:
            raise ValueError(f"P = {p} patches must be a multiple of merge_unit {cfg.merge_unit}")
        for name, arr, shape in (("segment_ids", segment_ids, (p,)), ("rope_rows_cols", rope_rows_cols, (p, 2)),
                                 ("interp_index", interp_index, (p, 4)), ("interp_weight", interp_weight, (p, 4))):
            if arr.shape != shape:
                raise ValueError(f"{name} must have shape {shape}, got {arr.shape}")
        # on a mesh the rows are split over every device, each holding whole merge windows
        # (parallel/patches.py): padding rows (segment 0) up to a multiple of devices x merge_unit
        patches, segment_ids, rope_rows_cols, interp_index, interp_weight = (constrain_rows(a) for a in pad_rows(
            (patches, segment_ids, rope_rows_cols, interp_index, interp_weight), patch_shards() * cfg.merge_unit))
        x = constrain_rows(self.patch_embed(patches.astype(self.dtype)))  # [P', D]
        acc = math_dtype(self.dtype)
        taps = jnp.take(self.pos_embed.embedding[...].astype(self.dtype), interp_index, axis=0)  # [P, 4, D]
        # the 4 taps weighted and summed in the math dtype, as transformers' float32 weights promote them
        pos = jnp.einsum("pkd,pk->pd", taps, interp_weight.astype(acc), preferred_element_type=acc)  # [P, D]
        x = constrain_rows(x + pos.astype(self.dtype))  # [P', D]
        cos, sin = (constrain_rows(a) for a in rope_cos_sin(rope_rows_cols, cfg, acc))  # [P', Dh] each

        def step(block: VisionBlock, x: jax.Array) -> jax.Array:  # [P', D] -> [P', D]
            return constrain_rows(block(x, cos, sin, segment_ids))

        step = nnx.remat(step) if self.remat else step

        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        def run(block: VisionBlock, x: jax.Array) -> jax.Array:
            return step(block, x)

        x = run(self.blocks, x)  # [P', D]
        return constrain_rows(self.merger(x))[: p // cfg.merge_unit]  # [P / mu, out_hidden_size]
