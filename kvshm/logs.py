"""Owner log files: where an auto-started owner logs, and how they stay bounded.

This module owns the owner log's path (``kvshm-NAME-owner.log`` in ``$XDG_RUNTIME_DIR``,
else the temp dir), its size bound, and its removal. A log is cut to its newest part, never
rotated: one file per segment name, which ``kvshm-inspect show`` names and ``rm`` removes.
It imports nothing of kvshm and nothing outside the standard library.
"""
from __future__ import annotations

import logging
import os
import stat
import sys
import tempfile
from typing import TextIO

LOG_LIMIT = 1 << 20  # bytes an owner log may reach before it is cut to its newest half
CUT_NOTE = b"[older lines cut: an owner log is kept under %d bytes]\n"


def owner_log_path(name: str) -> str:
    """Where an auto-started owner of segment ``name`` logs: ``kvshm-NAME-owner.log`` in
    ``$XDG_RUNTIME_DIR`` if set, else the system temp dir (appended, mode 0600)."""
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir(),
                        f"kvshm-{name}-owner.log")


def bound(path: str, limit: int = LOG_LIMIT) -> bool:
    """Cut the log at ``path`` to its newest ``limit // 2`` bytes (from a line's start, after
    a note saying so) if it is a regular file over ``limit`` bytes. True if it was cut.

    The newest part is written over the file's start before the file is shortened, so a
    process appending to it (O_APPEND) meanwhile loses at most the lines of that instant."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False  # absent (nothing to bound), or not ours to cut
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size <= limit:
            return False
        keep = limit // 2
        tail = os.pread(fd, keep, st.st_size - keep)
        tail = tail[tail.find(b"\n") + 1:] if b"\n" in tail else tail
        data = CUT_NOTE % limit + tail
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
        return True
    finally:
        os.close(fd)


def remove(name: str) -> str | None:
    """Remove segment ``name``'s owner log; returns its path if there was one."""
    path = owner_log_path(name)
    try:
        os.unlink(path)
    except FileNotFoundError:
        return None
    return path


class BoundedStderr(logging.StreamHandler):
    """A handler writing to ``stream`` (stderr) that, when the stream is the owner log at
    ``path`` (an auto-started owner's stderr is), keeps that file under ``limit`` bytes.
    Any other stderr (a terminal, a pipe, a file the user chose) is left alone."""

    def __init__(self, path: str, limit: int = LOG_LIMIT, stream: TextIO | None = None):
        super().__init__(stream if stream is not None else sys.stderr)
        self.path, self.limit = path, limit

    def emit(self, record: logging.LogRecord) -> None:
        super().emit(record)
        try:  # one fstat per log line: owners log events, not requests
            st = os.fstat(self.stream.fileno())
            if stat.S_ISREG(st.st_mode) and st.st_size > self.limit and \
                    os.path.samestat(st, os.stat(self.path)):
                bound(self.path, self.limit)
        except (OSError, ValueError, AttributeError):
            pass  # no file behind the stream (closed, a StringIO): nothing to bound


def owner_logging(name: str, level: str) -> None:
    """Log an owner of segment ``name`` to stderr at ``level``, one line per event; an
    auto-started owner's stderr is its log file, which is then kept under ``LOG_LIMIT``."""
    logging.basicConfig(level=level, handlers=[BoundedStderr(owner_log_path(name))],
                        format="%(asctime)s kvshm-owner[%(process)d] %(message)s")
