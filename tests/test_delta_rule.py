"""Chunked gated delta rule == per-token recurrence == the transformers reference in float64; documents reset."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from qwen35_kernels.choices import KernelChoices, resolved
from qwen35_kernels.gated_delta_rule.chunk_states import (
    UNROLL_CHUNKS,
    pallas_chunk_states,
)
from qwen35_kernels.gated_delta_rule.chunked import chunked_gated_delta_rule
from qwen35_kernels.gated_delta_rule.matmul import BF16_OPERANDS, BF16_ROUNDED, resolve_gdn_precision
from qwen35_kernels.gated_delta_rule.pallas_chunk_local import chunk_local_forward, pallas_chunk_local
from qwen35_kernels.gated_delta_rule.pallas_chunk_states import entering_states
from qwen35_kernels.gated_delta_rule.pallas_rule import pallas_chunked_rule
from qwen35_kernels.gated_delta_rule.reference import recurrent_gated_delta_rule
from transformers.models.qwen3_next.modeling_qwen3_next import (
    torch_chunk_gated_delta_rule,
    torch_recurrent_gated_delta_rule,
)

from float64_reference import torch_float64
from jaxpr_testutil import all_equations

B, HK, HV, DK, DV = 2, 2, 4, 8, 8


def _l2(x):
    return x / np.sqrt((x * x).sum(-1, keepdims=True) + 1e-6)


def _inputs(S, seed=0):
    """q, k L2-normed (q not yet scaled), v, g <= 0, beta in (0, 1), a random initial state."""
    rng = np.random.default_rng(seed)
    q = _l2(rng.normal(size=(B, S, HK, DK))).astype(np.float32)
    k = _l2(rng.normal(size=(B, S, HK, DK))).astype(np.float32)
    v = rng.normal(size=(B, S, HV, DV)).astype(np.float32)
    g = (-np.exp(rng.normal(size=(B, S, HV)) - 1.0)).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.normal(size=(B, S, HV))))).astype(np.float32)
    state = rng.normal(size=(B, HV, DK, DV)).astype(np.float32)
    return q, k, v, g, beta, state


def _close(a, b, atol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=atol, rtol=0)


def recurrence_jnp(q, k, v, g, beta, segment_ids, initial_state):
    """The per-token rule of the module docstring, token by token in jnp (so jax.grad differentiates it;
    under jax.enable_x64 with float64 inputs it is the float64 truth): [B, S, Hv, Dv] outputs, final state."""
    hk, hv = q.shape[2], v.shape[2]
    q, k = (jnp.repeat(x, hv // hk, axis=2) for x in (q, k))  # [B, S, Hv, Dk]
    st, outs = initial_state, []
    for t in range(q.shape[1]):
        if t > 0:  # a new document starts from a zero state; padding keeps the state
            starts = (segment_ids[:, t] != segment_ids[:, t - 1]) & (segment_ids[:, t] != 0)
            st = jnp.where(starts[:, None, None, None], 0.0, st)
        decayed = st * jnp.exp(g[:, t])[..., None, None]
        err = v[:, t] - jnp.einsum("bhkv,bhk->bhv", decayed, k[:, t])
        new = decayed + jnp.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * err)
        valid = (segment_ids[:, t] != 0)[:, None, None]  # padding: a no-op that outputs zeros
        outs.append(jnp.where(valid, jnp.einsum("bhkv,bhk->bhv", new, q[:, t]), 0.0))
        st = jnp.where(valid[..., None], new, st)
    return jnp.stack(outs, axis=1), st


def recurrence_float64(q, k, v, g, beta, segment_ids, initial_state):
    """`recurrence_jnp` in float64, as NumPy arrays."""
    with jax.enable_x64(True):
        args = (jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v, g, beta))
        out, final = recurrence_jnp(*args, jnp.asarray(segment_ids), jnp.asarray(np.asarray(initial_state, np.float64)))
        return np.asarray(out), np.asarray(final)


@pytest.mark.parametrize("scan", ["sequential", "associative", "pallas"])
@pytest.mark.parametrize("S, chunk_size", [(200, 16), (64, 64), (130, 64), (300, 16)])
def test_chunk_scans_match_float64_recurrence(scan, S, chunk_size):
    """Every way of carrying the state across chunks (13, 1, 3 and 19 chunks: odd counts, a single one,
    and more than UNROLL_CHUNKS, where "sequential" is a lax.scan instead of a written-out loop),
    with packed documents, padding inside and at the end of a row, an id that comes back after padding
    (a new document) and an initial state. float32 against the float64 truth: outputs and states are
    O(1) here and both scans land within 8e-7 of it; 5e-6 leaves room for another CPU's float32 matmul
    rounding, not for a wrong reset or a lost chunk (errors of 1e-2 and more)."""
    assert -(-300 // 16) > UNROLL_CHUNKS >= -(-200 // 16)
    q, k, v, g, beta, state = _inputs(S, seed=S + chunk_size)
    q = q * DK**-0.5
    rng = np.random.default_rng(S)
    seg = (np.cumsum(rng.random((B, S)) < 0.03, axis=1) + 1).astype(np.int32)
    seg[0, -5:] = 0
    seg[1, 30:33] = 0
    o_ref, s_ref = recurrence_float64(q, k, v, g, beta, seg, state)
    o, s = jax.jit(lambda *a: chunked_gated_delta_rule(*a, segment_ids=seg, initial_state=state,
                                                       chunk_size=chunk_size, chunk_scan=scan))(q, k, v, g, beta)
    _close(np.asarray(o, np.float64), o_ref, 5e-6)
    _close(np.asarray(s, np.float64), s_ref, 5e-6)


@pytest.mark.parametrize("precision", [None, BF16_OPERANDS])
def test_pallas_chunk_states_lower_for_gpu(precision):
    # The recurrence and output kernels built for Triton (not interpreted) and lowered for "cuda" on
    # this CPU machine, at the 0.8B model's shapes (8192 tokens: 128 chunks of 64, 16 heads of 128),
    # forward and backward. Catches what Triton cannot express; compiling the IR needs the GPU itself.
    n, b, h, L, dk, dv = 128, 1, 16, 64, 128, 128

    def loss(u, w, q, k, intra, decay, state):
        out, final = pallas_chunk_states(u, w, q, k, intra, decay, state, precision, interpret=False)
        return jnp.sum(out ** 2) + jnp.sum(final ** 2)

    shapes = [(b, n, h, L, dv), (b, n, h, L, dk), (b, n, h, L, dk), (b, n, h, L, dk), (b, n, h, L, L), (b, n, h),
              (b, h, dk, dv)]
    args = [jax.ShapeDtypeStruct(x, jnp.float32) for x in shapes]
    text = jax.jit(jax.grad(loss, range(7))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert "custom_call @__gpu$xla.gpu.triton" in text
    assert {"gdn_chunk_states", "gdn_chunk_states_reverse", "gdn_chunk_gradients", "gdn_chunk_outputs",
            "gdn_chunk_outputs_backward"} <= set(re.findall(r'name = "(\w+)"', text))


def test_pallas_chunked_rule_lowers_for_gpu_with_bf16_operands():
    # All seven kernels of the end-to-end Pallas rule (the chunk-local pair writing bfloat16 operands
    # for the state and output kernels) built for Triton and lowered for "cuda" at the 0.8B shapes,
    # two value heads per key head, forward and backward.
    n, b, hk, hv, L, dk, dv = 128, 1, 8, 16, 64, 128, 128

    def loss(q, k, v, cum, beta, read, write, decay, state, doc):
        out, final = pallas_chunked_rule(q, k, v, cum, beta, read, write, doc, decay, state, BF16_OPERANDS,
                                         interpret=False)
        return jnp.sum(out ** 2) + jnp.sum(final ** 2)

    shapes = [(b, n * L, hk, dk), (b, n * L, hk, dk), (b, n * L, hv, dv)] + [(b, n, hv, L)] * 4 + [(b, n, hv),
                                                                                                 (b, hv, dk, dv)]
    args = [jax.ShapeDtypeStruct(x, jnp.float32) for x in shapes] + [jax.ShapeDtypeStruct((b, n, L), jnp.int32)]
    text = jax.jit(jax.grad(loss, range(9))).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    assert {"gdn_chunk_local", "gdn_chunk_local_backward", "gdn_chunk_states", "gdn_chunk_states_reverse",
            "gdn_chunk_gradients", "gdn_chunk_outputs", "gdn_chunk_outputs_backward"} <= set(
        re.findall(r'name = "(\w+)"', text))


def _per_chunk_inputs(seed, b=1, n=3, hk=1, hv=2, L=16, dk=16, dv=16):
    """Random inputs of `pallas_chunked_rule` (a document boundary inside chunk 1, padding at the end)."""
    rng = np.random.default_rng(seed)
    q, k = (_l2(rng.normal(size=(b, n, hk, L, dk))).astype(np.float32) for _ in range(2))
    v = rng.normal(size=(b, n, hv, L, dv)).astype(np.float32)
    cum = np.cumsum(-np.exp(rng.normal(size=(b, n, hv, L)) - 2.0), axis=-1).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.normal(size=(b, n, hv, L))))).astype(np.float32)
    read, write = (np.exp(cum).astype(np.float32), np.exp(cum[..., -1:] - cum).astype(np.float32))
    decay = np.exp(cum[..., -1]).astype(np.float32)
    state = rng.normal(size=(b, hv, dk, dv)).astype(np.float32)
    doc = np.zeros((b, n, L), np.int32)
    doc[:, 1, L // 2:] = 1
    doc[:, 2] = 1
    doc[:, 2, -3:] = -1
    return q * dk**-0.5, k, v, cum, beta, read, write, doc, decay, state


def test_chunk_local_kernel_matches_float64_across_the_whole_chunk():
    """The local kernel's T = (I + A)^-1, u = T (beta v) and w = T (beta r k) at chunks of 64 (the inverse's
    four 16-token blocks and their six off-diagonal merges) against float64 NumPy. The decay here is
    weak (0.9 over a chunk), so the last block's T reaches back to the first through every merge term;
    a chunk with a document boundary and padding is included. float32 lands within 3e-7 of each
    result's largest entry; 1e-5 leaves room for another CPU's rounding, not for a lost term (1e-2)."""
    q, k, v, _, beta, read, write, doc, _, _ = _per_chunk_inputs(7, n=3, hv=2, L=64, dk=16, dv=16)
    cum = np.cumsum(np.full(beta.shape, -0.0017, np.float32), axis=-1)
    read, write = np.exp(cum).astype(np.float32), np.exp(cum[..., -1:] - cum).astype(np.float32)
    u, w, _, _, _, t = chunk_local_forward(q, k, v, cum, beta, read, write, doc, jax.lax.Precision.HIGHEST,
                                           interpret=True)
    q64, k64, v64, c64, b64, r64 = (np.asarray(x, np.float64) for x in (q, k, v, cum, beta, read))
    L = k.shape[3]
    for c in range(k.shape[1]):
        for h in range(v.shape[2]):
            kc = k64[0, c, h // (v.shape[2] // k.shape[2])]
            same = (doc[0, c][:, None] == doc[0, c][None, :]) & (doc[0, c][:, None] >= 0)
            decay = np.where(same, np.exp(c64[0, c, h][:, None] - c64[0, c, h][None, :]), 0.0)
            a = np.tril(b64[0, c, h][:, None] * (kc @ kc.T) * decay, -1)
            t_ref = np.linalg.inv(np.eye(L) + a)
            u_ref = t_ref @ (b64[0, c, h][:, None] * v64[0, c, h])
            w_ref = t_ref @ ((b64[0, c, h] * r64[0, c, h])[:, None] * kc)
            for got, want in ((t[0, c, h], t_ref), (u[0, c, h], u_ref), (w[0, c, h], w_ref)):
                assert np.abs(np.asarray(got, np.float64) - want).max() <= 1e-5 * np.abs(want).max()
    assert np.abs(np.tril(t_ref, -49)).max() > 1e-2  # the far corner is not negligible here


def test_pallas_rule_stores_bf16_operands_without_changing_a_result():
    """Under bf16 precision the end-to-end Pallas rule writes w, intra, q_read and k_write as bfloat16
    (every use multiplies them, rounding to bfloat16 first): the local kernel has four bfloat16
    outputs, and outputs, final state and every gradient equal those of the local kernel and the scan
    under two VJPs, which pass them as float32. The two differ only in where float32 sums are rounded:
    measured 0 here; 1e-6 of each result's largest entry allows another CPU's fusion, not u or a
    cotangent stored at bf16 (errors of 1e-3 and more)."""
    q, k, v, cum, beta, read, write, doc, decay, state = _per_chunk_inputs(0)
    b, n, hv, L, dv = v.shape
    weights = [np.random.default_rng(1).normal(size=s).astype(np.float32) for s in ((b, n * L, hv, dv), state.shape)]

    def end_to_end(q, k, v, cum, beta, read, write, decay, state):  # the rule reads q, k, v token-major
        q, k, v = (jnp.transpose(x, (0, 1, 3, 2, 4)).reshape(b, n * L, x.shape[2], x.shape[-1]) for x in (q, k, v))
        return pallas_chunked_rule(q, k, v, cum, beta, read, write, doc, decay, state, BF16_OPERANDS)

    def two_vjps(q, k, v, cum, beta, read, write, decay, state):
        u, w, intra, q_read, k_write = pallas_chunk_local(q, k, v, cum, beta, read, write, doc, BF16_OPERANDS)
        out, final = pallas_chunk_states(u, w, q_read, k_write, intra, decay, state, BF16_OPERANDS)
        return jnp.transpose(out, (0, 1, 3, 2, 4)).reshape(b, n * L, hv, dv), final  # token-major, as the rule

    args = (q, k, v, cum, beta, read, write, decay, state)
    results = {}
    for name, rule in (("end_to_end", end_to_end), ("two_vjps", two_vjps)):
        def loss(*a, rule=rule):
            out, final = rule(*a)
            return jnp.sum(out * weights[0]) + jnp.sum(final * weights[1])
        results[name] = (*jax.jit(rule)(*args), *jax.jit(jax.grad(loss, range(9)))(*args))
    for got, want in zip(results["end_to_end"], results["two_vjps"]):
        want = np.asarray(want, np.float64)
        assert np.abs(np.asarray(got, np.float64) - want).max() <= 1e-6 * np.abs(want).max()
    local = [e for e in all_equations(jax.make_jaxpr(end_to_end)(*args).jaxpr)
             if e.primitive.name == "pallas_call" and e.params["name"] == "gdn_chunk_local"]
    assert [str(x.aval.dtype) for x in local[0].outvars] == ["float32"] + ["bfloat16"] * 4 + ["float32"]


def test_pallas_rule_reads_bf16_values_as_they_are():
    """The end-to-end Pallas rule takes v in the compute dtype, reads it as float32 in registers and
    returns its gradient in that dtype (no float32 copy of v, no cast of its gradient): outputs, state
    and the other gradients as for v cast to float32 first (measured equal; 1e-6 of the largest entry
    allows another CPU's fusion), dv that float32 gradient rounded to bfloat16 (within one bfloat16
    step of the largest entry, 2**-8, for a last float32 bit that rounds the other way)."""
    S, chunk_size = 40, 16
    q, k, v, g, beta, state = _inputs(S, seed=3)
    q = q * DK**-0.5
    v16 = jnp.asarray(v).astype(jnp.bfloat16)
    seg = np.ones((B, S), np.int32)
    seg[:, 25:] = 2
    weights = [np.random.default_rng(4).normal(size=s).astype(np.float32) for s in ((B, S, HV, DV), state.shape)]

    def loss(q, k, v, g, beta):
        out, final = chunked_gated_delta_rule(q, k, v, g, beta, segment_ids=seg, initial_state=state,
                                              chunk_size=chunk_size, chunk_scan="pallas")
        return jnp.sum(out * weights[0]) + jnp.sum(final * weights[1]), (out, final)

    grad = jax.jit(jax.grad(loss, range(5), has_aux=True))
    grads16, (out16, final16) = grad(q, k, v16, g, beta)
    grads32, (out32, final32) = grad(q, k, v16.astype(jnp.float32), g, beta)
    assert grads16[2].dtype == jnp.bfloat16
    for got, want in zip((out16, final16, *grads16[:2], *grads16[3:]), (out32, final32, *grads32[:2], *grads32[3:])):
        want = np.asarray(want, np.float64)
        assert np.abs(np.asarray(got, np.float64) - want).max() <= 1e-6 * np.abs(want).max()
    dv32 = np.asarray(grads32[2], np.float64)
    assert np.abs(np.asarray(grads16[2].astype(jnp.float32), np.float64) - dv32).max() <= 2**-8 * np.abs(dv32).max()
    local = [e for e in all_equations(jax.make_jaxpr(grad)(q, k, v16, g, beta).jaxpr)
             if e.primitive.name == "pallas_call" and e.params["name"].startswith("gdn_chunk_local")]
    assert {str(e.invars[2].aval.dtype) for e in local} == {"bfloat16"}  # v, forward and backward


def test_pallas_rule_stores_q_and_k_as_bf16_only_under_bf16_operands():
    """Under bf16 operands the Pallas rule takes q and k as bfloat16 (every product rounds them so; the
    cast fuses into the L2 norm that makes them) and returns their gradients in it; under float32
    operands they stay float32. Accuracy under bf16 is test_bf16_operands_stay_within_bfloat16_rounding_of_float64's."""
    S = 40
    q, k, v, g, beta, state = _inputs(S, seed=8)

    def local_kernel_qk_dtypes(precision):
        def loss(q, k, v, g, beta):
            out, final = chunked_gated_delta_rule(q, k, v, g, beta, initial_state=state, chunk_size=16,
                                                  chunk_scan="pallas", precision=precision)
            return jnp.sum(out) + jnp.sum(final)

        jaxpr = jax.make_jaxpr(jax.grad(loss, range(5)))(q, k, v, g, beta)
        local = [e for e in all_equations(jaxpr.jaxpr)
                 if e.primitive.name == "pallas_call" and e.params["name"].startswith("gdn_chunk_local")]
        assert len(local) == 2  # forward and backward
        return {str(x.aval.dtype) for e in local for x in e.invars[:2]}

    assert local_kernel_qk_dtypes("bf16") == {"bfloat16"}
    assert local_kernel_qk_dtypes("highest") == {"float32"}


