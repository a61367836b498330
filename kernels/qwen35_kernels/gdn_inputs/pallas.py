"""The GDN mixer's input path (`gdn_inputs.rule_inputs` without a halo) as Pallas (Triton) kernels.

Per head and token t, from the raw projection x [B, S, H, D] and the depthwise conv kernel w [Kc, H, D]:

    pre_t = sum_s w_{Kc-1-s} x_{t-s} [t-s valid, in t's document]     (s = 0 .. Kc-1, zero before 0)
    y_t   = silu(pre_t)                                  rounded to x's dtype (v: the output)
    n_t   = scale y_t / sqrt(|y_t|^2 + eps)              float32 (q, k: `l2_scale` given)

XLA runs this as a conv fusion, the L2 norms' reduce and normalize fusions, and in the backward some
ten passes more (the conv's transpose, two-stage column sums for the conv kernel's gradient, the
norms' row sums), each a pass over the layer's [B, S, H, D] arrays. Here one program per
(row, block of L tokens, head) reads its tokens' x, w, document ids and writes the output, forward;
backward it recomputes pre, y and n for its tokens and the Kc - 1 after them (their gradients reach
back into this block through the conv), and writes dx and its block's share of dw (summed over the
blocks afterwards, [B, S / L, H, Kc, D] float32).

The conv reads token t - s, before the block: Triton loads rows at any offset, masked where they
fall outside the sequence (no memory is touched there). Interpreted (CPU tests) a load that starts
before row 0 is not masked that way, so there x, valid and doc are padded at the front by Kc - 1 rows
and every row offset shifted by them; rows past the end are masked the same way on both.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu
from qwen35_kernels.choices import KernelChoices, resolved

L2_EPS = 1e-6  # transformers' / FLA's l2norm eps; gdn_inputs.l2_normalize's default too
MAX_BLOCK = 64
NUM_WARPS = 4


def fits(seq: int, d: int) -> bool:
    """Whether Triton takes these sizes: D a power of two >= 16, S a multiple of 16."""
    return d >= 16 and d & (d - 1) == 0 and seq % 16 == 0


def _block(seq: int) -> int:
    rows = MAX_BLOCK
    while seq % rows:
        rows //= 2
    return rows


class _Rows:
    """Masked loads of L consecutive token rows t0 .. t0 + L - 1 (any t0, rows outside [0, S) masked)."""

    def __init__(self, S: int, L: int, front: int):
        self.S, self.L, self.front = S, L, front

    def tokens(self, ref, t0, other):  # ref [S (+ front), D] -> [L, D] float32
        t = t0 + lax.broadcasted_iota(jnp.int32, (self.L, ref.shape[-1]), 0)
        mask = (t >= 0) & (t < self.S)
        x = plgpu.load(ref.at[pl.ds(t0 + self.front, self.L), :], mask=mask, other=other)
        return x.astype(jnp.float32)

    def ids(self, ref, t0, other):  # ref [S (+ front)] -> [L] int32
        t = t0 + lax.broadcasted_iota(jnp.int32, (self.L,), 0)
        mask = (t >= 0) & (t < self.S)
        return plgpu.load(ref.at[pl.ds(t0 + self.front, self.L)], mask=mask, other=other)


def _tap(w_ref, s: int) -> jax.Array:  # [1, D] float32: the kernel row that multiplies token t - s
    return w_ref[w_ref.shape[0] - 1 - s, :].astype(jnp.float32)[None, :]


def _pre(rows: _Rows, x_ref, valid_ref, doc_ref, w_ref, t0):
    """pre [L, D] float32 for tokens t0 .. t0 + L - 1, and the source terms' tiles (for dw):
    [(x_{t-s} masked [L, D]) for s = 0 .. Kc - 1]."""
    Kc = w_ref.shape[0]
    doc_t = rows.ids(doc_ref, t0, -2)
    pre, sources = 0.0, []
    for s in range(Kc):
        keep = (rows.ids(valid_ref, t0 - s, 0) != 0) & (rows.ids(doc_ref, t0 - s, -3) == doc_t)
        xs = jnp.where(keep[:, None], rows.tokens(x_ref, t0 - s, 0.0), 0.0)
        sources.append(xs)
        pre = pre + xs * _tap(w_ref, s)
    return pre, sources


def _layout(x: jax.Array, w: jax.Array, interpret: bool) -> tuple[int, int, int, int, int, int, int, _Rows]:
    """(B, S, H, D, Kc, L, front, rows) of both kernels: x [B, S, H, D], w [Kc, H, D], blocks of L tokens,
    `front` rows of padding where interpreted (module docstring)."""
    B, S, H, D = x.shape
    Kc = w.shape[0]
    L = _block(S)
    front = Kc - 1 if interpret else 0
    return B, S, H, D, Kc, L, front, _Rows(S, L, front)


def _silu(pre: jax.Array, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(p, sigmoid(p), y = silu(p)) in float32, with p = pre and y rounded to `dtype` as the XLA path rounds
    them (the conv's sum and the SiLU output are in the compute dtype there)."""
    p = pre.astype(dtype).astype(jnp.float32)
    sig = jax.nn.sigmoid(p)
    return p, sig, (p * sig).astype(dtype).astype(jnp.float32)


