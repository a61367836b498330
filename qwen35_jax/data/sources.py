"""JSONL inputs: the files a list of paths and directories names, and random access to their lines.

Every line keeps its provenance (file and 1-based line number) so a bad row can be reported where it is.
Plain files are memory-mapped; `.jsonl.gz` files are decompressed into memory when first read.
"""

from __future__ import annotations

import gzip
import hashlib
import mmap
import os
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

JSONL_SUFFIXES = (".jsonl", ".jsonl.gz")
NEWLINE = 10


def is_jsonl(path: str) -> bool:
    return path.endswith(JSONL_SUFFIXES)


def find_jsonl_files(inputs: str | Sequence[str]) -> list[str]:
    """The JSONL files `inputs` names: files as given, directories searched recursively (sorted)."""
    if isinstance(inputs, str):
        inputs = [inputs]
    if not inputs:
        raise ValueError("no input files given")
    files: list[str] = []
    for item in inputs:
        if os.path.isdir(item):
            found = sorted(os.path.join(root, name) for root, _, names in os.walk(item)
                           for name in names if is_jsonl(name))
            if not found:
                raise ValueError(f"{item}: directory holds no .jsonl or .jsonl.gz files")
            files.extend(found)
        elif os.path.isfile(item):
            if not is_jsonl(item):
                raise ValueError(f"{item}: not a .jsonl or .jsonl.gz file")
            files.append(item)
        else:
            raise ValueError(f"input not found: {item}")
    return files


def file_sha256(path: str, chunk: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


def _read_bytes(path: str) -> bytes | mmap.mmap:
    try:
        if path.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                return f.read()
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size == 0:
                return b""
            return mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
    except (OSError, EOFError) as err:
        raise ValueError(f"{path}: cannot read ({err})") from None


def _newlines(data: bytes | mmap.mmap, chunk: int = 1 << 26) -> np.ndarray:
    """Offsets of every newline byte, scanned in chunks so a large file needs no file-sized mask."""
    found = [np.flatnonzero(np.frombuffer(data, np.uint8, count=min(chunk, len(data) - start), offset=start)
                            == NEWLINE) + start for start in range(0, len(data), chunk)]
    return np.concatenate(found) if found else np.zeros(0, np.int64)


def _line_spans(data: bytes | mmap.mmap) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Start, end (exclusive, without the newline) and 1-based number of every non-blank line."""
    newlines = _newlines(data)
    starts = np.concatenate([[0], newlines + 1]).astype(np.int64)
    ends = np.concatenate([newlines, [len(data)]]).astype(np.int64)
    numbers = np.arange(1, len(starts) + 1)
    buffer = np.frombuffer(data, np.uint8) if len(data) else np.zeros(0, np.uint8)  # a view, no copy
    nonempty = ends > starts
    carriage_return = np.zeros(len(ends), bool)
    carriage_return[nonempty] = buffer[ends[nonempty] - 1] == ord("\r")
    ends -= carriage_return
    keep = ends > starts
    return starts[keep], ends[keep], numbers[keep]


@dataclass(frozen=True)
class Line:
    path: str
    number: int  # 1-based line number in the file
    text: bytes

    @property
    def where(self) -> str:
        return f"{self.path}:{self.number}"


class JsonlLines:
    """A grain random-access source: the non-blank lines of `files`, in file order.

    Picklable for grain's worker processes: only the line index travels; each process opens the files
    itself.
    """

    def __init__(self, files: Sequence[str]):
        self.files = list(files)
        starts, ends, numbers, file_ids = [], [], [], []
        self._data: dict[int, bytes | mmap.mmap] = {}
        for i, path in enumerate(self.files):
            self._data[i] = _read_bytes(path)
            s, e, n = _line_spans(self._data[i])
            starts.append(s), ends.append(e), numbers.append(n)
            file_ids.append(np.full(len(s), i, np.int32))
        self.starts = np.concatenate(starts).astype(np.int64)
        self.ends = np.concatenate(ends).astype(np.int64)
        self.numbers = np.concatenate(numbers).astype(np.int64)
        self.file_ids = np.concatenate(file_ids)
        self.lines_per_file = [len(s) for s in starts]
        if len(self.starts) == 0:
            raise ValueError(f"no rows: {', '.join(self.files)} hold only blank lines")

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, index: int) -> Line:
        file_id = int(self.file_ids[index])
        data = self._data.get(file_id)
        if data is None:
            data = self._data[file_id] = _read_bytes(self.files[file_id])
        return Line(self.files[file_id], int(self.numbers[index]),
                    bytes(data[self.starts[index]:self.ends[index]]))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_data": {}}


IMAGE_PART_KEY = b'"image"'  # every image part of a chat row holds it ({"type": "image", "image": PATH})


def find_image_row(lines: JsonlLines) -> tuple[str, str] | None:
    """(file:line, image path) of the first row whose messages hold an image part, or None. Only the
    lines that contain the bytes `"image"` are parsed, so a text corpus is scanned at memory speed."""
    import json

    from qwen35_jax.data.image_rows import BadContent, content_images

    for file_id, path in enumerate(lines.files):
        data = lines._data.get(file_id)
        if data is None:
            data = lines._data[file_id] = _read_bytes(path)
        first = int(np.searchsorted(lines.file_ids, file_id))
        starts = lines.starts[first:first + lines.lines_per_file[file_id]]
        at = data.find(IMAGE_PART_KEY)
        while at >= 0:
            index = first + int(np.searchsorted(starts, at, side="right")) - 1  # the line holding byte `at`
            line = lines[index]
            try:
                row = json.loads(line.text)
                messages = row.get("messages") if isinstance(row, dict) else None
                for i, message in enumerate(messages if isinstance(messages, list) else []):
                    if isinstance(message, dict):
                        images = content_images(i, message.get("content"))
                        if images:
                            return line.where, images[0]
            except (ValueError, BadContent):  # not JSON, or malformed parts: the encoder reports those rows
                pass
            at = data.find(IMAGE_PART_KEY, int(lines.ends[index]) + 1)
    return None
