"""How a segment's POSIX object comes to exist, and how an attacher knows it is complete.

This module owns the creation protocol: creating the object (space reserved up front, so a
full ``/dev/shm`` is an error now, never a SIGBUS later, and the header written under the
creation lock), opening an existing one once its creator is done, and judging what a dead
creator left, and how many blocks a size in bytes holds. It hands back the object and its
mapping; ``segment.py`` wraps them.

Why a dead creator can never block anyone:

* A creator opens the name with O_CREAT|O_EXCL, takes the kernel-released LOCK_INIT on it,
  checks that its object is still linked, and holds the lock until the magic is written (or,
  on failure, until it has unlinked its object). The magic goes last.
* Only a LOCK_INIT holder ever removes an object without magic (``kvshm-inspect rm`` is the
  one manual exception). An attacher that finds no magic waits while LOCK_INIT is held; once
  it is free it takes the lock itself and re-reads: magic -> attach; an all-zero magic -> the
  leftover of a creator that died half-way, which it unlinks (still the same inode: nobody
  else may unlink while it holds the lock); anything else is a foreign object, left alone.
* POSIX shm has no link/rename, so a creator cannot appear fully formed: there is a window
  between its exclusive open and its lock. An attacher in that window judges the object a
  leftover and unlinks it. That is safe by construction, not by a grace period: the creator
  blocks on the lock the attacher holds, then finds its object unlinked (st_nlink == 0) and
  starts over (and with ``exist_ok`` attaches whatever was created meanwhile).
* A creator that fails unlinks its object before its lock falls, so racers find the object
  unlinked: to them the segment does not exist (an attacher re-opens the name, a
  create-racer creates afresh) -- never "remove it".
* An attacher waits for a live creator as long as the object keeps growing (fallocate of a
  large segment takes seconds to tens of seconds). A creator that holds the lock and makes
  no progress for _STALL_S (stopped with SIGSTOP, hung) gets ``CreationStalledError``.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import time
from typing import NamedTuple

import posix_ipc

from kvshm.crashpoints import crash_point
from kvshm.errors import (
    CreationStalledError,
    InsufficientSpaceError,
    InvalidArgumentError,
    NotAKvshmSegmentError,
    SegmentExistsError,
    SegmentNotFoundError,
    SegmentPermissionError,
)
from kvshm.shm import header, locks
from kvshm.shm import layout as L
from kvshm.shm.layout import Geometry, Layout
from kvshm.shm.names import SHM_DIR, shm_name
from kvshm.units import parse_size

# An attacher gives up on a creator that holds the creation lock but has not grown the
# object for this long (fallocate keeps growing it; only a stopped or hung creator stalls).
_STALL_S = 60.0
_RETRIES = 100  # create/attach rounds lost to racing removals before giving up


class Opened(NamedTuple):
    """A segment's object, mapped and validated: what ``Segment`` is made of."""
    shm: posix_ipc.SharedMemory
    mm: mmap.mmap
    layout: Layout
    geometry: Geometry
    created_ns: int


class _Gone(Exception):
    """Internal: the object under the name is absent, or was removed while we looked."""

    def __init__(self, why: str, absent: bool = False):
        super().__init__(why)
        self.absent = absent


def free_bytes() -> int:
    """Bytes a new segment may take: ``/dev/shm``'s free space, capped by the cgroup's."""
    st = os.statvfs(SHM_DIR)
    free = st.f_bavail * st.f_frsize
    # tmpfs pages are charged to our cgroup too: a cgroup limit below /dev/shm's free space
    # would end in the OOM killer instead of a clean error.
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        if limit != "max":
            with open("/sys/fs/cgroup/memory.current") as f:
                free = min(free, int(limit) - int(f.read()))
    except (OSError, ValueError):
        pass
    return free


