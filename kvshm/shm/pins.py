"""Pin-progress records in the header: which processes register the segment with CUDA.

This module owns the ``MAX_PINNERS`` records (pid, state, bytes done of total, when) that a
process pinning the data region updates so ``kvshm-inspect`` can show progress. A record of
a dead process is reused. It never pins anything itself (see ``transfer/pinning.py``).
"""
from __future__ import annotations

import os
import time

from kvshm.shm import layout as L
from kvshm.shm import words


class PinProgress:
    """This process's pin-progress record in the header (visible to ``kvshm-inspect``) of
    the segment mapped at ``buf``."""

    def __init__(self, buf: memoryview):
        self._buf = buf
        pid = os.getpid()
        self._off: int | None = None
        for i in range(L.MAX_PINNERS):
            off = L.OFF_PINNERS + i * L.PINNER.size
            rec = L.PinnerRecord._make(L.PINNER.unpack_from(buf, off))
            if rec.pid == pid or rec.state in (L.PIN_IDLE, L.PIN_DONE, L.PIN_FAILED) or \
                    not _pid_alive(rec.pid):
                self._off = off
                break
        self.update(L.PIN_WAITING, 0, 0)

    def update(self, state: int, done: int, total: int) -> None:
        if self._off is not None:  # table full: progress simply isn't shown
            words.store_fields(self._buf, self._off, L.PINNER_DTYPE, pid=os.getpid(),
                               state=state, done_bytes=done, total_bytes=total,
                               updated_ns=time.time_ns())

    def __call__(self, done: int, total: int) -> None:
        self.update(L.PIN_DONE if done >= total else L.PIN_RUNNING, done, total)


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
