"""qwen35_kernels.gated_delta_rule in FLA's call convention against transformers' per-token recurrence
run in float64: outputs, final state and the gradients of every input, with grouped value heads, the
in-kernel q/k L2 norm, an initial state and packed documents."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from qwen35_kernels.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

from float64_reference import torch_float64

B, T, H, HV, DK, DV = 2, 37, 2, 4, 16, 16  # T is no multiple of the chunk; 2 value heads per key head
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def problem(seed: int, b: int = B, t: int = T) -> dict[str, np.ndarray]:
    """Raw q, k (the kernel normalises them), v, log decays g <= 0, beta in (0, 1), a state; float32."""
    rng = np.random.default_rng(seed)
    x = {"q": rng.normal(size=(b, t, H, DK)), "k": rng.normal(size=(b, t, H, DK)), "v": rng.normal(size=(b, t, HV, DV)),
         "g": -np.log1p(np.exp(rng.normal(size=(b, t, HV)))), "beta": 1 / (1 + np.exp(-rng.normal(size=(b, t, HV)))),
         "initial_state": 0.3 * rng.normal(size=(b, HV, DK, DV))}
    return {name: a.astype(np.float32) for name, a in x.items()}


def cotangents(seed: int, b: int = B, t: int = T) -> tuple[np.ndarray, np.ndarray]:
    """Random weights of o and of the final state: the test's loss is sum(o * wo) + sum(S * ws)."""
    rng = np.random.default_rng(seed + 100)
    return rng.normal(size=(b, t, HV, DV)), rng.normal(size=(b, HV, DK, DV))


def float64_truth(x: dict[str, np.ndarray], wo: np.ndarray, ws: np.ndarray, *, l2norm: bool = True,
                  q_factor: float = 1.0) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    """transformers' recurrence in float64 end to end: o, final state, and the loss's input gradients.
    `q_factor` multiplies q before it (transformers has no `scale`: it always scales by Dk ** -0.5)."""
    t = {name: torch.tensor(a, dtype=torch.float64, requires_grad=True) for name, a in x.items()}
    with torch_float64():
        o, state = torch_recurrent_gated_delta_rule(t["q"] * q_factor, t["k"], t["v"], t["g"], t["beta"],
                                                    initial_state=t["initial_state"], output_final_state=True,
                                                    use_qk_l2norm_in_kernel=l2norm)
        loss = (o * torch.tensor(wo)).sum() + (state * torch.tensor(ws)).sum()
        loss.backward()
    return o.detach().numpy(), state.detach().numpy(), {n: t[n].grad.numpy() for n in NAMES}


def ours(rule, x: dict[str, np.ndarray], wo: np.ndarray, ws: np.ndarray, **kwargs):
    """`rule` in float32: o, final state and the same loss's gradients (jax.grad of every input)."""
    def loss(args):
        o, state = rule(*(args[n] for n in NAMES[:5]), initial_state=args["initial_state"], output_final_state=True,
                        **kwargs)
        return jnp.sum(o * wo) + jnp.sum(state * ws), (o, state)

    grads, (o, state) = jax.grad(loss, has_aux=True)(jax.tree.map(jnp.asarray, x))
    return np.asarray(o), np.asarray(state), {n: np.asarray(g) for n, g in grads.items()}


def assert_close(got: np.ndarray, want: np.ndarray, what: str, tol: float = 1e-5) -> None:
    """Within `tol` of the reference's largest entry (at least 1): float32 rounding of sums over at most
    T tokens, measured at most 4e-7 on these shapes for every rule and gradient; a wrong mask, decay,
    scale or head mapping is O(1)."""
    scale = max(1.0, float(np.abs(want).max()))
    err = float(np.abs(got - want).max()) / scale
    assert err < tol, f"{what}: max error {err:.2e} of scale {scale:.3g}"


RULES = {
    "chunk sequential": (chunk_gated_delta_rule, {"chunk_size": 16, "chunk_scan": "sequential", "precision": "highest"}),
    "chunk associative": (chunk_gated_delta_rule, {"chunk_size": 16, "chunk_scan": "associative", "precision": "highest"}),
    "chunk pallas": (chunk_gated_delta_rule, {"chunk_size": 16, "chunk_scan": "pallas", "precision": "highest"}),
    "fused recurrent": (fused_recurrent_gated_delta_rule, {}),
}


@pytest.mark.parametrize("name", RULES)
def test_outputs_state_and_every_gradient_match_float64(name):
    rule, kwargs = RULES[name]
    x = problem(0)
    wo, ws = cotangents(0)
    o_ref, s_ref, g_ref = float64_truth(x, wo, ws)
    o, s, grads = ours(rule, x, wo, ws, use_qk_l2norm_in_kernel=True, **kwargs)
    assert o.shape == (B, T, HV, DV) and s.shape == (B, HV, DK, DV)
    assert_close(o, o_ref, "o")
    assert_close(s, s_ref, "final state")
    for n in NAMES:
        assert_close(grads[n], g_ref[n], f"d{n}")


