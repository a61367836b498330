"""How the chunked delta rule carries its state from chunk to chunk: a sequential scan or a log-depth
associative scan.

Per chunk c (L tokens) the chunked form has, for every head: u_c [L, Dv] (new values), w_c [L, Dk]
(decayed keys that read the state), q_c [L, Dk] (decayed queries), k_c [L, Dk] (keys that write the
state, decayed to the chunk end), intra_c [L, L] and the chunk's total decay d_c. With S_c the state
entering chunk c:

    v_c     = u_c - w_c S_c
    o_c     = q_c S_c + intra_c v_c
    S_c+1   = d_c S_c + k_c^T v_c  =  A_c S_c + b_c,   A_c = d_c I - k_c^T w_c [Dk, Dk],  b_c = k_c^T u_c

- "sequential": `lax.scan` over the chunks, four thin matmuls per step (written out instead of a loop
  up to UNROLL_CHUNKS chunks). Least arithmetic; the right choice on CPU. On a GPU every step is a
  handful of tiny kernels, so over a long sequence's chunks the launches, not the arithmetic, set
  its time.
- "associative": the affine maps (A_c, b_c) compose associatively, (A2, b2) after (A1, b1) =
  (A2 A1, A2 b1 + b2), so `lax.associative_scan` gives every prefix in O(log n) rounds of batched
  [Dk, Dk] matmuls; then all v_c and o_c at once. The [Dk, Dk] products make it about 4x the state
  arithmetic of the sequential scan at Dk = 128, L = 64, all of it in large batched matmuls: worth it
  where launches cost more than arithmetic, not on CPU. The scan is recomputed in the backward pass
  rather than saving its log n levels of products.
- "pallas": one Pallas kernel walks the chunks in order with the state in registers, one launch for
  the whole sequence (and one, the transposed recurrence, for the backward); then all v_c and o_c at
  once by a second kernel (`pallas_chunk_outputs.py`), both under one VJP. The state arithmetic of
  the sequential scan without its launches. Triton kernels: compiled on a GPU, interpreted elsewhere
  (tests; slow). See `pallas_chunk_states.py`. With this scan the chunk-local part that feeds it is
  a Pallas kernel too (`pallas_chunk_local.py`), all of them under one VJP (`pallas_rule.py`).
- "auto": "sequential" on CPU, "pallas" on GPU, "associative" elsewhere (TPU).

All three are exact rewritings of the same recurrence; they differ only in float rounding order.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name
from qwen35_kernels.choices import DEFAULT_GDN_KERNEL_BLOCKS, KernelChoices, resolved
from qwen35_kernels.gated_delta_rule.matmul import GdnPrecision, bf16_operands, gdn_einsum
from qwen35_kernels.gated_delta_rule.pallas_chunk_outputs import chunk_outputs, chunk_outputs_backward
from qwen35_kernels.gated_delta_rule.pallas_chunk_states import (
    CHUNK_STATES_NAME,
    Blocks,
    entering_states,
    entering_states_backward,
    kernel_fits,
)

# What the GDN mixer keeps for its backward pass (`gdn_segment.gdn_segment`):
# - "none": no recompute; autodiff keeps every intermediate it needs, about 230 KB per token and layer
#   at the 0.8B shapes (16 heads of 128), most of it float32 [tokens, heads, 128]-sized arrays.
# - "states": the mixer is recomputed in the backward from its inputs, except the chunk states (named
#   CHUNK_STATES_NAME, [B, n + 1, H, Dk, Dv] float32 or, under bf16 precision, bfloat16; 1/L of a
#   token's state per token) and the rule's output as the gated norm reads it (RULE_OUTPUT_NAME,
#   [B, S, H, Dv] in the compute dtype), which are kept: the backward repeats the intra-chunk part but
#   neither the sequential part nor the output kernel (the rule's own backward does not need its
#   output; only the norm after it does). Several times less to keep.
# - "auto" (`choices.KernelChoices.resolve`): "states" with the Pallas chunk scan, "none" otherwise
#   (the sequential scan on CPU names no states, so "states" there would rerun the whole scan).
RULE_OUTPUT_NAME = "gdn_rule_output"


def apply_gdn_remat(fn: Callable[..., Any], choices: KernelChoices | None) -> Callable[..., Any]:
    """`fn` (a GDN mixer, taking a keyword `recomputed`) as the `choices`' `gdn_remat` says (None: the
    defaults for jax's backend): for "states" `fn(..., recomputed=True)` checkpointed so that only its
    inputs, the named chunk states and the named rule output are kept for the backward (its parts then
    need no checkpoint of their own: that would evaluate them a third time), else `fn(..., recomputed=False)`."""
    if resolved(choices).gdn_remat == "states":
        policy = jax.checkpoint_policies.save_only_these_names(CHUNK_STATES_NAME, RULE_OUTPUT_NAME)
        return jax.checkpoint(functools.partial(fn, recomputed=True), policy=policy)
    return functools.partial(fn, recomputed=False)


def chunk_scan_for(choices: KernelChoices, dk: int, dv: int, chunk: int) -> str:
    """The scan to run for these head and chunk sizes: the resolved `choices`' scan, except that where
    the Triton kernel cannot take the sizes (on GPU) the fallback of "auto" runs ("associative") and an
    explicit "pallas" is a one-line error."""
    scan = choices.gdn_chunk_scan
    if scan != "pallas" or choices.platform != "gpu" or kernel_fits(dk, dv, chunk, choices.gdn_kernel_blocks):
        return scan
    if choices.gdn_chunk_scan_fallback is not None:
        return choices.gdn_chunk_scan_fallback
    raise ValueError(f"GDN chunk scan 'pallas' needs key/value head dims and chunk size that are powers of two "
                     f">= 16 on GPU, got Dk={dk}, Dv={dv}, chunk {chunk}; choose gdn_chunk_scan='associative'")


# Up to this many chunks the sequential scan is written out: no while loop, and a backward of
# straight-line code instead of a reversed scan over stacked residuals. Its compile time grows with the
# chunks, hence the cap (docs/lab_log.md has both); longer sequences run the `lax.scan`.
UNROLL_CHUNKS = 16


def _written_out_chunk_states(u: jax.Array, w: jax.Array, q: jax.Array, k: jax.Array, intra: jax.Array,
                              decay: jax.Array, state: jax.Array, prec: GdnPrecision
                              ) -> tuple[jax.Array, jax.Array]:
    """`sequential_chunk_states` as a Python loop over the n chunks (shapes as there). The state update
    is one matmul, S' = [k; d I]^T [v; S]: as `d S + k^T v` it would be an elementwise chain from chunk
    to chunk, which XLA fuses into one expression per chunk that recomputes every earlier state
    (quadratic in n)."""
    n, dk = u.shape[1], w.shape[-1]

    def per_chunk(x: jax.Array) -> list[jax.Array]:  # split, not indexed: its transpose is one concatenate
        return [part[:, 0] for part in jax.lax.split(x, [1] * n, axis=1)]

    eye = jnp.eye(dk, dtype=w.dtype)
    s, outs = state, []
    for u_c, w_c, q_c, k_c, intra_c, dec_c in zip(*(per_chunk(x) for x in (u, w, q, k, intra, decay))):
        v_new = u_c - gdn_einsum("bhlk,bhkv->bhlv", w_c, s, prec)
        outs.append(gdn_einsum("bhlk,bhkv->bhlv", q_c, s, prec) + gdn_einsum("bhij,bhjv->bhiv", intra_c, v_new, prec))
        if bf16_operands(prec):  # the state itself stays float32, outside the bf16 operands
            s = dec_c[..., None, None] * s + gdn_einsum("bhlk,bhlv->bhkv", k_c, v_new, prec)
            continue
        k_aug = jnp.concatenate([k_c, dec_c[..., None, None] * eye], axis=-2)  # [B, H, L + Dk, Dk]
        s = gdn_einsum("bhlk,bhlv->bhkv", k_aug, jnp.concatenate([v_new, s], axis=-2), prec)
    return jnp.stack(outs, axis=1), s


def sequential_chunk_states(u: jax.Array, w: jax.Array, q: jax.Array, k: jax.Array, intra: jax.Array,
                            decay: jax.Array, state: jax.Array, prec: GdnPrecision
                            ) -> tuple[jax.Array, jax.Array]:
    """u [B, n, H, L, Dv], w/q/k [B, n, H, L, Dk], intra [B, n, H, L, L], decay [B, n, H],
    state [B, H, Dk, Dv] -> (out [B, n, H, L, Dv], final state [B, H, Dk, Dv])."""
    if u.shape[1] <= UNROLL_CHUNKS:
        return _written_out_chunk_states(u, w, q, k, intra, decay, state, prec)

    def step(s, xs):  # s [B, H, Dk, Dv]
        u_c, w_c, q_c, k_c, intra_c, dec_c = xs
        v_new = u_c - gdn_einsum("bhlk,bhkv->bhlv", w_c, s, prec)
        o = gdn_einsum("bhlk,bhkv->bhlv", q_c, s, prec) + gdn_einsum("bhij,bhjv->bhiv", intra_c, v_new, prec)
        return s * dec_c[..., None, None] + gdn_einsum("bhlk,bhlv->bhkv", k_c, v_new, prec), o

    chunk_major = (jnp.moveaxis(x, 1, 0) for x in (u, w, q, k, intra, decay))  # lax.scan walks axis 0
    state, out = jax.lax.scan(step, state, tuple(chunk_major))
    return jnp.moveaxis(out, 0, 1), state


def _entering_states(u: jax.Array, w: jax.Array, k: jax.Array, decay: jax.Array, state: jax.Array,
                     prec: GdnPrecision) -> jax.Array:
    """The state entering each chunk and the final one: [B, n + 1, H, Dk, Dv] (shapes as above)."""
    dk = w.shape[-1]
    a = decay[..., None, None] * jnp.eye(dk, dtype=w.dtype) - gdn_einsum("bnhlk,bnhlj->bnhkj", k, w, prec)  # A_c
    b = gdn_einsum("bnhlk,bnhlv->bnhkv", k, u, prec)  # b_c [B, n, H, Dk, Dv]

    def compose(first: tuple[jax.Array, jax.Array], then: tuple[jax.Array, jax.Array]
                ) -> tuple[jax.Array, jax.Array]:  # the map `first` followed by `then`
        (a1, b1), (a2, b2) = first, then
        return gdn_einsum("...ij,...jk->...ik", a2, a1, prec), gdn_einsum("...ij,...jv->...iv", a2, b1, prec) + b2

    through_a, through_b = jax.lax.associative_scan(compose, (a, b), axis=1)  # chunks 0..c composed
    after = gdn_einsum("bnhkj,bhjv->bnhkv", through_a, state, prec) + through_b  # state after chunk c
    return jnp.concatenate([state[:, None], after], axis=1)


def _outputs(u: jax.Array, w: jax.Array, q: jax.Array, intra: jax.Array, states: jax.Array,
             prec: GdnPrecision) -> tuple[jax.Array, jax.Array]:
    """Every chunk's output at once from the states entering it, states [B, n + 1, H, Dk, Dv] (the
    last one final) -> (out [B, n, H, L, Dv], final state)."""
    entering = states[:, :-1]  # [B, n, H, Dk, Dv]
    v_new = u - gdn_einsum("bnhlk,bnhkv->bnhlv", w, entering, prec)
    out = gdn_einsum("bnhlk,bnhkv->bnhlv", q, entering, prec) + gdn_einsum("bnhij,bnhjv->bnhiv", intra, v_new, prec)
    return out, states[:, -1]


def associative_chunk_states(u: jax.Array, w: jax.Array, q: jax.Array, k: jax.Array, intra: jax.Array,
                             decay: jax.Array, state: jax.Array, prec: GdnPrecision
                             ) -> tuple[jax.Array, jax.Array]:
    """As `sequential_chunk_states`, with every chunk's entering state from one associative scan."""
    states = jax.checkpoint(_entering_states, static_argnums=(5,))(u, w, k, decay, state, prec)
    return _outputs(u, w, q, intra, checkpoint_name(states, CHUNK_STATES_NAME), prec)


