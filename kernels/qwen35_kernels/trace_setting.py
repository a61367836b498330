"""Trace-time settings: context variables that layer code reads while a step is traced (kernel and
scan choices, matmul precision, sequence tiles). A jitted step keeps what its first trace read, so a
setting must wrap that first trace."""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator
from typing import TypeVar

T = TypeVar("T")


@contextlib.contextmanager
def scoped(var: contextvars.ContextVar[T], value: T) -> Iterator[None]:
    """`var` holds `value` inside the block and its previous value after it."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)
