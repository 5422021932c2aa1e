"""The shared-memory segment: one mapped POSIX object, its views and its header records.

This module owns ``Segment``, a process's handle of a segment: made by ``create`` or
``attach`` (the creation protocol, space reservation and header validation are
``creation.py``'s), it hands out zero-copy views of the data planes, the header's counters
and owner record, liveness questions through kernel locks, and ``unlink``. It never
interprets block states (see ``table.py``) and imports torch only inside ``torch_planes``.
"""
from __future__ import annotations

import contextlib
import mmap
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import numpy as np
import posix_ipc

from kvshm.errors import InvalidArgumentError
from kvshm.shm import creation, locks, words
from kvshm.shm import layout as L
from kvshm.shm.layout import Geometry, Layout
from kvshm.shm.names import object_name, remove

if TYPE_CHECKING:
    import torch


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
        self._mm: mmap.mmap | None = mm  # None once closed
        self._qfd: int | None = None
        # Counters are read by other processes: store words through a cast (one copy each),
        # never with struct.pack_into, which zero-fills before writing.
        self._counters = self.buf[
            L.OFF_COUNTERS:L.OFF_COUNTERS + L.COUNTERS_DTYPE.itemsize].cast("Q")

    # --- lifecycle (the creation protocol is ``creation.py``'s) ---------------------------
    @classmethod
    def create(cls, name: str, layout: Layout, num_blocks: int, *, mode: int = 0o600,
               max_clients: int = 32, ring_capacity: int = 128 << 10,
               hold_capacity: int = 4096, policy: str = "lru",
               exist_ok: bool = False) -> Segment:
        """Create segment ``name`` holding ``num_blocks`` blocks of ``layout``.

        With ``exist_ok`` an existing segment is attached instead (and validated against
        ``layout``); a half-created one whose creator died is removed and created afresh.
        ``policy`` ("lru" or "arc") is the eviction policy every owner of this segment will
        use. Space is reserved now: too little room raises :class:`InsufficientSpaceError`
        and leaves nothing behind.
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
        return cls(name, *creation.create(name, layout, geo, mode=mode, policy=policy.lower(),
                                          exist_ok=exist_ok))

    @classmethod
    def attach(cls, name: str, layout: Layout | None = None) -> Segment:
        """Attach existing segment ``name``; if ``layout`` is given it must match.

        Waits for a creator that is still creating it (see ``creation.py``).
        """
        return cls(name, *creation.attach(name, layout))

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

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @staticmethod
    def unlink(name: str, keep_log: bool = False) -> bool:
        """Remove segment ``name`` and its objects (the tier area, old doorbells) and, unless
        ``keep_log``, its auto-started owners' log. True if the segment existed. Objects of
        another user that this process may not remove stay:
        ``kvshm-inspect rm NAME`` run as that user or root removes them (and says so).

        Processes that still map it keep their mapping; the memory goes when they exit. One
        that opens an object of it after this sees it removed and removes that object again
        (``open_object``: the ``TierArea``).
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
        return np.frombuffer(self._mapping(), np.uint8, g.num_blocks * page, off).reshape(
            g.num_blocks, page)

    def planes(self) -> list[np.ndarray]:
        return [self.plane(i) for i in range(len(self.geometry.page_bytes))]

    def torch_planes(self) -> list[torch.Tensor]:
        """The planes as uint8 torch tensors sharing the segment's memory."""
        import torch
        return [torch.from_numpy(p) for p in self.planes()]

    def data_address(self) -> tuple[int, int]:
        """(virtual address, length) of the data region in this process, for pinning."""
        arr = np.frombuffer(self._mapping(), np.uint8, self.geometry.data_bytes,
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

    def _mapping(self) -> mmap.mmap:
        if self._mm is None:
            raise InvalidArgumentError(f"this handle of segment {self.name!r} is closed")
        return self._mm

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

