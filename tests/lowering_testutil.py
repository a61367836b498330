"""The trainer's step and abstract inputs for it, to lower for a backend this machine does not have."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from flax import nnx

from qwen35_jax.config import Qwen35Config
from qwen35_jax.model import Qwen35ForCausalLM
from qwen35_jax.parallel.mesh import create_sharded
from qwen35_jax.train import StepOptions, init_opt_state, make_optimizer, make_schedule
from qwen35_jax.train.step import batch_shardings, make_train_step


def abstract_step_inputs(config: Qwen35Config, mesh: jax.sharding.Mesh, seq: int,
                         ) -> tuple[nnx.GraphDef, Any, Any, Any, dict[str, jax.ShapeDtypeStruct]]:
    """(graphdef, optimizer, params, opt_state, batch): the model's ZeRO-3 sharded state on `mesh` and a
    batch of one micro-batch of 2 rows of `seq` tokens ([1, 2, seq] each) as ShapeDtypeStructs."""
    model = create_sharded(lambda: Qwen35ForCausalLM(config, rngs=nnx.Rngs(0)), mesh)
    graphdef = nnx.split(model)[0]
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    tx = make_optimizer(make_schedule(1e-4, 100))
    opt_state = init_opt_state(tx, params, mesh)
    rows = {name: np.zeros((1, 2, seq), np.int32) for name in ("tokens", "segment_ids", "loss_mask")}
    batch = {name: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)
             for (name, x), s in zip(rows.items(), batch_shardings(mesh, rows).values())}
    return graphdef, tx, params, opt_state, batch


def train_step_for(config: Qwen35Config, graphdef: nnx.GraphDef, tx: Any, params: Any, opt_state: Any,
                   lm_head: str) -> Any:
    """The trainer's jitted step for these parameter and optimizer shardings, under the config's kernel
    choices (traced when called)."""
    shardings = jax.tree.map(lambda x: x.sharding, (params, opt_state))
    return make_train_step(graphdef, tx, StepOptions(lm_head_mode=lm_head), shardings, kernels=config.kernels)
