"""The shared-memory segment: create, attach, validate, map, unlink.

This module owns the POSIX shared-memory object (``posix_ipc``) and its mapping: it reserves
the space up front (so a full ``/dev/shm`` is an error now, never a SIGBUS later), writes and
validates the header, and hands out zero-copy views of the data planes. It never interprets
block states (see ``table.py``) and imports torch only inside ``torch_planes``.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import time
from typing import TYPE_CHECKING, Iterator

import numpy as np
import posix_ipc

from kvshm.shm import layout as L
from kvshm.shm import locks
from kvshm.crashpoints import crash_point
from kvshm.errors import (CreationStalledError, InsufficientSpaceError, InvalidArgumentError,
                          NotAKvshmSegmentError, SegmentExistsError, SegmentNotFoundError,
                          SegmentPermissionError)
from kvshm.shm import header, words
from kvshm.shm.layout import Geometry, Layout
from kvshm.shm.names import SHM_DIR, object_name, remove, shm_name

if TYPE_CHECKING:
    import torch


# An attacher gives up on a creator that holds the creation lock but has not grown the
# object for this long (fallocate keeps growing it; only a stopped or hung creator stalls).
_STALL_S = 60.0
_RETRIES = 100  # create/attach rounds lost to racing removals before giving up


class _Gone(Exception):
    """Internal: the object under the name is absent, or was removed while we looked."""

    def __init__(self, why: str, absent: bool = False):
        super().__init__(why)
        self.absent = absent


def _free_bytes() -> int:
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


class Segment:
    """One mapped kvshm segment. Create with :meth:`create`, attach with :meth:`attach`.

    Every instance opens its own file descriptor, so its kernel locks are its own (see
    ``locks.py``). The segment outlives the processes that use it; :meth:`unlink` removes it.
    """

    def __init__(self, name: str, shm: posix_ipc.SharedMemory, mm: mmap.mmap,
                 layout: Layout, geometry: Geometry, created_ns: int):
        self.name = name
        self.layout = layout
        self.geometry = geometry
        self.created_ns = created_ns
        self.fd = shm.fd
        self.tag = format(os.fstat(self.fd).st_ino, "x")  # names this incarnation's objects
        self.buf = memoryview(mm)
        self._shm = shm
        self._mm = mm
        self._qfd: int | None = None
        # Counters are read by other processes: store words through a cast (one copy each),
        # never with struct.pack_into, which zero-fills before writing.
        self._counters = self.buf[
            L.OFF_COUNTERS:L.OFF_COUNTERS + L.COUNTERS_DTYPE.itemsize].cast("Q")

    # --- lifecycle ----------------------------------------------------------------------
    # Creation protocol (why a dead creator can never block anyone):
    #
    # * A creator opens the name with O_CREAT|O_EXCL, takes the kernel-released LOCK_INIT on
    #   it, checks that its object is still linked, and holds the lock until the magic is
    #   written (or, on failure, until it has unlinked its object). The magic goes last.
    # * Only a LOCK_INIT holder ever removes an object without magic (``kvshm-inspect rm`` is
    #   the one manual exception). An attacher that finds no magic waits while LOCK_INIT is
    #   held; once it is free it takes the lock itself and re-reads: magic -> attach; an
    #   all-zero magic -> the leftover of a creator that died half-way, which it unlinks
    #   (still the same inode: nobody else may unlink while it holds the lock); anything else
    #   is a foreign object, left alone.
    # * POSIX shm has no link/rename, so a creator cannot appear fully formed: there is a
    #   window between its exclusive open and its lock. An attacher in that window judges
    #   the object a leftover and unlinks it. That is safe by construction, not by a grace
    #   period: the creator blocks on the lock the attacher holds, then finds its object
    #   unlinked (st_nlink == 0) and starts over (and with ``exist_ok`` attaches whatever
    #   was created meanwhile).
    # * A creator that fails unlinks its object before its lock falls, so racers find the
    #   object unlinked: to them the segment does not exist (an attacher re-opens the name,
    #   a create-racer creates afresh) -- never "remove it".
    # * An attacher waits for a live creator as long as the object keeps growing (fallocate
    #   of a large segment takes seconds to tens of seconds). A creator that holds the lock
    #   and makes no progress for _STALL_S (stopped with SIGSTOP, hung) gets
    #   ``CreationStalledError``.
    @classmethod
    def create(cls, name: str, layout: Layout, num_blocks: int, *, mode: int = 0o600,
               max_clients: int = 32, ring_capacity: int = 128 << 10,
               hold_capacity: int = 4096, policy: str = "lru",
               exist_ok: bool = False) -> "Segment":
        """Create segment ``name`` holding ``num_blocks`` blocks of ``layout``.

        With ``exist_ok`` an existing segment is attached instead (and validated against
        ``layout``); a half-created one whose creator died is removed and created afresh.
        ``policy`` ("lru" or "arc") is the eviction policy every owner of this segment will
        use. Space is reserved now: too little room raises :class:`InsufficientSpaceError`
        and leaves nothing behind. See the creation protocol above.
        """
        if isinstance(num_blocks, (str, bytes, bool)):
            raise InvalidArgumentError(  # "64M" here meant bytes: say where bytes go
                f"num_blocks is a count of blocks, got {num_blocks!r}; to size a cache in "
                "bytes pass nbytes to kvshm.connect, or num_blocks=blocks_for_bytes(layout, "
                "nbytes) (both take units: '64M', '8G')")
        geo = Geometry(int(num_blocks), layout.page_bytes, max_clients, ring_capacity,
                       hold_capacity, layout.checksums)
        if not isinstance(policy, str) or policy.lower() not in L.POLICY_NAMES:
            raise InvalidArgumentError(  # checked before touching /dev/shm
                f"unknown cache policy {policy!r}; choose one of: {', '.join(L.POLICY_NAMES)}")
        policy = policy.lower()
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
                    return cls._attach_once(name, layout)
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
                need, free = geo.total_bytes, _free_bytes()
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
                seg = cls(name, shm, mm, layout, geo, time.time_ns())
                seg._write_header(policy)
                locks.unlock(shm.fd, L.LOCK_INIT)
                return seg
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

    @classmethod
    def attach(cls, name: str, layout: Layout | None = None) -> "Segment":
        """Attach existing segment ``name``; if ``layout`` is given it must match.

        Waits for a creator that is still creating it (see the creation protocol above).
        """
        why = ""
        for _ in range(_RETRIES):
            try:
                return cls._attach_once(name, layout)
            except _Gone as gone:
                if gone.absent:
                    break
                why = str(gone)
        raise SegmentNotFoundError(
            f"no kvshm segment named {name!r} (no {SHM_DIR}{shm_name(name)}"
            f"{'; ' + why if why else ''}); create it first, or list segments with "
            "'kvshm-inspect ls'")

    @classmethod
    def _attach_once(cls, name: str, layout: Layout | None) -> "Segment":
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
            return cls._validate(name, shm, layout)
        except BaseException:
            shm.close_fd()
            raise

    @staticmethod
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

    @classmethod
    def _validate(cls, name: str, shm: posix_ipc.SharedMemory,
                  expected: Layout | None) -> "Segment":
        head, size = cls._wait_for_header(name, shm)
        found, geo, created = header.check(name, shm.fd, head, size, expected)
        mm = mmap.mmap(shm.fd, geo.total_bytes)
        return cls(name, shm, mm, found, geo, created)

    def _write_header(self, policy: str) -> None:
        header.write(self.buf, self.geometry, self.layout, self.created_ns, policy)

    def close(self) -> None:
        """Unmap and close this process's handle (the segment itself stays)."""
        if self._mm is None:
            return
        try:
            self._counters.release()
            self.buf.release()
            self._mm.close()
        except BufferError:
            pass  # numpy/torch/ring views still alive: the mapping goes when they do
        with contextlib.suppress(Exception):
            self._shm.close_fd()
        if self._qfd is not None:
            os.close(self._qfd)
            self._qfd = None
        self._mm = None

    def __enter__(self) -> "Segment":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def unlink(name: str, keep_log: bool = False) -> bool:
        """Remove segment ``name`` and its objects (doorbells, tier area) and, unless
        ``keep_log``, its auto-started owners' log. True if the segment existed. Objects of
        another user that this process may not remove stay:
        ``kvshm-inspect rm NAME`` run as that user or root removes them (and says so).

        Processes that still map it keep their mapping; the memory goes when they exit. One
        that opens an object of it after this sees it removed and removes that object again
        (``Doorbell``, ``TierArea``).
        """
        return remove(name, keep_log)[0]

    def object_name(self, what: str) -> str:
        """POSIX name of this incarnation's object ``what`` (see ``object_name``)."""
        return object_name(self.name, self.tag, what)

    def removed(self) -> bool:
        """Whether this segment's name was removed (it may denote a new segment by now)."""
        return os.fstat(self._open_fd()).st_nlink == 0

    # --- views --------------------------------------------------------------------------
    def plane(self, index: int) -> np.ndarray:
        """Zero-copy ``(num_blocks, page_bytes)`` uint8 view of plane ``index``."""
        g = self.geometry
        off = g.plane_offsets()[index]
        page = g.page_bytes[index]
        return np.frombuffer(self._mm, np.uint8, g.num_blocks * page, off).reshape(
            g.num_blocks, page)

    def planes(self) -> list[np.ndarray]:
        return [self.plane(i) for i in range(len(self.geometry.page_bytes))]

    def torch_planes(self) -> list["torch.Tensor"]:
        """The planes as uint8 torch tensors sharing the segment's memory."""
        import torch
        return [torch.from_numpy(p) for p in self.planes()]

    def data_address(self) -> tuple[int, int]:
        """(virtual address, length) of the data region in this process, for pinning."""
        arr = np.frombuffer(self._mm, np.uint8, self.geometry.data_bytes,
                            self.geometry.data_offset)
        return arr.ctypes.data, self.geometry.data_bytes

    # --- header records -----------------------------------------------------------------
    def counter(self, name: str) -> int:
        return self._counters[L.COUNTER_NAMES.index(name)]

    def counter_add(self, name: str, n: int = 1) -> None:
        """Owner only (single writer): add ``n`` to header counter ``name``."""
        i = L.COUNTER_NAMES.index(name)
        self._counters[i] = (self._counters[i] + n) & 0xFFFFFFFFFFFFFFFF

    def counters(self) -> dict[str, int]:
        return {n: self.counter(n) for n in L.COUNTER_NAMES}

    def owner_record(self) -> L.OwnerRecord:
        """(pid, epoch, since_ns, tick) as last written by an owner."""
        return L.OwnerRecord._make(L.OWNER.unpack_from(self.buf, L.OFF_OWNER))

    def write_owner_record(self, pid: int, epoch: int, since_ns: int, tick: int) -> None:
        """Owner only: store the owner record one aligned word per field (a reader never
        sees a field zeroed in passing, as ``struct.pack_into`` would show it)."""
        words.store_fields(self.buf, L.OFF_OWNER, L.OWNER_DTYPE, pid=pid, epoch=epoch,
                           since_ns=since_ns, tick=tick)

    @property
    def policy(self) -> str:
        """The eviction policy recorded at creation."""
        return bytes(self.buf[L.OFF_POLICY:L.OFF_POLICY + 16]).rstrip(b"\0").decode() or "lru"

    def _query_fd(self) -> int:
        # Liveness questions go through a descriptor of their own: then locks held through
        # ``self.fd`` count too.
        if self._qfd is None:
            self._qfd = locks.query_fd(self._open_fd())
        return self._qfd

    def _open_fd(self) -> int:
        # After ``close`` the number may denote another file by now: never ask through it.
        if self._mm is None:
            raise InvalidArgumentError(f"this handle of segment {self.name!r} is closed")
        return self.fd

    def owner_alive(self) -> bool:
        """Whether any process (this one included) holds the owner lock."""
        return locks.is_held(self._query_fd(), L.LOCK_OWNER)

    def clients_alive(self) -> set[int]:
        """Slots whose lock any process (this one included) holds."""
        return locks.held_among(self._query_fd(), L.LOCK_CLIENT_BASE, self.geometry.max_clients)

    # --- pinning coordination -----------------------------------------------------------
    @contextlib.contextmanager
    def pin_turn(self) -> Iterator[None]:
        """Hold the segment-wide pin turn: processes register with CUDA one at a time."""
        with locks.holding(self.fd, L.LOCK_PIN_TURN):
            yield

