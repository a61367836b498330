"""Gated DeltaNet: the NNX module and its pure per-head sequence mixer `gdn_core`.

The module does the projections and out_proj; everything along the sequence (causal conv1d, the
delta-rule recurrence, the gated norm) lives in `gdn_core`, whose arrays all carry an explicit head
axis so that a sequence-parallel wrapper can all-to-all sequence shards into head shards around it
(`sharded_gdn_core` picks that or state passing under a mesh).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from flax import nnx
from qwen35_kernels.choices import KernelChoices, resolved
from qwen35_kernels.gated_delta_rule.tiles import delta_rule_tile

from qwen35_jax.config import GDN_SP_MODES, Qwen35Config
from qwen35_jax.layers.cache import GdnCache, LayerCache, is_decode_step
from qwen35_jax.layers.gdn_arrays import GdnTokens, GdnWeights, check_gdn_arrays, conv_halo
from qwen35_jax.layers.gdn_decode import gdn_decode_step, prompt_conv_window
from qwen35_jax.layers.gdn_segment import gdn_segment
from qwen35_jax.layers.gdn_state_passing import gdn_state_passing
from qwen35_jax.layers.gdn_tiling import tiled_gdn_core
from qwen35_jax.layers.linear import Linear
from qwen35_jax.layers.norms import GatedRMSNorm
from qwen35_jax.parallel.mesh import SP, auto_mesh, mesh_axis_size
from qwen35_jax.parallel.ulysses import GDN_SCOPE, Arg, active_sp_mesh, check_heads, shared_head_index, ulysses_call


def gdn_core(
    tokens: GdnTokens,  # q, k [B, S, Hk, Dk], v, z [B, S, Hv, Dv], b, a [B, S, Hv]: raw projections
    weights: GdnWeights,  # conv kernels [Kc, H, d], A_log, dt_bias [Hv], norm_weight [Dv]
    segment_ids: jax.Array | None,  # [B, S] document ids >= 1, 0 = padding
    *,
    eps: float,
    chunk_size: int,
    return_state: bool = False,
    choices: KernelChoices | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:  # [B, S, Hv, Dv] in q.dtype (and the final state)
    """Per-head Gated DeltaNet mixer: conv1d + SiLU, L2-norm, gated delta rule, gated RMSNorm.

    The conv window and the recurrent state restart at every document start; padding tokens are
    zeroed before the conv, leave the state untouched and output zeros. Sequences longer than the
    delta rule's tile (the kernel choices' `sequence_tile`) run tile by tile (`gdn_tiling.tiled_gdn_core`).
    `return_state`: also the delta-rule state after the last token, [B, Hv, Dk, Dv] float32. The
    kernels are `choices`' (None: the defaults for jax's backend).
    """
    check_gdn_arrays(tokens, weights, "gdn_core")
    B, S = tokens.q.shape[:2]
    choices = resolved(choices)
    tile = delta_rule_tile(chunk_size, choices)
    if tile is not None and S > tile:  # long sequences: the whole mixer tile by tile
        if segment_ids is None:
            segment_ids = jnp.ones((B, S), jnp.int32)
        segment = functools.partial(gdn_segment, eps=eps, chunk_size=chunk_size, choices=choices)
        return tiled_gdn_core(segment, tokens, weights, segment_ids, tile=tile, halo=conv_halo(weights),
                              return_state=return_state)
    out, state = gdn_segment(tokens, weights, segment_ids, eps=eps, chunk_size=chunk_size, choices=choices)
    return (out, state) if return_state else out


def sharded_gdn_core(
    tokens: GdnTokens,  # [B, S/sp, ...] each: this device's sequence shard
    weights: GdnWeights,
    segment_ids: jax.Array,  # [B, S/sp]
    *,
    eps: float,
    chunk_size: int,
    sp_mode: str = "all_to_all",
    return_state: bool = False,
    choices: KernelChoices | None = None,
) -> jax.Array | tuple[jax.Array, jax.Array]:  # [B, S/sp, Hv, Dv] (and the final state [B, Hv, Dk, Dv])
    """`gdn_core` under the context mesh's sequence parallelism: the seq <-> heads all-to-all around
    it (`ulysses_gdn`, sp_mode "all_to_all") or states passed between sequence shards
    (`gdn_state_passing`, "state_passing"). Without a multi-device mesh `gdn_core` itself; at sp = 1
    on one, `gdn_core` on each device's rows. `return_state` (prefill) always takes the all-to-all,
    where each device ends holding the final state of its own heads. The kernels are `choices`' (None:
    the defaults for jax's backend)."""
    if sp_mode not in GDN_SP_MODES:
        raise ValueError(f"GDN sequence-parallel mode {sp_mode!r} is not one of {GDN_SP_MODES}")
    mesh = active_sp_mesh()
    if mesh is not None and sp_mode == "state_passing" and not return_state:
        return gdn_state_passing(tokens, weights, segment_ids, mesh=mesh, eps=eps, chunk_size=chunk_size,
                                 choices=choices)
    return ulysses_gdn(gdn_core, tokens, weights, segment_ids, eps=eps, chunk_size=chunk_size,
                       return_state=return_state, choices=choices)


