"""Safetensors checkpoints on disk: read headers and tensors lazily, validate, write shards with an index.

A checkpoint directory holds either one `model.safetensors` or several shards listed in
`model.safetensors.index.json` (`{"metadata": {...}, "weight_map": {tensor name: shard file}}`).
Headers are parsed and checked by `safetensors.safe_open` (JSON, data offsets covering the file
exactly) before any tensor is touched. Tensors are then read one at a time with plain file reads
into a fresh array: a memory map would keep every page it touched in the process's resident set
until it is closed, i.e. the whole checkpoint by the end of an import. Writing streams tensor by
tensor: the header is computed from shapes and dtypes first, so at most one tensor's bytes are in
host memory.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from safetensors import SafetensorError, safe_open

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default shard limit, "5GB"

# safetensors dtype names <-> numpy dtypes (bfloat16 comes from ml_dtypes).
DTYPE_TO_NP: dict[str, np.dtype] = {
    "F64": np.dtype(np.float64),
    "F32": np.dtype(np.float32),
    "F16": np.dtype(np.float16),
    "BF16": np.dtype(ml_dtypes.bfloat16),
    "I64": np.dtype(np.int64),
    "I32": np.dtype(np.int32),
    "I16": np.dtype(np.int16),
    "I8": np.dtype(np.int8),
    "U8": np.dtype(np.uint8),
    "BOOL": np.dtype(np.bool_),
}
NP_TO_DTYPE: dict[np.dtype, str] = {v: k for k, v in DTYPE_TO_NP.items()}
# jnp / config dtype names <-> safetensors names for the float types a model may hold.
FLOAT_NAMES = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
FLOAT_NAMES_INV = {v: k for k, v in FLOAT_NAMES.items()}


@dataclass(frozen=True)
class TensorInfo:
    name: str
    file: str  # path of the shard that holds it
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]
    offset: int  # byte offset of the data in the file
    nbytes: int


class SafetensorsCheckpoint:
    """All tensor headers of a checkpoint directory; tensors are read on demand, one at a time."""

    def __init__(self, directory: str):
        self.directory = os.fspath(directory)
        self.files = _shard_files(self.directory)
        self.tensors: dict[str, TensorInfo] = {}
        listed = _index_weight_map(self.directory)
        for path in self.files:
            for info in _read_header(path):
                if info.name in self.tensors:
                    raise ValueError(f"{path}: tensor {info.name} is also stored in {self.tensors[info.name].file}")
                self.tensors[info.name] = info
        if listed is not None:
            for name, fname in listed.items():
                info = self.tensors.get(name)
                if info is None:
                    raise ValueError(f"{os.path.join(self.directory, fname)}: tensor {name} listed in "
                                     f"{INDEX_FILE} is not in that file")
                if os.path.basename(info.file) != fname:
                    raise ValueError(f"{info.file}: tensor {name} is listed in {INDEX_FILE} under {fname}")
            for name, info in self.tensors.items():
                if name not in listed:
                    raise ValueError(f"{info.file}: tensor {name} is not listed in {INDEX_FILE}")

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def read(self, name: str) -> np.ndarray:
        """One tensor as a new host numpy array, with the dtype and shape its header states."""
        info = self.tensors[name]
        if info.dtype not in DTYPE_TO_NP:
            raise ValueError(f"{info.file}: tensor {name} has dtype {info.dtype}, which cannot be read")
        arr = np.empty(info.shape, DTYPE_TO_NP[info.dtype])
        try:
            with open(info.file, "rb") as f:
                f.seek(info.offset)
                got = f.readinto(arr.reshape(-1).view(np.uint8)) if info.nbytes else 0
        except OSError as e:
            raise ValueError(f"{info.file}: cannot read tensor {name}: {e}") from None
        if got != info.nbytes:
            raise ValueError(f"{info.file}: tensor {name} is truncated ({got} of {info.nbytes} bytes)")
        return arr


def _shard_files(directory: str) -> list[str]:
    if not os.path.isdir(directory):
        raise ValueError(f"{directory}: not a directory")
    index = os.path.join(directory, INDEX_FILE)
    if os.path.exists(index):
        weight_map = _index_weight_map(directory)
        assert weight_map is not None
        files = []
        for fname in dict.fromkeys(weight_map.values()):
            path = os.path.join(directory, fname)
            if not os.path.isfile(path):
                raise ValueError(f"{path}: shard listed in {INDEX_FILE} does not exist")
            files.append(path)
        return files
    single = os.path.join(directory, SINGLE_FILE)
    if os.path.isfile(single):
        return [single]
    raise ValueError(f"{directory}: neither {SINGLE_FILE} nor {INDEX_FILE} found")


def _index_weight_map(directory: str) -> dict[str, str] | None:
    index = os.path.join(directory, INDEX_FILE)
    if not os.path.exists(index):
        return None
    try:
        with open(index) as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{index}: not valid JSON: {e}") from None
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: no 'weight_map' of tensor name -> shard file")
    return weight_map


def _read_header(path: str) -> list[TensorInfo]:
    """The tensors of one file, after safe_open checked its header (JSON, offsets covering the file)."""
    try:
        with safe_open(path, framework="numpy") as handle:
            shapes = {n: (handle.get_slice(n).get_dtype(), tuple(int(d) for d in handle.get_slice(n).get_shape()))
                      for n in handle.keys()}
    except SafetensorError as e:
        msg = str(e)
        if "incomplete metadata" in msg or "not fully covered" in msg:
            raise ValueError(f"{path}: truncated or corrupt: the data is shorter than its header says "
                             f"({msg})") from None
        raise ValueError(f"{path}: corrupt safetensors header ({msg})") from None
    except OSError as e:
        raise ValueError(f"{path}: cannot open: {e}") from None
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
    out = []
    for name, (dtype, shape) in shapes.items():
        start, end = header[name]["data_offsets"]
        out.append(TensorInfo(name, path, dtype, shape, 8 + n + int(start), int(end) - int(start)))
    return out


# ---------------------------------------------------------------------------------------------- writing
@dataclass(frozen=True)
class TensorToWrite:
    name: str
    dtype: str  # safetensors dtype name
    shape: tuple[int, ...]
    produce: Callable[[], np.ndarray]  # called once, when this tensor's bytes are written

    @property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * DTYPE_TO_NP[self.dtype].itemsize


def plan_shards(tensors: list[TensorToWrite], max_shard_bytes: int) -> list[list[TensorToWrite]]:
    """Greedy split in order; a shard exceeds the limit only when one tensor alone does."""
    shards: list[list[TensorToWrite]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return shards


def write_checkpoint(directory: str, tensors: list[TensorToWrite], *, max_shard_bytes: int = MAX_SHARD_BYTES,
                     on_written: Callable[[TensorToWrite], None] | None = None, write_files: bool = True) -> list[str]:
    """Write `tensors` into `directory` (which must exist) as HF does; returns the files written.

    One shard -> `model.safetensors`; more -> `model-0000i-of-0000n.safetensors` plus the index.
    `write_files=False` produces every tensor in the same order but writes nothing (the other
    processes of a multi-process export, whose `produce` calls take part in collectives).
    """
    shards = plan_shards(tensors, max_shard_bytes)
    n = len(shards)
    names = [SINGLE_FILE] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for fname, shard in zip(names, shards):
        _write_file(os.path.join(directory, fname), shard, on_written, write_files)
    written = list(names)
    if n > 1 and write_files:
        index = {
            "metadata": {"total_size": sum(t.nbytes for t in tensors)},
            "weight_map": {t.name: fname for fname, shard in zip(names, shards) for t in shard},
        }
        with open(os.path.join(directory, INDEX_FILE), "w") as f:
            json.dump(index, f, indent=2, sort_keys=True)
            f.write("\n")
        written.append(INDEX_FILE)
    return written


def _write_file(path: str, tensors: list[TensorToWrite], on_written: Callable | None, write: bool = True) -> None:
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for t in tensors:
        header[t.name] = {"dtype": t.dtype, "shape": list(t.shape), "data_offsets": [offset, offset + t.nbytes]}
        offset += t.nbytes
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)  # the data starts 8-byte aligned, as the format recommends
    with open(path, "wb") if write else contextlib.nullcontext() as f:
        if f is not None:
            f.write(struct.pack("<Q", len(blob)))
            f.write(blob)
        for t in tensors:
            arr = np.ascontiguousarray(t.produce())
            if arr.shape != t.shape or arr.dtype != DTYPE_TO_NP[t.dtype]:
                raise ValueError(f"{path}: tensor {t.name} produced {arr.dtype}{list(arr.shape)}, "
                                 f"header says {t.dtype}{list(t.shape)}")
            if f is not None:
                f.write(arr.reshape(-1).view(np.uint8))
            if on_written is not None:
                on_written(t)
