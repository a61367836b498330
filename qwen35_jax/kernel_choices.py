"""The kernel and parallelism choices a user can switch from the command line.

Attention implementation (`auto|xla|pallas|cudnn`), GDN sequence-parallel mode and the GDN matmul
precision are chosen per run and carried by the model config (`kernels_config`); the fused log-prob
backend and lm_head mode go to the step itself. When a step fails on a GPU or TPU while a Pallas
kernel is selected, `explain_compile_failure` names the flags that fall back to XLA, so nobody has to
edit code to get going.
"""

from __future__ import annotations

from qwen35_kernels.attention import resolve_implementation
from qwen35_kernels.choices import KernelChoices
from qwen35_kernels.logprob_entropy.api import resolve_backend

from qwen35_jax.config import Qwen35Config


def kernels_config(config: Qwen35Config, *, attention: str = "auto", gdn_sp_mode: str = "all_to_all",
                   gdn_precision: str = "auto") -> Qwen35Config:
    """`config` with a run's kernel flags: the attention implementation and GDN matmul precision in its
    `kernels`, the GDN sequence-parallel mode beside them."""
    return config.replace(kernels=config.kernels.replace(attention=attention, gdn_precision=gdn_precision),
                          gdn_sp_mode=gdn_sp_mode)


def check_kernel_choices(attention: str, compute_dtype: str, flag: str = "--compute-dtype") -> None:
    """One-line ValueError, before anything is built, for an attention kernel this run cannot use:
    "cudnn" off a GPU or with float32 compute (cuDNN's flash attention takes bf16/fp16)."""
    if resolve_implementation(attention) == "cudnn" and compute_dtype not in ("bfloat16", "float16"):
        raise ValueError(f"--attention cudnn needs {flag} bfloat16 (cuDNN flash attention takes bf16/fp16), "
                         f"got {compute_dtype}")


def explain_compile_failure(err: Exception, *, attention: str, logprob_backend: str,
                            kernels: KernelChoices = KernelChoices()) -> str | None:
    """A one-line message naming the fallback flags, when a Pallas or cuDNN kernel may have caused
    `err` (never on CPU, where every choice but cuDNN resolves to XLA and cuDNN is refused up front);
    None when no fallback applies. cuDNN attention falls back to the default (Triton) kernel.
    `kernels`: the run's kernel choices, whose platform is the one the step ran on."""
    if kernels.resolve().platform == "cpu" or isinstance(err, ValueError):
        return None
    fallbacks = []
    if attention == "cudnn":
        fallbacks.append("--attention auto")
    elif attention in ("auto", "pallas"):
        fallbacks.append("--attention xla")
    if resolve_backend(logprob_backend) in ("pallas", "pallas_xla"):
        fallbacks.append("--logprob-backend xla")
    if not fallbacks:
        return None
    first = (str(err).strip().splitlines() or [""])[0][:300]
    kind = "Pallas or cuDNN" if attention == "cudnn" else "Pallas"
    return (f"the first step failed to compile or run ({type(err).__name__}: {first}); if a {kind} kernel "
            f"is the cause, rerun with {' and '.join(fallbacks)}")