def test_pallas_rule_writes_its_output_in_the_compute_dtype():
    """out_dtype=bfloat16: the output kernel rounds the float32 sums itself, token-major, and the backward
    reads the bfloat16 cotangent: the same output and gradients as the float32 output cast afterwards
    (one bfloat16 step of the largest entry, 2**-8, for a last float32 bit rounding the other way;
    gradients measured equal, 1e-6 allows another CPU's fusion)."""
    S, chunk_size = 40, 16
    q, k, v, g, beta, state = _inputs(S, seed=5)
    q = q * DK**-0.5
    seg = np.ones((B, S), np.int32)
    seg[:, 21:] = 2
    seg[:, -3:] = 0
    weights = np.random.default_rng(6).normal(size=(B, S, HV, DV)).astype(np.float32)

    def loss(q, k, v, g, beta, out_dtype):
        out, final = chunked_gated_delta_rule(q, k, v, g, beta, segment_ids=seg, initial_state=state,
                                              chunk_size=chunk_size, chunk_scan="pallas", out_dtype=out_dtype)
        out = out.astype(jnp.bfloat16)  # a no-op for out_dtype bf16
        return jnp.sum(out.astype(jnp.float32) * weights) + jnp.sum(final), out

    results = {}
    for dtype in (jnp.bfloat16, jnp.float32):
        results[dtype] = jax.jit(jax.grad(functools.partial(loss, out_dtype=dtype), range(5), has_aux=True))(
            q, k, v, g, beta)
    (grads16, out16), (grads32, out32) = results[jnp.bfloat16], results[jnp.float32]
    want = np.asarray(out32.astype(jnp.float32), np.float64)
    assert np.abs(np.asarray(out16.astype(jnp.float32), np.float64) - want).max() <= 2**-8 * np.abs(want).max()
    for got, want in zip(grads16, grads32):
        want = np.asarray(want, np.float64)
        assert np.abs(np.asarray(got, np.float64) - want).max() <= 1e-6 * np.abs(want).max()


