"""The gated delta rule's chunked UT/WY form (the per-token recurrence it equals: `reference.py`).

Intra-chunk work as batched matmuls, the state carried over chunks by a scan (`chunk_states.py`),
or, with the "pallas" scan, all of it Pallas kernels under one VJP (`pallas_rule.py`). Semantics,
documents and padding as in `reference.py`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from qwen35_kernels.choices import KernelChoices, overridden
from qwen35_kernels.gated_delta_rule.chunk_states import CHUNK_STATES, chunk_scan_for
from qwen35_kernels.gated_delta_rule.matmul import gdn_einsum, operand_dtype, resolve_gdn_precision
from qwen35_kernels.gated_delta_rule.pallas_chunk_local import local_kernel_fits
from qwen35_kernels.gated_delta_rule.pallas_rule import pallas_chunked_rule
from qwen35_kernels.gated_delta_rule.reference import check_and_prepare
from qwen35_kernels.gated_delta_rule.tiles import delta_rule_tile, tiled_delta_rule
from qwen35_kernels.gated_delta_rule.triangular import unit_lower_inverse


def chunked_gated_delta_rule(
    q: jax.Array,  # [B, S, Hk, Dk]
    k: jax.Array,  # [B, S, Hk, Dk]
    v: jax.Array,  # [B, S, Hv, Dv]
    g: jax.Array,  # [B, S, Hv] log-decay, <= 0
    beta: jax.Array,  # [B, S, Hv]
    *,
    segment_ids: jax.Array | None = None,  # [B, S]
    initial_state: jax.Array | None = None,  # [B, Hv, Dk, Dv]
    chunk_size: int = 64,
    precision: str | None = None,
    chunk_scan: str | None = None,
    out_dtype: jnp.dtype = jnp.float32,
    choices: KernelChoices | None = None,
) -> tuple[jax.Array, jax.Array]:  # [B, S, Hv, Dv] out_dtype, [B, Hv, Dk, Dv] float32
    """Chunked UT/WY form: intra-chunk work as batched matmuls, then the state carried over chunks by
    `chunk_scan` (see `chunk_states.py`; None: the `choices`' `gdn_chunk_scan`, "auto" by default);
    with the "pallas" scan all of it Pallas kernels under one VJP (`pallas_rule.py`). `choices` (None:
    the defaults for jax's backend) also give the platform, the sequence tile and the state kernel's
    blocks; `chunk_scan` and `precision` override theirs for this call.

    Document boundaries are masks on the intra-chunk decay matrix, on which tokens read the carried
    state, and on which tokens (and whether the old state) enter the state carried out of a chunk.
    Key heads are not repeated: the two Gram matrices (q k^T, k k^T) are formed once per key head and
    broadcast over its G = Hv / Hk value heads. `precision` (`choices.GDN_PRECISIONS`; None:
    the `choices`') is that of the matmuls with a head-dim contraction; the triangular
    inverse is always float32 at HIGHEST. The output is computed in float32 and returned as `out_dtype`.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    choices = overridden(choices, gdn_chunk_scan=chunk_scan, gdn_precision=precision)
    tile = delta_rule_tile(chunk_size, choices)  # long sequences: tile by tile, one tile's chunks in memory at a time
    if tile is not None and q.ndim == 4 and q.shape[1] > tile:
        rule = functools.partial(chunked_gated_delta_rule, out_dtype=out_dtype, choices=choices)
        return tiled_delta_rule(rule, q, k, v, g, beta,
                                segment_ids=segment_ids, initial_state=initial_state, chunk_size=chunk_size,
                                tile=tile)
    prec = resolve_gdn_precision(choices)
    q, k, v, g, beta, valid, doc, state = check_and_prepare(q, k, v, g, beta, segment_ids, initial_state,
                                                             repeat_keys=False, cast_qkv=False)
    B, S, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    G = Hv // Hk
    L = chunk_size
    scan = chunk_scan_for(choices, Dk, Dv, L)
    pallas_rule = scan == "pallas" and (choices.platform != "gpu" or local_kernel_fits(Dk, Dv, L))
    # The end-to-end Pallas rule reads v in its own dtype (the compute dtype's bytes, the same float32
    # values in registers) and returns its gradient in it, where a float32 cast would be two more passes;
    # q and k it takes in the dtype it stores them (below).
    if not pallas_rule:
        q, k, v = (x.astype(jnp.float32) for x in (q, k, v))
    pad = (-S) % L
    n = (S + pad) // L

    def padded(x, fill=0):  # [B, S, ...] -> [B, n L, ...], padded with no-op tokens
        return jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2), constant_values=fill)

    def chunks(x, fill=0):  # [B, S, ...] -> [B, n, L, ...]
        x = padded(x, fill)
        return x.reshape(B, n, L, *x.shape[2:])

    g, beta = (jnp.moveaxis(chunks(x).reshape(B, n, L, Hk, G), 2, 4) for x in (g, beta))  # [B, n, Hk, G, L]
    valid = chunks(valid, False)  # [B, n, L]
    # The no-op tail tokens take the doc index of the token before them (doc indices never decrease).
    doc = jax.lax.cummax(chunks(doc, -1).reshape(B, n * L), axis=1).reshape(B, n, L)
    # Doc index of the token just before each chunk (0 for the first: the initial state's document).
    doc_before = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), doc[:, :-1, -1]], axis=1)  # [B, n]

    heads = (slice(None), slice(None), None, None)  # [B, n, ...] -> [B, n, 1, 1, ...]
    reads_state = (valid & (doc == doc_before[..., None]))[heads]  # [B, n, 1, 1, L]
    writes_state = (valid & (doc == doc[..., -1:]))[heads]  # [B, n, 1, 1, L]
    keeps_state = (doc[..., -1] == doc_before)[heads]  # [B, n, 1, 1]

    cum = jnp.cumsum(g, axis=-1)  # [B, n, Hk, G, L]
    read = jnp.exp(cum) * reads_state  # [B, n, Hk, G, L]: how each token reads the entering state
    write = jnp.exp(cum[..., -1:] - cum) * writes_state  # how each token's key enters the next one

    def value_heads(x):  # [B, n, Hk, G, ...] -> [B, n, Hv, ...]
        return x.reshape(B, n, Hv, *x.shape[4:])

    key = jnp.where(valid, doc, -1)  # [B, n, L]: two tokens interact iff their keys are equal and >= 0
    chunk_decay = jnp.exp(cum[..., -1]) * keeps_state  # [B, n, Hk, G]
    if pallas_rule:  # q, k, v stay token-major: the kernels read their chunks in place
        # Under bf16 operands every product rounds q and k to bfloat16: stored so, half their bytes (the
        # cast fuses into the L2 norm that makes them); their gradients come back in bfloat16 too.
        qk = operand_dtype(prec)
        out, state = pallas_chunked_rule(padded(q.astype(qk)), padded(k.astype(qk)), padded(v),
                                         *(value_heads(x) for x in (cum, beta, read, write)), key,
                                         value_heads(chunk_decay), state, prec, out_dtype=out_dtype,
                                         choices=choices)
        return out[:, :S], state  # [B, S, Hv, Dv]
    # Heads first, value heads grouped under their key head: [B, n, Hk, G, L, ...] (G = 1 for q, k).
    q, k = (jnp.moveaxis(chunks(x), 2, 3)[:, :, :, None] for x in (q, k))  # [B, n, Hk, 1, L, Dk]
    v = jnp.moveaxis(chunks(v).reshape(B, n, L, Hk, G, Dv), 2, 4)  # [B, n, Hk, G, L, Dv]
    u, w, intra = xla_chunk_local(q, k, v, cum, beta, read, key, prec)
    q_read = q * read[..., None]  # [B, n, Hk, G, L, Dk]
    k_write = k * write[..., None]
    chunk_states = CHUNK_STATES[scan]
    if scan == "pallas":  # the state kernel's blocks and interpretation are the choices'
        chunk_states = functools.partial(chunk_states, choices=choices)
    out, state = chunk_states(*(value_heads(x) for x in (u, w, q_read, k_write, intra, chunk_decay)),
                              state, prec)  # out [B, n, Hv, L, Dv]
    out = jnp.transpose(out, (0, 1, 3, 2, 4)).reshape(B, n * L, Hv, Dv)[:, :S]
    return out.astype(out_dtype), state


