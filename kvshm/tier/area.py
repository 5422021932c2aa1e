"""The tier area: a small shared-memory object beside a segment, owned by its mover.

This module owns the byte layout of the tier area (``/dev/shm/kvshm-NAME@TAG-tier``, named
for one incarnation of the segment like its doorbells, ``Segment.object_name``; it goes with
the segment, ``Segment.unlink``): the mover's liveness lock
and state, the lower-tier counters (which ``kvshm-inspect`` shows), and one *want ring* per
client slot through which engines ask the mover to fetch keys their lookups missed. It never
talks to a lower tier and never touches the segment's index.

Why a separate object and not a frame to the owner: a want is a hint on the engine's lookup
path, which reads shared memory and never waits for the owner. Writing a want is two stores
and, when the mover sleeps, one futex wake; the owner's exactly-once protocol and its
rings stay untouched, and an owner failover never loses or replays a want. Wants are lossy on
purpose (a lost want is a miss); nothing in the index depends on them.

Layout (the records below, each defined once as a numpy dtype)::

    0     AREA_HEAD_DTYPE: magic, version, geometry, the mover's pid, state and last error,
          the doorbell's sleeping flag, the kick flag
    128   AREA_COUNTERS_DTYPE (the mover is their only writer)
    384   backend description, 128 bytes of UTF-8 (what the mover talks to)
    512   per client slot s: WANT_RING_DTYPE (tail, done), then RING_ENTRIES x WANT_DTYPE

A want ring has one producer, the client holding slot ``s`` (slots are exclusive by kernel
lock), and one consumer, the mover. The producer writes an entry's key, then its ``seq``, then
publishes ``tail`` (seq numbers are 1-based and never reused; a new client in the slot goes on
from ``tail``). The mover reads entries ``done+1 .. tail``; one whose ``seq`` is not the one
expected was overwritten by a producer that lapped the mover, and is counted as dropped. After
handling a batch (a fetch started, or the key found absent below) the mover publishes ``done``:
a client whose want ``seq <= done`` knows its answer is already visible in the segment (the
key is WRITING or READY, or it stays a miss).

Both words are any client's to scribble (every engine maps the area writable), so each side
checks them where it reads them. A ring holds wants only while ``done < tail < SEQ_LIMIT``;
any other pair is empty to the mover, which never raises or wakes again for it. A producer
that finds ``done <= tail < SEQ_LIMIT`` false (a previous client of the slot left it so) goes
on from ``done``, or starts again at seq 0 when ``done`` is past ``SEQ_LIMIT / 2``; the mover,
finding ``done > tail``, starts its ``done`` again at 0 too, and reads what the producer wrote
since. A want is answered only while ``seq <= done <= tail``.

Only x86/ARM-aligned 8-byte stores are used, as ``kvshm.shm.ring`` explains; the mover's lock
(byte 0, an OFD lock) says whether it is alive.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import time

import numpy as np
import posix_ipc

from kvshm.errors import InvalidArgumentError, SegmentNotFoundError
from kvshm.shm import locks
from kvshm.shm.fence import full_fence
from kvshm.shm.layout import MAX_KEY_BYTES
from kvshm.shm.objects import open_object
from kvshm.shm.records import field_offset
from kvshm.shm.ring import Doorbell
from kvshm.shm.segment import Segment
from kvshm.shm.words import WordView

MAGIC = int.from_bytes(b"KVTIER01", "little")
VERSION = 2  # 2: a want ring's done word on its own cache line
RING_ENTRIES = 256
SEQ_LIMIT = 1 << 62  # want seqs stay below: a word at or past it was scribbled
LOCK_MOVER = 0

STATES = ("stopped", "connecting", "connected", "down")
_CONNECTED = STATES.index("connected")
COUNTERS = (
    "wants",            # keys engines asked the mover to fetch
    "wants_dropped",    # wants overwritten before the mover read them (a miss)
    "gets",             # blocks fetched, verified and published READY
    "get_bytes",        # bytes of those blocks (the block, not the stored header)
    "get_misses",       # wanted keys the lower tier does not have
    "get_failed",       # fetches that failed (transfer, RPC, lost share): a miss
    "get_rejected",     # fetched values whose header, length or checksum was wrong
    "get_no_room",      # wanted keys present below but the segment had no room
    "puts",             # blocks written to the lower tier
    "put_bytes",        # bytes of those blocks
    "put_failed",       # puts that failed (transfer, RPC)
    "put_refused_space",  # puts the lower tier refused for space
    "put_dropped",      # stores not spilled: the tier was down or the queue full
    "put_skipped",      # stored blocks evicted before their put, or fetched from below
    "rpc_failures",     # calls answered with an RPC failure (lower tier unreachable)
    "reconnects",       # times the mover (re)connected to its lower tier
)

# The area's header, at offset 0. Every field is one aligned u64 word.
AREA_HEAD_DTYPE = np.dtype({"names": [
    "magic",          # whoever (re)initialises the area, last of all: MAGIC once complete
    "version",        # the initialiser: VERSION; another version is re-initialised
    "max_clients",    # the initialiser: the segment's client slots (one want ring each)
    "ring_entries",   # the initialiser: RING_ENTRIES
    "mover_pid",      # the mover: its pid, for people (liveness is LOCK_MOVER)
    "mover_state",    # the mover: an index into STATES
    "since_ns",       # the mover: time.time_ns() when it took the area
    "last_error",     # the mover: the lower tier's last error code (signed, as u64)
    "last_error_ns",  # the mover: when it happened
    "sleeping",       # the doorbell's flag: the mover sleeps on its futex
    "kick",           # any engine: 1 = a store completed, read the events now; the mover: 0
], "formats": ["<u8"] * 11, "offsets": [8 * i for i in range(11)], "itemsize": 128})
_CTR, _DESC, _SLOT0 = 128, 384, 512  # byte offsets: counters, backend description, rings
AREA_COUNTERS_DTYPE = np.dtype({"names": list(COUNTERS), "formats": ["<u8"] * len(COUNTERS),
                                "offsets": [8 * i for i in range(len(COUNTERS))]})
assert _CTR + AREA_COUNTERS_DTYPE.itemsize <= _DESC
# A want ring's words: one producer (the client holding the slot), one consumer (the mover),
# each word on its own cache line.
WANT_RING_DTYPE = np.dtype({"names": ["tail", "done"], "formats": ["<u8", "<u8"],
                            # tail: the producer, seq of the last entry it published
                            # done: the mover, seq of the last entry it handled (its
                            #       effect visible in the segment)
                            "offsets": [0, 64], "itemsize": 128})
# A want entry (RING_ENTRIES of them after the ring's words).
WANT_DTYPE = np.dtype([
    ("seq", "<u8"),               # producer, last: the want's seq; 0 while it rewrites it
    ("length", "<u8"),            # producer: the key's length (<= MAX_KEY_BYTES)
    ("key", f"S{MAX_KEY_BYTES}"),  # producer: the key, before its seq
])
_RING_HDR = WANT_RING_DTYPE.itemsize
_ENTRY = WANT_DTYPE.itemsize
_E_SEQ, _E_LEN = field_offset(WANT_DTYPE, "seq") // 8, field_offset(WANT_DTYPE, "length") // 8
_E_KEY = field_offset(WANT_DTYPE, "key")
_ENTRY_WORDS = _ENTRY // 8
_SLOT_BYTES = _RING_HDR + RING_ENTRIES * _ENTRY


def _unread(tail: int, done: int) -> bool:
    """Whether a ring with these words has wants to read, or a ``done`` to start again."""
    return done < tail < SEQ_LIMIT or done > tail


def _queued(tail: int, done: int) -> int:
    return tail - done if done < tail < SEQ_LIMIT else 0


def area_bytes(max_clients: int) -> int:
    return _SLOT0 + max_clients * _SLOT_BYTES


class TierArea:
    """A mapped tier area. ``create`` is for the mover, ``attach`` for everyone else."""

    def __init__(self, name: str, posix: str, fd: int, mm: mmap.mmap) -> None:
        self.name, self.posix, self.fd, self._mm = name, posix, fd, mm  # segment, area names
        self.buf = memoryview(mm)
        self.head = WordView(self.buf, 0, AREA_HEAD_DTYPE)
        self.counters = WordView(self.buf, _CTR, AREA_COUNTERS_DTYPE)
        self.max_clients = int(self.head["max_clients"])
        self._slots = [self.buf[_SLOT0 + s * _SLOT_BYTES:_SLOT0 + (s + 1) * _SLOT_BYTES]
                       for s in range(self.max_clients)]
        self._rings = [WordView(v, 0, WANT_RING_DTYPE) for v in self._slots]
        self._entry_words = [v[_RING_HDR:].cast("Q") for v in self._slots]
        self._bell: Doorbell | None = None
        self._qfd: int | None = None

    # --- lifecycle ----------------------------------------------------------------------
    @classmethod
    def create(cls, seg: Segment) -> TierArea:
        """Open or create segment ``seg``'s area (the mover, holding no lock yet). An area
        of another version or geometry is re-initialised: nothing in it outlives a mover
        except counters, and those only when the geometry matches. Raises
        ``SegmentNotFoundError`` when ``seg`` was removed (it needs no area any more)."""
        posix, n = seg.object_name("tier"), seg.geometry.max_clients
        shm = open_object(posix, seg.fd, point="mover.area.after_open")
        fd = shm.fd
        size = area_bytes(n)
        if os.fstat(fd).st_size != size:
            os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size)
        head = WordView(memoryview(mm), 0, AREA_HEAD_DTYPE)
        if head["magic"] != MAGIC or head["version"] != VERSION or \
                head["max_clients"] != n or head["ring_entries"] != RING_ENTRIES:
            head["magic"] = 0
            mm[:] = bytes(size)
            head["max_clients"], head["ring_entries"], head["version"] = \
                n, RING_ENTRIES, VERSION
            full_fence()
            head["magic"] = MAGIC  # last: an attacher sees a whole header or none
        head.release()
        return cls(seg.name, posix, fd, mm)

    @classmethod
    def attach(cls, seg: Segment) -> TierArea | None:
        """The area of segment ``seg``, or None when no mover ever made one (or it is not
        initialised yet): then there is no lower tier to ask."""
        posix = seg.object_name("tier")
        try:
            shm = posix_ipc.SharedMemory(posix)
        except (posix_ipc.ExistentialError, posix_ipc.PermissionsError):
            return None
        fd = shm.fd
        size = os.fstat(fd).st_size
        if size < _SLOT0:
            os.close(fd)
            return None
        mm = mmap.mmap(fd, size)
        head = WordView(memoryview(mm), 0, AREA_HEAD_DTYPE)
        ok = (head["magic"] == MAGIC and head["version"] == VERSION and
              head["ring_entries"] == RING_ENTRIES and
              size == area_bytes(head["max_clients"]))
        head.release()
        if not ok:
            mm.close()
            os.close(fd)
            return None
        return cls(seg.name, posix, fd, mm)

    def close(self) -> None:
        if self._bell is not None:
            self._bell.close()
            self._bell = None
        for r in self._rings:
            r.release()
        for v in self._entry_words + self._slots:
            v.release()
        self.head.release()
        self.counters.release()
        self.buf.release()
        self._mm.close()
        os.close(self.fd)
        if self._qfd is not None:
            os.close(self._qfd)

    # --- the mover's side -------------------------------------------------------------
    def try_lock_mover(self) -> bool:
        """Become this segment's mover (False: another live process is)."""
        return locks.try_lock(self.fd, LOCK_MOVER)

    def mover_alive(self) -> bool:
        if self._qfd is None:  # our own OFD locks are invisible through our own descriptor
            self._qfd = locks.query_fd(self.fd)
        return locks.is_held(self._qfd, LOCK_MOVER)

    def set_mover(self, pid: int, description: str) -> None:
        self.head["mover_pid"] = pid
        self.head["since_ns"] = time.time_ns()
        raw = description.encode()[:127]
        self.buf[_DESC:_DESC + 128] = raw + bytes(128 - len(raw))

    def connected(self) -> bool:
        """Whether the mover last said its lower tier is connected (not whether it lives)."""
        return self.head["mover_state"] == _CONNECTED

    def set_state(self, state: str) -> None:
        self.head["mover_state"] = STATES.index(state)

    def set_error(self, code: int) -> None:
        self.head["last_error"] = code & 0xFFFFFFFFFFFFFFFF
        self.head["last_error_ns"] = time.time_ns()

    def add(self, counter: str, n: int = 1) -> None:
        """Mover only (the single writer of the counters)."""
        if n:
            self.counters[counter] = (self.counters[counter] + n) & 0xFFFFFFFFFFFFFFFF

    def bell(self) -> Doorbell:
        if self._bell is None:
            at = field_offset(AREA_HEAD_DTYPE, "sleeping")
            self._bell = Doorbell(self.buf[at:at + 8])
        return self._bell

    def _ring(self) -> None:
        """Wake the mover. An area removed under us has no mover left to wake, and a hint
        must never fail the engine that gives it."""
        with contextlib.suppress(SegmentNotFoundError):
            self.bell().ring()

    def kick(self) -> None:
        """An engine completed a store: wake the mover to read the store events now rather
        than at its next poll (any process may; a lost kick only delays the write-through)."""
        self.head["kick"] = 1
        self._ring()

    def kicked(self) -> bool:
        return bool(self.head["kick"])

    def take_kick(self) -> bool:
        """Mover: whether a kick came since the last call (and clear it)."""
        if not self.head["kick"]:
            return False
        self.head["kick"] = 0
        return True

    def pending(self) -> bool:
        """Whether any want ring holds unread entries, or a ``done`` to start again."""
        return any(_unread(r["tail"], r["done"]) for r in self._rings)

    def drain(self, limit: int = 4096) -> tuple[list[bytes], dict[int, int]]:
        """Read up to ``limit`` wanted keys; returns them and, per slot, the ``done`` value
        to publish (with ``publish``) once they are handled."""
        keys: list[bytes] = []
        done: dict[int, int] = {}
        for s, ring in enumerate(self._rings):
            tail, seen = ring["tail"], ring["done"]
            if seen > tail:  # a producer started again (or a scribble): so do we
                seen = done[s] = 0
            if not seen < tail < SEQ_LIMIT:  # nothing, or words no producer writes
                continue
            if tail - seen > RING_ENTRIES:  # lapped: the oldest are overwritten
                self.add("wants_dropped", tail - seen - RING_ENTRIES)
                seen = tail - RING_ENTRIES
            e = self._entry_words[s]
            view = self._slots[s]
            while seen < tail and len(keys) < limit:
                seen += 1
                i = (seen - 1) % RING_ENTRIES
                full_fence()
                base = i * _ENTRY_WORDS
                if e[base + _E_SEQ] != seen:
                    self.add("wants_dropped")
                    continue
                n = min(e[base + _E_LEN], MAX_KEY_BYTES)
                off = _RING_HDR + i * _ENTRY + _E_KEY
                key = bytes(view[off:off + n])
                full_fence()
                if e[base + _E_SEQ] != seen:  # overwritten while we copied it
                    self.add("wants_dropped")
                    continue
                keys.append(key)
            done[s] = seen
        self.add("wants", len(keys))
        return keys, done

    def publish(self, done: dict[int, int]) -> None:
        """Answer the wants ``drain`` returned: their effect is visible in the segment."""
        full_fence()
        for s, seen in done.items():
            self._rings[s]["done"] = seen

    def skip_all(self) -> None:
        """Mark every want answered (as misses): the mover is stopping or the tier is down."""
        _, done = self.drain()
        self.publish(done)

    # --- the engine's side ------------------------------------------------------------
    def want(self, slot: int, keys: list[bytes]) -> int:
        """Producer of ring ``slot``: ask for ``keys``; returns the seq of the last one."""
        if not 0 <= slot < self.max_clients:
            raise InvalidArgumentError(f"slot {slot} is not a client slot of {self.name!r}")
        ring, e, view = self._rings[slot], self._entry_words[slot], self._slots[slot]
        tail = ring["tail"]
        if not (done := ring["done"]) <= tail < SEQ_LIMIT:  # a previous client left it so
            tail = done if done < SEQ_LIMIT // 2 else 0  # go on from the mover, or start again
        for k in keys[:RING_ENTRIES]:
            tail += 1
            i = (tail - 1) % RING_ENTRIES
            base = i * _ENTRY_WORDS
            e[base + _E_SEQ] = 0  # a reader mid-copy sees the entry change and drops it
            off = _RING_HDR + i * _ENTRY + _E_KEY
            view[off:off + len(k)] = k
            e[base + _E_LEN] = len(k)
            full_fence()
            e[base + _E_SEQ] = tail
        full_fence()
        ring["tail"] = tail
        self._ring()
        return tail

    def answered(self, slot: int, seq: int) -> bool:
        """Whether the mover has handled want ``seq`` of ring ``slot`` (never while the
        ring's words are impossible: the mover starts its ``done`` again first)."""
        ring = self._rings[slot]
        done = ring["done"]
        return seq <= done <= ring["tail"]

    # --- what kvshm-inspect shows -----------------------------------------------------
    def snapshot(self) -> dict[str, object]:
        head = self.head
        alive = self.mover_alive()
        err, state = head["last_error"], head["mover_state"]
        return {
            "mover_pid": head["mover_pid"], "mover_alive": alive,
            "state": STATES[state] if alive and state < len(STATES) else "stopped",
            "backend": bytes(self.buf[_DESC:_DESC + 128]).rstrip(b"\0").decode(errors="replace"),
            "since_ns": head["since_ns"],
            "last_error": err - (1 << 64) if err >= 1 << 63 else err,
            "last_error_ns": head["last_error_ns"],
            "wants_queued": sum(_queued(r["tail"], r["done"]) for r in self._rings),
            "counters": {name: self.counters[name] for name in COUNTERS}}

