"""The two compiled programs of generation, for one model graph, sampling rule and length budget:

- prefill: prompts [B, S] -> the first token's logits [B, V] and the hybrid cache;
- decode: a `lax.while_loop` that samples a token per row, records it and its log-prob, and runs
  `forward.decode_step` on it, until every row has stopped or `max_new_tokens` tokens are out. No
  host round trip per token and never more than [B, V] logits at once.

With images (a VLM), prefill also takes the rows' mrope positions and the batch's `VisionInputs`, and
decode each row's position offset (`forward.py`); text-only calls pass None for them, which traces the
same programs as before these arguments existed.

Both run the model config's kernel choices, as the train step does. Programs are kept per
(graph, kernels, options, mesh), so generating again (an RL step) compiles nothing new for the
same shapes.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from qwen35_jax.generation.forward import ROWS, decode_step, prefill
from qwen35_jax.generation.sampling import SamplingOptions, row_keys, sample_tokens
from qwen35_jax.layers.cache import HybridCache
from qwen35_jax.parallel.mesh import constrain, rows_spec


@dataclasses.dataclass(frozen=True)
class DecodeOutput:
    tokens: jax.Array  # [B, N] int32, 0 after a row stopped
    log_probs: jax.Array  # [B, N] float32, 0 after a row stopped
    generated: jax.Array  # [B] int32 tokens each row produced (its stop token included)
    stopped: jax.Array  # [B] bool: ended on a stop token (else on the length budget)


@functools.lru_cache(maxsize=16)
def programs(graphdef: Any, options: SamplingOptions, max_new_tokens: int, mesh: Any
             ) -> tuple[Callable[..., Any], Callable[..., Any]]:
    """(prefill(state, tokens [B, S], lengths [B], positions [B, 3, S] | None, vision | None)
    -> (logits [B, V], cache),
    decode(state, logits, cache, rows, samples, active [B], stop_ids [n], seed, offsets [B] | None)
    -> DecodeOutput). Positions come row-major ([B, 3, S], split over rows like the tokens) and are
    turned into the model's [3, B, S] inside.
    `mesh` is part of the key only, so that a program compiled for one mesh is not reused on another."""
    del mesh

    def prefill_program(state: nnx.State, tokens: jax.Array, lengths: jax.Array, positions: jax.Array | None = None,
                        vision: Any = None) -> tuple[jax.Array, HybridCache]:
        model = nnx.merge(graphdef, state)
        if positions is not None:
            positions = jnp.moveaxis(positions, 1, 0)  # [B, 3, S] -> [3, B, S]
        hidden, cache = prefill(model, tokens, lengths, tokens.shape[1] + max_new_tokens - 1, positions, vision)
        return constrain(model.logits(hidden), rows_spec(2)), cache

    def decode_program(state: nnx.State, logits: jax.Array, cache: HybridCache, rows: jax.Array,
                       samples: jax.Array, active: jax.Array, stop_ids: jax.Array, seed: jax.Array,
                       offsets: jax.Array | None = None) -> DecodeOutput:
        b, n = logits.shape[0], max_new_tokens

        def advance(state: nnx.State, token: jax.Array, cache: HybridCache, grows: jax.Array
                    ) -> tuple[jax.Array, HybridCache]:
            # the parameters come in as operands of the loop: nnx refuses modules whose arrays belong
            # to an outer trace
            model = nnx.merge(graphdef, state)
            hidden, cache = decode_step(model, token, cache, grows, offsets)
            return constrain(model.logits(hidden), rows_spec(2)), cache

        def record(step: jax.Array, logits: jax.Array, done: jax.Array, outputs: tuple[jax.Array, ...]
                   ) -> tuple[jax.Array, jax.Array, tuple[jax.Array, ...]]:
            """Sample token `step` of the rows not done yet and write it down -> (token, done, outputs)."""
            tokens, log_probs, generated, stopped = outputs
            token, log_prob = sample_tokens(logits, row_keys(seed, rows, samples, step), options)
            live = ~done
            tokens = tokens.at[:, step].set(jnp.where(live, token, 0))
            log_probs = log_probs.at[:, step].set(jnp.where(live, log_prob, 0.0))
            generated = generated + live.astype(jnp.int32)
            hit = live & jnp.any(token[:, None] == stop_ids[None, :], axis=1)
            done = done | hit | (step + 1 >= n)
            return token, done, (tokens, log_probs, generated, stopped | hit)

        def cond(carry: tuple[Any, ...]) -> jax.Array:
            step, done = carry[1], carry[4]
            return (step < n) & ~jnp.all(done)

        def body(carry: tuple[Any, ...]) -> tuple[Any, ...]:
            # token step - 1 is out; run it through the model and sample token `step`
            state, step, token, cache, done, outputs = carry
            logits, cache = advance(state, token, cache, ~done)
            token, done, outputs = record(step, logits, done, outputs)
            return state, step + 1, token, cache, done, outputs

        zeros = constrain(jnp.zeros((b, n), jnp.int32), rows_spec(2))
        outputs = (zeros, zeros.astype(jnp.float32), constrain(jnp.zeros((b,), jnp.int32), ROWS),
                   constrain(jnp.zeros((b,), bool), ROWS))
        token, done, outputs = record(jnp.int32(0), logits, ~active, outputs)
        carry = (state, jnp.int32(1), token, cache, done, outputs)
        tokens, log_probs, generated, stopped = jax.lax.while_loop(cond, body, carry)[-1]
        return DecodeOutput(tokens=tokens, log_probs=log_probs, generated=generated, stopped=stopped)

    # XLA's default options, not the train step's (`xla_options.py`): what made XLA:CPU's YNNPACK
    # fusions slow there were the backward pass's reductions; without a backward, prefill and the
    # decode loop run faster with them (docs/lab_log.md).
    return jax.jit(prefill_program), jax.jit(decode_program)


jax.tree_util.register_dataclass(DecodeOutput, data_fields=["tokens", "log_probs", "generated", "stopped"],
                                 meta_fields=[])

