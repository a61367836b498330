"""The train state as ShapeDtypeStructs with their shardings: what a restore reads into and what the
compile-time memory estimate lowers the step from, without allocating anything."""

from __future__ import annotations

from typing import Any

import jax
import optax
from flax import nnx

from qwen35_jax.config import Qwen35Config
from qwen35_jax.parallel.mesh import state_shardings
from qwen35_jax.train.optim import Params, opt_state_shardings


def abstract_train_state(config: Qwen35Config, mesh: jax.sharding.Mesh,
                         tx: optax.GradientTransformation) -> tuple[nnx.GraphDef, Params, Any]:
    """(graphdef, params, opt_state) of `config`'s model and optimizer `tx`: ShapeDtypeStructs with
    their ZeRO-3 shardings on `mesh` (the optimizer state follows its parameters); nothing allocated."""
    from qwen35_jax.model import Qwen35ForCausalLM

    abstract = nnx.eval_shape(lambda: Qwen35ForCausalLM(config, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract, nnx.Param)
    params = nnx.to_pure_dict(params)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params,
                          state_shardings(params, mesh))
    opt_state = jax.eval_shape(tx.init, params)
    opt_state = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), opt_state,
                             opt_state_shardings(opt_state, params, mesh))
    return graphdef, params, opt_state
