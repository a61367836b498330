"""Backend kernels for causal, document-masked attention, and which one `attention_core` runs.

Semantics (those of the XLA core in `attention.py`, the reference): query i attends to key j iff
j <= i and segment_ids[i] == segment_ids[j]; padding (segment 0) is one more segment, so padding
tokens attend only to earlier padding. Every row keeps at least its diagonal, so no row is fully
masked. Scale 1/sqrt(Dh), softmax in float32, query head h reads kv head h // (H / K).

Kernels (flash: online softmax over key blocks, no [S, S] scores in memory, forward or backward):
  - "pallas_gpu": the Pallas Triton kernel `jax.experimental.pallas.ops.gpu.attention.mha`. It
    takes one segment-id row per sequence and masks q_seg == kv_seg inside every tile, so packed
    documents are exact.
  - "pallas_tpu": `jax.experimental.pallas.ops.tpu.flash_attention` with `SegmentIds`.
  - "cudnn" (GPU only, bf16/fp16, opt-in): cuDNN's fused flash attention with each row's documents
    as packed segments, the Triton kernel for rows it cannot take exactly (`cudnn.py`).
Both need the sequence in whole blocks and equal q/kv head counts: kv heads are repeated up to the
query heads (the gradient of the repeat sums them back) and S is padded at the end with segment -1;
causality keeps every real query off the padded keys, the padded rows are dropped.

Selection: the kernel choices' `attention` (`qwen35_kernels.choices`): "auto" is "xla" on CPU (and
any other backend), "pallas_gpu" on GPU, "pallas_tpu" on TPU; "pallas" is the platform's Pallas
kernel (on CPU the GPU kernel in interpret mode: tests); "cudnn" resolves only on a GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from qwen35_kernels.choices import ATTENTION_IMPLEMENTATIONS, choices_with, current_choices
from qwen35_kernels.logprob_entropy.tiles import half_operand_precision

IMPLEMENTATIONS = ATTENTION_IMPLEMENTATIONS


def check_implementation(name: str) -> None:
    """One-line ValueError unless `name` is one of IMPLEMENTATIONS."""
    if name not in IMPLEMENTATIONS:
        raise ValueError(f"attention implementation must be one of {IMPLEMENTATIONS}, got {name!r}")


def resolve_implementation(name: str | None = None, platform: str | None = None) -> str:
    """"xla", "pallas_gpu", "pallas_tpu" or "cudnn" for `name` (None: the kernel choices') on `platform`
    (None: the kernel choices'); a one-line ValueError for "cudnn" off a GPU."""
    if name is not None:
        check_implementation(name)
    changes = {key: value for key, value in (("attention", name), ("platform", platform)) if value is not None}
    return (choices_with(**changes) if changes else current_choices()).attention


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


def _is_pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def _pad_to_blocks(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, multiple: int
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


def gpu_flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                        block_q: int | None = None, block_k: int | None = None, block_bwd: int = 32,
                        num_warps: int | None = None, num_stages: int = 2,
                        interpret: bool | None = None) -> jax.Array:
    """Causal document-masked flash attention with the Pallas Triton kernel (fused Triton backward).

    q: [B, S, H, Dh], k/v: [B, S, K, Dh], segment_ids: [B, S] -> [B, S, H, Dh].
    Block sizes are powers of two (Triton tiles); S is padded to a multiple of the largest one that
    is needed (at least 16, the smallest Triton dot). Forward blocks default to 128 for Dh <= 128 and
    64 above (a 128 x 256 bf16 tile is 64 KiB of shared memory; with two pipeline stages of k and v
    128-row tiles would not fit). interpret=None: interpret unless on a GPU.
    On a GPU, float32 inputs go through TF32 tensor-core dots unless jax_default_matmul_precision is
    "highest" (bfloat16 inputs: bf16 products, float32 accumulation).
    """
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    check_attention_inputs(q, k, v, segment_ids)
    b, s, h, dh = q.shape
    default = 128 if dh <= 128 else 64
    block_q, block_k = block_q or default, block_k or default
    for name, blk in (("block_q", block_q), ("block_k", block_k), ("block_bwd", block_bwd)):
        if not (_is_pow2(blk) and blk >= 16):
            raise ValueError(f"{name} must be a power of two >= 16, got {blk}")
    if interpret is None:
        interpret = current_choices().platform != "gpu"
    tile = min(max(block_q, block_k, block_bwd), max(16, 1 << (s - 1).bit_length()))
    qp, kp, vp, seg = _pad_to_blocks(q, k, v, segment_ids, tile)
    bwd = min(block_bwd, tile)
    blocks = gpu_attention.BlockSizes(block_q=min(block_q, tile), block_k=min(block_k, tile),
                                      block_q_dkv=bwd, block_kv_dkv=bwd, block_q_dq=bwd, block_kv_dq=bwd)
    out = gpu_attention.mha(qp, kp, vp, seg, sm_scale=dh ** -0.5, causal=True, block_sizes=blocks,
                            num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    return out[:, :s]  # [B, S, H, Dh]


def tpu_flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                        block: int = 128, interpret: bool | None = None) -> jax.Array:
    """Causal document-masked flash attention with the Pallas TPU (Mosaic) kernel.

    q: [B, S, H, Dh], k/v: [B, S, K, Dh], segment_ids: [B, S] -> [B, S, H, Dh].
    `block` (a multiple of 128, the TPU lane width) tiles queries and keys, forward and backward;
    S is padded to a multiple of it. interpret=None: TPU interpret mode unless on a TPU.
    """
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_attention

    check_attention_inputs(q, k, v, segment_ids)
    if block <= 0 or block % 128:
        raise ValueError(f"block must be a positive multiple of 128, got {block}")
    if interpret is None:
        interpret = current_choices().platform != "tpu"
    b, s, h, dh = q.shape
    blk = min(block, 128 * -(-s // 128))
    qp, kp, vp, seg = _pad_to_blocks(q, k, v, segment_ids, blk)
    qp, kp, vp = (jnp.swapaxes(x, 1, 2) for x in (qp, kp, vp))  # [B, H, Sp, Dh]
    blocks = tpu_attention.BlockSizes(
        block_q=blk, block_k_major=blk, block_k=blk, block_b=1,
        block_q_major_dkv=blk, block_k_major_dkv=blk, block_k_dkv=blk, block_q_dkv=blk,
        block_k_major_dq=blk, block_k_dq=blk, block_q_dq=blk)

    def flash(q: jax.Array, k: jax.Array, v: jax.Array) -> jax.Array:  # [B, H, Sp, Dh] each
        return tpu_attention.flash_attention(q, k, v, segment_ids=tpu_attention.SegmentIds(seg, seg),
                                             causal=True, sm_scale=dh ** -0.5, block_sizes=blocks)

    settings: list[Callable[[], contextlib.AbstractContextManager[None]]] = []
    if interpret:
        from jax.experimental.pallas import tpu as pltpu
        settings.append(pltpu.force_tpu_interpret_mode)
    if half_operand_precision(q.dtype) is not None:  # the kernel's dots take the configured precision
        settings.append(lambda: jax.default_matmul_precision("default"))
    out = _traced_within(flash, settings)(qp, kp, vp) if settings else flash(qp, kp, vp)
    return jnp.swapaxes(out, 1, 2)[:, :s]  # [B, S, H, Dh]


def _traced_within(f: Callable[..., jax.Array], settings: list[Callable[[], contextlib.AbstractContextManager[None]]]
                   ) -> Callable[..., jax.Array]:
    """`f` traced inside every context of `settings` (trace-time settings such as TPU interpret mode
    or the matmul precision), forward and backward.

    A setting is read when the kernel is traced; the kernel's backward is traced only when the
    gradient is taken, outside any `with` around the forward, so the vjp runs inside them again.
    """
    @contextlib.contextmanager
    def inside() -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for setting in settings:
                stack.enter_context(setting())
            yield

    @jax.custom_vjp
    def run(*args: jax.Array) -> jax.Array:
        with inside():
            return f(*args)

    def fwd(*args: jax.Array) -> tuple[jax.Array, Callable[..., tuple[jax.Array, ...]]]:
        with inside():
            return jax.vjp(f, *args)

    def bwd(vjp: Callable[..., tuple[jax.Array, ...]], g: jax.Array) -> tuple[jax.Array, ...]:
        with inside():
            return vjp(g)

    run.defvjp(fwd, bwd)
    return run

