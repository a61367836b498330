"""Files and directories that appear in one step: a reader (or a crash) sees the old one or the new
one, never half of it.

Everything is written into a temporary sibling (same directory, so the same file system) and renamed
over the target only when the writing block ends without an error; on any error the temporary is
removed and the target is left as it was. The one place the library writes files this way:

    with replaced_atomically("out.npz", "wb") as f:   # a file, through a file object
        np.savez(f, ...)
    write_text_atomically("config.yaml", text)         # a text file in one call
    with staged_directory("dataset/") as stage:        # a new directory, filled in `stage`
        ...

Single-process helpers: under jax.distributed the caller decides which process writes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from typing import IO, Any


def _umask() -> int:
    umask = os.umask(0)
    os.umask(umask)
    return umask


def _temporary_prefix(path: str) -> tuple[str, str]:
    """(directory, name prefix) of a hidden temporary sibling of `path`."""
    return os.path.dirname(os.path.abspath(path)), f".{os.path.basename(os.path.abspath(path))}."


@contextlib.contextmanager
def replaced_atomically(path: str | os.PathLike[str], mode: str = "w", **open_kwargs: Any) -> Iterator[IO[Any]]:
    """A file object (open in `mode`, "w" or "wb") on a temporary sibling of `path`, renamed over
    `path` when the block ends without an error and removed when it raises. The file gets the
    permissions `open` gives a new file under the umask. The parent directory must exist."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    path = os.fspath(path)
    directory, prefix = _temporary_prefix(path)
    fd, tmp = tempfile.mkstemp(prefix=prefix, dir=directory)
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # as `open` would create it, not mkstemp's 0600
        with os.fdopen(fd, mode, **open_kwargs) as f:
            yield f
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise


def write_text_atomically(path: str | os.PathLike[str], text: str) -> None:
    """Write `text` to `path` through `replaced_atomically`."""
    with replaced_atomically(path, "w") as f:
        f.write(text)


@contextlib.contextmanager
def staged_directory(path: str | os.PathLike[str]) -> Iterator[str]:
    """A new temporary directory beside `path` (permissions as `os.mkdir` under the umask gives, not
    mkdtemp's 0700), renamed to `path` when the block ends without an error and removed with its
    contents otherwise. `path` must not exist, or be an empty directory (`os.rename` replaces that)."""
    path = os.fspath(path)
    directory, prefix = _temporary_prefix(path)
    os.makedirs(directory, exist_ok=True)
    stage = tempfile.mkdtemp(prefix=prefix, dir=directory)
    try:
        os.chmod(stage, 0o777 & ~_umask())  # mkdtemp's 0700 would hide the directory from other users
        yield stage
        os.rename(stage, path)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
