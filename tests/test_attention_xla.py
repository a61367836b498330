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

from qwen35_jax.config import Qwen35Config
from qwen35_jax.layers.attention import attention_core
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