def create(name: str, layout: Layout, geo: Geometry, *, mode: int, policy: str,
           exist_ok: bool) -> Opened:
    """Create segment ``name`` of ``geo`` with its header (``policy`` recorded in it); with
    ``exist_ok`` an existing segment is attached instead (see ``Segment.create``)."""
    posix = shm_name(name)
    why = ""
    for _ in range(_RETRIES):
        try:
            shm = posix_ipc.SharedMemory(posix, posix_ipc.O_CREX, mode=mode, size=0)
        except posix_ipc.ExistentialError:
            if not exist_ok:
                raise SegmentExistsError(
                    f"segment {name!r} already exists; attach to it, or remove it with "
                    f"'kvshm-inspect rm {name}'") from None
            try:
                return _attach_once(name, layout)
            except _Gone as gone:  # removed under us: create it ourselves
                why = str(gone)
                continue
        except posix_ipc.PermissionsError as e:
            raise SegmentPermissionError(
                f"cannot create segment {name!r} in {SHM_DIR}: {e}; run as a user who "
                f"may write {SHM_DIR}") from None
        crash_point("segment.create.after_open")
        # An attacher that found us before we locked may hold the lock (for an instant)
        # and unlink us; then we start over. Bounded only against a stopped attacher.
        if not locks.lock(shm.fd, L.LOCK_INIT, timeout=_STALL_S) or \
                os.fstat(shm.fd).st_nlink == 0:
            shm.close_fd()
            why = "an attacher removed it before it was locked"
            continue
        crash_point("segment.create.after_lock")
        try:
            os.fchmod(shm.fd, mode)  # shm_open applies the umask; the caller asked for `mode`
            need, free = geo.total_bytes, free_bytes()
            if need > free:
                raise InsufficientSpaceError(
                    f"segment {name!r} needs {need} bytes ({need / 2**30:.2f} GiB) but "
                    f"{SHM_DIR} has {free} bytes free; give it fewer blocks, or enlarge "
                    f"{SHM_DIR} (docker: --shm-size or --ipc=host)")
            try:
                os.posix_fallocate(shm.fd, 0, need)
            except OSError as e:
                raise InsufficientSpaceError(
                    f"reserving {need} bytes for segment {name!r} in {SHM_DIR} failed "
                    f"({e}); free space or enlarge {SHM_DIR}") from None
            crash_point("segment.create.after_reserve")
            mm = mmap.mmap(shm.fd, need)
            created_ns = time.time_ns()
            with memoryview(mm) as buf:  # released here: the segment's close unmaps it
                header.write(buf, geo, layout, created_ns, policy)
            locks.unlock(shm.fd, L.LOCK_INIT)
            return Opened(shm, mm, layout, geo, created_ns)
        except BaseException:
            # Unlink before the lock falls (it falls with the descriptor): racers must
            # find the object gone, never a headerless one to be told to remove.
            with contextlib.suppress(Exception):
                posix_ipc.unlink_shared_memory(posix)
            with contextlib.suppress(Exception):
                shm.close_fd()
            raise
    raise SegmentExistsError(
        f"segment {name!r} could not be created or attached after {_RETRIES} attempts "
        f"(last: {why}); other processes keep creating and removing it")


def attach(name: str, layout: Layout | None) -> Opened:
    """Open existing segment ``name``, waiting for a creator that is still creating it; if
    ``layout`` is given it must match."""
    why = ""
    for _ in range(_RETRIES):
        try:
            return _attach_once(name, layout)
        except _Gone as gone:
            if gone.absent:
                break
            why = str(gone)
    raise SegmentNotFoundError(
        f"no kvshm segment named {name!r} (no {SHM_DIR}{shm_name(name)}"
        f"{'; ' + why if why else ''}); create it first, or list segments with "
        "'kvshm-inspect ls'")


def _attach_once(name: str, layout: Layout | None) -> Opened:
    """Open and validate; ``_Gone`` if there is no object or it was removed meanwhile."""
    posix = shm_name(name)
    try:
        shm = posix_ipc.SharedMemory(posix)
    except posix_ipc.ExistentialError:
        raise _Gone("absent", absent=True) from None
    except posix_ipc.PermissionsError:
        raise SegmentPermissionError(
            f"permission denied opening segment {name!r} ({SHM_DIR}{posix}); run as its "
            "owner or create it with a group mode such as 0o660") from None
    try:
        head, size = _wait_for_header(name, shm)
        found, geo, created = header.check(name, shm.fd, head, size, layout)
        return Opened(shm, mmap.mmap(shm.fd, geo.total_bytes), found, geo, created)
    except BaseException:
        shm.close_fd()
        raise


