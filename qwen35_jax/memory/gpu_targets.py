"""GPUs to compile for without one: their descriptions, compile-only devices of them, and jax's cuDNN
checks answered for them.

XLA compiles for a GPU from a description of it (its PJRT "target config": SM count, memory, compute
capability, cuDNN and CUDA versions): jax's CUDA plugin makes compile-only devices of that description
(`jax.experimental.topologies`), and a jit lowered onto a mesh of them compiles to the program the
device would run, Triton kernels and cuDNN calls included, with the device's own memory figures. It
needs the plugin, not the CUDA libraries (`pip install -e ".[gpu-compile]"`; on a GPU machine the
installed one serves). The program traced is the GPU's because the model's kernel choices, which
its layers pass to every kernel, name the platform "gpu" (`qwen35_kernels.choices`); only jax's cuDNN attention asks the local device
for its cuDNN version and compute capability, which `cudnn_as_on_target` answers for the target.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GpuTarget:
    """What XLA:GPU's compiler needs to know about a device."""

    description: str  # as the device reports itself
    memory_bytes: int  # what the device holds (XLA sizes its scheduling and rematerialisation by it)
    memory_bandwidth: float  # bytes/s
    sm_count: int
    l2_bytes: int
    clock_ghz: float
    cudnn: tuple[int, int] = (9, 10)
    cuda: tuple[int, int] = (12, 8)

    def target_config(self) -> str:
        """The PJRT GPU target config (`stream_executor.GpuTargetConfigProto`, text format)."""
        return f"""gpu_device_info {{
  threads_per_block_limit: 1024 threads_per_warp: 32 shared_memory_per_block: 49152
  shared_memory_per_core: 233472 threads_per_core_limit: 2048 core_count: {self.sm_count}
  fpus_per_core: 128 block_dim_limit_x: 2147483647 block_dim_limit_y: 65535 block_dim_limit_z: 65535
  memory_bandwidth: {int(self.memory_bandwidth)} l2_cache_size: {self.l2_bytes} clock_rate_ghz: {self.clock_ghz}
  device_memory_size: {self.memory_bytes} shared_memory_per_block_optin: 232448
  cuda_compute_capability {{ major: 9 minor: 0 }}
  registers_per_core_limit: 65536 registers_per_block_limit: 65536
}}
platform_name: "CUDA"
dnn_version_info {{ major: {self.cudnn[0]} minor: {self.cudnn[1]} }}
runtime_version {{ major: {self.cuda[0]} minor: {self.cuda[1]} }}
device_description_str: "{self.description}"
"""


# Hopper SXM parts. The H200's memory is what the leased one reported (143,771 MiB).
GPU_TARGETS = {
    "h100": GpuTarget("NVIDIA H100 80GB HBM3", 81_559 * 2**20, 3.35e12, 132, 50 * 2**20, 1.98),
    "h200": GpuTarget("NVIDIA H200", 143_771 * 2**20, 4.8e12, 132, 50 * 2**20, 1.98),
}


def compile_only_devices(target: str, count: int) -> list[Any]:
    """`count` compile-only devices of GPU_TARGETS[target], one host's worth; a one-line error
    when jax's CUDA plugin is missing."""
    from jax.experimental import topologies

    if target not in GPU_TARGETS:
        raise ValueError(f"unknown GPU target {target!r}; choose one of {sorted(GPU_TARGETS)}")
    try:
        topology = topologies.get_topology_desc(platform="cuda", target_config=GPU_TARGETS[target].target_config(),
                                                topology=f"1x1x{count}")
    except NotImplementedError as err:  # no CUDA plugin registered its topologies
        raise RuntimeError("compiling for a GPU without one needs jax's CUDA plugin: "
                           f"pip install -e '.[gpu-compile]' ({type(err).__name__}: {err})") from None
    except RuntimeError as err:
        first = (str(err).strip().splitlines() or [""])[0]
        raise RuntimeError(f"jax's CUDA plugin made no compile-only {target} devices: {first}") from None
    return list(topology.devices)


@contextlib.contextmanager
def cudnn_as_on_target() -> Iterator[None]:
    """Inside the block jax's cuDNN attention module takes the target for a Hopper with cuDNN 9.10 (it
    asks the local device otherwise), so `--attention cudnn` traces as a GPU traces it."""
    from jax._src.cudnn import fused_attention_stablehlo as cudnn

    saved = cudnn.check_cudnn_version, cudnn.check_compute_capability
    cudnn.check_cudnn_version = lambda: 91000
    cudnn.check_compute_capability = lambda capability: True
    try:
        yield
    finally:
        cudnn.check_cudnn_version, cudnn.check_compute_capability = saved
