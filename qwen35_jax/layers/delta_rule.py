"""Gated delta rule: the per-token recurrence (test oracle) and the chunked UT/WY form.

State S [Dk, Dv] per head. For each token t of a document:

    S <- exp(g_t) * S
    S <- S + k_t (beta_t * (v_t - S^T k_t))^T
    o_t = S^T q_t

q and k arrive L2-normalised, q already scaled by Dk**-0.5. Key heads may be fewer than value heads
(Hv % Hk == 0); value head h reads key head h // (Hv // Hk).

Documents (`segment_ids` [B, S], ids >= 1, 0 = padding): the state restarts from zero at every
document start (a non-zero id that differs from the previous token's id). Padding tokens are
transparent no-ops: they leave the state untouched and output zeros. `initial_state` belongs to the
document of the first token. The final state is the state after the last token, i.e. that of the last
document (trailing padding does not change it). All arithmetic is float32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from qwen35_jax.layers.chunk_local_pallas import local_kernel_fits
from qwen35_jax.layers.chunk_states import CHUNK_STATES, chunk_scan_for
from qwen35_jax.layers.chunked_rule_pallas import pallas_chunked_rule
from qwen35_jax.layers.gdn_matmul import gdn_einsum, operand_dtype, resolve_gdn_precision
from qwen35_jax.layers.tiling import delta_rule_tile, tiled_delta_rule
from qwen35_jax.layers.triangular import unit_lower_inverse

_HI = jax.lax.Precision.HIGHEST


def _check_and_prepare(q, k, v, g, beta, segment_ids, initial_state, *, repeat_keys=True, cast_qkv=True):
    """Validate shapes, cast to float32 (q, k, v only if `cast_qkv`), repeat key heads onto value heads
    (if asked); make doc index/valid."""
    if q.ndim != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, S, Hk, Dk], got q {q.shape} and k {k.shape}")
    B, S, Hk, Dk = q.shape
    if v.ndim != 4 or v.shape[:2] != (B, S):
        raise ValueError(f"v must be [B, S, Hv, Dv] with B, S = {(B, S)}, got {v.shape}")
    Hv, Dv = v.shape[2:]
    if Hv % Hk:
        raise ValueError(f"value heads ({Hv}) must be a multiple of key heads ({Hk})")
    for name, x in (("g", g), ("beta", beta)):
        if x.shape != (B, S, Hv):
            raise ValueError(f"{name} must be [B, S, Hv] = {(B, S, Hv)}, got {x.shape}")
    if initial_state is not None and initial_state.shape != (B, Hv, Dk, Dv):
        raise ValueError(f"initial_state must be [B, Hv, Dk, Dv] = {(B, Hv, Dk, Dv)}, got {initial_state.shape}")
    if segment_ids is not None and segment_ids.shape != (B, S):
        raise ValueError(f"segment_ids must be [B, S] = {(B, S)}, got {segment_ids.shape}")

    f32 = jnp.float32
    g, beta = g.astype(f32), beta.astype(f32)
    if cast_qkv:
        q, k, v = (x.astype(f32) for x in (q, k, v))
    if repeat_keys and Hv != Hk:
        q = jnp.repeat(q, Hv // Hk, axis=2)  # [B, S, Hv, Dk]
        k = jnp.repeat(k, Hv // Hk, axis=2)
    valid, doc = document_index(segment_ids, B, S)
    g = jnp.where(valid[..., None], g, 0.0)  # padding never decays the state
    state = jnp.zeros((B, Hv, Dk, Dv), f32) if initial_state is None else initial_state.astype(f32)
    return q, k, v, g, beta, valid, doc, state


def document_index(segment_ids: jax.Array | None, B: int, S: int) -> tuple[jax.Array, jax.Array]:
    """valid [B, S] bool (not padding) and doc [B, S] int32: the running count of document starts.

    A document starts where a non-zero id differs from the previous token's id (never at t = 0, so
    that an initial state continues the first document). Two tokens share a document iff their doc
    indices are equal and both are valid; padding inherits the index of the document before it.
    """
    if segment_ids is None:
        return jnp.ones((B, S), bool), jnp.zeros((B, S), jnp.int32)
    seg = segment_ids.astype(jnp.int32)
    prev = jnp.concatenate([seg[:, :1], seg[:, :-1]], axis=1)
    start = (seg != prev) & (seg != 0)
    return seg != 0, jnp.cumsum(start.astype(jnp.int32), axis=1)


def recurrent_gated_delta_rule(
    q: jax.Array,  # [B, S, Hk, Dk]
    k: jax.Array,  # [B, S, Hk, Dk]
    v: jax.Array,  # [B, S, Hv, Dv]
    g: jax.Array,  # [B, S, Hv] log-decay, <= 0
    beta: jax.Array,  # [B, S, Hv]
    *,
    segment_ids: jax.Array | None = None,  # [B, S]
    initial_state: jax.Array | None = None,  # [B, Hv, Dk, Dv]
) -> tuple[jax.Array, jax.Array]:  # [B, S, Hv, Dv] float32, [B, Hv, Dk, Dv] float32
    """Per-token `lax.scan`; slow and obvious, the oracle for the chunked form."""
    q, k, v, g, beta, valid, doc, state = _check_and_prepare(q, k, v, g, beta, segment_ids, initial_state)
    prev_doc = jnp.concatenate([doc[:, :1], doc[:, :-1]], axis=1)
    reset = doc != prev_doc  # [B, S]

    def step(S, xs):  # S [B, H, Dk, Dv]
        q_t, k_t, v_t, g_t, b_t, valid_t, reset_t = xs
        S = jnp.where(reset_t[:, None, None, None], 0.0, S)
        S_new = S * jnp.exp(g_t)[..., None, None]
        kv_mem = jnp.einsum("bhkv,bhk->bhv", S_new, k_t, precision=_HI)
        delta = (v_t - kv_mem) * b_t[..., None]
        S_new = S_new + k_t[..., :, None] * delta[..., None, :]
        o_t = jnp.einsum("bhkv,bhk->bhv", S_new, q_t, precision=_HI)
        keep = valid_t[:, None, None, None]
        return jnp.where(keep, S_new, S), jnp.where(keep[..., 0], o_t, 0.0)

    xs = tuple(jnp.moveaxis(x, 1, 0) for x in (q, k, v, g, beta, valid, reset))
    state, out = jax.lax.scan(step, state, xs)
    return jnp.moveaxis(out, 0, 1), state


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
) -> tuple[jax.Array, jax.Array]:  # [B, S, Hv, Dv] out_dtype, [B, Hv, Dk, Dv] float32
    """Chunked UT/WY form: intra-chunk work as batched matmuls, then the state carried over chunks by
    `chunk_scan` (see `chunk_states.py`; None: the `gdn_chunk_scan` context, "auto" by default); with
    the "pallas" scan all of it Pallas kernels under one VJP (`chunked_rule_pallas.py`).

    Document boundaries are masks on the intra-chunk decay matrix, on which tokens read the carried
    state, and on which tokens (and whether the old state) enter the state carried out of a chunk.
    Key heads are not repeated: the two Gram matrices (q k^T, k k^T) are formed once per key head and
    broadcast over its G = Hv / Hk value heads. `precision` (`gdn_matmul.GDN_PRECISIONS`; None:
    the `gdn_precision` context) is that of the matmuls with a head-dim contraction; the triangular
    inverse is always float32 at HIGHEST. The output is computed in float32 and returned as `out_dtype`.
    """
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    tile = delta_rule_tile(chunk_size)  # long sequences: tile by tile, one tile's chunks in memory at a time
    if tile is not None and q.ndim == 4 and q.shape[1] > tile:
        rule = functools.partial(chunked_gated_delta_rule, precision=precision, chunk_scan=chunk_scan,
                                 out_dtype=out_dtype)
        return tiled_delta_rule(rule, q, k, v, g, beta,
                                segment_ids=segment_ids, initial_state=initial_state, chunk_size=chunk_size,
                                tile=tile)
    prec = resolve_gdn_precision(precision)
    q, k, v, g, beta, valid, doc, state = _check_and_prepare(q, k, v, g, beta, segment_ids, initial_state,
                                                             repeat_keys=False, cast_qkv=False)
    B, S, Hk, Dk = q.shape
    Hv, Dv = v.shape[2:]
    G = Hv // Hk
    L = chunk_size
    scan = chunk_scan_for(chunk_scan, Dk, Dv, L)
    pallas_rule = scan == "pallas" and (jax.default_backend() != "gpu" or local_kernel_fits(Dk, Dv, L))
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
                                         value_heads(chunk_decay), state, prec, out_dtype=out_dtype)
        return out[:, :S], state  # [B, S, Hv, Dv]
    # Heads first, value heads grouped under their key head: [B, n, Hk, G, L, ...] (G = 1 for q, k).
    q, k = (jnp.moveaxis(chunks(x), 2, 3)[:, :, :, None] for x in (q, k))  # [B, n, Hk, 1, L, Dk]
    v = jnp.moveaxis(chunks(v).reshape(B, n, L, Hk, G, Dv), 2, 4)  # [B, n, Hk, G, L, Dv]
    u, w, intra = xla_chunk_local(q, k, v, cum, beta, read, key, prec)
    q_read = q * read[..., None]  # [B, n, Hk, G, L, Dk]
    k_write = k * write[..., None]
    out, state = CHUNK_STATES[scan](*(value_heads(x) for x in (u, w, q_read, k_write, intra, chunk_decay)),
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
    """The chunk-local part as batched XLA ops (`chunk_local_pallas.py` says the same as one kernel)."""
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
