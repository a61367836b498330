"""The chunked delta rule as Pallas kernels end to end, under one VJP.

The chunk-local kernel (`pallas_chunk_local.py`) makes u, w, intra, q_read and k_write; the state and
output kernels (`pallas_chunk_states.py`, `pallas_chunk_outputs.py`) carry the state over the chunks
and make the outputs. Under one VJP what passes between them is private, so under bf16 precision
the four arrays that the later kernels only multiply (w, intra, q_read, k_write) are written as
bfloat16, the value each multiplication would round them to anyway: the same results as float32
storage at half its bytes, and no conversion pass between the kernels. Their cotangents stay float32.
u (it is added to, not only multiplied), T and every gradient stay float32; the stored states are
bfloat16 too (`pallas_chunk_states.py`), the final state float32.

Backward: the output kernel's backward, the reverse recurrence and chunk-gradient kernel, then the
chunk-local backward kernel, each fed the float32 cotangents of the one before.

q, k and v come token-major ([B, n L, H, d], the layout of the layer around it) and the chunk-local
kernels read their [L, d] tiles from it and write dq, dk, dv back in it; the output leaves
token-major too, in the compute dtype the layer continues in, written so by the output kernel: no
transposition or cast pass around the rule, forward or backward.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from qwen35_kernels.choices import KernelChoices, resolved
from qwen35_kernels.gated_delta_rule.chunk_states import scan_backward, scan_forward
from qwen35_kernels.gated_delta_rule.matmul import GdnPrecision, operand_dtype
from qwen35_kernels.gated_delta_rule.pallas_chunk_local import chunk_local_backward, chunk_local_forward
from qwen35_kernels.gated_delta_rule.pallas_chunk_states import Blocks


@functools.partial(jax.custom_vjp, nondiff_argnums=(10, 11, 12, 13))
def _rule(q, k, v, cum, beta, read, write, doc, decay, state, prec, out_dtype, interpret, blocks):
    return _rule_fwd(q, k, v, cum, beta, read, write, doc, decay, state, prec, out_dtype, interpret, blocks)[0]


def _rule_fwd(q, k, v, cum, beta, read, write, doc, decay, state, prec, out_dtype, interpret, blocks):
    u, w, intra, q_read, k_write, t = chunk_local_forward(q, k, v, cum, beta, read, write, doc, prec, interpret,
                                                          operand_dtype(prec), token_major=True)
    out, states, final = scan_forward(u, w, q_read, k_write, intra, decay, state, prec, interpret, out_dtype,
                                      token_major=True, blocks=blocks)
    residuals = (q, k, v, cum, beta, read, write, doc, t, u, w, q_read, k_write, intra, decay, states)
    return (out, final), residuals


def _rule_bwd(prec, out_dtype, interpret, blocks, residuals, cotangents):
    q, k, v, cum, beta, read, write, doc, t, u, w, q_read, k_write, intra, decay, states = residuals
    d_out, d_final = cotangents
    du, dw, dq_read, dk_write, dintra, d_decay, d_state = scan_backward(
        u, w, q_read, k_write, intra, decay, states, d_out, d_final, prec, interpret, token_major=True,
        blocks=blocks)
    grads = chunk_local_backward(q, k, v, cum, beta, read, write, doc, t, du, dw, dintra, dq_read, dk_write,
                                 prec, interpret, token_major=True)
    return (*grads[:7], None, d_decay, d_state)


_rule.defvjp(_rule_fwd, _rule_bwd)


def pallas_chunked_rule(
    q: jax.Array,  # [B, n L, Hk, Dk] float32 or bfloat16 (read as float32; dq in its dtype), scaled
    k: jax.Array,  # [B, n L, Hk, Dk] as q
    v: jax.Array,  # [B, n L, Hv, Dv] float32 or the compute dtype (read as float32; its gradient in its own)
    cum: jax.Array,  # [B, n, Hv, L] float32: cumulative log-decay inside each chunk
    beta: jax.Array,  # [B, n, Hv, L] float32
    read: jax.Array,  # [B, n, Hv, L] float32: the factor with which each token reads the entering state
    write: jax.Array,  # [B, n, Hv, L] float32: the factor with which each token's key enters the next state
    doc: jax.Array,  # [B, n, L] int32: document index, -1 on padding
    decay: jax.Array,  # [B, n, Hv] float32: each chunk's decay of the state entering it
    state: jax.Array,  # [B, Hv, Dk, Dv] float32: the state entering the first chunk
    prec: GdnPrecision,
    *,
    out_dtype: jnp.dtype = jnp.float32,
    choices: KernelChoices | None = None,
    interpret: bool | None = None,
) -> tuple[jax.Array, jax.Array]:  # out [B, n L, Hv, Dv] in out_dtype, final state [B, Hv, Dk, Dv] float32
    """The chunked delta rule from its per-chunk inputs (`delta_rule.chunked_gated_delta_rule` makes
    them): `pallas_chunk_local.pallas_chunk_local` then `chunk_states.pallas_chunk_states`, as one VJP,
    the output written token-major (the layer's own layout) and rounded to `out_dtype` by the output
    kernel (its cotangent read in that dtype). The state kernel's blocks are the `choices`' (None: the
    defaults for jax's backend); `interpret`: None runs the Triton kernels on the choices' GPU and
    interprets them elsewhere; False builds them for Triton anywhere."""
    choices = resolved(choices)
    if interpret is None:
        interpret = choices.interpret
    return _rule(q, k, v, cum, beta, read, write, doc, decay, state, prec, jnp.dtype(out_dtype), bool(interpret),
                 choices.gdn_kernel_blocks)