def test_chunk_scan_choice_per_platform_and_block():
    assert resolved(None).gdn_chunk_scan == "sequential"  # "auto" on CPU
    assert [KernelChoices(platform=p).resolve().gdn_chunk_scan for p in ("gpu", "tpu")] == ["pallas", "associative"]
    assert resolved(KernelChoices(gdn_chunk_scan="pallas")).gdn_chunk_scan == "pallas"
    associative = resolved(KernelChoices(gdn_chunk_scan="associative"))
    assert associative.gdn_chunk_scan == "associative"
    # another choice leaves this one as it is
    assert associative.replace(gdn_precision="high").resolve().gdn_chunk_scan == "associative"
    assert resolved(None).gdn_chunk_scan == "sequential"
    with pytest.raises(ValueError, match="'parallel'"):
        KernelChoices(gdn_chunk_scan="parallel")


@pytest.mark.parametrize("S", [1, 7, 64, 70, 200])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("with_state", [False, True])
def test_chunked_equals_recurrent(S, chunk_size, with_state):
    q, k, v, g, beta, state = _inputs(S)
    q = q * DK**-0.5
    init = state if with_state else None
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=init)
    o, s = chunked_gated_delta_rule(q, k, v, g, beta, initial_state=init, chunk_size=chunk_size)
    assert o.shape == (B, S, HV, DV) and s.shape == (B, HV, DK, DV)
    _close(o, o_ref)
    _close(s, s_ref)