class DepthwiseConvKernel(nnx.Module):
    """Holds the depthwise conv1d kernel [Kc, C] (HF `conv1d.weight` [C, 1, Kc], squeezed and transposed)."""

    def __init__(self, kernel_size: int, channels: int, *, param_dtype: jnp.dtype, rngs: nnx.Rngs):
        self.kernel = nnx.Param(nnx.initializers.normal(0.02)(rngs.params(), (kernel_size, channels), param_dtype))


class GatedDeltaNet(nnx.Module):
    """Qwen3.5 linear-attention mixer; attribute names follow HF's `Qwen3_5GatedDeltaNet`."""

    def __init__(self, config: Qwen35Config, *, rngs: nnx.Rngs):
        self.config = config
        self.Hk, self.Hv = config.linear_num_key_heads, config.linear_num_value_heads
        self.Dk, self.Dv = config.linear_key_head_dim, config.linear_value_head_dim
        if self.Hv % self.Hk:
            raise ValueError(f"linear_num_value_heads ({self.Hv}) must be a multiple of "
                             f"linear_num_key_heads ({self.Hk})")
        D = config.hidden_size
        key_dim, value_dim = self.Hk * self.Dk, self.Hv * self.Dv
        conv_dim = 2 * key_dim + value_dim  # channel order: q, k, v
        pdt = jnp.dtype(config.param_dtype)
        lin = dict(use_bias=False, dtype=jnp.dtype(config.dtype), param_dtype=pdt, rngs=rngs,
                   kernel_init=nnx.initializers.normal(0.02))
        self.in_proj_qkv = Linear(D, conv_dim, **lin)
        self.in_proj_z = Linear(D, value_dim, **lin)
        self.in_proj_b = Linear(D, self.Hv, **lin)
        self.in_proj_a = Linear(D, self.Hv, **lin)
        self.conv1d = DepthwiseConvKernel(config.linear_conv_kernel_dim, conv_dim, param_dtype=pdt, rngs=rngs)
        # A = exp(A_log) ~ U(0.01, 16), as transformers initialises it.
        A = jax.random.uniform(rngs.params(), (self.Hv,), jnp.float32, minval=0.01, maxval=16.0)
        self.A_log = nnx.Param(jnp.log(A).astype(pdt))
        self.dt_bias = nnx.Param(jnp.ones((self.Hv,), pdt))
        self.norm = GatedRMSNorm(self.Dv, eps=config.rms_norm_eps, param_dtype=config.param_dtype)
        self.out_proj = Linear(value_dim, D, **lin)

    def mixer_arrays(self, x: jax.Array, *, split_weights: bool = True) -> tuple[GdnTokens, GdnWeights]:
        """x [B, S, D] -> the raw per-head projections [B, S, ...] and the mixer's weights.
        `split_weights`: q, k and v each from its own columns of `in_proj_qkv` (`Linear.parts`, for
        sequences); else one matmul split after (a decode step, where slicing the weight would copy it)."""
        B, S, _ = x.shape
        Hk, Hv, Dk, Dv = self.Hk, self.Hv, self.Dk, self.Dv
        x = x.astype(jnp.dtype(self.config.dtype))
        if split_weights:
            q, k, v = self.in_proj_qkv.parts(x, (Hk * Dk, Hk * Dk, Hv * Dv))  # [B, S, .] each
        else:
            q, k, v = jnp.split(self.in_proj_qkv(x), (Hk * Dk, 2 * Hk * Dk), axis=-1)
        tokens = GdnTokens(q=q.reshape(B, S, Hk, Dk), k=k.reshape(B, S, Hk, Dk), v=v.reshape(B, S, Hv, Dv),
                           z=self.in_proj_z(x).reshape(B, S, Hv, Dv),
                           b=self.in_proj_b(x), a=self.in_proj_a(x))  # b, a: [B, S, Hv]
        w = self.conv1d.kernel[...]  # [Kc, C], channels q, k, v
        Kc = w.shape[0]
        weights = GdnWeights(conv_q=w[:, : Hk * Dk].reshape(Kc, Hk, Dk),
                             conv_k=w[:, Hk * Dk : 2 * Hk * Dk].reshape(Kc, Hk, Dk),
                             conv_v=w[:, 2 * Hk * Dk :].reshape(Kc, Hv, Dv),
                             A_log=self.A_log[...], dt_bias=self.dt_bias[...], norm_weight=self.norm.weight[...])
        return tokens, weights

    def __call__(
        self,
        x: jax.Array,  # [B, S, D]
        segment_ids: jax.Array | None = None,  # [B, S] document ids >= 1, 0 = padding
        cache: LayerCache | None = None,
    ) -> jax.Array | tuple[jax.Array, GdnCache]:  # [B, S, D] (and this layer's stacked GdnCache)
        """The mixer on a sequence (training; under a mesh sequence-parallel) or, with `cache`, on a
        prompt that starts the cache (right-padded rows: the chunked kernels, and the conv window and
        state each row leaves) or a decode step (one token per row, continuing from the cache's
        window and state). The cache is stacked over blocks ([NB, B, ...]); this layer's slot is
        `cache.block`, written in place."""
        B, S, _ = x.shape
        if segment_ids is None:
            segment_ids = jnp.ones((B, S), jnp.int32)
        elif segment_ids.shape != (B, S):
            raise ValueError(f"segment_ids must be [B, S] = {(B, S)}, got {segment_ids.shape}")
        decoding = is_decode_step(x, cache)
        tokens, weights = self.mixer_arrays(x, split_weights=not decoding)
        if decoding:
            mine = GdnCache(*(a[cache.block] for a in cache.stacked))
            out, mine = gdn_decode_step(tokens, weights, mine, eps=self.config.rms_norm_eps,
                                        choices=self.config.kernels)  # [B, 1, Hv, Dv]
        else:
            out = sharded_gdn_core(tokens, weights, segment_ids, eps=self.config.rms_norm_eps,
                                   chunk_size=self.config.gdn_chunk(),
                                   sp_mode=self.config.gdn_sp_mode, return_state=cache is not None,
                                   choices=self.config.kernels)
            if cache is not None:  # a prompt: the state after it and the window before each row's end
                out, state = out
                lengths = jnp.sum(segment_ids > 0, axis=1, dtype=jnp.int32)  # [B]
                mine = GdnCache(conv=prompt_conv_window(tokens, weights, lengths), state=state)
        out = self.out_proj(out.reshape(B, S, self.Hv * self.Dv))
        if cache is None:
            return out
        return out, GdnCache(*(a.at[cache.block].set(m.astype(a.dtype)) for a, m in zip(cache.stacked, mine)))


