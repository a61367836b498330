"""How the chunked delta rule carries its state from chunk to chunk: a sequential scan or a log-depth
associative scan.

Per chunk c (L tokens) the chunked form has, for every head: u_c [L, Dv] (new values), w_c [L, Dk]
(decayed keys that read the state), q_c [L, Dk] (decayed queries), k_c [L, Dk] (keys that write the
state, decayed to the chunk end), intra_c [L, L] and the chunk's total decay d_c. With S_c the state
entering chunk c:

    v_c     = u_c - w_c S_c
    o_c     = q_c S_c + intra_c v_c
    S_c+1   = d_c S_c + k_c^T v_c  =  A_c S_c + b_c,   A_c = d_c I - k_c^T w_c [Dk, Dk],  b_c = k_c^T u_c

- "sequential": `lax.scan` over the chunks, four thin matmuls per step. Least arithmetic; the right
  choice on CPU. On a GPU every step is a handful of tiny kernels (13 forward, 21 backward): at
  S = 8192 (128 chunks) the 0.8B train step launched 78k of them, 37% of its time on an H200.
- "associative": the affine maps (A_c, b_c) compose associatively, (A2, b2) after (A1, b1) =
  (A2 A1, A2 b1 + b2), so `lax.associative_scan` gives every prefix in O(log n) rounds of batched
  [Dk, Dk] matmuls; then all v_c and o_c at once. The [Dk, Dk] products make it about 4x the state
  arithmetic of the sequential scan at Dk = 128, L = 64, all of it in large batched matmuls (on CPU
  the S = 4096 core takes 2x as long). The scan is recomputed in the backward pass rather than
  saving its log n levels of products.
- "auto": "sequential" on CPU, "associative" elsewhere.

Both are exact rewritings of the same recurrence; they differ only in float rounding order.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import jax
import jax.numpy as jnp

GDN_CHUNK_SCANS = ("auto", "sequential", "associative")
_scan: contextvars.ContextVar[str] = contextvars.ContextVar("gdn_chunk_scan", default="auto")


@contextlib.contextmanager
def gdn_chunk_scan(name: str | None) -> Iterator[None]:
    """Chunk-state scan (GDN_CHUNK_SCANS) of delta rules traced inside the block; None leaves it as is.
    Like any trace-time setting it must wrap the first trace of a jitted step."""
    token = _scan.set(resolve_gdn_chunk_scan(name, on_backend=False)) if name is not None else None
    try:
        yield
    finally:
        if token is not None:
            _scan.reset(token)


def resolve_gdn_chunk_scan(name: str | None = None, *, on_backend: bool = True) -> str:
    """`name` (None: the context's) checked, and with on_backend "auto" resolved for this backend."""
    name = _scan.get() if name is None else name
    if name not in GDN_CHUNK_SCANS:
        raise ValueError(f"GDN chunk scan must be one of {GDN_CHUNK_SCANS}, got {name!r}")
    if on_backend and name == "auto":
        return "sequential" if jax.default_backend() == "cpu" else "associative"
    return name


def _mm(spec: str, a: jax.Array, b: jax.Array, prec: jax.lax.Precision | None) -> jax.Array:
    return jnp.einsum(spec, a, b, precision=prec)


def sequential_chunk_states(u: jax.Array, w: jax.Array, q: jax.Array, k: jax.Array, intra: jax.Array,
                            decay: jax.Array, state: jax.Array, prec: jax.lax.Precision | None
                            ) -> tuple[jax.Array, jax.Array]:
    """u [n, B, H, L, Dv], w/q/k [n, B, H, L, Dk], intra [n, B, H, L, L], decay [n, B, H],
    state [B, H, Dk, Dv] -> (out [n, B, H, L, Dv], final state [B, H, Dk, Dv])."""
    def step(s, xs):  # s [B, H, Dk, Dv]
        u_c, w_c, q_c, k_c, intra_c, dec_c = xs
        v_new = u_c - _mm("bhlk,bhkv->bhlv", w_c, s, prec)
        o = _mm("bhlk,bhkv->bhlv", q_c, s, prec) + _mm("bhij,bhjv->bhiv", intra_c, v_new, prec)
        return s * dec_c[..., None, None] + _mm("bhlk,bhlv->bhkv", k_c, v_new, prec), o

    state, out = jax.lax.scan(step, state, (u, w, q, k, intra, decay))
    return out, state


def _entering_states(u: jax.Array, w: jax.Array, k: jax.Array, decay: jax.Array, state: jax.Array,
                     prec: jax.lax.Precision | None) -> jax.Array:
    """The state entering each chunk and the final one: [n + 1, B, H, Dk, Dv] (shapes as above)."""
    dk = w.shape[-1]
    a = decay[..., None, None] * jnp.eye(dk, dtype=w.dtype) - _mm("nbhlk,nbhlj->nbhkj", k, w, prec)  # A_c
    b = _mm("nbhlk,nbhlv->nbhkv", k, u, prec)  # b_c [n, B, H, Dk, Dv]

    def compose(first: tuple[jax.Array, jax.Array], then: tuple[jax.Array, jax.Array]
                ) -> tuple[jax.Array, jax.Array]:  # the map `first` followed by `then`
        (a1, b1), (a2, b2) = first, then
        return _mm("...ij,...jk->...ik", a2, a1, prec), _mm("...ij,...jv->...iv", a2, b1, prec) + b2

    through_a, through_b = jax.lax.associative_scan(compose, (a, b), axis=0)  # chunks 0..c composed
    after = _mm("nbhkj,bhjv->nbhkv", through_a, state, prec) + through_b  # state after chunk c
    return jnp.concatenate([state[None], after], axis=0)


def associative_chunk_states(u: jax.Array, w: jax.Array, q: jax.Array, k: jax.Array, intra: jax.Array,
                             decay: jax.Array, state: jax.Array, prec: jax.lax.Precision | None
                             ) -> tuple[jax.Array, jax.Array]:
    """As `sequential_chunk_states`, with every chunk's entering state from one associative scan."""
    states = jax.checkpoint(_entering_states, static_argnums=(5,))(u, w, k, decay, state, prec)
    entering = states[:-1]  # [n, B, H, Dk, Dv]
    v_new = u - _mm("nbhlk,nbhkv->nbhlv", w, entering, prec)
    out = _mm("nbhlk,nbhkv->nbhlv", q, entering, prec) + _mm("nbhij,nbhjv->nbhiv", intra, v_new, prec)
    return out, states[-1]


CHUNK_STATES = {"sequential": sequential_chunk_states, "associative": associative_chunk_states}
