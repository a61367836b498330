"""Causal document-masked flash attention with the Pallas TPU (Mosaic) kernel (`attention_core`'s
"pallas_tpu"): `jax.experimental.pallas.ops.tpu.flash_attention` with `SegmentIds`. Blocks, padding
and the repeated kv heads as in `pallas_gpu.py`. Off a TPU it runs in TPU interpret mode (tests).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import jax
import jax.numpy as jnp
from qwen35_kernels.attention.checks import check_attention_inputs, pad_to_blocks
from qwen35_kernels.choices import KernelChoices, resolved
from qwen35_kernels.logprob_entropy.tiles import half_operand_precision


def tpu_flash_attention(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, *,
                        block: int = 128, choices: KernelChoices | None = None,
                        interpret: bool | None = None) -> jax.Array:
    """Causal document-masked flash attention with the Pallas TPU (Mosaic) kernel.

    q: [B, S, H, Dh], k/v: [B, S, K, Dh], segment_ids: [B, S] -> [B, S, H, Dh].
    `block` (a multiple of 128, the TPU lane width) tiles queries and keys, forward and backward;
    S is padded to a multiple of it. interpret=None: TPU interpret mode unless the `choices`' platform
    (None: jax's backend) is a TPU.
    """
    from jax.experimental.pallas.ops.tpu import flash_attention as tpu_attention

    check_attention_inputs(q, k, v, segment_ids)
    if block <= 0 or block % 128:
        raise ValueError(f"block must be a positive multiple of 128, got {block}")
    if interpret is None:
        interpret = resolved(choices).platform != "tpu"
    b, s, h, dh = q.shape
    blk = min(block, 128 * -(-s // 128))
    qp, kp, vp, seg = pad_to_blocks(q, k, v, segment_ids, blk)
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
