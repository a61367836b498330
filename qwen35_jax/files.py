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
import secrets
import shutil
from collections.abc import Callable, Iterator
from typing import IO, Any


def _new_sibling(path: str, create: Callable[[str], Any]) -> tuple[str, Any]:
    """(name, what `create(name)` returned) for a new hidden sibling of `path`, `.NAME.<random>`.
    `create` must fail with FileExistsError on a name that is taken. Created by os.open / os.mkdir with
    the usual modes, the umask applies as to any new file (tempfile's would be 0600 / 0700)."""
    path = os.path.abspath(path)
    for _ in range(100):
        name = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{secrets.token_hex(4)}")
        try:
            return name, create(name)
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


@contextlib.contextmanager
def replaced_atomically(path: str | os.PathLike[str], mode: str = "w", **open_kwargs: Any) -> Iterator[IO[Any]]:
    """A file object (open in `mode`, "w" or "wb") on a temporary sibling of `path`, renamed over
    `path` when the block ends without an error and removed when it raises. The file gets the
    permissions `open` gives a new file. The parent directory must exist."""
    if mode not in ("w", "wb"):
        raise ValueError(f"mode must be 'w' or 'wb', got {mode!r}")
    path = os.fspath(path)
    tmp, fd = _new_sibling(path, lambda name: os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    try:
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
    """A new temporary directory beside `path` (the permissions `os.mkdir` gives, so other users can
    read what it becomes), renamed to `path` when the block ends without an error and removed with its
    contents otherwise. Its parent is created if missing. `path` must not exist, or be an empty
    directory (`os.rename` replaces that)."""
    path = os.fspath(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    stage, _ = _new_sibling(path, lambda name: os.mkdir(name, 0o777))
    try:
        yield stage
        os.rename(stage, path)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
