"""The trainer's step for a library user's model, by one call.

A model jitted in the user's own `jax.jit` runs remat "auto" as "full" and compiles with XLA's default
options. `trainer_step` gives the program `scripts/train.py` runs instead: remat "auto" resolved at
the first call to the least recomputation whose compiled step fits the device (`remat_choice`), the
config's kernel choices over the whole step (backward included), the trainer's XLA:CPU options
(`xla_options`), and the micro-batched SFT/PPO step of `step.py` with its AdamW update.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx

from qwen35_jax.train.optim import Params, init_opt_state
from qwen35_jax.train.remat_choice import make_config_train_step
from qwen35_jax.train.step import Batch, StepOptions

TrainStep = Callable[[Params, Any, Batch], tuple[Params, Any, dict[str, jax.Array]]]


def trainer_step(model: nnx.Module, tx: optax.GradientTransformation, mesh: jax.sharding.Mesh,
                 options: StepOptions = StepOptions()) -> tuple[TrainStep, Params, Any]:
    """(step, params, opt_state) for `model` (a `Qwen35ForCausalLM` whose parameters are sharded on
    `mesh`, as `load_model(..., mesh=mesh)` or `create_sharded` leave them) and optimizer `tx`.

    Call `params, opt_state, metrics = step(params, opt_state, batch)` inside `jax.set_mesh(mesh)`, with
    `batch` from `qwen35_jax.train.place_batch` (every field [K, B/K, S]); it donates the old params and
    optimizer state. Every call must keep the first batch's shapes (remat "auto" is chosen for them).
    """
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    opt_state = init_opt_state(tx, params, mesh)
    shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))
    return make_config_train_step(model.config, tx, options, shardings), params, opt_state