def test_scale_without_l2norm():
    # no in-kernel norm: raw q and k of norm ~4, kept small by a short sequence; scale 0.1 instead of 1/4
    x = problem(1, t=12)
    x["q"], x["k"] = x["q"] / 4, x["k"] / 4
    wo, ws = cotangents(1, t=12)
    o_ref, s_ref, g_ref = float64_truth(x, wo, ws, l2norm=False, q_factor=0.1 * DK**0.5)
    for name in ("chunk associative", "fused recurrent"):
        rule, kwargs = RULES[name]
        o, s, grads = ours(rule, x, wo, ws, scale=0.1, **kwargs)
        assert_close(o, o_ref, "o")
        assert_close(s, s_ref, "final state")
        assert_close(grads["q"], g_ref["q"], "dq")


def test_packed_documents_equal_separate_runs():
    # One row packs three documents and trailing padding: [0, 9) [9, 25) [25, 33) pad [33, 37).
    # Each document equals its own run (the first from the initial state, the others from zero),
    # padding outputs zeros, and the final state is the last document's.
    x = problem(2, b=1)
    bounds = [(0, 9), (9, 25), (25, 33)]
    seg = np.zeros((1, T), np.int32)
    for i, (a, b) in enumerate(bounds):
        seg[0, a:b] = i + 1
    for rule, kwargs in RULES.values():
        o, s = rule(*(jnp.asarray(x[n]) for n in NAMES[:5]), initial_state=jnp.asarray(x["initial_state"]),
                    output_final_state=True, use_qk_l2norm_in_kernel=True, segment_ids=jnp.asarray(seg), **kwargs)
        for i, (a, b) in enumerate(bounds):
            doc = {n: x[n][:, a:b] for n in NAMES[:5]}
            doc["initial_state"] = x["initial_state"] if i == 0 else np.zeros_like(x["initial_state"])
            wo, ws = np.zeros((1, b - a, HV, DV)), np.zeros((1, HV, DK, DV))
            o_ref, s_ref, _ = float64_truth(doc, wo, ws)
            assert_close(np.asarray(o)[:, a:b], o_ref, f"document {i + 1}")
        np.testing.assert_array_equal(np.asarray(o)[:, 33:], 0.0)
        assert_close(np.asarray(s), s_ref, "final state = the last document's")


def test_dtypes_and_optional_final_state():
    x = {n: jnp.asarray(a, jnp.bfloat16) for n, a in problem(3).items()}
    for name in ("chunk associative", "fused recurrent"):
        rule, kwargs = RULES[name]
        o, s = rule(*(x[n] for n in NAMES[:5]), use_qk_l2norm_in_kernel=True, **kwargs)
        assert o.dtype == jnp.bfloat16 and s is None
        _, s = rule(*(x[n] for n in NAMES[:5]), initial_state=x["initial_state"], output_final_state=True, **kwargs)
        assert s.dtype == jnp.float32


def test_bad_shapes_are_one_line_errors():
    x = {n: jnp.asarray(a) for n, a in problem(4).items()}
    with pytest.raises(ValueError, match=r"value heads \(3\) must be a multiple of key heads \(2\)"):
        chunk_gated_delta_rule(x["q"], x["k"], x["v"][:, :, :3], x["g"][..., :3], x["beta"][..., :3])
    with pytest.raises(ValueError, match="initial_state must be"):
        fused_recurrent_gated_delta_rule(*(x[n] for n in NAMES[:5]), initial_state=x["initial_state"][:1])
    with pytest.raises(ValueError, match=r"q must be \[B, T, H, Dk\]"):
        chunk_gated_delta_rule(x["q"][0], x["k"], x["v"], x["g"], x["beta"])


def test_prefill_hands_its_state_to_the_per_token_step():
    # What generation does: the chunked rule over a prompt of 21 tokens returns its final state, and
    # the per-token rule continues from it one token at a time (T = 1); together they are the whole
    # sequence's recurrence, against float64.
    x = problem(5)
    zeros_o, zeros_s = np.zeros((B, T, HV, DV)), np.zeros((B, HV, DK, DV))
    o_ref, s_ref, _ = float64_truth(x, zeros_o, zeros_s)
    arrays = {n: jnp.asarray(a) for n, a in x.items()}
    head = {n: a[:, :21] for n, a in arrays.items() if n != "initial_state"}
    rule, kwargs = RULES["chunk sequential"]
    o, state = rule(*(head[n] for n in NAMES[:5]), initial_state=arrays["initial_state"], output_final_state=True,
                    use_qk_l2norm_in_kernel=True, **kwargs)
    outs = [o]
    for t in range(21, T):
        o, state = fused_recurrent_gated_delta_rule(*(arrays[n][:, t: t + 1] for n in NAMES[:5]), initial_state=state,
                                                    output_final_state=True, use_qk_l2norm_in_kernel=True)
        outs.append(o)
    assert_close(np.concatenate(outs, axis=1), o_ref, "o")
    assert_close(np.asarray(state), s_ref, "final state")
