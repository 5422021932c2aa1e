"""Single-producer/single-consumer byte-frame ring in shared memory.

This module owns the ring's byte layout (header, frame format, wrap marker), the ordering of
its publications across processes, the checks that make a ring whose words another process
scribbled an error rather than a crash, and the producer's backoff when full; the
``Doorbell`` that wakes a sleeping consumer is ``doorbell.py``'s (re-exported here). It must
never decode frames (payloads are opaque bytes; msgspec lives with the protocol), never
allocate or name shared memory itself (callers hand it a writable buffer carved from the
segment), and never take locks shared between processes.

Region layout (native byte order, i.e. little-endian on x86 and ARM; it never leaves the host)::

    0    magic u64 | capacity u64        (cache line 0, written once by format())
    64   tail  u64  producer-owned       (cache line 1)
    128  head  u64  consumer-owned       (cache line 2: no false sharing with tail)
    192  data[capacity]                  frames: u32 length | payload | pad to 8 bytes

head/tail are monotonically increasing byte counters (position = counter % capacity). A frame
never splits across the end: the producer writes a wrap marker and continues at offset 0.
Counters start below ``POS_LIMIT`` (2**63), so they never reach the end of their u64 words
(that would take 2**63 bytes through one ring).

Every word of a ring is its producer's or its consumer's, each perhaps another process's
that scribbles: a peer reads the other side's words as untrusted. Counters out of step or
near the end of their range, a frame that claims more than a frame can hold or ends past the
published tail, are ``ProtocolError``, never an exception of another type nor a position
outside the data area.

Memory ordering. The producer writes the payload, THEN publishes tail; the consumer reads tail,
THEN the payload, and only after copying it out publishes head. Counters are loaded and stored
by indexing a memoryview cast to 'Q': CPython does that with a fixed-size 8-byte memcpy, which
compiles to one 8-byte mov (x86-64) / ldr/str (AArch64), single-copy atomic when aligned (hence
the alignment check), so a peer never sees a torn counter. NOT struct.pack_into: it memsets the
field to zero before writing, so a concurrent reader can see 0 (a consumer then reads unwritten
frames; measured: 2% of racing reads). On x86 (TSO) stores become visible in program order and
loads are not reordered with older loads, nor stores with older loads; each Python-level access
is a separate call into C that the compiler cannot reorder across, so the ring needs no fence.
Weakly ordered CPUs (ARM, POWER) do reorder, so there memory_fence() runs between payload write
and tail publish, between tail read and payload read, and between payload read and head
publish.
"""
from __future__ import annotations

import ctypes
import os
import time

from kvshm.errors import FrameTooLargeError, InvalidArgumentError, ProtocolError, RingFullError
from kvshm.shm.doorbell import Doorbell
from kvshm.shm.fence import WEAK_ORDER as _WEAK_ORDER  # module-level: tests patch it
from kvshm.shm.fence import full_fence

__all__ = ["Doorbell", "Ring", "memory_fence"]

_MAGIC = int.from_bytes(b"KVRING01", "little")
_CAP, _TAIL, _HEAD, _DATA = 1, 8, 16, 192  # word indexes into the 'Q' header view; data offset
_WRAP = 0xFFFFFFFF  # length value of the wrap marker: "continue at offset 0"
POS_LIMIT = 2**63  # an attached ring's counters are below it (see above)
_SPIN_S, _YIELD_S, _SLEEP_MAX_S = 50e-6, 2e-3, 1e-3  # put() backoff phases when full

_yield = os.sched_yield
# One fence for all of kvshm; see fence.py for why a lock round trip is a barrier.
memory_fence = full_fence


def _view(buf: memoryview, need: int, what: str, whole: bool = False) -> memoryview:
    """A writable, 8-byte-aligned byte view of ``need`` (or all) bytes of ``buf``."""
    mv = memoryview(buf).cast("B")
    if mv.readonly or len(mv) < need:
        raise InvalidArgumentError(f"{what} needs a writable buffer of >= {need} bytes, got "
                                   f"{len(mv)}{' read-only' if mv.readonly else ''} bytes")
    addr = ctypes.addressof(ctypes.c_char.from_buffer(mv))
    if addr % 8:  # a misaligned counter could tear: refuse rather than corrupt silently
        raise InvalidArgumentError(f"{what} buffer starts at address {addr:#x}, which is not "
                                   "8-byte aligned; carve regions at multiples of 64 bytes")
    return mv if whole else mv[:need]


