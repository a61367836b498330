"""cuDNN attention (`cudnn.py`): the packed-segment form of segment ids, the switch to the
fallback kernel, and lowering for CUDA. cuDNN itself runs only on a GPU (scripts/device_check.sh
checks its values there); here its packed semantics are a float64 NumPy model."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from qwen35_kernels.attention import attention_core, resolve_implementation
from qwen35_kernels.attention import cudnn as ac
from qwen35_kernels.choices import KernelChoices

# rows of segment ids, and whether cuDNN can take them exactly at M = 4
LAYOUTS = {
    "documents_then_padding": ([1, 1, 1, 2, 2, 3, 3, 3, 0, 0], True),
    "one_document": ([4] * 10, True),
    "left_padding": ([0, 0, 0, 7, 7, 7, 7, 7, 7, 7], True),
    "too_many_runs": ([1, 1, 2, 2, 3, 3, 4, 4, 0, 0], False),
    "id_in_two_runs": ([1, 1, 1, 0, 0, 1, 1, 1, 1, 1], False),
}


def _runs(row: list[int]) -> list[tuple[int, int]]:
    """(start, length) of each run of equal ids."""
    starts = [i for i in range(len(row)) if i == 0 or row[i] != row[i - 1]]
    return [(a, b - a) for a, b in zip(starts, starts[1:] + [len(row)])]


def _probs64(q: np.ndarray, k: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """float64 attention probabilities of one row: q/k [S, H, Dh], allowed [S, S] -> [H, S, S]."""
    logits = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(q.shape[-1])
    logits = np.where(allowed, logits, -np.inf)
    with np.errstate(invalid="ignore"):  # a query outside every segment (more runs than M) gets NaN
        p = np.exp(logits - logits.max(-1, keepdims=True))
    return p / p.sum(-1, keepdims=True)


def _attention64(q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """float64 softmax attention of one row: q/k/v [S, H, Dh], allowed [S, S] -> [S, H, Dh]."""
    return np.einsum("hqk,khd->qhd", _probs64(q, k, allowed), v)


def _attention64_grads(q: np.ndarray, k: np.ndarray, v: np.ndarray, allowed: np.ndarray, w: np.ndarray
                       ) -> tuple[np.ndarray, ...]:
    """float64 output and the gradients of sum(output * w) for one row, written out: q [S, H, Dh],
    k/v [S, K, Dh] (query head h reads kv head h // (H / K)), allowed [S, S], w [S, H, Dh]
    -> out [S, H, Dh], dq [S, H, Dh], dk [S, K, Dh], dv [S, K, Dh]."""
    g = q.shape[1] // k.shape[1]
    kr, vr = np.repeat(k, g, axis=1), np.repeat(v, g, axis=1)
    p = _probs64(q, kr, allowed)  # [H, S, S]
    dp = np.einsum("qhd,khd->hqk", w, vr)
    ds = p * (dp - np.sum(p * dp, axis=-1, keepdims=True)) / np.sqrt(q.shape[-1])
    dq = np.einsum("hqk,khd->qhd", ds, kr)
    dk = np.einsum("hqk,qhd->khd", ds, q)
    dv = np.einsum("hqk,qhd->khd", p, w)

    def fold(x: np.ndarray) -> np.ndarray:  # [S, H, Dh] -> [S, K, Dh]: the repeated heads summed back
        return x.reshape(x.shape[0], -1, g, x.shape[-1]).sum(axis=2)

    return np.einsum("hqk,khd->qhd", p, vr), dq, fold(dk), fold(dv)


def _segment_mask(row) -> np.ndarray:
    """The XLA core's rule: same id and j <= i."""
    row = np.asarray(row)
    return (row[:, None] == row[None, :]) & np.tri(len(row), dtype=bool)


def _packed_mask(seqlen: np.ndarray, offsets: np.ndarray, s: int) -> np.ndarray:
    """cuDNN's packed rule for one row: causal within each segment [offset, offset + length)."""
    allowed = np.zeros((s, s), bool)
    for start, length in zip(offsets, seqlen):
        if length >= 0:
            allowed[start:start + length, start:start + length] = np.tri(length, dtype=bool)
    return allowed


@pytest.mark.parametrize("name", LAYOUTS)
def test_packed_segments_are_the_runs(name):
    row, fits = LAYOUTS[name]
    seqlen, offsets, exact = (np.asarray(x) for x in ac.packed_segments(jnp.asarray([row]), 4))
    runs = _runs(row)[:4]
    assert offsets.shape == (1, 5) and seqlen.shape == (1, 4)
    assert [int(x) for x in offsets[0]] == [a for a, _ in runs] + [-1] * (5 - len(runs))
    assert [int(x) for x in seqlen[0]] == [n for _, n in runs] + [-1] * (4 - len(runs))
    assert bool(exact) == fits


def test_packed_segments_exact_needs_every_row():
    rows = jnp.asarray([LAYOUTS["one_document"][0], LAYOUTS["too_many_runs"][0]])
    assert not bool(ac.packed_segments(rows, 4)[2])
    assert bool(ac.packed_segments(rows, 5)[2])
    with pytest.raises(ValueError, match="max_segments must be >= 1"):
        ac.packed_segments(rows, 0)


@pytest.mark.parametrize("name", LAYOUTS)
def test_packed_rule_is_the_segment_rule_exactly_when_exact(name):
    # what cuDNN computes from the packed form, against the XLA core's rule, in float64: equal
    # when `exact` holds, and different on every layout where it does not (so the check is needed)
    row, fits = LAYOUTS[name]
    seqlen, offsets, _ = ac.packed_segments(jnp.asarray([row]), 4)
    seqlen, offsets = np.asarray(seqlen)[0], np.asarray(offsets)[0]
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((len(row), 2, 8)) for _ in range(3))
    packed = _attention64(q, k, v, _packed_mask(seqlen, offsets, len(row)))
    want = _attention64(q, k, v, _segment_mask(row))
    if fits:
        np.testing.assert_allclose(packed, want, rtol=1e-12, atol=1e-12)
    else:
        assert not np.allclose(np.nan_to_num(packed), want, atol=1e-3)


