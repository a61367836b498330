"""The XLA attention core and its custom VJP against float64 autograd; the layouts XLA:CPU gives its backward
and the dense projections' weight gradients."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from qwen35_kernels.attention import attention_core
from qwen35_kernels.attention.xla import MAX_KEY_STARTS, default_block_q, first_visible_key, key_starts

from qwen35_jax.config import Qwen35Config
from qwen35_jax.layers.linear import Linear
from qwen35_jax.layers.mlp import MLP


def _inputs(b: int, s: int, h: int, k: int, dh: int):
    rng = np.random.default_rng(0)
    q = rng.standard_normal((b, s, h, dh)).astype(np.float32)
    kk, v = (rng.standard_normal((b, s, k, dh)).astype(np.float32) for _ in range(2))
    w = rng.standard_normal((b, s, h, dh)).astype(np.float32)
    seg = np.ones((b, s), np.int32)  # row 0: three documents, padding (0) at the end; row 1: one document
    seg[0, s // 4:] = 2
    seg[0, s // 2:] = 3
    seg[0, s - 5:] = 0
    return q, kk, v, seg, w


def _torch_float64(q, k, v, seg, w):
    """Output and gradients of sum(attention * w), float64 autograd on the dense [S, S] masked softmax."""
    tq, tk, tv = (torch.tensor(x, dtype=torch.float64, requires_grad=True) for x in (q, k, v))
    g = q.shape[2] // k.shape[2]
    kr, vr = (x.repeat_interleave(g, dim=2) for x in (tk, tv))  # query head h reads kv head h // g
    scores = torch.einsum("bqhd,bkhd->bhqk", tq, kr) / q.shape[-1] ** 0.5
    s = q.shape[1]
    tseg = torch.tensor(seg)
    mask = torch.tril(torch.ones(s, s, dtype=torch.bool)) & (tseg[:, :, None] == tseg[:, None, :])
    probs = torch.softmax(scores.masked_fill(~mask[:, None], float("-inf")), dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, vr)
    (out * torch.tensor(w, dtype=torch.float64)).sum().backward()
    return out.detach().numpy(), [x.grad.numpy() for x in (tq, tk, tv)]


@pytest.mark.parametrize("block_q", [16, 512])  # 5 blocks, the last partial; one block
def test_attention_core_and_its_vjp_match_float64(block_q):
    q, k, v, seg, w = _inputs(2, 70, 4, 2, 16)
    want, want_grads = _torch_float64(q, k, v, seg, w)

    def loss(q, k, v):
        out = attention_core(q, k, v, jnp.asarray(seg), block_q=block_q, implementation="xla")
        return jnp.sum(out * w), out

    (_, got), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    # float32 rounding of 16-term dots and softmaxes over <= 70 keys: measured <= 3e-7 of each array's
    # largest entry; 1e-5 leaves ample room and still catches a wrong mask, scale or transpose (O(1)).
    assert np.abs(np.asarray(got) - want).max() / np.abs(want).max() < 1e-5
    for name, g, gw in zip("qkv", grads, want_grads):
        err = np.abs(np.asarray(g, np.float64) - gw).max() / np.abs(gw).max()
        assert err < 1e-5, (name, err)


def test_first_visible_key_is_the_first_key_each_query_may_attend_to():
    """Against the mask itself, on rows with reused ids (a document id that comes back later), padding and
    one document: the smallest j <= i with the same id as query i."""
    rng = np.random.default_rng(1)
    rows = [rng.integers(0, 4, 50), np.repeat([3, 1, 3, 0, 2, 1], [9, 7, 5, 11, 8, 10]), np.full(50, 7)]
    seg = np.stack(rows).astype(np.int32)  # [3, 50]
    got = np.asarray(first_visible_key(jnp.asarray(seg)))
    want = [[min(j for j in range(i + 1) if row[j] == row[i]) for i in range(len(row))] for row in seg]
    np.testing.assert_array_equal(got, want)


def test_key_starts_are_whole_tiles_up_to_the_block_and_at_most_the_cap():
    assert key_starts(0, 16) == (0,)
    assert key_starts(48, 16) == (0, 16, 32, 48)
    long = key_starts(100 * 16, 16)  # 101 tiles: every 13th
    assert len(long) <= MAX_KEY_STARTS and long[0] == 0 and long[-1] <= 100 * 16
    assert all(b - a == 13 * 16 for a, b in zip(long, long[1:]))


def test_default_block_is_a_sixteenth_of_the_row_within_128_to_512():
    assert [default_block_q(s) for s in (1, 70, 512, 2048, 3000, 4096, 8192, 65536)] == [
        128, 128, 128, 128, 256, 256, 512, 512]


def _xla_grad(seg: np.ndarray, w: np.ndarray, block_q: int):
    def loss(q, k, v):
        out = attention_core(q, k, v, jnp.asarray(seg), block_q=block_q, implementation="xla")
        return jnp.sum(out * w), out

    return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _assert_matches_float64(q, k, v, seg, w, block_q):
    """Output and gradients against float64 autograd, to float32 rounding (as in the test above)."""
    want, want_grads = _torch_float64(q, k, v, seg, w)
    (_, got), grads = _xla_grad(seg, w, block_q)(q, k, v)
    assert np.abs(np.asarray(got) - want).max() / np.abs(want).max() < 1e-5
    for name, g, gw in zip("qkv", grads, want_grads):
        err = np.abs(np.asarray(g, np.float64) - gw).max() / np.abs(gw).max()
        assert err < 1e-5, (name, err)


def test_keys_no_query_of_a_block_can_see_are_never_read():
    """Documents at 0, 21 and 37 with block_q 16: the blocks from 48 on skip keys [0, 32). Document 1's
    values are NaN; a block that read them would return NaN (0 * NaN), as block [32, 48) does, which holds
    document 2's keys from 21 on and so starts at 16."""
    q, k, v, _, w = _inputs(1, 80, 4, 2, 16)
    seg = np.repeat([1, 2, 3], [21, 16, 43])[None].astype(np.int32)
    v_nan = v.copy()
    v_nan[0, :21] = np.nan
    grad = _xla_grad(seg, w, 16)
    out_nan = np.asarray(grad(q, k, v_nan)[0][1])
    assert np.isfinite(out_nan[:, 48:]).all()
    assert np.isnan(out_nan[:, 32:48]).all()
    np.testing.assert_array_equal(out_nan[:, 48:], np.asarray(grad(q, k, v)[0][1])[:, 48:])
    _assert_matches_float64(q, k, v, seg, w, 16)