def xla_chunk_local(
    q: jax.Array,  # [B, n, Hk, 1, L, Dk]
    k: jax.Array,  # [B, n, Hk, 1, L, Dk]
    v: jax.Array,  # [B, n, Hk, G, L, Dv]
    cum: jax.Array,  # [B, n, Hk, G, L]
    beta: jax.Array,  # [B, n, Hk, G, L]
    read: jax.Array,  # [B, n, Hk, G, L]
    key: jax.Array,  # [B, n, L] int32: document index, -1 on padding
    prec,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # u [.., L, Dv], w [.., L, Dk], intra [.., L, L]
    """The chunk-local part as batched XLA ops (`pallas_chunk_local.py` says the same as one kernel)."""
    Dv, L = v.shape[-1], key.shape[-1]
    causal = jnp.tril(jnp.ones((L, L), bool))
    pair_mask = ((key[..., :, None] == key[..., None, :]) & (key[..., :, None] >= 0) & causal)[:, :, None, None]
    diff = cum[..., :, None] - cum[..., None, :]  # [B, n, Hk, G, L, L]
    decay = jnp.where(pair_mask, jnp.exp(jnp.where(pair_mask, diff, 0.0)), 0.0)
    kk = gdn_einsum("...id,...jd->...ij", k, k, prec)  # [B, n, Hk, 1, L, L]
    qk = gdn_einsum("...id,...jd->...ij", q, k, prec)

    # Unit lower-triangular system (I + A) with A = strict_tril(k_beta k^T * decay), k_beta = beta * k.
    inverse = unit_lower_inverse(beta[..., None] * kk * decay)  # [B, n, Hk, G, L, L]
    rhs = jnp.concatenate([v * beta[..., None], jnp.broadcast_to(k, (*v.shape[:-1], k.shape[-1])) *
                           (beta * read)[..., None]], axis=-1)
    sol = gdn_einsum("...ij,...jd->...id", inverse, rhs, prec)
    # u: new values; w: decayed keys reading the entering state; intra: in-chunk attention
    return sol[..., :Dv], sol[..., Dv:], qk * decay
