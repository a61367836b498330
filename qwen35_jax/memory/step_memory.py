"""Compile-time memory of one whole train step on a (fsdp, sp) mesh, from abstract inputs only.

The step is the training step of `qwen35_jax.train`, rebuilt here as a pure function of its arrays
(parameters, AdamW state, batch) so that it lowers without any buffer: sequence-sharded forward, the
fused log-prob kernel (`scoring.score_tokens`), the SFT loss, gradients, global-norm clipping and the
AdamW update, float32 master weights and moments ZeRO-3 sharded over (fsdp, sp), bf16 compute.
Parameters and optimizer state are donated, so their outputs alias their inputs.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding

from qwen35_jax.config import Qwen35Config
from qwen35_jax.layers.attention_kernels import attention_implementation
from qwen35_jax.layers.tiling import DEFAULT_SEQUENCE_TILE, sequence_tile
from qwen35_jax.labels import IGNORE, next_token_labels
from qwen35_jax.losses import sft_loss
from qwen35_jax.parallel.gdn_state_passing import gdn_sp_mode
from qwen35_jax.parallel.mesh import TOKENS_BS, make_mesh, state_shardings
from qwen35_jax.scoring import score_tokens


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


def abstract_train_state(config: Qwen35Config, mesh: jax.sharding.Mesh,
                         tx: optax.GradientTransformation) -> tuple[nnx.GraphDef, Any, Any]:
    """(graphdef, params, opt_state): ShapeDtypeStructs with their ZeRO-3 shardings; nothing allocated."""
    from qwen35_jax.model import Qwen35ForCausalLM

    abstract = nnx.eval_shape(lambda: Qwen35ForCausalLM(config, rngs=nnx.Rngs(0)))
    graphdef, params = nnx.split(abstract, nnx.Param)
    params = nnx.to_pure_dict(params)
    shardings = state_shardings(params, mesh)
    params = jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), params, shardings)
    opt_shapes = jax.eval_shape(tx.init, params)
    replicated = NamedSharding(mesh, jax.sharding.PartitionSpec())

    def place(leaf: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:  # moments follow their parameter
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=replicated)

    opt_state = jax.tree.map(place, opt_shapes)
    flat_params = {tuple(p): leaf for p, leaf in _flatten(params)}
    opt_state = _follow_params(opt_state, flat_params)
    return graphdef, params, opt_state


def _flatten(tree: Any) -> list[tuple[tuple[Any, ...], Any]]:
    return [(tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path), leaf)
            for path, leaf in jax.tree.flatten_with_path(tree)[0]]


def _follow_params(opt_state: Any, flat_params: dict[tuple[Any, ...], Any]) -> Any:
    """Give every optimizer leaf whose path ends with a parameter's path that parameter's sharding."""

    def one(path: tuple[Any, ...], leaf: jax.ShapeDtypeStruct) -> jax.ShapeDtypeStruct:
        names = tuple(getattr(k, "key", getattr(k, "idx", k)) for k in path)
        for start in range(len(names)):
            if names[start:] in flat_params:
                return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=flat_params[names[start:]].sharding)
        return leaf

    return jax.tree.map_with_path(one, opt_state)


def make_pure_train_step(graphdef: nnx.GraphDef, tx: optax.GradientTransformation, *,
                         lm_head_mode: str = "gather"):
    """(params, opt_state, tokens [B, S], segment_ids [B, S]) -> (params, opt_state, loss)."""

    def step(params: Any, opt_state: Any, tokens: jax.Array, segment_ids: jax.Array):
        def loss_fn(params: Any) -> jax.Array:
            model = nnx.merge(graphdef, nnx.State(params))
            log_probs, _ = score_tokens(model, tokens, segment_ids, lm_head_mode=lm_head_mode)  # [B, S]
            mask = (next_token_labels(tokens, segment_ids) != IGNORE).astype(jnp.float32)
            return sft_loss(log_probs, mask)[0]

        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return step


def default_optimizer() -> optax.GradientTransformation:
    """Clipping + AdamW, as `train.step.make_optimizer` builds it (the state is what matters here)."""
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-5, b1=0.9, b2=0.95, weight_decay=0.0))


def compile_train_step(config: Qwen35Config, seq: int, mesh_shape: tuple[int, int], *,
                       gdn_mode: str = "all_to_all", attention: str = "pallas",
                       tile: int | None = DEFAULT_SEQUENCE_TILE, lm_head_mode: str = "gather",
                       batch: int | None = None,
                       devices: list[Any] | None = None) -> tuple[Any, float]:
    """Lower and compile the whole train step for one [batch, seq] batch (batch default: fsdp).

    attention: the implementation traced (`attention_implementation`); "pallas" is the GPU flash
    kernel, which on CPU lowers in interpret mode (no [S, S] or [block, S] scores), the path an H200
    runs. tile: `sequence_tile` (None: untiled). lm_head_mode: as `score_tokens` takes it."""
    fsdp, sp = mesh_shape
    devs = list(jax.devices() if devices is None else devices)[: fsdp * sp]
    mesh = make_mesh(mesh_shape, devices=devs)
    tx = default_optimizer()
    graphdef, params, opt_state = abstract_train_state(config, mesh, tx)
    b = fsdp if batch is None else batch
    tokens = jax.ShapeDtypeStruct((b, seq), jnp.int32, sharding=NamedSharding(mesh, TOKENS_BS))
    step = make_pure_train_step(graphdef, tx, lm_head_mode=lm_head_mode)
    out_shardings = (jax.tree.map(lambda x: x.sharding, params), jax.tree.map(lambda x: x.sharding, opt_state),
                     NamedSharding(mesh, jax.sharding.PartitionSpec()))
    start = time.time()
    mode = gdn_sp_mode(gdn_mode) if sp > 1 else contextlib.nullcontext()
    with jax.set_mesh(mesh), mode, attention_implementation(attention), sequence_tile(tile):
        compiled = jax.jit(step, donate_argnums=(0, 1), out_shardings=out_shardings).lower(
            params, opt_state, tokens, tokens).compile()
    return compiled, time.time() - start


def step_memory(config: Qwen35Config, seq: int, mesh_shape: tuple[int, int], **kwargs: Any) -> StepMemory:
    """Compile the train step and read its per-device memory."""
    compiled, seconds = compile_train_step(config, seq, mesh_shape, **kwargs)
    m = compiled.memory_analysis()
    return StepMemory(seq=seq, arguments=m.argument_size_in_bytes, outputs=m.output_size_in_bytes,
                      temporaries=m.temp_size_in_bytes, aliased=m.alias_size_in_bytes, compile_s=seconds)
