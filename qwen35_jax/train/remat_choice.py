"""remat "auto": the train step recomputes activations only as far as it must to fit.

At its first call, `AutoRematStep` compiles the step under each policy of `AUTO_REMAT_LADDER` in turn
("none", then "mlp", which recomputes each layer's feed-forward, then "full") and keeps the first whose
compiled program's per-device memory (`memory_analysis`: arguments + outputs + temporaries - donated)
is at most `AUTO_REMAT_HEADROOM` of the device's memory; the last rung is kept either way, with a
warning in the log line when it does not fit either. One compile when the step fits without
recomputation, one more per rung it falls past. Every process
decides from its own devices, so a cluster of unlike machines should pass an explicit policy.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import jax
import optax

from qwen35_jax.config import Qwen35Config
from qwen35_jax.hf.load import abstract_model
from qwen35_jax.model import scans_layers
from qwen35_jax.train.step import StepOptions, make_train_step

AUTO_REMAT_HEADROOM = 0.85  # of the device memory: room for fragmentation and what runs beside the step
# cheapest recomputation first: nothing; each layer's feed-forward (about 7% more matmul work on the
# 0.8B); each whole block (a second forward)
AUTO_REMAT_LADDER = ("none", "mlp", "full")


def device_memory_bytes(device: Any | None = None) -> int:
    """What one device can hold: the allocator's limit on GPU/TPU, the host RAM shared by the local
    devices on CPU (which reports no limit)."""
    device = jax.local_devices()[0] if device is None else device
    stats = device.memory_stats() or {}
    if stats.get("bytes_limit"):
        return int(stats["bytes_limit"])
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // jax.local_device_count()


def compiled_bytes(compiled: Any) -> int:
    """Per-device peak of a compiled step: arguments + outputs + temporaries - aliased (donated)."""
    m = compiled.memory_analysis()
    return (m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes
            - m.alias_size_in_bytes)


class AutoRematStep:
    """A train step (`step(params, opt_state, batch)`) that picks its remat policy at its first call.

    make_step(policy) builds the jitted step of one policy. The choice is compiled from the first
    call's arguments (inside the caller's mesh and kernel contexts); later calls run that program, and a
    batch of another shape or structure (a VLM batch with or without images, another patch bucket)
    compiles the chosen policy's step for it once.
    """

    def __init__(self, make_step: Callable[[str], Any], *, limit_bytes: int | None = None,
                 log: Callable[[str], None] | None = None, describe: Callable[[str], str] | None = None):
        self._make_step = make_step
        self._limit = limit_bytes
        self._log = log
        self._describe = describe  # policy -> what else its step does differently, for the log line
        self._compiled: Any = None
        self._programs: dict[Any, Any] = {}  # batch signature -> the chosen policy's compiled step
        self.policy: str | None = None  # a rung of AUTO_REMAT_LADDER, once compiled
        # per device, of each rung compiled (None: the compiler refused it as too large)
        self.needed: dict[str, int | None] = {}

    def __call__(self, params: Any, opt_state: Any, batch: Any) -> Any:
        key = _signature(batch)
        if self._compiled is None:
            self._choose(params, opt_state, batch)
            self._programs[key] = self._compiled
        program = self._programs.get(key)
        if program is None:  # another batch shape (a VLM batch's images, or none): the chosen policy's program
            program = self._programs[key] = self._make_step(self.policy).lower(params, opt_state, batch).compile()
        return program(params, opt_state, batch)

    def _choose(self, *args: Any) -> None:
        limit = device_memory_bytes() if self._limit is None else self._limit
        for policy in AUTO_REMAT_LADDER[:-1]:
            try:
                compiled = self._make_step(policy).lower(*args).compile()
                self.needed[policy] = compiled_bytes(compiled)
            except jax.errors.JaxRuntimeError as err:  # a compiler that refuses what cannot fit
                if "RESOURCE_EXHAUSTED" not in str(err):
                    raise
                self.needed[policy] = None
                continue
            if self.needed[policy] <= AUTO_REMAT_HEADROOM * limit:
                self.policy, self._compiled = policy, compiled
                break
        else:
            self.policy = AUTO_REMAT_LADDER[-1]
            self._compiled = self._make_step(self.policy).lower(*args).compile()
            self.needed[self.policy] = compiled_bytes(self._compiled)
        if self._log is not None:
            detail = f" ({self._describe(self.policy)})" if self._describe is not None else ""
            hint = ("; it may run out of memory: shorten the rows, add devices or pass remat 'nested' or "
                    "'offload' (docs/parallelism.md)" if self.needed[self.policy] > AUTO_REMAT_HEADROOM * limit
                    else "")
            self._log(f"remat auto -> {self.policy}{detail}: " + "; ".join(
                self._needs(policy, needed, limit) for policy, needed in self.needed.items()) + hint)

    @staticmethod
    def _needs(policy: str, needed: int | None, limit: int) -> str:
        what = "without recomputation" if policy == "none" else f"under {policy!r}"
        if needed is None:
            return f"{what} the step needs more than the compiler could fit"
        fits = needed <= AUTO_REMAT_HEADROOM * limit
        return (f"{what} the step needs {needed / 2**30:.2f} GiB per device, {'within' if fits else 'over'} "
                f"{AUTO_REMAT_HEADROOM:.0%} of the device's {limit / 2**30:.1f} GiB")


def _signature(batch: Any) -> Any:
    """What a compiled step is specific to in its batch: the tree, and each array's shape, dtype and sharding."""
    leaves, tree = jax.tree.flatten(batch)
    return tree, tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in leaves)


def make_config_train_step(config: Qwen35Config, tx: optax.GradientTransformation, options: StepOptions,
                           shardings: tuple[Any, Any], *, log: Callable[[str], None] | None = None) -> Any:
    """The trainer's step (`make_train_step`) for `config`; an `AutoRematStep` when its remat is "auto"."""

    def make_step(policy: str) -> Any:
        return make_train_step(abstract_model(config.replace(remat=policy))[0], tx, options, shardings,
                               kernels=config.kernels)

    def layout(policy: str) -> str:
        return "blocks scanned" if scans_layers(config.replace(remat=policy)) else "blocks one after another"

    return AutoRematStep(make_step, log=log, describe=layout) if config.remat == "auto" else make_step(config.remat)