@pytest.mark.parametrize("S, chunk_size", [(7, 16), (70, 16), (200, 64), (200, 16)])
def test_chunked_equals_recurrent_random_documents(S, chunk_size):
    q, k, v, g, beta, state = _inputs(S, seed=S + chunk_size)
    q = q * DK**-0.5
    rng = np.random.default_rng(S)
    seg = np.cumsum(rng.random((B, S)) < 0.08, axis=1).astype(np.int32) + 1  # ~12-token documents
    seg[rng.random((B, S)) < 0.05] = 0  # scattered padding
    seg[0, -3:] = 0
    o_ref, s_ref = recurrent_gated_delta_rule(q, k, v, g, beta, segment_ids=seg, initial_state=state)
    o, s = chunked_gated_delta_rule(q, k, v, g, beta, segment_ids=seg, initial_state=state, chunk_size=chunk_size)
    _close(o, o_ref)
    _close(s, s_ref)


@pytest.mark.parametrize("S", [7, 70])
def test_matches_transformers_reference(S):
    q, k, v, g, beta, state = _inputs(S, seed=1)
    t = [torch.from_numpy(x.astype(np.float64)) for x in (q, k, v, g, beta, state)]
    with torch_float64():
        o_rec, s_rec = torch_recurrent_gated_delta_rule(
            *t[:3], g=t[3], beta=t[4], initial_state=t[5], output_final_state=True
        )
        o_chk, s_chk = torch_chunk_gated_delta_rule(
            *t[:3], g=t[3], beta=t[4], initial_state=t[5], output_final_state=True, chunk_size=16
        )
    qs = q * DK**-0.5  # ours takes q already scaled
    # Our float32 outputs and states vs the float64 truth: measured max 1.9e-7 (values up to 1.6) on AMD EPYC;
    # 2e-6 leaves 10x headroom.
    atol = 2e-6
    o, s = recurrent_gated_delta_rule(qs, k, v, g, beta, initial_state=state)
    _close(o, o_rec.numpy(), atol)
    _close(s, s_rec.numpy(), atol)
    o, s = chunked_gated_delta_rule(qs, k, v, g, beta, initial_state=state, chunk_size=16)
    _close(o, o_chk.numpy(), atol)
    _close(s, s_chk.numpy(), atol)


