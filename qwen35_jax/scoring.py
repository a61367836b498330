"""Per-token log-probs and entropy of token sequences, on any (fsdp, sp) mesh.

The model returns final hidden states; the fused kernel turns them into log-probs and entropy without
materialising [tokens x vocab] logits. Under a mesh the hidden states stay sequence-sharded
P('fsdp', 'sp', None), the labels are built on the global sequence (qwen35_jax.labels) and sharded the
same way, and each device scores its own tokens inside `jax.shard_map` against the FSDP-sharded lm_head
(gathered once, or used vocabulary-parallel).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from qwen35_kernels import linear_logprob_entropy, sharded_linear_logprob_entropy
from qwen35_kernels.choices import KernelChoices
from tqdm import tqdm

from qwen35_jax.labels import next_token_labels
from qwen35_jax.parallel.mesh import FSDP, SP, TOKENS_BS, mesh_axis_size
from qwen35_jax.parallel.padding import padded_size
from qwen35_jax.parallel.processes import gather_rows
from qwen35_jax.xla_options import compiler_options


def check_inputs(tokens: np.ndarray, segment_ids: np.ndarray | None, vocab_size: int, *,
                 source: str = "tokens") -> None:
    """One-line ValueError for token ids outside [0, vocab) or segment ids that are not >= 0."""
    if tokens.size and (tokens.min() < 0 or tokens.max() >= vocab_size):
        bad = tokens[(tokens < 0) | (tokens >= vocab_size)][0]
        where = tuple(int(i) for i in np.argwhere(tokens == bad)[0])
        raise ValueError(f"{source}: token id {int(bad)} at {where} is outside [0, {vocab_size})")
    if segment_ids is not None and segment_ids.size and segment_ids.min() < 0:
        raise ValueError(f"{source}: segment ids must be >= 0 (0 = padding), found {int(segment_ids.min())}")


def score_tokens(
    model: nnx.Module,
    tokens: jax.Array,  # [B, S] int32, B % fsdp == 0 and S % sp == 0 on a mesh
    segment_ids: jax.Array,  # [B, S] int32: document ids >= 1, 0 = padding
    *,
    temperature: float = 1.0,
    backend: str = "auto",
    lm_head_mode: str = "gather",
    positions: jax.Array | None = None,  # [B, S] or mrope [3, B, S] (a VLM's batch); None: each document's index
    vision: Any = None,  # a VLM batch's VisionInputs (vision/inputs.py); None: no tower in the program
) -> tuple[jax.Array, jax.Array]:  # (log_probs [B, S] float32, entropy [B, S] float32)
    """Log p(next token) and entropy at every position; 0 where there is no label / at padding.

    Uses the context mesh (`jax.set_mesh`) when there is one. Call under `nnx.jit`.
    """
    choices = model.config.kernels  # the fused kernel's backend and blocks: the model's kernel choices
    hidden = model(tokens, positions=positions, segment_ids=segment_ids, vision=vision)  # [B, S, D]
    labels = next_token_labels(tokens, segment_ids)  # [B, S], global shift
    weight = model.lm_head_weight().astype(hidden.dtype)  # [D, V]: the matmul in the compute dtype, as logits()
    mesh = jax.sharding.get_abstract_mesh()
    n = mesh_axis_size(mesh, FSDP) * mesh_axis_size(mesh, SP)
    if n == 1:
        b, s, d = hidden.shape
        log_probs, entropy = linear_logprob_entropy(
            hidden.reshape(b * s, d), weight, labels.reshape(b * s),
            temperature=temperature, backend=backend, choices=choices)
        log_probs, entropy = log_probs.reshape(b, s), entropy.reshape(b, s)
    else:
        vocab_split = weight.shape[1] % n == 0
        if lm_head_mode == "vocab_parallel" and not vocab_split:
            raise ValueError(f"lm_head mode 'vocab_parallel' needs the vocabulary ({weight.shape[1]}) "
                             f"divisible by the {n} devices; use 'gather'")
        w_spec = P(None, (FSDP, SP)) if vocab_split else P()
        mode = lm_head_mode if vocab_split else "gather"

        def local(h: jax.Array, w: jax.Array, lab: jax.Array) -> tuple[jax.Array, jax.Array]:
            # h [B/F, S/sp, D], w [D, V/n] (or [D, V] replicated), lab [B/F, S/sp]
            bl, sl, d = h.shape
            if vocab_split:
                lp, ent = sharded_linear_logprob_entropy(
                    h.reshape(bl * sl, d), w, lab.reshape(bl * sl), mode=mode,
                    axis_names=(FSDP, SP), temperature=temperature, backend=backend, choices=choices)
            else:
                lp, ent = linear_logprob_entropy(h.reshape(bl * sl, d), w, lab.reshape(bl * sl),
                                                 temperature=temperature, backend=backend, choices=choices)
            return lp.reshape(bl, sl), ent.reshape(bl, sl)

        log_probs, entropy = jax.shard_map(
            local, in_specs=(P(FSDP, SP, None), w_spec, TOKENS_BS), out_specs=(TOKENS_BS, TOKENS_BS),
            check_vma=False,
        )(hidden, weight, labels)
    entropy = jnp.where(segment_ids > 0, entropy, 0.0)
    return log_probs, entropy


def _row_batches(n_rows: int, batch_size: int | None) -> Iterator[slice]:
    step = n_rows if batch_size is None else batch_size
    for start in range(0, n_rows, max(step, 1)):
        yield slice(start, min(start + step, n_rows))


@dataclasses.dataclass(frozen=True)
class ScoreOptions:
    """How `score_tokens` computes log-probs: a training run's are its `StepOptions.scoring`, so its
    step and everything it scores outside the step (old, reference, synthetic log-probs) agree."""
    temperature: float = 1.0
    backend: str = "auto"  # fused log-prob backend
    lm_head_mode: str = "gather"  # gather | vocab_parallel


@functools.lru_cache(maxsize=16)
def score_program(graphdef: nnx.GraphDef, kernels: KernelChoices, scoring: ScoreOptions) -> Any:
    """`score_tokens` jitted for one model graph (whose config's kernel choices it runs; `kernels`, the
    same choices, names the platform whose compiler options it takes):
    (state, tokens [B, S], segment_ids [B, S]) -> (log_probs, entropy) [B, S]. Kept, so that scoring
    again (every step of an online RL run) compiles nothing new for the same shapes."""

    def score(state: nnx.State, tok: jax.Array, seg: jax.Array) -> tuple[jax.Array, jax.Array]:
        return score_tokens(nnx.merge(graphdef, state), tok, seg, temperature=scoring.temperature,
                            backend=scoring.backend, lm_head_mode=scoring.lm_head_mode)

    # the train step's XLA options
    return jax.jit(score, compiler_options=compiler_options(kernels.resolve().platform))


def score_batches(
    model: nnx.Module,
    tokens: np.ndarray,  # [B, S] int
    segment_ids: np.ndarray | None,  # [B, S] int or None (each row one document)
    *,
    mesh: Mesh,
    temperature: float = 1.0,
    batch_size: int | None = None,
    backend: str = "auto",
    lm_head_mode: str = "gather",
    scoring: ScoreOptions | None = None,
) -> tuple[np.ndarray, np.ndarray]:  # (log_probs [B, S] float32, entropy [B, S] float32)
    """Score a host array in row batches; rows and positions are padded to fit the mesh and stripped.
    It runs the model config's kernel choices, as the train step does. `scoring` (a training
    run's `StepOptions.scoring`), when given, replaces temperature, backend and lm_head_mode."""
    n_rows, seq = tokens.shape
    if segment_ids is None:
        segment_ids = np.ones_like(tokens)
    fsdp, sp = mesh_axis_size(mesh, FSDP), mesh_axis_size(mesh, SP)
    seq_padded = padded_size(max(seq, 1), sp)
    data_sharding = NamedSharding(mesh, TOKENS_BS)

    graphdef, state = nnx.split(model)
    scoring = scoring or ScoreOptions(temperature, backend, lm_head_mode)
    step = score_program(graphdef, model.config.kernels, scoring)

    log_probs = np.zeros(tokens.shape, np.float32)
    entropy = np.zeros(tokens.shape, np.float32)
    batches = list(_row_batches(n_rows, batch_size))
    with jax.set_mesh(mesh):
        for rows in tqdm(batches, desc="scoring", unit="batch", disable=len(batches) < 2):
            n = rows.stop - rows.start
            pad = ((0, padded_size(n, fsdp) - n), (0, seq_padded - seq))
            tok = jax.device_put(np.pad(tokens[rows].astype(np.int32), pad), data_sharding)
            seg = jax.device_put(np.pad(segment_ids[rows].astype(np.int32), pad), data_sharding)
            lp, ent = step(state, tok, seg)
            log_probs[rows] = gather_rows(lp)[:n, :seq]
            entropy[rows] = gather_rows(ent)[:n, :seq]
    return log_probs, entropy
