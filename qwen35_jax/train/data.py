"""Training batches: rows of token ids (and their per-token fields) from .npy files or random tokens.

    DIR/tokens.npy         int [N, S]   required
    DIR/segment_ids.npy    int [N, S]   document ids >= 1, 0 = padding (default: each row one document)
    DIR/loss_mask.npy      0/1 [N, S]   1 = train on log_probs[:, t], the prediction of tokens[:, t + 1]
    DIR/old_log_probs.npy  float [N, S] PPO: behaviour-policy log-probs (scripts/logprobs.py's log_probs)
    DIR/advantages.npy     float [N, S] PPO: per-token advantages

Every per-token field is aligned with the log-probs. Batches take `batch_size` consecutive rows (wrapping
around), are padded along S to a multiple of sp (segment 0, loss mask 0) and placed P('fsdp', 'sp').
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding

from qwen35_jax.parallel.mesh import FSDP, SP, TOKENS_BS, mesh_axis_size
from qwen35_jax.parallel.padding import padded_size
from qwen35_jax.scoring import check_inputs

INT_FIELDS = ("tokens", "segment_ids", "loss_mask")
FLOAT_FIELDS = ("old_log_probs", "advantages")
FIELDS = INT_FIELDS + FLOAT_FIELDS
PPO_FIELDS = ("old_log_probs", "advantages")


def check_batch_size(batch_size: int, fsdp: int) -> None:
    """One-line ValueError unless the global batch is a positive multiple of the fsdp axis size."""
    if batch_size < 1 or batch_size % fsdp:
        valid = ", ".join(str(fsdp * k) for k in range(1, 4))
        raise ValueError(f"batch size {batch_size} must be a positive multiple of fsdp={fsdp} "
                         f"(rows are split over fsdp): valid batch sizes are {valid}, ...")


def load_npy_dir(directory: str) -> dict[str, np.ndarray]:
    """The fields present in `directory` (tokens.npy required), checked for shape and dtype."""
    if not os.path.isdir(directory):
        raise ValueError(f"data directory not found: {directory}")
    data: dict[str, np.ndarray] = {}
    for name in FIELDS:
        path = os.path.join(directory, f"{name}.npy")
        if not os.path.isfile(path):
            continue
        try:
            data[name] = np.load(path, allow_pickle=False)
        except Exception as err:  # numpy raises several kinds for a damaged file
            raise ValueError(f"{path} is not a readable .npy array ({err})") from None
    if "tokens" not in data:
        raise ValueError(f"{directory}: no tokens.npy")
    check_fields(data, source=directory)
    return data


def check_fields(data: dict[str, np.ndarray], *, source: str) -> None:
    tokens = data["tokens"]
    if tokens.ndim != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 2:
        raise ValueError(f"{source}: tokens must be [N, S] with N >= 1 and S >= 2, got shape {tokens.shape}")
    for name, x in data.items():
        if x.shape != tokens.shape:
            raise ValueError(f"{source}: {name} has shape {x.shape}, tokens have {tokens.shape}")
        if name in INT_FIELDS and not np.issubdtype(x.dtype, np.integer):
            raise ValueError(f"{source}: {name} must be integers, got dtype {x.dtype}")
        if name in FLOAT_FIELDS and not np.all(np.isfinite(x)):
            raise ValueError(f"{source}: {name} holds non-finite values")
    if "loss_mask" in data and not np.isin(data["loss_mask"], (0, 1)).all():
        raise ValueError(f"{source}: loss_mask must hold only 0 and 1")


def synthetic_data(n_rows: int, seq_len: int, vocab_size: int, *, objective: str = "sft",
                   seed: int = 0) -> dict[str, np.ndarray]:
    """Random token rows (one document each); for PPO also random advantages (old_log_probs are the
    caller's: score the tokens with the starting model, `scoring.score_batches`)."""
    rng = np.random.default_rng(seed)
    data = {"tokens": rng.integers(0, vocab_size, size=(n_rows, seq_len), dtype=np.int32)}
    if objective == "ppo":
        data["advantages"] = rng.standard_normal((n_rows, seq_len)).astype(np.float32)
    return data


class BatchSource:
    """Global batches of `batch_size` rows, cycling over the data, placed on `mesh` as P('fsdp', 'sp')."""

    def __init__(self, data: dict[str, np.ndarray], batch_size: int, mesh: Mesh, *, vocab_size: int,
                 objective: str = "sft", source: str = "data"):
        check_fields(data, source=source)
        check_inputs(data["tokens"], data.get("segment_ids"), vocab_size, source=source)
        check_batch_size(batch_size, mesh_axis_size(mesh, FSDP))
        if objective == "ppo":
            missing = [f for f in PPO_FIELDS if f not in data]
            if missing:
                raise ValueError(f"{source}: objective 'ppo' needs {', '.join(missing)}")
        n, s = data["tokens"].shape
        self.data = dict(data)
        self.data.setdefault("segment_ids", np.ones((n, s), np.int32))
        if objective == "sft":
            self.data = {k: v for k, v in self.data.items() if k not in PPO_FIELDS}
        self.batch_size, self.mesh = batch_size, mesh
        self.seq_padded = padded_size(s, mesh_axis_size(mesh, SP))
        self.sharding = NamedSharding(mesh, TOKENS_BS)

    def host_batch(self, step: int) -> dict[str, np.ndarray]:  # every field [B, S'] (S' % sp == 0)
        n, s = self.data["tokens"].shape
        rows = np.arange(step * self.batch_size, (step + 1) * self.batch_size) % n
        pad = ((0, 0), (0, self.seq_padded - s))
        out = {}
        for name, x in self.data.items():
            dtype = np.float32 if name in FLOAT_FIELDS else np.int32
            out[name] = np.pad(x[rows].astype(dtype), pad)  # padding: segment 0, mask 0
        return out

    def batch(self, step: int) -> dict[str, jax.Array]:
        """The global batch of `step`, each process placing the shards of its own devices."""
        host = self.host_batch(step)
        return {name: jax.make_array_from_callback(x.shape, self.sharding, lambda idx, x=x: x[idx])
                for name, x in host.items()}

    def __iter__(self) -> Iterator[dict[str, jax.Array]]:
        step = 0
        while True:
            yield self.batch(step)
            step += 1