@pytest.mark.parametrize("fn", ["recurrent", "chunked"])
def test_packed_documents_equal_separate_runs(fn):
    """Docs starting mid-chunk, a doc spanning chunks, a padding gap and a padding tail."""
    S = 70
    q, k, v, g, beta, state = _inputs(S, seed=2)
    q = q * DK**-0.5
    # row 0: [1]*5 [2]*30 [3]*25 pad*10; row 1: [7]*20 pad*4 [7]*30 [1]*16 (7 again is a new doc)
    docs = {0: [(0, 5), (5, 35), (35, 60)], 1: [(0, 20), (24, 54), (54, 70)]}
    seg = np.zeros((B, S), np.int32)
    seg[0, 0:5], seg[0, 5:35], seg[0, 35:60] = 1, 2, 3
    seg[1, 0:20], seg[1, 24:54], seg[1, 54:70] = 7, 7, 1
    run = {
        "recurrent": recurrent_gated_delta_rule,
        "chunked": lambda *a, **kw: chunked_gated_delta_rule(*a, chunk_size=16, **kw),
    }[fn]
    out, final = run(q, k, v, g, beta, segment_ids=jnp.asarray(seg), initial_state=state)
    for b, spans in docs.items():
        covered = np.zeros(S, bool)
        for i, (lo, hi) in enumerate(spans):
            sl = slice(lo, hi)
            init = state[b : b + 1] if i == 0 else None  # the initial state continues the first doc
            o_doc, s_doc = recurrent_gated_delta_rule(
                q[b : b + 1, sl], k[b : b + 1, sl], v[b : b + 1, sl], g[b : b + 1, sl], beta[b : b + 1, sl],
                initial_state=init,
            )
            _close(out[b, sl], o_doc[0])
            covered[sl] = True
        _close(out[b, ~covered], np.zeros_like(out[b, ~covered]))  # padding outputs zeros
        _close(final[b], s_doc[0])  # the last document's state; trailing padding is a no-op