def test_key_skipping_is_exact_when_a_document_id_comes_back():
    """Row 1 reuses id 5 after another document: the block [64, 80) holds only the second run of 5, which
    still attends to the first run at [10, 20), so no key tile of that block may be skipped (a skip bound
    from where the run starts would drop them). Row 0's late documents alone would allow skipping; the
    skip is the smallest over the batch."""
    q, k, v, _, w = _inputs(2, 80, 4, 2, 16)
    seg = np.stack([np.repeat([1, 2, 3], [21, 16, 43]), np.repeat([4, 5, 6, 5], [10, 10, 30, 30])]).astype(np.int32)
    _assert_matches_float64(q, k, v, seg, w, 16)


def _largest_relayout(fn, *args) -> int:
    """Elements of the largest transpose or copy in the optimised CPU program of `fn` (fusions included)."""
    hlo = jax.jit(fn).lower(*args).compile().as_text()
    sizes = [int(np.prod([int(d) for d in dims.split(",") if d]))
             for dims in re.findall(r"= \w+\[([\d,]*)\]\{[^}]*\} (?:transpose|copy)\(", hlo)]
    return max(sizes, default=0)


def test_attention_backward_never_relayouts_a_score_block():
    """dK and dV are computed transposed so XLA:CPU keeps every [Q, T] block in place; only q/k/v-sized arrays
    (and the output) move. A [Q, T] transpose here was half of the core's time."""
    b, s, h, kh, dh = 1, 256, 4, 2, 16
    q, k, v = jnp.zeros((b, s, h, dh)), jnp.zeros((b, s, kh, dh)), jnp.zeros((b, s, kh, dh))
    seg = jnp.ones((b, s), jnp.int32)
    grad = jax.grad(lambda q, k, v: jnp.sum(attention_core(q, k, v, seg, block_q=64, implementation="xla")),
                    argnums=(0, 1, 2))
    assert _largest_relayout(grad, q, k, v) <= q.size < 64 * s * h  # a [Q, T] block of all heads


def test_linear_on_a_batch_flattens_tokens_and_matches_nnx_linear():
    """Same parameters as `nnx.Linear` (so HF import/export is unchanged), and x @ W against float64:
    8-term float32 dot products of unit-scale values agree to ~1e-6."""
    x = jax.random.normal(jax.random.key(0), (2, 5, 8))
    ours = Linear(8, 12, use_bias=False, rngs=nnx.Rngs(0))
    ref = nnx.Linear(8, 12, use_bias=False, rngs=nnx.Rngs(0))
    assert jax.tree.structure(nnx.state(ours)) == jax.tree.structure(nnx.state(ref))
    np.testing.assert_array_equal(np.asarray(ours.kernel[...]), np.asarray(ref.kernel[...]))
    want = np.asarray(x, np.float64) @ np.asarray(ours.kernel[...], np.float64)  # [2, 5, 12]
    got = ours(x)
    assert got.shape == (2, 5, 12)
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=1e-5, atol=1e-5)


def test_mlp_weight_gradients_need_no_relayout_of_activations():
    """On [B, S, D] the weight gradient contracts B and S; XLA:CPU then copies the [B, S, F] operand into a
    transposed layout (the MLP backward ran 2.4x slower). `Linear` contracts one flat token axis instead."""
    cfg = Qwen35Config.preset("tiny")
    mlp = MLP(cfg, rngs=nnx.Rngs(0))
    graphdef, params = nnx.split(mlp)
    b, s = 2, 64
    x = jnp.ones((b, s, cfg.hidden_size))

    def loss(params, x):
        return jnp.sum(jnp.sin(nnx.merge(graphdef, params)(x)))

    assert _largest_relayout(jax.grad(loss), params, x) < b * s * cfg.intermediate_size


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
def test_decode_attention_matches_float64_softmax_over_each_rows_slots(kv_heads):
    from qwen35_kernels.attention import decode_attention

    rng = np.random.default_rng(1)
    b, length, h, dh = 3, 11, 4, 8
    q = rng.standard_normal((b, h, dh)).astype(np.float32)
    k, v = (rng.standard_normal((b, length, kv_heads, dh)).astype(np.float32) for _ in range(2))
    lengths = np.array([1, 6, 11], np.int32)
    got = np.asarray(decode_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lengths)))
    for row in range(b):
        n = lengths[row]
        for head in range(h):
            kv = head // (h // kv_heads)
            s = k[row, :n, kv].astype(np.float64) @ q[row, head].astype(np.float64) / np.sqrt(dh)
            p = np.exp(s - s.max())
            want = (p / p.sum()) @ v[row, :n, kv].astype(np.float64)
            # float32 scores and sums over at most 11 slots: measured error below 1e-6
            np.testing.assert_allclose(got[row, head], want, atol=1e-5, rtol=0)
