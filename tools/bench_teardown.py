"""How a benchmark that made its own segment removes it: the segment, its owner, its log.

A benchmark connects to a fresh segment, which starts an owner (``mgr._link.owner_proc``,
the owner this process started); at the end it calls ``remove_segment``. It never touches a
segment or an owner the benchmark did not make.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any


def remove_segment(name: str, owner: Any, wait_s: float = 5.0) -> None:
    """Unlink segment ``name``, let ``owner`` (the owner this process started, or None) stop
    by itself, as it does once its segment is gone, within ``wait_s`` seconds, else
    terminate it and at last kill it; then remove its owner log."""
    from kvshm.logs import owner_log_path
    from kvshm.shm.segment import Segment
    Segment.unlink(name)
    if owner is not None:
        try:
            owner.wait(timeout=wait_s)
        except Exception:  # noqa: BLE001  (still running)
            owner.terminate()
            try:
                owner.wait(timeout=wait_s)
            except Exception:  # noqa: BLE001
                owner.kill()
    with contextlib.suppress(OSError):
        os.unlink(owner_log_path(name))


if __name__ == "__main__":  # a library: say what it is and who runs it
    import os.path
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from library_help import explain
    explain("bench_teardown.py", __doc__, instead="tools/bench_owner.py")