def _reference_packed_attention(q, k, v, seqlen, offsets, scale):
    """cuDNN's packed semantics in jax (float32 inside): causal within each segment of each row."""
    s = q.shape[1]
    pos = jnp.arange(s)
    inside = ((pos[None, None, :] >= offsets[:, :-1, None])
              & (pos[None, None, :] < offsets[:, :-1, None] + seqlen[:, :, None]))  # [B, M, S]
    same = jnp.einsum("bmi,bmj->bij", inside.astype(jnp.float32), inside.astype(jnp.float32)) > 0
    allowed = same & (pos[:, None] >= pos[None, :])  # [B, S, S]
    # float32 operands: XLA:CPU has no bf16 x bf16 -> f32 dot
    logits = jnp.einsum("bqhd,bkhd->bhqk", q.astype(jnp.float32), k.astype(jnp.float32)) * scale
    p = jax.nn.softmax(jnp.where(allowed[:, None], logits, -jnp.inf), axis=-1)
    return jnp.einsum("bhqk,bkhd->bqhd", p, v.astype(jnp.float32)).astype(q.dtype)


def _values_and_grads(fn, q, k, v, seg, w):
    def loss(q, k, v):
        out = fn(q, k, v, seg)
        return jnp.sum(out.astype(jnp.float32) * w), out

    (_, out), grads = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))(q, k, v)
    return out, grads


@pytest.mark.parametrize("rows", [("documents_then_padding", "left_padding"),
                                  ("documents_then_padding", "id_in_two_runs"),
                                  ("too_many_runs", "one_document")])
def test_cudnn_path_or_fallback_equals_the_segment_rule(rows):
    # the packed branch (cuDNN's semantics, modelled) when every row fits, the fallback otherwise;
    # values and gradients against the segment rule in float64 on the same bf16 inputs: the bound
    # (2e-2 of the largest entry) is bf16 rounding of the outputs and gradients
    seg = jnp.asarray([LAYOUTS[r][0] for r in rows], jnp.int32)
    keys = jax.random.split(jax.random.key(0), 4)
    b, s, h, kh, dh = 2, seg.shape[1], 4, 2, 16
    q = jax.random.normal(keys[0], (b, s, h, dh), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (b, s, kh, dh), jnp.bfloat16) for kk in keys[1:3])
    w = jax.random.normal(keys[3], (b, s, h, dh))
    took = []

    def packed(*args):
        took.append("packed")
        return _reference_packed_attention(*args)

    def fallback(q, k, v, seg):  # float32 inside: XLA:CPU runs no bf16 x bf16 -> f32 dot in a branch
        took.append("fallback")
        f32 = (x.astype(jnp.float32) for x in (q, k, v))
        return attention_core(*f32, seg, implementation="xla").astype(q.dtype)

    def cudnn(q, k, v, seg):
        return ac.cudnn_flash_attention(q, k, v, seg, max_segments=4, packed_attention=packed, fallback=fallback)

    got, got_grads = _values_and_grads(cudnn, q, k, v, seg, w)
    assert set(took) == {"packed", "fallback"}  # both branches traced: the choice is made on the device
    q64, k64, v64, w64 = (np.asarray(x, np.float64) for x in (q, k, v, w))
    rows64 = [_attention64_grads(q64[i], k64[i], v64[i], _segment_mask(seg[i]), w64[i]) for i in range(b)]
    want = [np.stack(x) for x in zip(*rows64)]  # out, dq, dk, dv: [B, ...] each
    for name, x, x64 in zip(["out", "dq", "dk", "dv"], [got, *got_grads], want):
        err = float(np.max(np.abs(np.asarray(x, np.float64) - x64)) / np.max(np.abs(x64)))
        assert err < 2e-2, (name, err)


