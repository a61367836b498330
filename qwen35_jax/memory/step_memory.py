"""Compile-time memory of one whole train step on a (fsdp, sp) mesh, from abstract inputs only.

The step is the trainer's own (`qwen35_jax.train.step.make_train_step`, a pure function of parameters,
AdamW state and batch), lowered from ShapeDtypeStructs so that nothing is allocated: sequence-sharded
forward, the fused log-prob kernel, the SFT loss, gradients, global-norm clipping and the AdamW update,
float32 master weights and moments ZeRO-3 sharded over (fsdp, sp), bf16 compute.
Parameters and optimizer state are donated, so their outputs alias their inputs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from qwen35_kernels.choices import DEFAULT_SEQUENCE_TILE

from qwen35_jax.config import Qwen35Config
from qwen35_jax.memory.targets import target_backend, target_devices, traced_for
from qwen35_jax.model import scans_layers
from qwen35_jax.parallel.mesh import FSDP, SP, make_mesh
from qwen35_jax.train.abstract_state import abstract_train_state
from qwen35_jax.train.optim import make_optimizer, make_schedule
from qwen35_jax.train.step import MICRO_BSS, StepOptions, make_train_step
from qwen35_jax.vision.inputs import VisionInputs


@dataclass(frozen=True)
class StepMemory:
    """Per-device bytes of one compiled train step (XLA's `memory_analysis()`)."""

    seq: int
    arguments: int
    outputs: int
    temporaries: int
    aliased: int
    compile_s: float

    @property
    def total(self) -> int:
        """What the device holds at the peak: arguments + outputs + temporaries - aliased."""
        return self.arguments + self.outputs + self.temporaries - self.aliased


def traced_platform(target: str | None) -> str:
    """The platform whose program `compile_train_step` builds for `target`: the target's ("gpu" or
    "tpu"), and without one a GPU's (on this process's devices, its kernels interpreted)."""
    return "gpu" if target is None else target_backend(target)


def traced_config(config: Qwen35Config, target: str | None) -> Qwen35Config:
    """`config` with its "auto" layer layout and GDN chunk size resolved for `traced_platform(target)`,
    as `compile_train_step` traces the step (not for this process's CPU, whose chunks can differ)."""
    platform = traced_platform(target)
    return config.replace(scan_layers=scans_layers(config, backend=platform),
                          gdn_chunk_size=config.gdn_chunk(platform))


def compile_train_step(config: Qwen35Config, seq: int, mesh_shape: tuple[int, int], *,
                       gdn_mode: str = "all_to_all", attention: str = "pallas",
                       gdn_scan: str = "pallas", tile: int | None = DEFAULT_SEQUENCE_TILE,
                       lm_head_mode: str = "gather", batch: int | None = None,
                       devices: list[Any] | None = None, gdn_precision: str | None = None,
                       logprob_backend: str = "auto", target: str | None = None,
                       image_patches: int | None = None) -> tuple[Any, float]:
    """Lower and compile the whole train step for one [batch, seq] batch (batch default: fsdp).

    By default the program an H200 runs: attention ("pallas": the GPU flash kernel, no [S, S] or
    [block, S] scores) and the GDN chunk-state scan (`KernelChoices.gdn_chunk_scan`, "pallas": the Triton kernel,
    whose mixers keep only their inputs and chunk states) lower in interpret mode on CPU, and a
    `scan_layers` and a GDN chunk size of "auto" are resolved as on a GPU (`traced_config`). tile: `sequence_tile` (None:
    untiled). lm_head_mode: as `score_tokens` takes it. gdn_precision: the chunked delta rule's matmul
    precision (`KernelChoices.gdn_precision`; None: the platform's default). logprob_backend: the fused
    log-prob kernel's (`qwen35_kernels.BACKENDS`). devices: the mesh's devices
    (default: this process's). target: a device of `targets.COMPILE_TARGETS` to compile for with its
    own compiler instead, on compile-only devices of it (no GPU or TPU needed): that device's program
    and memory. A TPU target runs the TPU's kernels: the Pallas TPU attention ("pallas" is it there)
    and the associative GDN chunk scan ("pallas" is taken as "auto"), its layers as a TPU lays them out.
    image_patches: a VLM step whose batch also holds that many image patches (one bucket; the tower runs,
    its features replace placeholders, positions are three-axis), as `train/vision.py` places them."""
    fsdp, sp = mesh_shape
    config = traced_config(config, target)
    platform = None if target is None else target_backend(target)  # None: this process's (kernels interpreted)
    if platform == "tpu" and gdn_scan == "pallas":
        gdn_scan = "auto"
    kernels = config.kernels.replace(attention=attention, gdn_chunk_scan=gdn_scan, sequence_tile=tile,
                                     gdn_precision=gdn_precision or "auto", platform=platform)
    config = config.replace(kernels=kernels, gdn_sp_mode=gdn_mode)
    if target is not None:
        devs = target_devices(target, fsdp * sp)
    else:
        devs = list(jax.devices() if devices is None else devices)[: fsdp * sp]
    mesh = make_mesh(mesh_shape, devices=devs)
    tx = make_optimizer(make_schedule(1e-5, 1000))  # the trainer's AdamW + clipping: its state is what counts
    graphdef, params, opt_state = abstract_train_state(config, mesh, tx)
    b = fsdp if batch is None else batch
    batch_arrays = {name: jax.ShapeDtypeStruct((1, b, seq), jnp.int32, sharding=NamedSharding(mesh, MICRO_BSS))
                    for name in ("tokens", "segment_ids", "loss_mask")}
    if image_patches is not None:
        batch_arrays.update(vision_batch_shapes(config, mesh, b, seq, image_patches))
    shardings = (jax.tree.map(lambda x: x.sharding, params), jax.tree.map(lambda x: x.sharding, opt_state))
    step = make_train_step(graphdef, tx, StepOptions(lm_head_mode=lm_head_mode, backend=logprob_backend),
                           shardings, kernels=config.kernels)  # the trainer's step
    start = time.time()
    with jax.set_mesh(mesh), traced_for(target):
        compiled = step.lower(params, opt_state, batch_arrays).compile()
    return compiled, time.time() - start


def vision_batch_shapes(config: Qwen35Config, mesh: Any, batch: int, seq: int, patches: int) -> dict[str, Any]:
    """The abstract "positions" [1, 3, b, S] and "vision" ([1, P, ...] `VisionInputs`, replicated) of a VLM
    micro-batch, as `train.data.place_batch` places them."""
    if config.vision is None:
        raise ValueError("image patches need a model with a vision tower; this config has none")
    unit = config.vision.merge_unit
    if patches < unit or patches % unit:
        raise ValueError(f"image patches {patches} must be a positive multiple of the merge window {unit}")
    whole = NamedSharding(mesh, P())

    def sds(shape: tuple[int, ...], dtype: Any) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct((1, patches, *shape), dtype, sharding=whole)

    vision = VisionInputs(sds((config.vision.patch_dim,), jnp.float32), sds((), jnp.int32), sds((2,), jnp.int32),
                          sds((4,), jnp.int32), sds((4,), jnp.float32))
    positions = jax.ShapeDtypeStruct((1, 3, batch, seq), jnp.int32,
                                     sharding=NamedSharding(mesh, P(None, None, FSDP, SP)))
    return {"positions": positions, "vision": vision}


def step_memory(config: Qwen35Config, seq: int, mesh_shape: tuple[int, int], **kwargs: Any) -> StepMemory:
    """Compile the train step and read its per-device memory."""
    compiled, seconds = compile_train_step(config, seq, mesh_shape, **kwargs)
    m = compiled.memory_analysis()
    return StepMemory(seq=seq, arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes,
                      temporaries=m.temp_size_in_bytes, aliased=m.alias_size_in_bytes, compile_s=seconds)
