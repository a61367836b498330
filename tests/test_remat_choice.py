"""remat "auto": the trainer keeps the first of "none", "mlp", "full" whose step fits the device.

The chooser is tested on three stand-in steps whose compiled memory differs by known buffers, so the
limit can be put between them; the trainer test checks that a real run reports its choice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_jax.config import Qwen35Config
from qwen35_jax.memory.budget import step_budget
from qwen35_jax.train.remat_choice import (AUTO_REMAT_HEADROOM, AUTO_REMAT_LADDER, AutoRematStep, compiled_bytes,
                                           device_memory_bytes, make_config_train_step)

N = 1 << 16  # float32 elements of each argument
T = 1024  # the stand-in temporaries: [T, T] float32 (4 MiB) under "none", [T, T / 4] under "mlp"


def stand_in_steps(built: list[str]):
    """make_step(policy): "none" holds a [T, T] temporary, "mlp" a quarter of it, "full" none; all
    three return p + o + b."""

    def with_temporary(cols: int):
        def step(p, o, b):
            product = jnp.outer(p[:T], o[:cols]) @ b[:cols]  # the outer product is a matmul operand: a buffer
            return p + o + b + jnp.sum(product) * 0.0
        return step

    def full(p, o, b):
        return p + o + b

    def make_step(policy: str):
        built.append(policy)
        return jax.jit({"none": with_temporary(T), "mlp": with_temporary(T // 4), "full": full}[policy])

    return make_step


def args():
    return tuple(jnp.full((N,), float(i)) for i in range(3))


def needs(policy: str) -> int:
    return compiled_bytes(stand_in_steps([])(policy).lower(*args()).compile())


def test_fitting_step_compiles_once_without_recomputation():
    built, logged = [], []
    step = AutoRematStep(stand_in_steps(built), limit_bytes=1 << 40, log=logged.append)
    out = step(*args())
    assert step.policy == "none" and built == ["none"]
    np.testing.assert_array_equal(np.asarray(out), np.full(N, 3.0))
    assert step.needed == {"none": needs("none")}
    step(*args())  # later calls reuse the compiled program
    assert built == ["none"] and len(logged) == 1 and "auto -> none" in logged[0] and "within" in logged[0]


def test_step_over_the_limit_climbs_the_ladder():
    none, mlp = needs("none"), needs("mlp")
    assert none - mlp >= T * T * 4 * 3 // 4  # the temporaries are counted
    assert AUTO_REMAT_LADDER == ("none", "mlp", "full")

    def choose(limit: int) -> tuple[AutoRematStep, list[str], list[str]]:
        built, logged = [], []
        step = AutoRematStep(stand_in_steps(built), limit_bytes=limit, log=logged.append,
                             describe=lambda policy: f"what {policy} runs")
        np.testing.assert_array_equal(np.asarray(step(*args())), np.full(N, 3.0))
        return step, built, logged

    step, built, logged = choose(int(none / AUTO_REMAT_HEADROOM) - 1)  # just too small for "none"
    assert step.policy == "mlp" and built == ["none", "mlp"] and step.needed == {"none": none, "mlp": mlp}
    assert logged[0].startswith("remat auto -> mlp (what mlp runs): without recomputation the step needs")
    assert "over" in logged[0] and "under 'mlp' the step needs" in logged[0] and "within" in logged[0]
    assert "may run out of memory" not in logged[0]

    full = needs("full")
    step, built, logged = choose(int(mlp / AUTO_REMAT_HEADROOM) - 1)  # too small for "mlp" as well
    assert step.policy == "full" and built == ["none", "mlp", "full"]
    assert step.needed == {"none": none, "mlp": mlp, "full": full}
    assert "auto -> full (what full runs):" in logged[0] and "under 'full' the step needs" in logged[0]
    assert "may run out of memory" not in logged[0]  # "full" fits this limit

    step, built, logged = choose(int(full / AUTO_REMAT_HEADROOM) - 1)  # nothing fits
    assert step.policy == "full" and "within" not in logged[0]
    assert logged[0].endswith("it may run out of memory: shorten the rows, add devices or pass remat 'nested' or "
                              "'offload' (docs/parallelism.md)")

    step, built, _ = choose(int(mlp / AUTO_REMAT_HEADROOM) + 1)
    assert step.policy == "mlp"


def test_a_step_the_compiler_refuses_counts_as_not_fitting():
    def make_step(policy: str):
        if policy == "none":
            class Refused:
                def lower(self, *args):
                    raise jax.errors.JaxRuntimeError("RESOURCE_EXHAUSTED: out of memory while compiling")
            return Refused()
        return stand_in_steps([])(policy)

    logged = []
    step = AutoRematStep(make_step, limit_bytes=1 << 40, log=logged.append)
    step(*args())
    assert step.policy == "mlp" and step.needed == {"none": None, "mlp": needs("mlp")}
    assert "without recomputation the step needs more than the compiler could fit" in logged[0]


def test_explicit_policy_is_a_plain_jitted_step():
    from qwen35_jax.train.optim import make_optimizer, make_schedule
    from qwen35_jax.train.step import StepOptions

    tx = make_optimizer(make_schedule(1e-3, 10))
    config = Qwen35Config.preset("tiny")
    assert config.remat == "auto"
    assert isinstance(make_config_train_step(config, tx, StepOptions(), (None, None)), AutoRematStep)
    explicit = make_config_train_step(config.replace(remat="full"), tx, StepOptions(), (None, None))
    assert not isinstance(explicit, AutoRematStep) and hasattr(explicit, "lower")


def test_device_memory_is_the_allocator_limit_or_the_hosts_share():
    class Device:
        def memory_stats(self):
            return {"bytes_limit": 123 << 30, "bytes_in_use": 0}

    assert device_memory_bytes(Device()) == 123 << 30
    cpu = device_memory_bytes(jax.devices("cpu")[0])  # XLA:CPU reports no limit: RAM / local devices
    assert 0 < cpu * jax.local_device_count() <= 1 << 50


def test_memory_budget_refuses_auto():
    with pytest.raises(ValueError, match="'auto' is chosen by the trainer"):
        step_budget(Qwen35Config.preset("tiny"), 64, (1, 1))
