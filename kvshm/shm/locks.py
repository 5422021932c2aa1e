"""Kernel-released byte-range locks (Linux OFD locks) on a segment's file descriptor.

This module owns liveness: the owner, each client slot and the pin turn are single bytes
locked with ``F_OFD_SETLK``. The kernel drops an OFD lock when the last descriptor of the open
file description closes — including when its process is SIGKILLed — so "is the holder alive?"
is answered by the kernel, never by PID files or heartbeats.

OFD locks belong to the open file description, not the process: every party opens its own
descriptor (``os.open``) so that two parties in one process still exclude each other, and a
forked child shares its parent's locks (the README tells users to connect after forking).
It must never lock data bytes or touch the mapping.
"""
from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import struct
from collections.abc import Iterator

from kvshm.shm.wait import poll_until

# struct flock on Linux x86_64/aarch64: short l_type, short l_whence, off_t l_start,
# off_t l_len, pid_t l_pid (+ padding). l_pid must be 0 for OFD locks.
_FLOCK = struct.Struct("hhqqi4x")


def _flock(kind: int, start: int) -> bytes:
    return _FLOCK.pack(kind, os.SEEK_SET, start, 1, 0)


def query_fd(fd: int) -> int:
    """A new open file description of the object ``fd`` holds (close-on-exec), for asking who
    holds its locks: the kernel never reports a description's own locks back to it, so a
    process asking through the descriptor it locks with would not see itself. Opened through
    ``fd`` rather than the object's name, it is the same object even after the name was
    removed (or reused)."""
    return os.open(f"/proc/self/fd/{fd}", os.O_RDWR | os.O_CLOEXEC)


def try_lock(fd: int, byte: int) -> bool:
    """Take the exclusive lock on ``byte`` without waiting; False if someone holds it."""
    return _try(fd, byte, fcntl.F_WRLCK)


def try_share(fd: int, byte: int) -> bool:
    """Take a shared lock on ``byte`` without waiting (any number of descriptions may hold
    one; ``is_held`` sees it); False if someone holds it exclusively."""
    return _try(fd, byte, fcntl.F_RDLCK)


def _try(fd: int, byte: int, kind: int) -> bool:
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(kind, byte))
        return True
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def lock(fd: int, byte: int, timeout: float | None = None) -> bool:
    """Take the lock on ``byte``, blocking (``timeout=None``) or polling until ``timeout``."""
    if timeout is None:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW, _flock(fcntl.F_WRLCK, byte))
        return True
    return poll_until(lambda: try_lock(fd, byte), timeout)  # polling a kernel lock


def unlock(fd: int, byte: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _flock(fcntl.F_UNLCK, byte))


def is_held(fd: int, byte: int) -> bool:
    """True if another open file description holds ``byte`` (our own locks don't count)."""
    res = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _flock(fcntl.F_WRLCK, byte))
    return _FLOCK.unpack(res)[0] != fcntl.F_UNLCK


def held_among(fd: int, first: int, count: int) -> set[int]:
    """Which of the bytes ``first .. first+count-1`` are held by someone else."""
    return {i for i in range(count) if is_held(fd, first + i)}


@contextlib.contextmanager
def holding(fd: int, byte: int) -> Iterator[None]:
    """Context manager: hold ``byte`` (blocking) for the duration of the block."""
    lock(fd, byte)
    try:
        yield
    finally:
        unlock(fd, byte)