def _relative_gradient_errors(scan: str, chunk_size: int, precision: str = "highest") -> dict[str, float]:
    """Gradients of the float32 chunked rule against jax.grad of the per-token recurrence in float64:
    each input's largest error relative to its gradient's largest entry."""
    S = 40
    q, k, v, g, beta, state = _inputs(S, seed=3)
    q = q * DK**-0.5
    seg = np.ones((B, S), np.int32)
    seg[0, 13:] = 2
    seg[1, 35:] = 0
    w = np.random.default_rng(4).normal(size=(B, S, HV, DV))
    ws = np.random.default_rng(5).normal(size=(B, HV, DK, DV))

    def loss(fn, *args):
        o, s = fn(*args[:5], segment_ids=jnp.asarray(seg), initial_state=args[5])
        return jnp.sum(o * w) + jnp.sum(s * ws)

    args = (q, k, v, g, beta, state)
    with jax.enable_x64(True):
        ref = jax.grad(lambda *a: loss(recurrence_jnp, *a), argnums=range(6))(*(x.astype(np.float64) for x in args))
        ref = [np.asarray(r) for r in ref]
    assert all(r.dtype == np.float64 and np.abs(r).max() > 0 for r in ref)
    chunked = lambda *a, **kw: chunked_gated_delta_rule(*a, chunk_size=chunk_size, chunk_scan=scan,  # noqa: E731
                                                        precision=precision, **kw)
    got = jax.grad(lambda *a: loss(chunked, *a), argnums=range(6))(*args)
    return {name: float(np.abs(np.asarray(c, np.float64) - r).max() / np.abs(r).max())
            for name, r, c in zip("q k v g beta initial_state".split(), ref, got)}


