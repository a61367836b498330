"""Which kernel runs each op, as one frozen value, and the one place where "auto" is resolved.

`KernelChoices` names the attention implementation, the delta rule's chunk-state scan, its matmul
precision, what the GDN mixer keeps for its backward, which kernels make the GDN rule's inputs, the
fused log-prob backend, the sequence tile and the GDN state kernel's blocks. `resolve(platform)`
replaces every "auto" by what that platform ("cpu", "gpu", "tpu") runs:

| choice | cpu | gpu | tpu |
| --- | --- | --- | --- |
| attention | xla | pallas_gpu (Triton) | pallas_tpu (Mosaic) |
| gdn_chunk_scan | sequential | pallas (Triton) | associative |
| gdn_precision | highest | default (TF32 for float32) | default |
| gdn_remat | none | states (with the pallas scan) | none |
| gdn_inputs | xla | pallas (with the pallas scan) | xla |
| logprob_backend | xla | xla | pallas |

A model's config carries a `KernelChoices`; its layers pass it down, and every public op takes it as
an argument (`choices=`; None: the defaults for jax's backend, `resolved(None)`), resolving it once
and handing the resolved value (or what it implies: Triton interpretation, blocks, precision) to
everything it calls. The platform is the value's own (`platform=`) when set, so a tool can trace the
program of a GPU or TPU that is not there by naming it; otherwise the backend jax runs on.
"""

from __future__ import annotations

import dataclasses
from typing import Any

ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "pallas", "pallas_gpu", "pallas_tpu", "cudnn")
GDN_CHUNK_SCANS = ("auto", "sequential", "associative", "pallas")
GDN_PRECISIONS = ("auto", "highest", "high", "default", "bf16")
GDN_REMATS = ("auto", "none", "states")
GDN_INPUTS = ("auto", "xla", "pallas")
LOGPROB_BACKENDS = ("auto", "pallas", "xla", "pallas_xla", "reference")
DEFAULT_SEQUENCE_TILE = 8192  # tokens per tile of each device's shard
# (state columns per program, Triton warps per program) of the GDN state kernel: [Dk, 64] float32 lives
# in registers at Dk = 128, and B x H x Dv / 64 programs run side by side.
DEFAULT_GDN_KERNEL_BLOCKS = (64, 4)