def test_float32_inputs_raise():
    z = jnp.zeros((1, 4, 2, 8))
    with pytest.raises(ValueError, match="'cudnn' needs bfloat16 or float16 q/k/v"):
        ac.cudnn_flash_attention(z, z, z, jnp.ones((1, 4), jnp.int32))


def test_resolves_on_gpu_only():
    with pytest.raises(ValueError, match="'cudnn' needs a CUDA GPU, this backend is cpu"):
        resolve_implementation("cudnn")
    assert resolve_implementation("cudnn", "gpu") == "cudnn"
    assert resolve_implementation(choices=KernelChoices(attention="cudnn", platform="gpu")) == "cudnn"


@pytest.fixture
def stub_hopper(monkeypatch):
    """Lowering for CUDA from this CPU machine: jax's cuDNN module reads the cuDNN version and the
    compute capability when traced, stubbed here to a Hopper with cuDNN 9.10 (compiling needs the
    device), and the backend reads as "gpu" so that "cudnn" resolves."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    monkeypatch.setattr(cudnn, "check_cudnn_version", lambda: 91000)
    monkeypatch.setattr(cudnn, "check_compute_capability", lambda capability: True)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")


def test_lowers_for_cuda_with_the_triton_fallback(stub_hopper):
    # the 0.8B's attention shapes, bf16, forward and backward
    b, s, h, kh, dh = 1, 4096, 8, 2, 256

    def step(q, k, v, seg, w):
        def loss(q, k, v):
            return jnp.sum(attention_core(q, k, v, seg, implementation="cudnn").astype(jnp.float32) * w)
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    args = (jax.ShapeDtypeStruct((b, s, h, dh), jnp.bfloat16), jax.ShapeDtypeStruct((b, s, kh, dh), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, s, kh, dh), jnp.bfloat16), jax.ShapeDtypeStruct((b, s), jnp.int32),
            jax.ShapeDtypeStruct((b, s, h, dh), jnp.float32))
    text = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    targets = re.findall(r"custom_call @([\w$.]+)", text)
    assert targets.count("__cudnn$fmhaSoftmax") == 1 and targets.count("__cudnn$fmhaSoftmaxBackward") == 1
    assert targets.count("__gpu$xla.gpu.triton") == 3  # the fallback's forward and two backward kernels
    assert "stablehlo.case" in text or "stablehlo.if" in text
    assert "4096x4096" not in text  # no [S, S] array on either path


def test_lowers_for_cuda_inside_ulysses(stub_hopper, mesh_2x4):
    # per device after the all-to-all: the whole sequence, 8 / 4 query heads, inside shard_map
    from qwen35_jax.parallel.ulysses import ulysses_attention

    def step(q, k, v, seg):
        def loss(q, k, v):
            out = ulysses_attention(lambda *a: attention_core(*a, implementation="cudnn"), q, k, v, seg)
            return jnp.sum(out.astype(jnp.float32))
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    b, s, h, kh, dh = 2, 512, 8, 4, 64
    args = (jax.ShapeDtypeStruct((b, s, h, dh), jnp.bfloat16), jax.ShapeDtypeStruct((b, s, kh, dh), jnp.bfloat16),
            jax.ShapeDtypeStruct((b, s, kh, dh), jnp.bfloat16), jax.ShapeDtypeStruct((b, s), jnp.int32))
    with jax.set_mesh(mesh_2x4):
        text = jax.jit(step).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    targets = set(re.findall(r"custom_call @([\w$.]+)", text))
    assert {"__cudnn$fmhaSoftmax", "__cudnn$fmhaSoftmaxBackward", "__gpu$xla.gpu.triton"} <= targets
    assert "all_to_all" in text