# chunks of 2: 20 chunks, more than UNROLL_CHUNKS, so "sequential" is a lax.scan (else written out)
@pytest.mark.parametrize("scan, chunk_size", [("sequential", 16), ("sequential", 2), ("associative", 16),
                                              ("pallas", 16)])
def test_gradients_match_float64_recurrence(scan, chunk_size):
    assert -(-40 // 2) > UNROLL_CHUNKS >= -(-40 // 16)
    # float32 gradients against the float64 truth: measured at most 2.3e-7 of each gradient's largest
    # entry (every scan, AMD EPYC); 2e-6 leaves 8x headroom and still fails a dropped term or reset.
    errors = _relative_gradient_errors(scan, chunk_size)
    assert max(errors.values()) < 2e-6, errors


@pytest.mark.parametrize("scan", ["sequential", "associative", "pallas"])
def test_bf16_operands_stay_within_bfloat16_rounding_of_float64(scan):
    """precision="bf16" rounds every matmul operand to bfloat16 (8 significant bits, unit roundoff
    2**-9 ~ 2e-3). Against the float64 truth, O(1) outputs and states (3 documents, an initial
    state) measured 3.0e-3..6.7e-3 and 6.1e-3..9.3e-3 (all scans; gradients 2.8e-3..8.9e-3 of their
    largest entry). 2.5e-2 allows another CPU's summation order, not a float32 state rounded to bf16
    chunk after chunk or a dropped term (errors of 1e-1 and more); above 5e-4 shows the rounding is
    applied (float32 operands land within 1e-6)."""
    S, chunk_size = 200, 16
    q, k, v, g, beta, state = _inputs(S, seed=S + chunk_size)
    q = q * DK**-0.5
    seg = (np.cumsum(np.random.default_rng(S).random((B, S)) < 0.03, axis=1) + 1).astype(np.int32)
    o_ref, s_ref = recurrence_float64(q, k, v, g, beta, seg, state)
    o, s = jax.jit(lambda *a: chunked_gated_delta_rule(*a, segment_ids=seg, initial_state=state, chunk_size=chunk_size,
                                                       chunk_scan=scan, precision="bf16"))(q, k, v, g, beta)
    for got, want in ((o, o_ref), (s, s_ref)):
        err = np.abs(np.asarray(got, np.float64) - want).max()
        assert 5e-4 < err < 2.5e-2, err
    errors = _relative_gradient_errors(scan, 16, "bf16")
    assert 5e-4 < max(errors.values()) < 2.5e-2, errors


def test_bf16_einsum_on_a_gpu_and_its_cpu_emulation_equal_the_rounded_product():
    # On CPU the bf16 operands are rounded and multiplied in float32; on a GPU they are bf16 operands of
    # a float32-accumulating matmul. Both against the float64 product of the bf16-rounded operands:
    # only float32 summation differs, 1e-5 of the result's largest entry allows it, not a lost
    # rounding; the unrounded float64 product is more than 3e-4 away (the rounding happened).
    from qwen35_kernels.gated_delta_rule import matmul as gdn_matmul

    rng = np.random.default_rng(0)
    a, b = (jnp.asarray(rng.normal(size=s).astype(np.float32)) for s in ((2, 3, 16, 32), (2, 3, 32, 8)))
    spec = "...ij,...jk->...ik"
    cpu_prec = resolve_gdn_precision(KernelChoices(gdn_precision="bf16"))
    gpu_prec = resolve_gdn_precision(KernelChoices(gdn_precision="bf16", platform="gpu"))
    assert (cpu_prec, gpu_prec) == (BF16_ROUNDED, BF16_OPERANDS)
    emulated = jax.jit(lambda a, b: gdn_matmul.gdn_einsum(spec, a, b, cpu_prec))(a, b)
    bf16 = jax.jit(lambda a, b: gdn_matmul.gdn_einsum(spec, a, b, gpu_prec))(a, b)  # the GPU's form, run on this CPU
    rounded = np.einsum(spec, *(np.asarray(x.astype(jnp.bfloat16), np.float64) for x in (a, b)))
    exact = np.einsum(spec, np.asarray(a, np.float64), np.asarray(b, np.float64))
    scale = np.abs(exact).max()
    for got in (bf16, emulated):
        assert np.abs(np.asarray(got, np.float64) - rounded).max() < 1e-5 * scale
    assert np.abs(np.asarray(bf16, np.float64) - exact).max() > 3e-4 * scale


def test_bad_shapes_are_named():
    q, k, v, g, beta, state = _inputs(5)
    with pytest.raises(ValueError, match="beta"):
        chunked_gated_delta_rule(q, k, v, g, beta[:, :, :1])
    with pytest.raises(ValueError, match="initial_state"):
        recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=state[:, :1])
    with pytest.raises(ValueError, match="segment_ids"):
        chunked_gated_delta_rule(q, k, v, g, beta, segment_ids=jnp.ones((B, 4), jnp.int32))


