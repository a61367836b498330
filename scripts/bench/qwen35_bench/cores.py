"""The sequence mixers alone, forward+backward of sum(out * cotangent), ours against transformers':
the GDN core (`chunked_gated_delta_rule` vs `torch_chunk_gated_delta_rule`) and the causal
document-masked attention core (`attention_core` vs `scaled_dot_product_attention` with the same
boolean mask); and the GDN rule's chunk-local part, our Pallas kernels against our XLA form."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_bench.timing import jit_tuned, time_side_by_side


def time_gdn_core(
    seq: int,
    heads: int,
    dim: int,
    *,
    steps: int,
    ours: bool = True,
    theirs: bool = True,
    scans: list[str] | None = None,
    precisions: list[str] | None = None,
    kernel_blocks: list[tuple[int, int]] | None = None,
) -> dict:
    """One row: the GDN core at B = 1, S = `seq`, `heads` key = value heads of `dim`, q and k
    L2-normalised. Ours once per (chunk scan, precision, kernel blocks) combination (None: the
    defaults), each after the first with its largest gradient error relative to the first's."""
    rng = np.random.default_rng(0)
    B, S, H, D = 1, seq, heads, dim
    q, k = (rng.standard_normal((B, S, H, D)).astype(np.float32) for _ in range(2))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    v = rng.standard_normal((B, S, H, D)).astype(np.float32)
    g = -np.abs(rng.standard_normal((B, S, H))).astype(np.float32) * 0.1
    beta = (1 / (1 + np.exp(-rng.standard_normal((B, S, H))))).astype(np.float32)
    cot = rng.standard_normal((B, S, H, D)).astype(np.float32)
    jargs = [jnp.asarray(x) for x in (q, k, v, g, beta)]

    from qwen35_kernels.choices import KernelChoices
    from qwen35_kernels.gated_delta_rule.chunked import chunked_gated_delta_rule

    grads = {}
    for scan in scans or [None]:
        for precision in precisions or [None]:
            for blocks in kernel_blocks or [None]:
                choices = KernelChoices() if blocks is None else KernelChoices(gdn_kernel_blocks=blocks)

                def gdn_loss(q, k, v, g, beta, precision=precision, scan=scan, choices=choices):
                    # torch's rule scales q inside; ours takes it scaled
                    out, _ = chunked_gated_delta_rule(q * D**-0.5, k, v, g, beta, precision=precision,
                                                      chunk_scan=scan, choices=choices)
                    return jnp.sum(out * cot)

                grad = jit_tuned(jax.grad(gdn_loss, argnums=(0, 1, 2, 3, 4)))
                label = None if blocks is None else "blocks {}x{}".format(*blocks)
                grads[" ".join(["ours", *(x for x in (precision, scan, label) if x is not None)])] = grad
    fns = {name: (lambda f=f: jax.block_until_ready(f(*jargs))) for name, f in grads.items()} if ours else {}
    if theirs:
        import torch
        from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

        targs = [torch.tensor(x, requires_grad=True) for x in (q, k, v, g, beta)]
        tcot = torch.tensor(cot)

        def torch_gdn() -> None:
            out, _ = torch_chunk_gated_delta_rule(*targs)
            torch.autograd.grad((out * tcot).sum(), targs)

        fns["transformers"] = torch_gdn
    row = {"config": "gdn_core", "settings": dict(B=B, S=S, H=H, d=D), "batch": B, "seq": S,
           **time_side_by_side(fns, steps)}
    if ours and len(grads) > 1:
        ref = [np.asarray(x, np.float64) for x in next(iter(grads.values()))(*jargs)]
        for name, f in list(grads.items())[1:]:
            row[name]["max_rel_grad_err_vs_first"] = max(
                float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max()) for a, b in zip(f(*jargs), ref))
    return row


