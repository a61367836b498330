"""The gated delta rule in the call convention of FLA (`fla.ops.gated_delta_rule`) and transformers.

    S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - (exp(g_t) S_{t-1})^T k_t))^T        S: [Dk, Dv] per head
    o_t = S_t^T (scale q_t)

- q, k [B, T, H, Dk]; v [B, T, HV, Dv] with HV a multiple of H (value head h reads key head
  h // (HV // H), FLA's grouped value attention); g [B, T, HV] the log decay (<= 0); beta [B, T, HV].
- `scale` multiplies q (None: Dk ** -0.5); `use_qk_l2norm_in_kernel` L2-normalises q and k first
  (eps 1e-6, FLA's and transformers' `l2norm`), inside the differentiated function.
- `initial_state` [B, HV, Dk, Dv]; the final state comes back when `output_final_state` (else None),
  always float32. Every input is differentiable, `initial_state` included.
- `segment_ids` [B, T] (ids >= 1, 0 = padding) packs documents into a row: the state restarts from
  zero where a new id starts, padding tokens leave it untouched and output zeros. `initial_state`
  belongs to a row's first document and the final state is its last document's. FLA's `cu_seqlens`
  maps onto it (docs/kernels.md).

`chunk_gated_delta_rule` is the chunked UT/WY form (`chunked.py`: Pallas kernels on GPU, XLA
elsewhere); `fused_recurrent_gated_delta_rule` is the per-token recurrence (`reference.py`): the
oracle of the chunked form, and the one-token decode step. Both compute in float32 and return o in
q's dtype.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from qwen35_kernels.choices import KernelChoices
from qwen35_kernels.gated_delta_rule.chunked import chunked_gated_delta_rule
from qwen35_kernels.gated_delta_rule.reference import recurrent_gated_delta_rule
from qwen35_kernels.gdn_inputs.xla import l2_normalize


def _prepared_qk(q: jax.Array, k: jax.Array, scale: float | None, use_qk_l2norm_in_kernel: bool
                 ) -> tuple[jax.Array, jax.Array]:  # [B, T, H, Dk] each
    """q and k as the rule reads them: L2-normalised if asked (float32), q times `scale`."""
    if q.ndim != 4:
        raise ValueError(f"q must be [B, T, H, Dk], got shape {tuple(q.shape)}")
    if use_qk_l2norm_in_kernel:
        q, k = l2_normalize(q), l2_normalize(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * jnp.asarray(scale, q.dtype), k


def chunk_gated_delta_rule(
    q: jax.Array,  # [B, T, H, Dk]
    k: jax.Array,  # [B, T, H, Dk]
    v: jax.Array,  # [B, T, HV, Dv]
    g: jax.Array,  # [B, T, HV] log decay
    beta: jax.Array,  # [B, T, HV]
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,  # [B, HV, Dk, Dv]
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    segment_ids: jax.Array | None = None,  # [B, T]
    chunk_size: int = 64,
    chunk_scan: str | None = None,
    precision: str | None = None,
    choices: KernelChoices | None = None,
) -> tuple[jax.Array, jax.Array | None]:  # o [B, T, HV, Dv] in q.dtype, final state [B, HV, Dk, Dv] float32
    """The gated delta rule by chunks of `chunk_size` tokens (see the module docstring).

    `chunk_scan` ("sequential", "associative", "pallas"; None: the `choices`') carries the state from
    chunk to chunk; `precision` ("highest", "high", "default", "bf16"; None: the `choices`') is that of
    the matmuls with a head-dim contraction. Neither changes the result beyond rounding. `choices`
    (`qwen35_kernels.choices.KernelChoices`; None: the defaults for jax's backend) also give the
    platform, the sequence tile and the Triton state kernel's blocks."""
    out_dtype = q.dtype
    q, k = _prepared_qk(q, k, scale, use_qk_l2norm_in_kernel)
    o, state = chunked_gated_delta_rule(q, k, v, g, beta, segment_ids=segment_ids, initial_state=initial_state,
                                        chunk_size=chunk_size, chunk_scan=chunk_scan, precision=precision,
                                        out_dtype=out_dtype, choices=choices)
    return o, state if output_final_state else None


def fused_recurrent_gated_delta_rule(
    q: jax.Array,  # [B, T, H, Dk]
    k: jax.Array,  # [B, T, H, Dk]
    v: jax.Array,  # [B, T, HV, Dv]
    g: jax.Array,  # [B, T, HV] log decay
    beta: jax.Array,  # [B, T, HV]
    *,
    scale: float | None = None,
    initial_state: jax.Array | None = None,  # [B, HV, Dk, Dv]
    output_final_state: bool = False,
    use_qk_l2norm_in_kernel: bool = False,
    segment_ids: jax.Array | None = None,  # [B, T]
) -> tuple[jax.Array, jax.Array | None]:  # o [B, T, HV, Dv] in q.dtype, final state [B, HV, Dk, Dv] float32
    """The gated delta rule one token at a time (a `lax.scan`; see the module docstring): the oracle
    of `chunk_gated_delta_rule`, and a decode step when T = 1."""
    out_dtype = q.dtype
    q, k = _prepared_qk(q, k, scale, use_qk_l2norm_in_kernel)
    o, state = recurrent_gated_delta_rule(q, k, v, g, beta, segment_ids=segment_ids, initial_state=initial_state)
    return o.astype(out_dtype), state if output_final_state else None
