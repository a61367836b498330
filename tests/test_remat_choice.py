"""remat "auto": the trainer keeps the step without recomputation when it fits the device, else "full".

The chooser is tested on two stand-in steps whose compiled memory differs by a known buffer, so the
limit can be put on either side of it; the trainer test checks that a real run reports its choice.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from qwen35_jax.config import Qwen35Config
from qwen35_jax.memory.budget import step_budget
from qwen35_jax.train.remat_choice import (AUTO_REMAT_HEADROOM, AutoRematStep, compiled_bytes, device_memory_bytes,
                                           make_config_train_step)

N = 1 << 16  # float32 elements of each argument
T = 1024  # the stand-in temporary is [T, T] float32, 4 MiB


def stand_in_steps(built: list[str]):
    """make_step(policy): "none" holds a [T, T] temporary that "full" does not; both return p + o + b."""

    def none(p, o, b):
        product = jnp.outer(p[:T], o[:T]) @ b[:T]  # the [T, T] outer product is a matmul operand: a buffer
        return p + o + b + jnp.sum(product) * 0.0

    def full(p, o, b):
        return p + o + b

    def make_step(policy: str):
        built.append(policy)
        return jax.jit({"none": none, "full": full}[policy])

    return make_step


def args():
    return tuple(jnp.full((N,), float(i)) for i in range(3))


def test_fitting_step_compiles_once_without_recomputation():
    built, logged = [], []
    step = AutoRematStep(stand_in_steps(built), limit_bytes=1 << 40, log=logged.append)
    out = step(*args())
    assert step.policy == "none" and built == ["none"]
    np.testing.assert_array_equal(np.asarray(out), np.full(N, 3.0))
    assert step.needed_bytes == compiled_bytes(stand_in_steps([])("none").lower(*args()).compile())
    step(*args())  # later calls reuse the compiled program
    assert built == ["none"] and len(logged) == 1 and "auto -> none" in logged[0] and "within" in logged[0]


def test_step_over_the_limit_falls_back_to_full():
    built, logged = [], []
    probe = AutoRematStep(stand_in_steps([]), limit_bytes=1 << 40)
    probe(*args())
    needed = probe.needed_bytes
    assert needed >= T * T * 4  # the temporary is counted
    limit = int(needed / AUTO_REMAT_HEADROOM) - 1  # just too small for "none"
    step = AutoRematStep(stand_in_steps(built), limit_bytes=limit, log=logged.append,
                         describe=lambda policy: f"what {policy} runs")
    np.testing.assert_array_equal(np.asarray(step(*args())), np.full(N, 3.0))
    assert step.policy == "full" and built == ["none", "full"] and step.needed_bytes == needed
    assert "auto -> full (what full runs):" in logged[0] and "over" in logged[0]
    just_enough = AutoRematStep(stand_in_steps([]), limit_bytes=int(needed / AUTO_REMAT_HEADROOM) + 1)
    just_enough(*args())
    assert just_enough.policy == "none"


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
