"""Causal document-masked attention with cuDNN's fused flash attention (Hopper or newer, bf16/fp16).

cuDNN takes packed documents as per-row segments: for row b, segment m covers tokens
[offsets[b, m], offsets[b, m] + seqlen[b, m]) and attends causally within itself. `packed_segments`
turns segment ids into that form, one cuDNN segment per run of equal ids. That is exactly the XLA
core's semantics (same id and j <= i) when every id's tokens are contiguous in its row, and the row
has at most `max_segments` runs (a static size: cuDNN's softmax statistics are [B * M, H, S]). Packed
rows as `qwen35_jax.data` writes them are of that kind (documents one after another, padding at the
end); any row that is not sends the whole call to `fallback` (the Pallas Triton kernel) through a
`lax.cond`, so the result never depends on which kernel ran.

The kv heads are repeated up to the query heads: jax 0.10 scales the kv's segment offsets by the
query's heads x head dim, which is the kv's stride only when the head counts match (later releases
use the kv's own). The gradient of the repeat sums the heads back.

jax exposes the packed form only in `jax._src.cudnn.fused_attention_stablehlo` (checked when traced:
cuDNN 9.6 or newer, compute capability 9.0 or newer, head dim <= 256 and a multiple of 8).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from qwen35_kernels.attention.checks import check_attention_inputs
from qwen35_kernels.attention.pallas_gpu import gpu_flash_attention
from qwen35_kernels.choices import KernelChoices

DEFAULT_MAX_SEGMENTS = 32

# (q [B, S, H, Dh], k [B, S, H, Dh], v [B, S, H, Dh], seqlen [B, M], offsets [B, M + 1], scale) -> [B, S, H, Dh]
PackedAttention = Callable[[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array, float], jax.Array]


def packed_segments(segment_ids: jax.Array, max_segments: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """cuDNN's packed-segment form of `segment_ids` [B, S]: one segment per run of equal ids.

    -> seqlen [B, M] int32 (run lengths, -1 after a row's last run), offsets [B, M + 1] int32 (run
    starts, -1 after a row's last run), exact [] bool: every row has at most M = `max_segments` runs
    and no id in two runs (then causal attention within runs is attention within equal ids).
    """
    if max_segments < 1:
        raise ValueError(f"max_segments must be >= 1, got {max_segments}")
    b, s = segment_ids.shape
    seg = segment_ids.astype(jnp.int32)
    starts = jnp.concatenate([jnp.ones((b, 1), bool), seg[:, 1:] != seg[:, :-1]], axis=1)  # [B, S]
    runs = jnp.sum(starts, axis=1)  # [B]
    run = jnp.cumsum(starts, axis=1) - 1  # [B, S] the run each token is in
    ordered = jnp.sort(seg, axis=1)
    distinct = 1 + jnp.sum(ordered[:, 1:] != ordered[:, :-1], axis=1)  # [B]
    exact = jnp.all((runs <= max_segments) & (runs == distinct))

    pos = jnp.broadcast_to(jnp.arange(s, dtype=jnp.int32), (b, s))
    slot = jnp.where(starts & (run < max_segments), run, max_segments + 1)  # out of range: dropped
    rows = jnp.broadcast_to(jnp.arange(b)[:, None], (b, s))
    offsets = jnp.full((b, max_segments + 1), -1, jnp.int32).at[rows, slot].set(pos, mode="drop")
    lengths = jnp.zeros((b, max_segments + 1), jnp.int32).at[rows, jnp.minimum(run, max_segments)].add(1)
    seqlen = jnp.where(offsets[:, :max_segments] >= 0, lengths[:, :max_segments], -1)
    return seqlen, offsets, exact


def cudnn_packed_attention(q: jax.Array, k: jax.Array, v: jax.Array, seqlen: jax.Array, offsets: jax.Array,
                           scale: float) -> jax.Array:
    """jax's cuDNN fused attention over packed segments, causal within each.

    q/k/v: [B, S, H, Dh] (bf16 or fp16), seqlen: [B, M], offsets: [B, M + 1] -> [B, S, H, Dh].
    """
    try:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn
    except ImportError as e:  # a private module: name what is missing rather than fail deep inside
        raise ImportError(f"attention implementation 'cudnn' needs jax's cuDNN attention module ({e})") from e
    return cudnn.dot_product_attention(q, k, v, q_seqlen=seqlen, kv_seqlen=seqlen, q_offsets=offsets,
                                       kv_offsets=offsets, scale=scale, mask_type=cudnn.MaskType.CAUSAL)


def cudnn_flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                          max_segments: int = DEFAULT_MAX_SEGMENTS,
                          packed_attention: PackedAttention = cudnn_packed_attention,
                          fallback: Callable[..., jax.Array] | None = None,
                          choices: KernelChoices | None = None) -> jax.Array:
    """Causal document-masked attention through cuDNN, `fallback` for rows cuDNN cannot take exactly.

    q: [B, S, H, Dh], k/v: [B, S, K, Dh] (bf16 or fp16), segment_ids: [B, S] -> [B, S, H, Dh].
    `packed_attention` is the packed-segment primitive (cuDNN; tests pass a reference of it),
    `fallback` any kernel `(q, k, v, segment_ids) -> out` (None: the Pallas Triton kernel for the
    `choices`' platform).
    """
    if fallback is None:
        fallback = functools.partial(gpu_flash_attention, choices=choices)
    check_attention_inputs(q, k, v, segment_ids)
    if q.dtype not in (jnp.bfloat16, jnp.float16) or k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"attention implementation 'cudnn' needs bfloat16 or float16 q/k/v (the compute "
                         f"dtype), got {q.dtype}/{k.dtype}/{v.dtype}")
    h, dh = q.shape[2], q.shape[3]
    seqlen, offsets, exact = packed_segments(segment_ids, max_segments)

    def packed(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        g = h // k.shape[2]
        k, v = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)  # [B, S, H, Dh]: head h <- kv head h // g
        return packed_attention(q, k, v, seqlen, offsets, dh ** -0.5)

    def general(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:
        return fallback(q, k, v, segment_ids)

    return jax.lax.cond(exact, packed, general, q, k, v)  # [B, S, H, Dh]
