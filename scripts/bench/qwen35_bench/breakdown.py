"""Where our step's time goes: forward and forward+backward of each piece alone, jitted, on a
config's shapes (each decoder layer kind, its mixer and MLP, the delta rule, the loss, the model
body). Remat as configured applies to the whole model only."""

from __future__ import annotations

import statistics
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qwen35_bench.timing import jit_tuned, time_calls
from qwen35_jax.config import Qwen35Config


def time_pieces(config: Qwen35Config, batch: int, seq: int, steps: int) -> list[dict]:
    """[{"piece", "fwd_s", "fwd_bwd_s"}], medians of `steps` calls after one warm-up each."""
    from qwen35_kernels import linear_logprob_entropy
    from qwen35_kernels.gated_delta_rule.chunked import chunked_gated_delta_rule

    from qwen35_jax.layers.rope import rope_cos_sin
    from qwen35_jax.model import DecoderLayer, Qwen35ForCausalLM

    rng = np.random.default_rng(0)
    B, S, D = batch, seq, config.hidden_size
    x = jnp.asarray(rng.standard_normal((B, S, D)).astype(np.float32))
    seg = jnp.ones((B, S), jnp.int32)
    cos, sin = rope_cos_sin(jnp.broadcast_to(jnp.arange(S), (3, B, S)), config)
    results = []

    def time_piece(name: str, fwd: Callable, grad: Callable, args: tuple) -> None:
        r = {"piece": name}
        for label, f in (("fwd_s", fwd), ("fwd_bwd_s", grad)):
            jax.block_until_ready(f(*args))
            r[label] = statistics.median(time_calls(lambda f=f: jax.block_until_ready(f(*args)), steps))
        results.append(r)
        print(f"{name:40s} fwd {r['fwd_s']:.3f} s  fwd+bwd {r['fwd_bwd_s']:.3f} s", flush=True)

    def time_module(name: str, module: nnx.Module, inputs: tuple) -> None:
        graphdef, state = nnx.split(module)

        def loss(state, *inputs):
            out = nnx.merge(graphdef, state)(*inputs)
            return jnp.sum(out * out) * 1e-3

        time_piece(name, jit_tuned(loss), jit_tuned(jax.grad(loss, argnums=(0, 1))), (state, *inputs))

    for kind in ("linear_attention", "full_attention"):
        layer = DecoderLayer(config, kind, rngs=nnx.Rngs(0))
        time_module(f"layer {kind}", layer, (x, cos, sin, seg))
        if kind == "linear_attention":
            time_module("  mixer GatedDeltaNet", layer.linear_attn, (x, seg))
            time_module("  mlp", layer.mlp, (x,))  # the same in both kinds
        else:
            time_module("  mixer Attention", layer.self_attn, (x, cos, sin, seg))

    # the delta rule alone, on the GDN layer's head shapes
    Hk, Hv = config.linear_num_key_heads, config.linear_num_value_heads
    Dk, Dv = config.linear_key_head_dim, config.linear_value_head_dim
    q, k = (jnp.asarray(rng.standard_normal((B, S, Hk, Dk)).astype(np.float32) * Dk**-0.5) for _ in range(2))
    v = jnp.asarray(rng.standard_normal((B, S, Hv, Dv)).astype(np.float32))
    g = jnp.full((B, S, Hv), -0.05, jnp.float32)
    beta = jnp.full((B, S, Hv), 0.5, jnp.float32)
    chunk = config.gdn_chunk(jax.default_backend())

    def rule(q, k, v, g, beta):
        return jnp.sum(chunked_gated_delta_rule(q, k, v, g, beta, chunk_size=chunk, choices=config.kernels)[0])

    time_piece("    delta rule", jit_tuned(rule), jit_tuned(jax.grad(rule, argnums=(0, 1, 2, 3, 4))),
               (q, k, v, g, beta))

    # the loss: lm_head + fused log-probs on the final hidden states
    w = jnp.asarray(rng.standard_normal((D, config.vocab_size)).astype(np.float32) * D**-0.5)
    labels = jnp.asarray(rng.integers(0, config.vocab_size, (B * S,)), jnp.int32)

    def head(h, w):
        lp, _ = linear_logprob_entropy(h.reshape(B * S, D), w, labels, choices=config.kernels)
        return -jnp.mean(lp)

    time_piece("loss (lm_head + log-probs)", jit_tuned(head), jit_tuned(jax.grad(head, argnums=(0, 1))), (x, w))

    # the whole model body (no loss, no optimizer)
    graphdef, state = nnx.split(Qwen35ForCausalLM(config, rngs=nnx.Rngs(0)))
    tokens = jnp.asarray(rng.integers(0, config.vocab_size, (B, S)), jnp.int32)

    def body(state, tokens):
        h = nnx.merge(graphdef, state)(tokens)
        return jnp.sum(h * h) * 1e-3

    remat = "full" if config.remat == "auto" else config.remat  # the model alone runs auto as full
    time_piece(f"model body (remat={remat})", jit_tuned(body), jit_tuned(jax.grad(body)), (state, tokens))
    return results