def test_precision_setting_per_backend_and_context():
    assert resolve_gdn_precision() == jax.lax.Precision.HIGHEST  # "auto" on CPU
    assert resolve_gdn_precision(None, "default") is None  # left to jax_default_matmul_precision
    high = KernelChoices(gdn_precision="high")
    assert resolve_gdn_precision(high) == jax.lax.Precision.HIGH
    assert resolve_gdn_precision(high, "highest") == jax.lax.Precision.HIGHEST
    assert resolve_gdn_precision() == jax.lax.Precision.HIGHEST
    assert resolve_gdn_precision(None, "bf16") == BF16_ROUNDED  # on CPU: rounded, multiplied in float32
    assert resolve_gdn_precision(KernelChoices(platform="gpu"), "bf16") == BF16_OPERANDS
    with pytest.raises(ValueError, match="'tf32'"):
        resolve_gdn_precision(None, "tf32")
    with pytest.raises(ValueError, match="'tf32'"):
        KernelChoices(gdn_precision="tf32")


def test_every_precision_setting_traces_and_agrees_on_cpu():
    q, k, v, g, beta, state = _inputs(40, seed=6)
    ref, _ = chunked_gated_delta_rule(q * DK**-0.5, k, v, g, beta, chunk_size=16)
    for name in ("highest", "high", "default"):
        out, _ = chunked_gated_delta_rule(q * DK**-0.5, k, v, g, beta, chunk_size=16, precision=name)
        _close(out, ref)  # float32 CPU matmuls ignore the precision; conftest forces "highest" as default


def test_pallas_chunk_scan_needs_triton_sized_tiles_on_gpu():
    # On a GPU the Triton kernel takes power-of-two tiles of at least 16: "auto" then runs the
    # associative scan for other head dims or chunk sizes, and an explicit "pallas" is a one-line error.
    import qwen35_kernels.gated_delta_rule.chunk_states as cs

    assert cs.kernel_fits(128, 128, 64) and cs.kernel_fits(64, 32, 16)
    assert not cs.kernel_fits(96, 128, 64) and not cs.kernel_fits(128, 128, 8) and not cs.kernel_fits(128, 96, 64)
    gpu = KernelChoices(platform="gpu").resolve()
    assert cs.chunk_scan_for(gpu, 128, 128, 64) == "pallas"  # "auto" on GPU
    assert cs.chunk_scan_for(gpu, 96, 96, 64) == "associative"
    with pytest.raises(ValueError, match="'pallas' needs .* got Dk=96, Dv=96, chunk 64"):
        cs.chunk_scan_for(gpu.replace(gdn_chunk_scan="pallas").resolve(), 96, 96, 64)


def test_pallas_kernel_blocks_split_the_state_columns_alike():
    # The state's columns never mix, so any split of Dv over programs gives the same states up to the
    # float32 rounding of differently shaped matmuls (measured 2.4e-6 on states of O(1); 2e-5 allows
    # other CPUs, not a lost or doubled column block); blocks wider than Dv take the whole head. Bad
    # blocks are a one-line error.
    rng = np.random.default_rng(0)
    n, b, h, L, dk, dv = 3, 1, 2, 16, 16, 64
    u, w, k = (jnp.asarray(rng.normal(size=(b, n, h, L, d)).astype(np.float32) * 0.3) for d in (dv, dk, dk))
    decay = jnp.asarray(rng.uniform(0.5, 1.0, size=(b, n, h)).astype(np.float32))
    state = jnp.asarray(rng.normal(size=(b, h, dk, dv)).astype(np.float32))
    hi = jax.lax.Precision.HIGHEST
    want, want_final = entering_states(u, w, k, decay, state, hi, interpret=True)
    np.testing.assert_array_equal(want_final, want[:, -1])  # float32 states: the final one is the last
    for blocks in ((16, 4), (32, 8), (128, 2)):
        blocks = KernelChoices(gdn_kernel_blocks=blocks).gdn_kernel_blocks
        got, final = entering_states(u, w, k, decay, state, hi, interpret=True, blocks=blocks)
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-5)
        np.testing.assert_array_equal(final, got[:, -1])
    with pytest.raises(ValueError, match="block_v must be a power of two >= 16"):
        KernelChoices(gdn_kernel_blocks=(24, 4))