def _wait_for_header(name: str, shm: posix_ipc.SharedMemory) -> tuple[bytes, int]:
    """The header bytes and file size once a creator has finished (see the protocol)."""
    fd = shm.fd
    progress, since, delay = None, time.monotonic(), 1e-4
    while True:
        if locks.is_held(fd, L.LOCK_INIT):  # a live creator: wait while it progresses
            st = os.fstat(fd)
            now = time.monotonic()
            if (st.st_size, st.st_blocks) != progress:
                progress, since = (st.st_size, st.st_blocks), now
            elif now - since > _STALL_S:
                raise CreationStalledError(
                    f"segment {name!r} is still being created, but its creator (alive: it "
                    f"holds the creation lock) has made no progress for {_STALL_S:.0f} s; "
                    f"find it with 'fuser {SHM_DIR}{shm.name}' and resume or stop it")
            time.sleep(delay)  # polling the creator's progress
            delay = min(delay * 2, 0.01)
            continue
        # Decide with the lock in hand: no creator can start or finish underneath.
        if not locks.try_lock(fd, L.LOCK_INIT):
            continue
        try:
            st = os.fstat(fd)
            if st.st_nlink == 0:
                raise _Gone("its creator failed and removed it")
            head = os.pread(fd, L.HEADER.size, 0)
            if head[:8] == L.MAGIC and st.st_size >= L.HEADER_BYTES:
                return head, st.st_size
            if any(head[:8]):
                raise NotAKvshmSegmentError(
                    f"{SHM_DIR}{shm.name} is not a kvshm segment (size {st.st_size}, no "
                    f"kvshm header); if it is a leftover, remove it with "
                    f"'kvshm-inspect rm {name}'")
            # No magic and nobody creating: a creator died half-way (or is between its
            # exclusive open and its lock, and will start over when it finds itself
            # unlinked). Remove it only if the name still denotes this very object.
            with contextlib.suppress(FileNotFoundError, posix_ipc.ExistentialError):
                if os.stat(SHM_DIR + shm.name).st_ino == st.st_ino:
                    posix_ipc.unlink_shared_memory(shm.name)
            raise _Gone("a creator died half-way; its leftover was removed")
        finally:
            locks.unlock(fd, L.LOCK_INIT)


def blocks_for_bytes(layout: Layout, nbytes: int | str) -> int:
    """How many blocks of ``layout`` fit in ``nbytes`` (like vLLM's ``cpu_bytes_to_use``): an
    int, or a size with a unit as the command lines take it ("64M", "8G"). Every refusal is
    an ``InvalidArgumentError`` about ``nbytes``, the parameter the caller gave."""
    if isinstance(nbytes, str):
        try:
            n = parse_size(nbytes)
        except ValueError as e:
            raise InvalidArgumentError(f"nbytes={nbytes!r}: {e}") from None
    elif isinstance(nbytes, int) and not isinstance(nbytes, bool):
        n = nbytes
    else:
        raise InvalidArgumentError(
            f"nbytes must be a number of bytes: an int, or a string with a unit such as "
            f"'64M' or '8G'; got {nbytes!r}")
    bb = layout.block_bytes
    if n < bb:
        raise InvalidArgumentError(
            f"nbytes={nbytes!r} ({n} bytes) cannot hold one block of {bb} bytes; give the "
            "cache more memory")
    if n // bb > L.MAX_BLOCKS:
        raise InvalidArgumentError(
            f"nbytes={nbytes!r} would make {n // bb} blocks of {bb} bytes; a segment holds "
            f"at most {L.MAX_BLOCKS} blocks: give nbytes at most {L.MAX_BLOCKS * bb} "
            f"({L.MAX_BLOCKS * bb / 2**40:.0f} TiB), or use larger blocks")
    return n // bb
