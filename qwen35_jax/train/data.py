"""Training batches: token rows from .npy directories or random tokens, and their placement on the mesh.

    DIR/tokens.npy         int [N, S]    required
    DIR/segment_ids.npy    int [N, S]    document ids >= 1, 0 = padding (default: each row one document)
    DIR/loss_mask.npy      0/1 [N, S]    1 = train on log_probs[:, t], the prediction of tokens[:, t + 1]
    DIR/old_log_probs.npy  float [N, S]  PPO: behaviour-policy log-probs (scripts/logprobs.py's log_probs)
    DIR/advantages.npy     float [N, S]  PPO: per-token advantages, or [N]: one per sequence (GRPO)
    DIR/ref_log_probs.npy  float [N, S]  PPO with --kl-coef: reference-policy log-probs

Every per-token field is aligned with the log-probs. Arrays are memory-mapped, so a directory larger
than RAM trains. A batch stream (`BatchStream`) yields each process's slice of every global batch as
host arrays; `place_batch` pads S to a multiple of sp and assembles the global [K, B/K, S] arrays.
"""

from __future__ import annotations

import os
from typing import Any, Protocol

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from qwen35_jax.parallel.mesh import FSDP, SP, mesh_axis_size
from qwen35_jax.parallel.padding import padded_size
from qwen35_jax.scoring import check_inputs
from qwen35_jax.train.step import MICRO_BSS, batch_shardings

INT_FIELDS = ("tokens", "segment_ids", "loss_mask")
FLOAT_FIELDS = ("old_log_probs", "advantages", "ref_log_probs")
FIELDS = INT_FIELDS + FLOAT_FIELDS
HostBatch = dict[str, np.ndarray]  # every field [rows, S] (per-sequence advantages [rows])


