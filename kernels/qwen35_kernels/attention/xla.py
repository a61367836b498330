"""The XLA attention core (CPU, and the reference for the flash kernels): query blocks, each a
flash-style custom VJP.

Forward of one block: scores against the keys from the block's first visible key up to its last
query, masked, softmax in float32; it saves only its inputs, the output and the per-row
log-sum-exp. Backward: recompute the probabilities from the log-sum-exp, then the usual products.

Key skipping: a query sees no key before the first occurrence of its own segment id (that
occurrence is never after the query), so no query of a block sees a key before the smallest first
occurrence over the block. Keys before it are skipped in whole tiles of block_q: each block
compiles one variant per possible first tile (at most `MAX_KEY_STARTS`, evenly spaced) and
`lax.switch` runs the one the segment ids pick. Exact for any id layout: the skipped keys carry
probability exactly 0. A packed row whose later documents start past a tile boundary skips that
share of its score work (forward and backward); a row of one document runs the full-range variant.

Three choices make it fast on XLA:CPU:
  - dK and dV come out transposed, [Dh, T] = [Dh, Q] @ [Q, T]: the [Q, T] score gradient is then a
    row-major right operand. Written as [T, Q] @ [Q, Dh] (what autodiff emits), XLA:CPU copies every
    [Q, T] block into its transpose first.
  - The row max is a plain compare-and-select reduction (`select_row_max`, shared with the fused
    loss): `jnp.max` propagates NaN, which XLA:CPU does not vectorise. A NaN score still
    reaches the output through exp and the sum.
  - The softmax denominators come out of the p @ v matmul, as the product with a column of ones
    appended to v: XLA:CPU turns a row sum over more than 32 keys into a reduce-window tree that
    reads p once more from memory.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from qwen35_kernels.logprob_entropy.tiles import select_row_max

_MASKED = float(jnp.finfo(jnp.float32).min)


MAX_KEY_STARTS = 8  # compiled key-range variants per query block, forward and backward each


def _block_mask(q_idx: jax.Array, q_seg: jax.Array, kv_seg: jax.Array, k_start: int) -> jax.Array:
    """q_idx: [Q] absolute query positions, q_seg: [B, Q], kv_seg: [B, T] the segments of keys
    [k_start, k_start + T) -> [B, 1, 1, Q, T] bool."""
    causal = q_idx[:, None] >= k_start + jnp.arange(kv_seg.shape[1])[None, :]  # [Q, T]
    same_doc = q_seg[:, :, None] == kv_seg[:, None, :]  # [B, Q, T]
    return (causal[None] & same_doc)[:, None, None]


def _masked_scores(qg: jax.Array, k: jax.Array, mask: jax.Array) -> jax.Array:
    """qg: [B, K, G, Q, Dh], k: [B, K, T, Dh], mask: [B, 1, 1, Q, T] -> [B, K, G, Q, T] float32, scaled."""
    s = jnp.einsum("bkgqd,bktd->bkgqt", qg, k, preferred_element_type=jnp.float32) * (qg.shape[-1] ** -0.5)
    return jnp.where(mask, s, _MASKED)


def _block_forward(qg: jax.Array, k: jax.Array, v: jax.Array, q_idx: jax.Array, q_seg: jax.Array,
                   kv_seg: jax.Array, k_start: int) -> tuple[jax.Array, jax.Array]:
    """Queries against keys [k_start, k_start + T) (k/v: [B, K, T, Dh], kv_seg: [B, T]).

    -> out [B, K, G, Q, Dh] in v's dtype, lse [B, K, G, Q] float32 (log-sum-exp of each row's scores).
    """
    s = _masked_scores(qg, k, _block_mask(q_idx, q_seg, kv_seg, k_start))
    m = select_row_max(s)  # every row keeps its diagonal, so m is a real score
    p = jnp.exp(s - m)
    v_one = jnp.concatenate([v, jnp.ones((*v.shape[:-1], 1), v.dtype)], axis=-1)  # [B, K, T, Dh + 1]
    out_sum = jnp.einsum("bkgqt,bktd->bkgqd", p.astype(v.dtype), v_one, preferred_element_type=jnp.float32)
    denom = out_sum[..., -1:]  # [B, K, G, Q, 1]: the row sums of p, from the same matmul as p @ v
    out = out_sum[..., :-1] / denom
    return out.astype(v.dtype), (m + jnp.log(denom))[..., 0]


def _block_backward(qg: jax.Array, k: jax.Array, v: jax.Array, q_idx: jax.Array, q_seg: jax.Array,
                    kv_seg: jax.Array, k_start: int, out: jax.Array, lse: jax.Array, d_out: jax.Array
                    ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The gradients of `_block_forward` for d_out [B, K, G, Q, Dh]: dq [B, K, G, Q, Dh] and dk, dv
    [B, K, T, Dh] for its keys [k_start, k_start + T)."""
    b, kh, g, nq, dh = qg.shape
    t = k.shape[2]
    p = jnp.exp(_masked_scores(qg, k, _block_mask(q_idx, q_seg, kv_seg, k_start)) - lse[..., None])  # [B, K, G, Q, T]
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
    return dq.astype(qg.dtype), dk_t.swapaxes(-1, -2).astype(k.dtype), dv_t.swapaxes(-1, -2).astype(v.dtype)


