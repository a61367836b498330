"""The XLA attention core (CPU, and the reference for the flash kernels): query blocks, each a
flash-style custom VJP.

Forward of one block: scores against every key up to the block's last query, masked, softmax in
float32; it saves only its inputs, the output and the per-row log-sum-exp. Backward: recompute the
probabilities from the log-sum-exp, then the usual products. Three choices make it fast on XLA:CPU:
  - dK and dV come out transposed, [Dh, T] = [Dh, Q] @ [Q, T]: the [Q, T] score gradient is then a
    row-major right operand. Written as [T, Q] @ [Q, Dh] (what autodiff emits), XLA:CPU copies every
    [Q, T] block into its transpose first; those copies were half the time of the whole core.
  - The row max is a plain compare-and-select reduction (`select_row_max`, shared with the fused
    loss): `jnp.max` propagates NaN, which XLA:CPU does not vectorise (7x slower). A NaN score still
    reaches the output through exp and the sum.
  - The softmax denominators come out of the p @ v matmul, as the product with a column of ones
    appended to v: XLA:CPU turns a row sum over more than 32 keys into a reduce-window tree that
    reads p once more from memory (the attention core is 7% faster without it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from qwen35_kernels.logprob_entropy.tiles import select_row_max

_MASKED = float(jnp.finfo(jnp.float32).min)


def _block_mask(q_idx: jax.Array, q_seg: jax.Array, kv_seg: jax.Array, t: int) -> jax.Array:
    """q_idx: [Q] absolute query positions, q_seg: [B, Q], kv_seg: [B, T] -> [B, 1, 1, Q, T] bool."""
    causal = q_idx[:, None] >= jnp.arange(t)[None, :]  # [Q, T]
    same_doc = q_seg[:, :, None] == kv_seg[:, None, :]  # [B, Q, T]
    return (causal[None] & same_doc)[:, None, None]


def _masked_scores(qg: jax.Array, k: jax.Array, mask: jax.Array) -> jax.Array:
    """qg: [B, K, G, Q, Dh], k: [B, K, T, Dh], mask: [B, 1, 1, Q, T] -> [B, K, G, Q, T] float32, scaled."""
    s = jnp.einsum("bkgqd,bktd->bkgqt", qg, k, preferred_element_type=jnp.float32) * (qg.shape[-1] ** -0.5)
    return jnp.where(mask, s, _MASKED)


def _block_forward(qg: jax.Array, k: jax.Array, v: jax.Array, q_idx: jax.Array, q_seg: jax.Array,
                   kv_seg: jax.Array) -> tuple[jax.Array, jax.Array]:
    """-> out [B, K, G, Q, Dh] in v's dtype, lse [B, K, G, Q] float32 (log-sum-exp of each row's scores)."""
    s = _masked_scores(qg, k, _block_mask(q_idx, q_seg, kv_seg, k.shape[2]))
    m = select_row_max(s)  # every row keeps its diagonal, so m is a real score
    p = jnp.exp(s - m)
    v_one = jnp.concatenate([v, jnp.ones((*v.shape[:-1], 1), v.dtype)], axis=-1)  # [B, K, T, Dh + 1]
    out_sum = jnp.einsum("bkgqt,bktd->bkgqd", p.astype(v.dtype), v_one, preferred_element_type=jnp.float32)
    denom = out_sum[..., -1:]  # [B, K, G, Q, 1]: the row sums of p, from the same matmul as p @ v
    out = out_sum[..., :-1] / denom
    return out.astype(v.dtype), (m + jnp.log(denom))[..., 0]


@jax.custom_vjp
def attend_block(qg: jax.Array, k: jax.Array, v: jax.Array, q_idx: jax.Array, q_seg: jax.Array,
                 kv_seg: jax.Array) -> jax.Array:
    """One block of queries against keys [0, T), head-major.

    qg: [B, K, G, Q, Dh], k/v: [B, K, T, Dh], q_idx: [Q] absolute query positions, q_seg: [B, Q],
    kv_seg: [B, T] -> [B, K, G, Q, Dh]. Query i sees key j iff j <= q_idx[i] and the segments match.
    """
    return _block_forward(qg, k, v, q_idx, q_seg, kv_seg)[0]


_Residuals = tuple[jax.Array, ...]  # qg, k, v, q_idx, q_seg, kv_seg, out [B, K, G, Q, Dh], lse [B, K, G, Q]


def _attend_block_fwd(qg: jax.Array, k: jax.Array, v: jax.Array, q_idx: jax.Array, q_seg: jax.Array,
                      kv_seg: jax.Array) -> tuple[jax.Array, _Residuals]:
    out, lse = _block_forward(qg, k, v, q_idx, q_seg, kv_seg)
    return out, (qg, k, v, q_idx, q_seg, kv_seg, out, lse)


def _attend_block_bwd(residuals: _Residuals, d_out: jax.Array  # d_out [B, K, G, Q, Dh]
                      ) -> tuple[jax.Array, jax.Array, jax.Array, None, None, None]:  # dq, dk, dv
    qg, k, v, q_idx, q_seg, kv_seg, out, lse = residuals
    b, kh, g, nq, dh = qg.shape
    t = k.shape[2]
    p = jnp.exp(_masked_scores(qg, k, _block_mask(q_idx, q_seg, kv_seg, t)) - lse[..., None])  # [B, K, G, Q, T]
    dp = jnp.einsum("bkgqd,bktd->bkgqt", d_out, v, preferred_element_type=jnp.float32)
    row = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1, keepdims=True)  # [B, K, G, Q, 1]
    ds = (p * (dp - row) * (dh ** -0.5)).astype(qg.dtype)  # gradient of the scaled scores
    dq = jnp.einsum("bkgqt,bktd->bkgqd", ds, k, preferred_element_type=jnp.float32)
    # [B, K, Dh, G*Q] @ [B, K, G*Q, T] -> [B, K, Dh, T]: see the module docstring
    q_t = qg.reshape(b, kh, g * nq, dh).swapaxes(-1, -2)
    d_out_t = d_out.reshape(b, kh, g * nq, dh).swapaxes(-1, -2)
    dk_t = jnp.einsum("bkdq,bkqt->bkdt", q_t, ds.reshape(b, kh, g * nq, t), preferred_element_type=jnp.float32)
    dv_t = jnp.einsum("bkdq,bkqt->bkdt", d_out_t, p.astype(v.dtype).reshape(b, kh, g * nq, t),
                      preferred_element_type=jnp.float32)
    return (dq.astype(qg.dtype), dk_t.swapaxes(-1, -2).astype(k.dtype), dv_t.swapaxes(-1, -2).astype(v.dtype),
            None, None, None)


attend_block.defvjp(_attend_block_fwd, _attend_block_bwd)


def xla_attention_core(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array, block_q: int
                       ) -> jax.Array:
    """q: [B, S, H, Dh], k/v: [B, S, K, Dh], segment_ids: [B, S] -> [B, S, H, Dh] (see `attention_core`)."""
    b, s, h, dh = q.shape
    kh = k.shape[2]
    qg = q.reshape(b, s, kh, h // kh, dh).transpose(0, 2, 3, 1, 4)  # [B, K, G, S, Dh]
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, Dh]
    outs = []
    for start in range(0, s, block_q):  # static shapes: block i sees keys [0, end_i)
        end = min(start + block_q, s)
        outs.append(attend_block(qg[:, :, :, start:end], kt[:, :, :end], vt[:, :, :end], jnp.arange(start, end),
                                 segment_ids[:, start:end], segment_ids[:, :end]))  # [B, K, G, Q_i, Dh]
    out = jnp.concatenate(outs, axis=3) if len(outs) > 1 else outs[0]  # [B, K, G, S, Dh]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, s, h, dh)