def scan_forward(u: jax.Array, w: jax.Array, q: jax.Array, k: jax.Array, intra: jax.Array, decay: jax.Array,
                 state: jax.Array, prec: GdnPrecision, interpret: bool, out_dtype: jnp.dtype = jnp.float32,
                 token_major: bool = False, blocks: Blocks = DEFAULT_GDN_KERNEL_BLOCKS
                 ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The Pallas scan's forward kernels (no VJP; shapes as `sequential_chunk_states`) -> out (in
    `out_dtype`, [B, n L, H, Dv] with `token_major`), the states [B, n + 1, H, Dk, Dv] (float32;
    bfloat16 under bf16 precision) named CHUNK_STATES_NAME, and the final state in float32. A remat
    policy that saves the name keeps the recurrence kernel out of the recomputed forward (a name on a
    custom_vjp's output alone does not reach its residuals). w, q, k and intra may be bfloat16 under
    bf16 precision. `blocks`: the state kernel's (state columns, warps), the kernel choices' `gdn_kernel_blocks`."""
    states, final = entering_states(u, w, k, decay, state, prec, interpret, blocks)
    states = checkpoint_name(states, CHUNK_STATES_NAME)
    return chunk_outputs(u, w, q, intra, states, prec, interpret, out_dtype, token_major, blocks), states, final


def scan_backward(u: jax.Array, w: jax.Array, q: jax.Array, k: jax.Array, intra: jax.Array, decay: jax.Array,
                  states: jax.Array, d_out: jax.Array, d_final: jax.Array, prec: GdnPrecision, interpret: bool,
                  token_major: bool = False, blocks: Blocks = DEFAULT_GDN_KERNEL_BLOCKS
                  ) -> tuple[jax.Array, ...]:  # du, dw, dq, dk, dintra, d_decay, d_state
    """The Pallas scan's backward kernels (float32 gradients) from `scan_forward`'s inputs and states and
    the cotangents of out (in its layout) and of the final state."""
    du, dw, dq, dintra, d_states = chunk_outputs_backward(u, w, q, intra, states, d_out, d_final, prec, interpret,
                                                          token_major, blocks)
    # u and w feed both kernels: the chunk-gradient kernel adds the output kernel's share in registers
    du, dw, dk, d_decay, d_state = entering_states_backward(u, w, k, decay, states, d_states, prec, interpret,
                                                            blocks, du_add=du, dw_add=dw)
    return du, dw, dq, dk, dintra, d_decay, d_state


@functools.partial(jax.custom_vjp, nondiff_argnums=(7, 8, 9))
def _pallas_scan(u, w, q, k, intra, decay, state, prec, interpret, blocks):
    out, _, final = scan_forward(u, w, q, k, intra, decay, state, prec, interpret, blocks=blocks)
    return out, final


def _pallas_scan_fwd(u, w, q, k, intra, decay, state, prec, interpret, blocks):
    out, states, final = scan_forward(u, w, q, k, intra, decay, state, prec, interpret, blocks=blocks)
    return (out, final), (u, w, q, k, intra, decay, states)


def _pallas_scan_bwd(prec, interpret, blocks, res, cotangents):
    return scan_backward(*res, *cotangents, prec, interpret, blocks=blocks)


_pallas_scan.defvjp(_pallas_scan_fwd, _pallas_scan_bwd)


def pallas_chunk_states(u: jax.Array, w: jax.Array, q: jax.Array, k: jax.Array, intra: jax.Array,
                        decay: jax.Array, state: jax.Array, prec: GdnPrecision, *,
                        choices: KernelChoices | None = None, interpret: bool | None = None
                        ) -> tuple[jax.Array, jax.Array]:
    """As `sequential_chunk_states`, with every chunk's entering state from the Pallas recurrence kernel
    and the outputs from them by the Pallas output kernel, under one VJP; the state kernel's blocks are
    the `choices`' (None: the defaults for jax's backend). `interpret`: None runs the Triton kernels on
    the choices' GPU and interprets them elsewhere; False builds them for Triton anywhere."""
    choices = resolved(choices)
    if interpret is None:
        interpret = choices.interpret
    return _pallas_scan(u, w, q, k, intra, decay, state, prec, bool(interpret), choices.gdn_kernel_blocks)


CHUNK_STATES = {"sequential": sequential_chunk_states, "associative": associative_chunk_states,
                "pallas": pallas_chunk_states}
