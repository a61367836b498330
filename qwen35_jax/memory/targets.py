"""The devices a train step can be compiled for without having them: the GPUs of `gpu_targets` and
the TPUs of `tpu_targets`, behind one name each ("h200", "v5p", ...)."""

from __future__ import annotations

import contextlib
from typing import Any

from qwen35_jax.memory.gpu_targets import GPU_TARGETS, GpuTarget, compile_only_devices, cudnn_as_on_target
from qwen35_jax.memory.tpu_targets import TPU_TARGETS, TpuTarget, tpu_compile_only_devices

COMPILE_TARGETS = (*GPU_TARGETS, *TPU_TARGETS)


def target_backend(target: str) -> str:
    """"gpu" or "tpu", as `jax.default_backend()` names the target's platform; a one-line ValueError
    for a name that is neither."""
    if target in GPU_TARGETS:
        return "gpu"
    if target in TPU_TARGETS:
        return "tpu"
    raise ValueError(f"--target {target!r} is not one of {COMPILE_TARGETS}")


def _description(target: str) -> GpuTarget | TpuTarget:
    return (GPU_TARGETS if target_backend(target) == "gpu" else TPU_TARGETS)[target]


def target_memory_bytes(target: str) -> int:
    """What one device (a GPU, a TPU chip) of the target holds."""
    return _description(target).memory_bytes


def target_compiler(target: str) -> str:
    """The compiler and device, for a report's header: "XLA:GPU for NVIDIA H200"."""
    return f"XLA:{target_backend(target).upper()} for {_description(target).description}"


def target_devices(target: str, count: int) -> list[Any]:
    """`count` compile-only devices of the target (jax's CUDA plugin or libtpu, no device needed)."""
    if target_backend(target) == "gpu":
        return compile_only_devices(target, count)
    return tpu_compile_only_devices(target, count)


def traced_for(target: str | None) -> contextlib.AbstractContextManager[None]:
    """What a step traced for `target` needs beyond its kernel choices' platform: on a GPU target jax's
    cuDNN checks answer for the target (`cudnn_as_on_target`); nothing otherwise."""
    if target is not None and target_backend(target) == "gpu":
        return cudnn_as_on_target()
    return contextlib.nullcontext()
