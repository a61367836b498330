"""Model FLOPs of a train step, device peak rates, and an independent count from a jaxpr.

`train_flops` counts every matmul of one forward pass over a batch (projections, attention scores and
values with the full S^2 term, the chunked delta rule of GDN, MLP or routed experts, the lm_head) and
multiplies by 3 (forward + backward of both operands). Recomputation under remat is not counted: MFU
measures useful work. `jaxpr_dot_flops` is the cross-check: the dot FLOPs of a traced function, every
scan body counted times its length.
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from qwen35_jax.config import Qwen35Config

# Dense bf16 peak TFLOP/s per chip (no sparsity), keyed by a substring of `device.device_kind`.
PEAK_TFLOPS = {
    "H100": 989.0, "H200": 989.0, "B200": 2250.0, "GB200": 2500.0,
    "TPU v4": 275.0, "TPU v5 lite": 197.0, "TPU v5e": 197.0, "TPU v5p": 459.0, "TPU v5": 459.0,
    "TPU v6 lite": 918.0, "TPU v6e": 918.0,
}


def peak_tflops(device: Any) -> float | None:
    """The table's peak for `device`, or None (CPU, unknown chips: MFU is then not reported)."""
    kind = getattr(device, "device_kind", "")
    for name in sorted(PEAK_TFLOPS, key=len, reverse=True):
        if name.lower() in kind.lower():
            return PEAK_TFLOPS[name]
    return None


def forward_flops_per_token(config: Qwen35Config, seq_len: int) -> dict[str, float]:
    """Matmul FLOPs per token of one forward pass, by component, for rows of `seq_len` tokens."""
    c = config
    d, s = c.hidden_size, seq_len
    n_attn = sum(kind == "full_attention" for kind in c.layer_types)
    n_gdn = c.num_hidden_layers - n_attn
    h, kv, dh = c.num_attention_heads, c.num_key_value_heads, c.head_dim
    # q_proj holds query and output gate; scores q k^T and weighted values over the full row
    attention = 2 * d * (2 * h * dh + 2 * kv * dh) + 2 * h * dh * d + 4 * s * h * dh
    hk, hv, dk, dv, chunk = (c.linear_num_key_heads, c.linear_num_value_heads, c.linear_key_head_dim,
                             c.linear_value_head_dim, min(c.gdn_chunk(), s))
    projections = 2 * d * (2 * hk * dk + 2 * hv * dv + 2 * hv) + 2 * hv * dv * d  # qkv, z, a, b; out
    # per value head and token: k_beta k^T and q k^T within the chunk (2L Dk each), the unit-triangular
    # solve for [v, k] (L (Dk + Dv)), state reads w S and q S and the write k^T v (2 Dk Dv each),
    # intra-chunk attention times values (2 L Dv)
    delta_rule = hv * (4 * chunk * dk + chunk * (dk + dv) + 6 * dk * dv + 2 * chunk * dv)
    gdn = projections + delta_rule
    if c.is_moe:
        mlp = (2 * d * c.num_experts + 6 * d * c.moe_intermediate_size * c.num_experts_per_tok
               + 6 * d * c.shared_expert_intermediate_size + 2 * d)
    else:
        mlp = 6 * d * c.intermediate_size
    return {"attention": float(n_attn * attention), "gdn": float(n_gdn * gdn),
            "mlp": float(c.num_hidden_layers * mlp), "lm_head": float(2 * d * c.vocab_size)}


def train_flops(config: Qwen35Config, rows: int, seq_len: int) -> float:
    """Model FLOPs of one optimizer step over `rows` x `seq_len` tokens (forward + backward)."""
    return 3.0 * rows * seq_len * sum(forward_flops_per_token(config, seq_len).values())


def _dot_flops(eqn: Any) -> float:
    if eqn.primitive.name == "dot_general":
        (lhs_contract, _), (lhs_batch, _) = eqn.params["dimension_numbers"]
        lhs, rhs = (v.aval.shape for v in eqn.invars)
        out = eqn.outvars[0].aval.shape
        return 2.0 * np.prod(out, dtype=np.float64) * np.prod([lhs[i] for i in lhs_contract], dtype=np.float64)
    if eqn.primitive.name == "ragged_dot":  # [M, K] x [G, K, N] -> [M, N]: each row meets one group
        m, k = eqn.invars[0].aval.shape
        return 2.0 * m * k * eqn.invars[1].aval.shape[-1]
    return 0.0


def _sub_jaxprs(eqn: Any) -> list[tuple[Any, float]]:
    """(sub-jaxpr, times it runs) for the eqn's bodies: a scan's body `length` times, any other
    higher-order primitive's (pjit, remat, custom_vjp, shard_map, cond: its costliest branch) once."""
    if eqn.primitive.name == "scan":
        return [(eqn.params["jaxpr"], float(eqn.params["length"]))]
    if eqn.primitive.name == "cond":
        return [(max(eqn.params["branches"], key=lambda b: jaxpr_dot_flops(b)), 1.0)]
    if eqn.primitive.name == "while":
        raise ValueError("while loop with an unknown trip count in the jaxpr: FLOPs cannot be counted")
    found = []
    for value in eqn.params.values():
        for item in value if isinstance(value, (tuple, list)) else (value,):
            if isinstance(item, (jax.extend.core.Jaxpr, jax.extend.core.ClosedJaxpr)):
                found.append((item, 1.0))
    return found


def jaxpr_dot_flops(jaxpr: Any) -> float:
    """Dot FLOPs of a (closed) jaxpr, every scan body times its length."""
    jaxpr = getattr(jaxpr, "jaxpr", jaxpr)
    total = 0.0
    for eqn in jaxpr.eqns:
        total += _dot_flops(eqn)
        for sub, times in _sub_jaxprs(eqn):
            total += times * jaxpr_dot_flops(sub)
    return total
