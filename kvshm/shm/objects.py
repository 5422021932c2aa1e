"""Opening a segment's named objects: the tier area (doorbells are words of the segment,
``doorbell.py``, not objects).

This module owns the one way such an object is opened or created: with the access of the
file it belongs to from the first instant it has its name, and never outliving that file's
removal. It never names objects (``names.py``) and never maps or locks them.

Why create-then-link: ``shm_open`` applies the umask, so an object created
under its name would show the wrong mode until its creator chmods it, and a creator killed
in between would leave other users refused for as long as the object lives. Instead the
creator makes the object under a name of its own, sets its mode and group, and links it into
place (``link`` fails if somebody was first: then it opens theirs). This is how glibc's own
``sem_open`` creates a semaphore atomically.
"""
from __future__ import annotations

import contextlib
import itertools
import os
import stat
from typing import TypeAlias

import posix_ipc

from kvshm.crashpoints import crash_point
from kvshm.errors import SegmentNotFoundError, SegmentPermissionError
from kvshm.shm.names import SHM_DIR

Shared: TypeAlias = posix_ipc.SharedMemory
_seq = itertools.count()


def _path(name: str) -> str:
    return f"{SHM_DIR}/{name.lstrip('/')}"


def _open(name: str, flags: int = 0, mode: int = 0o600) -> Shared:
    return posix_ipc.SharedMemory(name, flags, mode=mode)


def _close(obj: Shared) -> None:
    obj.close_fd()


def _unlink(name: str) -> None:
    # Another user's is refused by the sticky /dev/shm: its maker or the segment's remover
    # takes it (``names.remove_objects``).
    with contextlib.suppress(posix_ipc.ExistentialError, posix_ipc.PermissionsError):
        posix_ipc.unlink_shared_memory(name)


def _create(name: str, mode: int, gid: int) -> Shared | None:
    """Make ``name`` with ``mode`` and group ``gid``; None if somebody else made it first."""
    tmp = f"{name}.new-{os.getpid()}-{next(_seq)}"  # begins like name: removed with it
    obj = _open(tmp, posix_ipc.O_CREX, mode)
    try:
        path = _path(tmp)
        os.chmod(path, mode)
        if gid >= 0 and os.stat(path).st_gid != gid:
            with contextlib.suppress(OSError):  # a group we are not in: the creator's stays
                os.chown(path, -1, gid)
        crash_point("object.before_link")
        os.link(path, _path(name))
    except (FileExistsError, FileNotFoundError):  # first made by another; or our file was
        _close(obj)                               # removed with a removed segment: again
        return None
    except BaseException:
        _close(obj)
        raise
    finally:
        _unlink(tmp)
    return obj


def open_object(name: str, like_fd: int | None, *, point: str) -> Shared:
    """Open, creating it if absent, shared-memory object ``name`` that
    belongs to the open file ``like_fd``: it gets that file's mode and group (0600 without
    one). Raises ``SegmentNotFoundError`` if that file was removed before the object was open
    (the object is removed again: a removal after it finds it), ``SegmentPermissionError`` if
    this process may not open it. ``point`` is the crash point between open and check."""
    mode, gid = 0o600, -1
    if like_fd is not None:
        st = os.fstat(like_fd)
        mode, gid = stat.S_IMODE(st.st_mode), st.st_gid
    try:
        while True:
            try:
                obj = _open(name)
                break
            except posix_ipc.ExistentialError:
                made = _create(name, mode, gid)
                if made is not None:
                    obj = made
                    break
    except posix_ipc.PermissionsError as e:
        raise SegmentPermissionError(
            f"permission denied opening {name} ({e}); every process sharing a segment must be "
            "able to open its objects: create the segment with a group mode such as "
            "mode=0o660 and run the processes in that group, or remove stale objects with "
            "'kvshm-inspect rm NAME'") from None
    crash_point(point)
    if like_fd is not None and os.fstat(like_fd).st_nlink == 0:
        # Whoever removed the file removed the objects it found; one made after that would
        # stay forever. Checked after the open: a removal that comes later finds ours. The
        # name is this removed file's alone (a new one under the same name has names of its
        # own), so it goes whoever made it.
        _close(obj)
        _unlink(name)
        raise SegmentNotFoundError(
            f"{name} belongs to an object that was removed while this process was opening "
            "it; create it again, or connect to the one now under its name")
    return obj