@dataclasses.dataclass(frozen=True)
class KernelChoices:
    """The kernels a model's trace runs; every "auto" is the platform's default (module docstring)."""
    attention: str = "auto"  # auto | xla | pallas | pallas_gpu | pallas_tpu | cudnn
    gdn_chunk_scan: str = "auto"  # auto | sequential | associative | pallas
    gdn_precision: str = "auto"  # auto | highest | high | default | bf16: GDN matmuls with a head-dim contraction
    gdn_remat: str = "auto"  # auto | none | states: what the GDN mixer keeps for its backward
    sequence_tile: int | None = DEFAULT_SEQUENCE_TILE  # tokens per tile of long sequences (None: untiled)
    gdn_kernel_blocks: tuple[int, int] = DEFAULT_GDN_KERNEL_BLOCKS  # (state columns, warps) per program
    platform: str | None = None  # cpu | gpu | tpu; None: the backend jax runs on, when resolved
    # set by `resolve`: where the Triton state kernel cannot take the head or chunk sizes, the scan to
    # run instead ("associative" when the scan was "auto"; None: a one-line error)
    gdn_chunk_scan_fallback: str | None = None
    gdn_inputs: str = "auto"  # auto | xla | pallas: the GDN conv + SiLU + L2 norms (pallas: Triton kernels)
    logprob_backend: str = "auto"  # auto | pallas | xla | pallas_xla | reference: the fused log-prob op

    def __post_init__(self) -> None:
        for name, allowed in (("attention", ATTENTION_IMPLEMENTATIONS), ("gdn_chunk_scan", GDN_CHUNK_SCANS),
                              ("gdn_precision", GDN_PRECISIONS), ("gdn_remat", GDN_REMATS),
                              ("gdn_inputs", GDN_INPUTS), ("logprob_backend", LOGPROB_BACKENDS)):
            if getattr(self, name) not in allowed:
                raise ValueError(f"kernel choice {name} must be one of {allowed}, got {getattr(self, name)!r}")
        if self.sequence_tile is not None and (isinstance(self.sequence_tile, bool) or int(self.sequence_tile) < 0):
            raise ValueError(f"sequence tile must be >= 0 tokens (0 or None: off), got {self.sequence_tile!r}")
        if self.sequence_tile == 0:
            object.__setattr__(self, "sequence_tile", None)
        block_v, warps = (int(x) for x in self.gdn_kernel_blocks)
        if block_v < 16 or block_v & (block_v - 1) or warps not in (1, 2, 4, 8):
            raise ValueError(f"GDN kernel blocks: block_v must be a power of two >= 16 and num_warps 1, 2, 4 or 8, "
                             f"got {block_v} and {warps}")
        object.__setattr__(self, "gdn_kernel_blocks", (block_v, warps))

    def replace(self, **changes: Any) -> KernelChoices:
        """These choices with `changes` (field=value) made. A scan named here has no fallback of its own
        (resolving "auto" gives it one): replacing the scan of a resolved value drops the fallback."""
        if "gdn_chunk_scan" in changes:
            changes = {"gdn_chunk_scan_fallback": None, **changes}
        return dataclasses.replace(self, **changes)

    def resolve(self, platform: str | None = None) -> KernelChoices:
        """Every "auto" replaced for the value's own platform, else `platform`, else jax's backend;
        a one-line ValueError for a choice that platform cannot run (cuDNN off a GPU). Resolving a
        resolved value returns it unchanged."""
        if not (self.platform or platform):
            import jax  # here, not at the top: a config that holds these choices loads without jax

            platform = jax.default_backend()
        platform = self.platform or platform
        attention = self.attention
        if attention == "cudnn" and platform != "gpu":
            raise ValueError(f"attention implementation 'cudnn' needs a CUDA GPU, this backend is {platform}")
        if attention == "auto":
            attention = {"gpu": "pallas_gpu", "tpu": "pallas_tpu"}.get(platform, "xla")
        elif attention == "pallas":
            attention = "pallas_tpu" if platform == "tpu" else "pallas_gpu"
        scan, fallback = self.gdn_chunk_scan, self.gdn_chunk_scan_fallback
        if scan == "auto":
            scan = {"cpu": "sequential", "gpu": "pallas"}.get(platform, "associative")
            fallback = "associative"
        precision = self.gdn_precision
        if precision == "auto":
            precision = "highest" if platform == "cpu" else "default"
        remat = self.gdn_remat
        if remat == "auto":
            remat = "states" if scan == "pallas" else "none"
        # the Triton input kernels on a GPU with the Pallas chunk scan (whose alternative, the "associative"
        # scan, is then XLA throughout)
        inputs = self.gdn_inputs
        if inputs == "auto":
            inputs = "pallas" if platform == "gpu" and scan == "pallas" else "xla"
        # GPU runs "xla": the Triton kernel's float32 atomic adds into dh and dW cost more than the
        # logit tiles XLA writes to memory (docs/kernels.md)
        logprob = self.logprob_backend
        if logprob == "auto":
            logprob = "pallas" if platform == "tpu" else "xla"
        return dataclasses.replace(self, attention=attention, gdn_chunk_scan=scan, gdn_precision=precision,
                                   gdn_remat=remat, platform=platform, gdn_chunk_scan_fallback=fallback,
                                   gdn_inputs=inputs, logprob_backend=logprob)

    @property
    def interpret(self) -> bool:
        """Whether a Triton (Pallas GPU) kernel runs interpreted: anywhere but on a GPU (a resolved value)."""
        return self.platform != "gpu"


def resolved(choices: KernelChoices | None = None) -> KernelChoices:
    """`choices` resolved (`KernelChoices.resolve`); None: the defaults for jax's backend."""
    return (KernelChoices() if choices is None else choices).resolve()


def overridden(choices: KernelChoices | None, **changes: Any) -> KernelChoices:
    """`choices` (None: the defaults) with the per-call overrides among `changes` that are not None
    made, resolved: what an op runs when its caller names one choice (`precision=`, `chunk_scan=`)."""
    changes = {name: value for name, value in changes.items() if value is not None}
    base = KernelChoices() if choices is None else choices
    return base.replace(**changes).resolve() if changes else base.resolve()