def ulysses_gdn(
    core: Callable[..., jax.Array],
    tokens: GdnTokens,  # [B, S/sp, ...] each: this device's sequence shard of the raw projections
    weights: GdnWeights,
    segment_ids: jax.Array,  # [B, S/sp]
    return_state: bool = False,
    **static: object,  # eps, chunk_size
) -> jax.Array | tuple[jax.Array, jax.Array]:  # [B, S/sp, Hv, Dv] (and the final state [B, Hv, Dk, Dv])
    """The gated DeltaNet core `core(tokens, weights, segment_ids, **static)` sequence-parallel over
    value heads (key heads follow, replicated). `return_state`: the core also returns its final
    state, which comes back sharded over sp on its value heads."""
    if return_state:
        static = {**static, "return_state": True}
    call = functools.partial(core, **static)
    mesh = auto_mesh()
    if mesh is None:
        return call(tokens, weights, segment_ids)
    sp = mesh_axis_size(mesh, SP)
    n_v, n_k = tokens.v.shape[2], tokens.q.shape[2]
    check_heads(n_v, sp, "gated DeltaNet value heads")
    key = shared_head_index(n_v, n_k, sp)
    per_value_head = Arg("seq_heads")
    kinds = (
        GdnTokens(q=Arg("seq_heads", index=key), k=Arg("seq_heads", index=key),
                  v=per_value_head, z=per_value_head, b=per_value_head, a=per_value_head),
        GdnWeights(conv_q=Arg("heads", head_axis=1, index=key), conv_k=Arg("heads", head_axis=1, index=key),
                   conv_v=Arg("heads", head_axis=1), A_log=Arg("heads", head_axis=0),
                   dt_bias=Arg("heads", head_axis=0), norm_weight=Arg("replicated")),
        Arg("seq"),
    )
    with jax.named_scope(GDN_SCOPE):
        return ulysses_call(call, (tokens, weights, segment_ids), kinds, mesh,
                            extra_head_axes=(1,) if return_state else ())
