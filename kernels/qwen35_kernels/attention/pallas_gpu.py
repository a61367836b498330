"""Causal document-masked flash attention with the Pallas Triton kernel (`attention_core`'s "pallas_gpu").

`jax.experimental.pallas.ops.gpu.attention.mha` takes one segment-id row per sequence and masks
q_seg == kv_seg inside every tile, so packed documents are exact. It needs the sequence in whole
blocks and equal q/kv head counts: kv heads are repeated up to the query heads (the gradient of the
repeat sums them back) and S is padded at the end with segment -1; causality keeps every real query
off the padded keys, the padded rows are dropped. Off a GPU it runs interpreted (tests).
"""

from __future__ import annotations

import jax
from qwen35_kernels.attention.checks import check_attention_inputs, is_pow2, pad_to_blocks
from qwen35_kernels.choices import KernelChoices, resolved


def gpu_flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                        block_q: int | None = None, block_k: int | None = None, block_bwd: int = 32,
                        num_warps: int | None = None, num_stages: int = 2,
                        choices: KernelChoices | None = None, interpret: bool | None = None) -> jax.Array:
    """Causal document-masked flash attention with the Pallas Triton kernel (fused Triton backward).

    q: [B, S, H, Dh], k/v: [B, S, K, Dh], segment_ids: [B, S] -> [B, S, H, Dh].
    Block sizes are powers of two (Triton tiles); S is padded to a multiple of the largest one that
    is needed (at least 16, the smallest Triton dot). Forward blocks default to 128 for Dh <= 128 and
    64 above (a 128 x 256 bf16 tile is 64 KiB of shared memory; with two pipeline stages of k and v
    128-row tiles would not fit). interpret=None: interpret unless the `choices`' platform (None: jax's
backend) is a GPU.
    On a GPU, float32 inputs go through TF32 tensor-core dots unless jax_default_matmul_precision is
    "highest" (bfloat16 inputs: bf16 products, float32 accumulation).
    """
    from jax.experimental.pallas.ops.gpu import attention as gpu_attention

    check_attention_inputs(q, k, v, segment_ids)
    b, s, h, dh = q.shape
    default = 128 if dh <= 128 else 64
    block_q, block_k = block_q or default, block_k or default
    for name, blk in (("block_q", block_q), ("block_k", block_k), ("block_bwd", block_bwd)):
        if not (is_pow2(blk) and blk >= 16):
            raise ValueError(f"{name} must be a power of two >= 16, got {blk}")
    if interpret is None:
        interpret = resolved(choices).interpret
    tile = min(max(block_q, block_k, block_bwd), max(16, 1 << (s - 1).bit_length()))
    qp, kp, vp, seg = pad_to_blocks(q, k, v, segment_ids, tile)
    bwd = min(block_bwd, tile)
    blocks = gpu_attention.BlockSizes(block_q=min(block_q, tile), block_k=min(block_k, tile),
                                      block_q_dkv=bwd, block_kv_dkv=bwd, block_q_dq=bwd, block_kv_dq=bwd)
    out = gpu_attention.mha(qp, kp, vp, seg, sm_scale=dh ** -0.5, causal=True, block_sizes=blocks,
                            num_warps=num_warps, num_stages=num_stages, interpret=interpret)
    return out[:, :s]  # [B, S, H, Dh]
