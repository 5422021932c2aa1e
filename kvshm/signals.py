"""Stopping a daemon (an owner, a mover) with SIGTERM or SIGINT: quietly, once it can.

This module owns the one way kvshm's long-running processes take the signals a process
manager or Ctrl-C sends. It imports nothing of kvshm and nothing outside the standard library.
"""
from __future__ import annotations

import logging
import signal
from collections.abc import Callable


class StopSignals:
    """SIGTERM and SIGINT, taken as a request to stop instead of their default actions (death
    mid-way, a KeyboardInterrupt traceback). Create it before the process starts; once it has,
    ``on_stop(stop)`` makes a signal call ``stop()``, at once if one came meanwhile."""

    def __init__(self) -> None:
        self.received: list[str] = []  # signal names, in order
        self._stop: Callable[[], object] | None = None
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handler)

    def _handler(self, signum: int, _frame: object) -> None:
        self.received.append(signal.Signals(signum).name)
        if self._stop is not None:
            self._stop()  # only sets a flag: the process stops where its loop looks

    def on_stop(self, stop: Callable[[], object]) -> None:
        self._stop = stop
        if self.received:
            stop()

    def to_kernel(self, on: bool) -> None:
        """While ``on``, SIGTERM and SIGINT take their default actions again: the kernel ends
        the process at once, even while another thread holds the GIL in a call that never lets
        go of it (a handler of ours would never run then). Off: this object's handler again.
        Main thread only, like ``signal.signal``; a signal that came before ``on`` is kept."""
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, signal.SIG_DFL if on else self._handler)

    def report(self, log: logging.Logger, what: str = "") -> None:
        """One line, if a signal stopped the process: which one (and ``what``)."""
        if self.received:
            log.info("stopped by %s%s", self.received[0], what)