def time_gdn_chunk_local(seq: int, heads: int, dim: int, *, steps: int, chunk: int = 64,
                         precisions: list[str] | None = None) -> dict:
    """One row: the chunked rule's chunk-local part alone (u, w, intra and the decayed q and k of every
    chunk from q, k, v, the decays and beta; `pallas_chunk_local.py`), forward+backward of
    sum(outputs * cotangents), as the Pallas kernels against the batched XLA ops, at B = 1, S = `seq`,
    `heads` key = value heads of `dim`, one document; once per precision (None: the backend's), each
    kernel's largest gradient error relative to the XLA form's at the same precision."""
    from qwen35_kernels.gated_delta_rule.chunked import xla_chunk_local
    from qwen35_kernels.gated_delta_rule.matmul import resolve_gdn_precision
    from qwen35_kernels.gated_delta_rule.pallas_chunk_local import pallas_chunk_local

    if seq % chunk:
        raise ValueError(f"chunk-local core: --core-seq {seq} is not a multiple of the chunk size {chunk}")
    rng = np.random.default_rng(0)
    B, n, H, L, D = 1, seq // chunk, heads, chunk, dim
    q, k = (rng.standard_normal((B, n, H, L, D)).astype(np.float32) for _ in range(2))
    q, k = (x / np.linalg.norm(x, axis=-1, keepdims=True) for x in (q, k))
    q = q * D**-0.5
    v = rng.standard_normal((B, n, H, L, D)).astype(np.float32)
    cum = np.cumsum(-np.abs(rng.standard_normal((B, n, H, L))) * 0.1, axis=-1).astype(np.float32)
    beta = (1 / (1 + np.exp(-rng.standard_normal((B, n, H, L))))).astype(np.float32)
    read, write = np.exp(cum), np.exp(cum[..., -1:] - cum)
    cot_u, cot_w = (rng.standard_normal((B, n, H, L, D)).astype(np.float32) for _ in range(2))
    cot_intra = rng.standard_normal((B, n, H, L, L)).astype(np.float32)
    doc = np.zeros((B, n, L), np.int32)
    cot_q, cot_k = (rng.standard_normal((B, n, H, L, D)).astype(np.float32) for _ in range(2))
    jargs = [jnp.asarray(x) for x in (q, k, v, cum, beta, read, write)]

    def grouped(x):  # [B, n, H, L, ...] -> the XLA form's [B, n, Hk, G = 1, L, ...]
        return x[:, :, :, None]

    grads, ref_of = {}, {}
    for precision in precisions or [None]:
        prec = resolve_gdn_precision(None, precision)

        def kernel_loss(q, k, v, cum, beta, read, write, prec=prec):
            u, w, intra, q_read, k_write = pallas_chunk_local(q, k, v, cum, beta, read, write, doc, prec)
            return (jnp.sum(u * cot_u) + jnp.sum(w * cot_w) + jnp.sum(intra * cot_intra)
                    + jnp.sum(q_read * cot_q) + jnp.sum(k_write * cot_k))

        def xla_loss(q, k, v, cum, beta, read, write, prec=prec):
            u, w, intra = (x[:, :, :, 0] for x in xla_chunk_local(*(grouped(x) for x in (q, k, v, cum, beta, read)),
                                                                  doc, prec))
            q_read, k_write = q * read[..., None], k * write[..., None]  # as the rule forms them around XLA's
            return (jnp.sum(u * cot_u) + jnp.sum(w * cot_w) + jnp.sum(intra * cot_intra)
                    + jnp.sum(q_read * cot_q) + jnp.sum(k_write * cot_k))

        suffix = "" if precision is None else f" {precision}"
        for form, loss in (("xla", xla_loss), ("pallas", kernel_loss)):
            grads[f"ours {form}{suffix}"] = jit_tuned(jax.grad(loss, argnums=tuple(range(7))))
        ref_of[f"ours pallas{suffix}"] = f"ours xla{suffix}"
    fns = {name: (lambda f=f: jax.block_until_ready(f(*jargs))) for name, f in grads.items()}
    row = {"config": "gdn_chunk_local", "settings": dict(B=B, S=seq, H=H, d=D, L=L), "batch": B, "seq": seq,
           **time_side_by_side(fns, steps)}
    for name, ref_name in ref_of.items():
        ref = [np.asarray(x, np.float64) for x in grads[ref_name](*jargs)]
        row[name]["max_rel_grad_err_vs_xla"] = max(float(np.abs(np.asarray(a, np.float64) - b).max() / np.abs(b).max())
                                                   for a, b in zip(grads[name](*jargs), ref))
    return row


def time_attention_core(seq: int, *, steps: int, ours: bool = True, theirs: bool = True) -> dict:
    """One row: the attention core at B = 1, S = `seq`, 4 query / 2 kv heads of 64, two documents (cut
    at S / 3), causal."""
    from qwen35_kernels.attention import attention_core

    rng = np.random.default_rng(0)
    B, S, H, K, Dh = 1, seq, 4, 2, 64
    q = rng.standard_normal((B, S, H, Dh)).astype(np.float32)
    k, v = (rng.standard_normal((B, S, K, Dh)).astype(np.float32) for _ in range(2))
    seg = (1 + (np.arange(S) >= S // 3)).astype(np.int32)[None].repeat(B, 0)
    cot = rng.standard_normal((B, S, H, Dh)).astype(np.float32)

    def attn_loss(q, k, v):
        return jnp.sum(attention_core(q, k, v, jnp.asarray(seg)) * cot)

    grad = jit_tuned(jax.grad(attn_loss, argnums=(0, 1, 2)))
    jargs = [jnp.asarray(x) for x in (q, k, v)]
    fns = {"ours": lambda: jax.block_until_ready(grad(*jargs))} if ours else {}
    if theirs:
        import torch
        import torch.nn.functional as F

        tq, tk, tv = (torch.tensor(x, requires_grad=True) for x in (q, k, v))
        tseg = torch.tensor(seg)
        mask = (torch.tril(torch.ones(S, S, dtype=torch.bool)) & (tseg[:, :, None] == tseg[:, None, :]))[:, None]
        tcot = torch.tensor(cot)

        def torch_attn() -> None:
            out = F.scaled_dot_product_attention(tq.transpose(1, 2), tk.transpose(1, 2), tv.transpose(1, 2),
                                                 attn_mask=mask, enable_gqa=True).transpose(1, 2)
            torch.autograd.grad((out * tcot).sum(), (tq, tk, tv))

        fns["transformers"] = torch_attn
    return {"config": "attention_core", "settings": dict(B=B, S=S, H=H, K=K, Dh=Dh), "batch": B, "seq": S,
            **time_side_by_side(fns, steps)}
