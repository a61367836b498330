"""SIGTERM / SIGINT: finish the current step, save, exit cleanly; a second SIGINT interrupts at once."""

from __future__ import annotations

import signal
import sys
import threading
from types import FrameType
from typing import Any


_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopRequest:
    """Context manager that turns the first SIGTERM/SIGINT into a request the loop polls between steps."""

    def __init__(self) -> None:
        self.signal_name: str | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> "StopRequest":
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.signal_name is None:
            self.signal_name = signal.Signals(signum).name
            print(f"\nreceived {self.signal_name}: finishing the current step, then saving a checkpoint "
                  "(Ctrl-C again to abort without saving)", file=sys.stderr, flush=True)
            signal.signal(signal.SIGINT, signal.default_int_handler)

    def agreed(self) -> bool:
        """Whether any process was asked to stop (all processes must stop at the same step)."""
        from qwen35_jax.parallel.processes import gather_values  # not at import time: the handler
        # is installed before jax loads

        asked = self.signal_name is not None
        flags = gather_values(int(asked))  # [P]
        if flags.any() and self.signal_name is None:
            self.signal_name = "a stop request on another process"
        return bool(flags.any())