class BatchStream(Protocol):
    """An endless, resumable stream of this process's slice of every global batch."""
    seq_len: int

    def next_batch(self) -> HostBatch: ...
    def get_state(self) -> dict[str, Any]: ...  # JSON-serialisable position
    def set_state(self, state: dict[str, Any]) -> None: ...
    def summary(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


def check_batch_size(batch_size: int, fsdp: int, grad_accum: int = 1) -> None:
    """One-line ValueError unless each of the `grad_accum` micro-batches splits evenly over fsdp."""
    step = fsdp * grad_accum
    if grad_accum < 1:
        raise ValueError(f"grad-accum must be >= 1, got {grad_accum}")
    if batch_size < 1 or batch_size % step:
        valid = ", ".join(str(step * k) for k in range(1, 4))
        raise ValueError(f"batch size {batch_size} must be a positive multiple of fsdp x grad-accum = "
                         f"{fsdp} x {grad_accum} (each micro-batch's rows are split over fsdp): "
                         f"valid batch sizes are {valid}, ...")


def load_npy_dir(directory: str) -> dict[str, np.ndarray]:
    """The fields present in `directory` (tokens.npy required), memory-mapped and checked."""
    if not os.path.isdir(directory):
        raise ValueError(f"data directory not found: {directory}")
    data: dict[str, np.ndarray] = {}
    for name in FIELDS:
        path = os.path.join(directory, f"{name}.npy")
        if not os.path.isfile(path):
            continue
        try:
            data[name] = np.load(path, mmap_mode="r", allow_pickle=False)
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
        per_sequence = name == "advantages" and x.shape == tokens.shape[:1]
        if x.shape != tokens.shape and not per_sequence:
            raise ValueError(f"{source}: {name} has shape {x.shape}, tokens have {tokens.shape}"
                             + (f" (or [{tokens.shape[0]}] per sequence)" if name == "advantages" else ""))
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


class ArrayBatches:
    """`BatchStream` over in-memory or memory-mapped rows: global batch k takes rows
    [k*B, (k+1)*B) modulo N, in order; this process reads slice `shard_index` of `shard_count`.
    The position (global batches taken) does not depend on the slicing, so a run resumes on any
    number of processes."""

    def __init__(self, data: dict[str, np.ndarray], batch_size: int, *, vocab_size: int,
                 fields: tuple[str, ...] = (), shard_index: int = 0, shard_count: int = 1, source: str = "data"):
        check_fields(data, source=source)
        check_inputs(np.asarray(data["tokens"]), None if "segment_ids" not in data else np.asarray(data["segment_ids"]),
                     vocab_size, source=source)
        missing = [f for f in fields if f not in data]
        if missing:
            raise ValueError(f"{source}: the objective needs {', '.join(f'{m}.npy' for m in missing)}")
        if batch_size % shard_count or not 0 <= shard_index < shard_count:
            raise ValueError(f"cannot read slice {shard_index} of {shard_count} of a batch of {batch_size} rows")
        self.data = {k: v for k, v in data.items() if k in INT_FIELDS or k in fields}
        self.rows, self.seq_len = data["tokens"].shape
        self.batch_size, self.shard_index, self.shard_count = batch_size, shard_index, shard_count
        self.batches_taken = 0

    @property
    def epoch(self) -> float:
        return self.batches_taken * self.batch_size / self.rows

    def next_batch(self) -> HostBatch:
        local = self.batch_size // self.shard_count
        start = self.batches_taken * self.batch_size + self.shard_index * local
        rows = np.arange(start, start + local) % self.rows
        self.batches_taken += 1
        out = {name: np.asarray(x[rows]) for name, x in self.data.items()}
        out.setdefault("segment_ids", np.ones((local, self.seq_len), np.int32))
        out.setdefault("loss_mask", np.ones((local, self.seq_len), np.int32))
        return {name: x.astype(np.float32 if name in FLOAT_FIELDS else np.int32) for name, x in out.items()}

    def get_state(self) -> dict[str, Any]:
        return {"kind": "arrays", "batches_taken": self.batches_taken, "rows": self.rows}

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("kind") != "arrays" or state.get("rows") != self.rows:
            raise ValueError(f"the checkpoint's data position {state} is not one of this data ({self.rows} rows)")
        self.batches_taken = int(state["batches_taken"])

    def summary(self) -> dict[str, Any]:
        return {"rows": self.rows, "seq_len": self.seq_len}

    def close(self) -> None:
        pass


def process_slice(mesh: Mesh, batch_size: int, grad_accum: int) -> tuple[int, int]:
    """(shard_index, shard_count): which equal slice of every global batch this process's devices
    hold rows of. With fsdp spread over processes each reads its own rows; processes that share rows
    (sp spread over them) read the same slice."""
    micro = batch_size // grad_accum
    shape = (grad_accum, micro, mesh_axis_size(mesh, SP))
    index_map = NamedSharding(mesh, MICRO_BSS).addressable_devices_indices_map(shape)
    blocks = sorted({idx[1].indices(micro)[:2] for idx in index_map.values()})
    size = blocks[-1][1] - blocks[0][0]
    tiled = all(a[1] == b[0] for a, b in zip(blocks, blocks[1:]))
    if not tiled or micro % size or blocks[0][0] % size:
        raise ValueError(f"this process's devices hold rows {blocks} of each {micro}-row micro-batch: "
                         "not one aligned block")
    return blocks[0][0] // size, micro // size


def place_batch(host: HostBatch, mesh: Mesh, grad_accum: int, shard_count: int) -> dict[str, Any]:
    """This process's rows [B/n, S] of a global batch -> global arrays [K, B/K, S'] (S' a multiple of
    sp, padded with segment 0 and loss mask 0), sharded P(None, 'fsdp', 'sp'). A VLM batch
    (`train/vision.py`) also places "positions" [3, B/n, S] as [K, 3, B/K, S'] sharded
    P(None, None, 'fsdp', 'sp'), and "vision" ([K, P, ...] VisionInputs) replicated on every device."""
    rows, s = host["tokens"].shape
    pad = padded_size(s, mesh_axis_size(mesh, SP)) - s
    local, placed = {}, {}
    for name, x in host.items():
        if name == "vision":
            if shard_count > 1:
                raise ValueError("image batches are read by one process for now (the vision inputs are "
                                 "replicated): run a VLM on the devices of one process")
            placed[name] = jax.device_put(x, NamedSharding(mesh, P()))
            continue
        if name == "positions":  # [3, rows, S] -> [K, 3, rows/K, S']
            x = np.pad(x, ((0, 0), (0, 0), (0, pad)))
            x = x.reshape(3, grad_accum, rows // grad_accum, -1).transpose(1, 0, 2, 3)
            sharding = NamedSharding(mesh, P(None, None, FSDP, SP))
            placed[name] = jax.make_array_from_process_local_data(
                sharding, np.ascontiguousarray(x), (grad_accum, 3, rows * shard_count // grad_accum, x.shape[-1]))
            continue
        if x.ndim == 2 and pad:
            x = np.pad(x, ((0, 0), (0, pad)))
        local[name] = x.reshape(grad_accum, rows // grad_accum, *x.shape[1:])
    global_shapes = {name: (grad_accum, rows * shard_count // grad_accum, *x.shape[2:]) for name, x in local.items()}
    shardings = batch_shardings(mesh, local)
    return {**{name: jax.make_array_from_process_local_data(shardings[name], x, global_shapes[name])
               for name, x in local.items()}, **placed}