class Ring:
    """SPSC ring of byte frames. One process produces, one consumes; any may inspect."""

    __slots__ = ("_w", "_data", "_lens", "_cap", "_max_frame", "_tail", "_head_seen", "_head",
                 "_tail_seen", "_next_head")

    @staticmethod
    def region_size(capacity: int) -> int:
        """Bytes of shared memory a ring with ``capacity`` data bytes needs (multiple of 64)."""
        if not isinstance(capacity, int) or capacity < 64 or capacity % 8:
            raise InvalidArgumentError(f"ring capacity must be an int >= 64 and a multiple of 8,"
                                       f" got {capacity!r}")
        return _DATA + (capacity + 63) // 64 * 64

    @staticmethod
    def max_payload(capacity: int) -> int:
        """Largest payload a ring of ``capacity`` accepts: its frame fits in half the ring, so
        it fits an empty ring wherever the counters stand (before the end or after a wrap)."""
        Ring.region_size(capacity)
        return (capacity // 2 & ~7) - 4

    @staticmethod
    def format(buf: memoryview, capacity: int) -> None:
        """Initialise an empty ring in ``buf``. Only while nobody is attached: existing Ring
        objects cache counters and must be re-created (re-attached) afterwards."""
        mv = _view(buf, Ring.region_size(capacity), "Ring.format")
        mv[:_DATA] = bytes(_DATA)
        w = mv[:_DATA].cast("Q")
        w[_CAP] = capacity
        memory_fence()  # magic last: an attacher that sees it sees a complete header
        w[0] = _MAGIC
        w.release()
        mv.release()

    def __init__(self, buf: memoryview) -> None:
        full = _view(buf, 8, "Ring", whole=True)
        w = full[:_DATA].cast("Q") if len(full) >= _DATA else None
        magic, cap = (w[0], w[_CAP]) if w is not None else (0, 0)
        if w is None or magic != _MAGIC or cap < 64 or cap % 8 or len(full) < _DATA + cap:
            raise ProtocolError(f"buffer does not hold a kvshm ring (magic {magic:#x}, capacity "
                                f"{cap}, {len(full)} bytes): format it with Ring.format() first "
                                "or check the region offset the segment layout gives")
        self._w, self._data, self._cap = w, full[_DATA:_DATA + cap], cap
        self._lens = self._data.cast("I")  # frame lengths: positions are 8-aligned
        self._max_frame = Ring.max_payload(cap) + 4
        self._head = self._head_seen = w[_HEAD]
        self._tail = self._tail_seen = w[_TAIL]
        if not 0 <= self._tail - self._head <= cap or self._tail >= POS_LIMIT:
            raise ProtocolError(f"ring counters are inconsistent (head {self._head}, tail "
                                f"{self._tail}, capacity {cap}, at most {POS_LIMIT}): the "
                                "region was overwritten; re-create the segment")
        self._next_head = -1

    # --- producer -----------------------------------------------------------------------
    def try_put(self, payload: bytes | memoryview) -> bool:
        """Append one frame; False if there is no room now. Never blocks."""
        if type(payload) is not bytes:
            payload = memoryview(payload).cast("B")  # count bytes, not items
        n = len(payload)
        size = (n + 11) & ~7  # u32 length + payload, padded to 8
        if size > self._max_frame:
            raise FrameTooLargeError(
                f"frame of {n} bytes exceeds this ring's limit of {self._max_frame - 4} bytes "
                f"(capacity {self._cap}): send less per frame or give the ring >= {2 * size} bytes")
        cap, tail = self._cap, self._tail
        pos = tail % cap
        skip = cap - pos if size > cap - pos else 0  # unusable end of the data area: wrap
        end = tail + skip + size
        if end - self._head_seen > cap:  # our cached head may be stale (too low): re-read
            self._head_seen = self._w[_HEAD]
            if end - self._head_seen > cap:
                return False
            if _WEAK_ORDER:
                memory_fence()  # the consumer's reads of that space precede our overwrite
        if skip:
            self._lens[pos >> 2] = _WRAP
            pos = 0
        self._lens[pos >> 2] = n
        self._data[pos + 4:pos + 4 + n] = payload
        if _WEAK_ORDER:
            memory_fence()  # payload visible before the tail that publishes it
        self._tail = self._w[_TAIL] = end
        return True

    def put(self, payload: bytes | memoryview, timeout: float) -> None:
        """Append one frame, waiting up to ``timeout`` seconds for room (spin, yield, sleep)."""
        if self.try_put(payload):
            return
        start = time.perf_counter()
        while not self.try_put(payload):
            waited = time.perf_counter() - start
            if waited >= timeout:
                raise RingFullError(
                    f"ring stayed full for {timeout:g}s ({self.depth()} of {self._cap} bytes "
                    "used): its consumer is not draining it; check that the consumer process is "
                    "alive and polling, or raise the timeout / the ring capacity")
            if waited >= _YIELD_S:
                time.sleep(min(_SLEEP_MAX_S, timeout - waited))
            elif waited >= _SPIN_S:
                os.sched_yield()

    # --- consumer -----------------------------------------------------------------------
    def peek(self) -> memoryview | None:
        """Zero-copy view of the next frame's payload, or None. The view aliases the ring:
        use it (e.g. msgspec.decode) before advance(), and drop or release() it after."""
        got = self._frame_at(self._head)
        if got is None:
            return None
        view, self._next_head = got
        return view

    def peek_after(self) -> tuple[memoryview, int] | None:
        """Consumer: the frame after those the next ``advance()`` consumes, and the position
        past it, or None if none is published yet; ``include(end)`` adds it to them. A
        consumer takes frames queued behind each other as one this way: none of them is
        released before all are applied."""
        return self._frame_at(self._next_head)

    def include(self, end: int) -> None:
        """Let the next ``advance()`` consume everything up to ``end`` (from ``peek_after``)."""
        self._next_head = end

    def _frame_at(self, head: int) -> tuple[memoryview, int] | None:
        """The view of the frame at position ``head`` (the consumer's, or past frames it
        peeked) and the position past it, or None if no frame is published there."""
        if head == self._tail_seen:
            tail = self._w[_TAIL]
            if tail == head:
                return None
            if not head < tail <= self._head + self._cap:  # a scribbled tail: never trust it
                raise ProtocolError(f"ring tail {tail} is not within capacity {self._cap} of "
                                    f"head {self._head}: the producer overwrote the ring's "
                                    "header")
            self._tail_seen = tail
            if _WEAK_ORDER:
                memory_fence()  # tail read before the payload it covers
        pos = head % self._cap
        n = self._lens[pos >> 2]
        if n == _WRAP:
            head += self._cap - pos
            pos = 0
            n = self._lens[0]
        end = head + ((n + 11) & ~7)
        if n > self._max_frame - 4 or end > self._tail_seen:
            raise ProtocolError(f"ring frame at offset {pos} claims {n} bytes, more than a frame "
                                "can hold or than its producer published: the ring was "
                                "overwritten; re-create the segment")
        return self._data[pos + 4:pos + 4 + n], end

    def advance(self) -> None:
        """Consume the frame the last peek() returned, handing its space back to the producer."""
        if _WEAK_ORDER:
            memory_fence()  # our reads of the payload complete before the producer may reuse it
        self._head = self._w[_HEAD] = self._next_head

    def try_get(self) -> bytes | None:
        """Remove and return the next frame's payload (a copy), or None if the ring is empty."""
        view = self.peek()
        if view is None:
            return None
        out = view.tobytes()
        self.advance()
        return out

    # --- inspection (any process) -------------------------------------------------------
    def depth(self) -> int:
        """Bytes in use, wrap padding included (head read first, so never negative)."""
        head = self._w[_HEAD]
        return self._w[_TAIL] - head

    @property
    def tail(self) -> int:
        """Producer only: the position just past the last frame it put."""
        return self._tail

    def head(self) -> int:
        """The consumer's position now (any process may read it)."""
        return self._w[_HEAD]

    def position(self) -> int:
        """Consumer: its own position, as it last published it (not the shared word)."""
        return self._head

    def consumed(self, pos: int) -> bool:
        """Whether the consumer has taken every frame before position ``pos``."""
        return self._w[_HEAD] >= pos

    def pending(self) -> bool:
        """Whether a frame is waiting (usable as a Doorbell ``ready`` callable)."""
        return self._w[_HEAD] != self._w[_TAIL]  # head first, as in depth()

    def waiting(self) -> bool:
        """Consumer: whether a frame waits past the last one it took. Unlike ``pending`` it
        reads no head word, which the producer could hold away from the tail for ever."""
        return self._head != self._w[_TAIL]

    @property
    def capacity(self) -> int:
        return self._cap

    def close(self) -> None:
        """Release this object's views so the segment's mmap can be closed."""
        for view in (self._lens, self._data, self._w):
            view.release()