_Residuals = tuple[jax.Array, ...]  # qg, k, v, q_idx, q_seg, kv_seg, branch, out [B, K, G, Q, Dh], lse [B, K, G, Q]


def _run_from_start(starts: tuple[int, ...], branch: jax.Array, from_start: Callable[[int], Callable[..., Any]],
                    *operands: jax.Array) -> Any:
    """from_start(starts[branch])(*operands): one compiled variant per start, picked by `lax.switch`."""
    if len(starts) == 1:
        return from_start(starts[0])(*operands)
    return jax.lax.switch(branch, [from_start(k0) for k0 in starts], *operands)


def _forward_variants(starts: tuple[int, ...], qg: jax.Array, k: jax.Array, v: jax.Array, q_idx: jax.Array,
                      q_seg: jax.Array, kv_seg: jax.Array, branch: jax.Array) -> tuple[jax.Array, jax.Array]:
    """`_block_forward` on keys [starts[branch], T)."""
    def from_start(k_start: int) -> Callable[..., tuple[jax.Array, jax.Array]]:
        return lambda qg, k, v, q_idx, q_seg, kv_seg: _block_forward(
            qg, k[:, :, k_start:], v[:, :, k_start:], q_idx, q_seg, kv_seg[:, k_start:], k_start)

    return _run_from_start(starts, branch, from_start, qg, k, v, q_idx, q_seg, kv_seg)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def attend_block(starts: tuple[int, ...], qg: jax.Array, k: jax.Array, v: jax.Array, q_idx: jax.Array,
                 q_seg: jax.Array, kv_seg: jax.Array, branch: jax.Array) -> jax.Array:
    """One block of queries against keys [0, T), head-major, computed on keys [starts[branch], T).

    qg: [B, K, G, Q, Dh], k/v: [B, K, T, Dh], q_idx: [Q] absolute query positions, q_seg: [B, Q],
    kv_seg: [B, T], branch: int32 scalar -> [B, K, G, Q, Dh]. Query i sees key j iff j <= q_idx[i]
    and the segments match; the caller guarantees that no query sees a key before starts[branch].
    """
    return _forward_variants(starts, qg, k, v, q_idx, q_seg, kv_seg, branch)[0]


def _attend_block_fwd(starts: tuple[int, ...], qg: jax.Array, k: jax.Array, v: jax.Array, q_idx: jax.Array,
                      q_seg: jax.Array, kv_seg: jax.Array, branch: jax.Array) -> tuple[jax.Array, _Residuals]:
    out, lse = _forward_variants(starts, qg, k, v, q_idx, q_seg, kv_seg, branch)
    return out, (qg, k, v, q_idx, q_seg, kv_seg, branch, out, lse)