def _forward(x, w, valid, doc, l2_scale, out_dtype, interpret):
    B, S, H, D, Kc, L, front, rows = _layout(x, w, interpret)

    def kernel(x_ref, w_ref, valid_ref, doc_ref, y_ref):
        t0 = pl.program_id(1) * L
        pre, _ = _pre(rows, x_ref, valid_ref, doc_ref, w_ref, t0)
        _, _, y = _silu(pre, x_ref.dtype)
        if l2_scale is not None:
            y = y * lax.rsqrt(jnp.sum(y * y, axis=1, keepdims=True) + L2_EPS) * l2_scale
        y_ref[...] = y.astype(y_ref.dtype)

    return pl.pallas_call(
        kernel, grid=(B, S // L, H),
        in_specs=_in_specs(S + front, Kc, D),
        out_specs=pl.BlockSpec((None, L, None, D), lambda b, c, h: (b, c, h, 0)),
        out_shape=jax.ShapeDtypeStruct((B, S, H, D), out_dtype),
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret, name="gdn_conv_silu" if l2_scale is None else "gdn_conv_silu_l2",
    )(_pad_front(front, x), w, _pad_front(front, valid), _pad_front(front, doc, -1))


def _backward(x, w, valid, doc, dy, l2_scale, interpret):
    B, S, H, D, Kc, L, front, rows = _layout(x, w, interpret)

    def kernel(x_ref, w_ref, valid_ref, doc_ref, dy_ref, dx_ref, dw_ref):
        t0 = pl.program_id(1) * L
        doc_t = rows.ids(doc_ref, t0, -2)
        dx, sources, g_own = 0.0, None, None
        for s in range(Kc):  # the tokens t + s whose conv reads token t with tap Kc - 1 - s
            pre, src = _pre(rows, x_ref, valid_ref, doc_ref, w_ref, t0 + s)
            g = _pre_gradient(pre, rows.tokens(dy_ref, t0 + s, 0.0), x_ref.dtype, l2_scale)
            if s == 0:
                sources, g_own = src, g
            same = rows.ids(doc_ref, t0 + s, -3) == doc_t
            dx = dx + jnp.where(same[:, None], g, 0.0) * _tap(w_ref, s)
        valid_t = rows.ids(valid_ref, t0, 0) != 0
        dx_ref[...] = jnp.where(valid_t[:, None], dx, 0.0).astype(dx_ref.dtype)
        tap = lax.broadcasted_iota(jnp.int32, (Kc, 1), 0)
        dw = 0.0
        for s in range(Kc):
            dw = dw + jnp.where(tap == Kc - 1 - s, jnp.sum(g_own * sources[s], axis=0)[None, :], 0.0)
        dw_ref[...] = dw

    dx, dw = pl.pallas_call(
        kernel, grid=(B, S // L, H),
        in_specs=_in_specs(S + front, Kc, D) + [pl.BlockSpec((None, S + front, None, D), lambda b, c, h: (b, 0, h, 0))],
        out_specs=[pl.BlockSpec((None, L, None, D), lambda b, c, h: (b, c, h, 0)),
                   pl.BlockSpec((None, None, None, Kc, D), lambda b, c, h: (b, c, h, 0, 0))],
        out_shape=[jax.ShapeDtypeStruct((B, S, H, D), x.dtype),
                   jax.ShapeDtypeStruct((B, S // L, H, Kc, D), jnp.float32)],
        compiler_params=plgpu.CompilerParams(num_warps=NUM_WARPS, num_stages=1),
        interpret=interpret, name="gdn_conv_silu_backward" if l2_scale is None else "gdn_conv_silu_l2_backward",
    )(_pad_front(front, x), w, _pad_front(front, valid), _pad_front(front, doc, -1), _pad_front(front, dy))
    return dx, jnp.transpose(jnp.sum(dw, axis=(0, 1)), (1, 0, 2)).astype(w.dtype)  # [Kc, H, D]


def _pre_gradient(pre, dy, dtype, l2_scale):
    """d loss / d pre [L, D] from the output's cotangent dy [L, D] (float32), through silu and, with
    l2_scale, the L2 norm; pre is rounded to `dtype` before silu and y after it, as in the forward."""
    p, sig, y = _silu(pre, dtype)
    dy_silu = dy
    if l2_scale is not None:
        r = lax.rsqrt(jnp.sum(y * y, axis=1, keepdims=True) + L2_EPS)
        unit = y * r
        dy_silu = l2_scale * r * (dy - unit * jnp.sum(unit * dy, axis=1, keepdims=True))
    return dy_silu * sig * (1.0 + p * (1.0 - sig))


def _in_specs(rows: int, Kc: int, D: int) -> list:
    """x [B, rows, H, D], w [Kc, H, D], valid and doc [B, rows]: each program sees its row and head whole."""
    return [pl.BlockSpec((None, rows, None, D), lambda b, c, h: (b, 0, h, 0)),
            pl.BlockSpec((Kc, None, D), lambda b, c, h: (0, h, 0)),
            pl.BlockSpec((None, rows), lambda b, c, h: (b, 0)),
            pl.BlockSpec((None, rows), lambda b, c, h: (b, 0))]


def _pad_front(front: int, a: jax.Array, fill: int = 0) -> jax.Array:  # [B, S, ...] -> [B, front + S, ...]
    if not front:
        return a
    return jnp.pad(a, [(0, 0), (front, 0)] + [(0, 0)] * (a.ndim - 2), constant_values=fill)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6))
def _conv_silu(x, w, valid, doc, l2_scale, out_dtype, interpret):
    return _forward(x, w, valid, doc, l2_scale, out_dtype, interpret)


def _conv_silu_fwd(x, w, valid, doc, l2_scale, out_dtype, interpret):
    return _forward(x, w, valid, doc, l2_scale, out_dtype, interpret), (x, w, valid, doc)


def _conv_silu_bwd(l2_scale, out_dtype, interpret, residuals, dy):
    x, w, valid, doc = residuals
    dx, dw = _backward(x, w, valid, doc, dy, l2_scale, interpret)
    return dx, dw, None, None


_conv_silu.defvjp(_conv_silu_fwd, _conv_silu_bwd)


def pallas_conv_silu(
    x: jax.Array,  # [B, S, H, D] raw projection output
    kernel: jax.Array,  # [Kc, H, D]; kernel[-1] multiplies the current token
    valid: jax.Array,  # [B, S] bool: not padding (padding is zeroed before the conv)
    doc: jax.Array,  # [B, S] int32 document index (`delta_rule.document_index`)
    *,
    l2_scale: float | None = None,
    l2_dtype: jnp.dtype = jnp.float32,
    choices: KernelChoices | None = None,
    interpret: bool | None = None,
) -> jax.Array:  # [B, S, H, D]: x's dtype, or l2_dtype with l2_scale
    """`gdn_inputs`' conv1d + SiLU and, with `l2_scale`, the L2 norm times l2_scale (written as
    `l2_dtype`), by the kernels above (module docstring). `interpret`: None runs Triton on the
    `choices`' GPU (None: the defaults for jax's backend) and interprets elsewhere."""
    B, S, H, D = x.shape
    if not fits(S, D):
        raise ValueError(f"pallas_conv_silu: S = {S} must be a multiple of 16 and D = {D} a power of two >= 16")
    if interpret is None:
        interpret = resolved(choices).interpret
    out_dtype = jnp.dtype(x.dtype if l2_scale is None else l2_dtype)
    return _conv_silu(x, kernel, valid.astype(jnp.int32), doc.astype(jnp.int32),
                      None if l2_scale is None else float(l2_scale), out_dtype, bool(interpret))