def _attend_block_bwd(starts: tuple[int, ...], residuals: _Residuals, d_out: jax.Array  # [B, K, G, Q, Dh]
                      ) -> tuple[jax.Array, jax.Array, jax.Array, None, None, None, None]:  # dq, dk, dv
    qg, k, v, q_idx, q_seg, kv_seg, branch, out, lse = residuals

    def from_start(k_start: int) -> Callable[..., tuple[jax.Array, jax.Array, jax.Array]]:
        def grads(qg, k, v, q_idx, q_seg, kv_seg, out, lse, d_out):
            dq, dk, dv = _block_backward(qg, k[:, :, k_start:], v[:, :, k_start:], q_idx, q_seg,
                                         kv_seg[:, k_start:], k_start, out, lse, d_out)
            front = ((0, 0), (0, 0), (k_start, 0), (0, 0))  # the skipped keys get exact zeros
            return dq, jnp.pad(dk, front), jnp.pad(dv, front)
        return grads

    dq, dk, dv = _run_from_start(starts, branch, from_start, qg, k, v, q_idx, q_seg, kv_seg, out, lse, d_out)
    return dq, dk, dv, None, None, None, None


attend_block.defvjp(_attend_block_fwd, _attend_block_bwd)


def first_visible_key(segment_ids: jax.Array) -> jax.Array:  # [B, S] -> [B, S] int32
    """For each query, the first key it may attend to: the first occurrence of its segment id in
    the row (never after the query itself). A stable sort groups equal ids in position order."""
    b, s = segment_ids.shape
    order = jnp.argsort(segment_ids, axis=-1, stable=True)  # [B, S] positions, grouped by id
    ids = jnp.take_along_axis(segment_ids, order, axis=-1)
    new_id = jnp.concatenate([jnp.ones((b, 1), bool), ids[:, 1:] != ids[:, :-1]], axis=-1)
    group_start = jax.lax.cummax(jnp.where(new_id, jnp.arange(s), 0), axis=1)  # sorted index of the id's first
    first_sorted = jnp.take_along_axis(order, group_start, axis=-1)  # position of that first occurrence
    return jnp.take_along_axis(first_sorted, jnp.argsort(order, axis=-1), axis=-1).astype(jnp.int32)


def default_block_q(seq_len: int) -> int:
    """Queries per block for rows of `seq_len`: about a sixteenth of the row, a power of two in [128, 512].
    Fewer, longer blocks compute more of the masked upper triangle (one block of 512 at S = 512 does
    twice the needed work); shorter ones run more, smaller matmuls; a sixteenth balanced the two
    best on CPU (docs/lab_log.md)."""
    return min(512, max(128, 1 << max(seq_len // 16 - 1, 0).bit_length()))


def key_starts(q_start: int, block_q: int) -> tuple[int, ...]:
    """The key-range starts compiled for the query block at q_start: whole tiles of block_q up to
    the block itself, at most MAX_KEY_STARTS of them, evenly spaced from 0."""
    tiles = q_start // block_q + 1
    stride = -(-tiles // MAX_KEY_STARTS) * block_q
    return tuple(range(0, q_start + 1, stride))


def xla_attention_core(q: jax.Array, k: jax.Array, v: jax.Array, segment_ids: jax.Array,
                       block_q: int | None = None) -> jax.Array:
    """q: [B, S, H, Dh], k/v: [B, S, K, Dh], segment_ids: [B, S] -> [B, S, H, Dh] (see `attention_core`);
    block_q None: `default_block_q(S)`."""
    b, s, h, dh = q.shape
    block_q = block_q or default_block_q(s)
    kh = k.shape[2]
    qg = q.reshape(b, s, kh, h // kh, dh).transpose(0, 2, 3, 1, 4)  # [B, K, G, S, Dh]
    kt, vt = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, K, S, Dh]
    first = first_visible_key(segment_ids) if s > block_q else None  # [B, S]
    outs = []
    for start in range(0, s, block_q):  # static shapes: block i sees keys [0, end_i)
        end = min(start + block_q, s)
        starts = key_starts(start, block_q)
        branch = jnp.zeros((), jnp.int32)
        if len(starts) > 1:  # the last start at or before every query's first visible key, over the batch
            branch = jnp.min(first[:, start:end]) // (starts[1] - starts[0])
        outs.append(attend_block(starts, qg[:, :, :, start:end], kt[:, :, :end], vt[:, :, :end],
                                 jnp.arange(start, end), segment_ids[:, start:end], segment_ids[:, :end],
                                 branch))  # [B, K, G, Q_i, Dh]
    out = jnp.concatenate(outs, axis=3) if len(outs) > 1 else outs[0]  # [B, K, G, S, Dh]
    return out.transpose(0, 3, 1, 2, 4).reshape(b, s, h, dh)
