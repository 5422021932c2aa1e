"""Client slots in the segment: claim one, activate it, view its rings, give it back.

This module owns the life cycle of a slot. A slot belongs to whoever holds its kernel lock
(``LOCK_CLIENT_BASE + slot``); its record says what it is (free, a manager client, or a job
channel between an engine's scheduler and a worker). A manager client also holds the lock of
its generation (``gen_lock``): whether a generation's stores have a living writer. Only
slots whose record is FREE are claimed, so nobody reformats rings that an owner may still be
reading. A client slot goes back to FREE only through the owner (after a goodbye, or when it
sees the holder dead, adopted or not), or through ``kvshm-inspect gc`` while it holds the
owner lock: the one process that may be reading a slot's rings is the one that clears it.
It never talks to the owner.
"""
from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable

import numpy as np

from kvshm.crashpoints import crash_point
from kvshm.errors import ClientSlotsExhaustedError
from kvshm.shm import layout as L
from kvshm.shm import locks, words
from kvshm.shm.fence import full_fence, publish_fence
from kvshm.shm.layout import SlotRecord, SlotState
from kvshm.shm.records import next_gen
from kvshm.shm.ring import Ring
from kvshm.shm.segment import Segment
from kvshm.shm.words import WordView


def record(seg: Segment, slot: int) -> SlotRecord:
    """The record of ``slot``: ``.state`` (a ``SlotState`` value), ``.pid``, ``.gen``,
    ``.attached_ns``, ``.name``, ``.events``."""
    return SlotRecord._make(L.SLOT.unpack_from(seg.buf, seg.geometry.slot_offset(slot)))


def claimable(seg: Segment, slot: int) -> int | None:
    """With ``slot``'s client lock taken: the generation a new client of it takes, or None
    if it may not be taken. FREE is the last client's word: a slot is free only once no
    owner serves it either (``LOCK_SERVED_BASE``)."""
    rec = record(seg, slot)
    if rec.state == SlotState.FREE and not locks.is_held(seg.fd, L.LOCK_SERVED_BASE + slot):
        return next_gen(rec.gen)
    return None


def lock_free(seg: Segment, slot: int) -> int | None:
    """Lock ``slot`` if it is FREE and no owner serves it: the generation its next client
    takes, its client lock held; else None, nothing held. Only a FREE slot is locked to be
    read: a dead client's slot locked even for a moment is, to an owner looking then, a live
    holder that rewrote its record."""
    if record(seg, slot).state != SlotState.FREE or \
            not locks.try_lock(seg.fd, L.LOCK_CLIENT_BASE + slot):
        return None
    crash_point("client.slot.after_lock")
    gen = claimable(seg, slot)
    if gen is None:
        locks.unlock(seg.fd, L.LOCK_CLIENT_BASE + slot)
    return gen


def claim(seg: Segment, wait_for_reclaim: Callable[[], object] | None = None,
          timeout: float = 5.0) -> tuple[int, int]:
    """Lock a FREE slot that no owner serves and return (slot, next generation).

    Dead clients' slots are not FREE until reclaimed, nor one whose owner still serves its
    last client (``LOCK_SERVED_BASE``); ``wait_for_reclaim`` is called (e.g. to make sure an
    owner runs) between attempts while such slots exist.
    """
    g, fd = seg.geometry, seg.fd
    deadline = time.monotonic() + timeout
    while True:
        dirty = False
        for slot in range(g.max_clients):
            gen = lock_free(seg, slot)
            if gen is not None:
                if locks.try_lock(fd, gen_lock(slot, gen)):
                    return slot, gen
                locks.unlock(fd, L.LOCK_CLIENT_BASE + slot)
            # a slot nobody holds that we could not take waits for the owner's reclaim
            dirty = dirty or not locks.is_held(seg._query_fd(), L.LOCK_CLIENT_BASE + slot)
        if not dirty or wait_for_reclaim is None or time.monotonic() > deadline:
            raise ClientSlotsExhaustedError(
                f"all {g.max_clients} client slots of segment {seg.name!r} are in use"
                + (" or belong to dead clients not yet reclaimed (a live owner reclaims them "
                   "within a second; with none, 'kvshm-inspect gc' does)" if dirty else "")
                + "; close unused clients or create the segment with more max_clients")
        wait_for_reclaim()
        time.sleep(0.05)  # polling the owner's reclaim, bounded by the deadline


def _store(seg: Segment, slot: int, name: str, value: int | bytes) -> None:
    """Store field ``name`` of the slot record (one aligned word: old or new, never torn)."""
    words.store_fields(seg.buf, seg.geometry.slot_offset(slot), L.SLOT_DTYPE,
                       **{name: value})


def activate(seg: Segment, slot: int, gen: int, state: int = SlotState.CLIENT,
             takes_grants: bool = True, quota: int = 0, events: bool = False) -> None:
    """Reset a claimed slot (holds, counters, served record, rings) and publish its record.
    ``takes_grants=False``: no owner ever stocks its grant ring; ``quota``: the blocks it may
    keep cached, 0 for no quota; ``events``: it takes events (every owner reads all three
    when it adopts the slot, before it serves any request of it)."""
    g = seg.geometry
    s = share(seg, slot)
    s["quota"], s["cached"] = quota, 0
    s.release()
    hold_mark(seg, slot)[0] = 0
    holds(seg, slot)[:] = -1
    head, ids = grants(seg, slot)
    ids[:] = -1
    head.clear()
    head["refused"] = not takes_grants
    counters(seg, slot)[:] = 0
    served(seg, slot).clear()
    for name in L.RING_NAMES:
        Ring.format(ring_view(seg, slot, name), g.ring_capacity)
    _store(seg, slot, "name", os.path.basename(sys.argv[0] or "python")[:L.SLOT_NAME_BYTES]
           .encode())
    _store(seg, slot, "pid", os.getpid())
    _store(seg, slot, "attached_ns", time.time_ns())
    _store(seg, slot, "events", int(events))
    _store(seg, slot, "gen", gen)
    full_fence()  # everything above before the state that publishes it
    _store(seg, slot, "state", state)
    full_fence()


def release(seg: Segment, slot: int, gen: int) -> None:
    """Clear a slot we hold and unlock it. Only for slots no owner reads (job channels)."""
    clear(seg, slot, gen)
    unlock(seg, slot, gen)


def unlock(seg: Segment, slot: int, gen: int) -> None:
    """Give up our hold of ``slot`` as its client ``gen`` (``claim``); its record stays for
    the owner to reclaim."""
    # The generation's first: its copiers (``writers.generation_alive``) and an owner that
    # adopted it see it dead from then on, one that did not (``Roster.slot_held``) later.
    locks.unlock(seg.fd, gen_lock(slot, gen))  # (a no-op for a job channel: it holds none)
    locks.unlock(seg.fd, L.LOCK_CLIENT_BASE + slot)


def gen_lock(slot: int, gen: int) -> int:
    """The lock byte client ``gen`` of ``slot`` holds while it lives (``LOCK_GEN_BASE``)."""
    return L.LOCK_GEN_BASE + (slot << 32) + gen


def is_client(seg: Segment, slot: int, gen: int) -> bool:
    """Whether (``slot``, ``gen``) can name a client of ``seg`` at all (both in range): the
    lock bytes derived from them stay within their own ranges."""
    return 0 <= slot < seg.geometry.max_clients and 0 <= gen < 2**32


def generation_held(seg: Segment, slot: int, gen: int) -> bool:
    """Whether client ``gen`` of ``slot`` lives: the kernel lock of that generation is held
    (asked through the segment's query descriptor, so a lock this process holds through
    ``seg.fd`` counts too). Its slot record's generation word decides nothing: the client
    writes it, and a dead generation's stores may outlive it in the table (kept for its
    copy workers) while the slot's next client lives."""
    return is_client(seg, slot, gen) and locks.is_held(seg._query_fd(), gen_lock(slot, gen))


def leave(seg: Segment, slot: int) -> None:
    """Owner only: mark a client slot LEAVING (a goodbye in progress), fenced, so that copy
    workers checking its generation see it dead before the owner looks at their registry."""
    _store(seg, slot, "state", SlotState.LEAVING)
    full_fence()


def clear(seg: Segment, slot: int, gen: int) -> None:
    """Mark ``slot`` FREE, keeping the generation count. The caller holds its lock, or is
    the owner, which alone clears client slots (it stops reading their rings first)."""
    holds(seg, slot)[:] = -1
    _store(seg, slot, "pid", 0)
    _store(seg, slot, "events", 0)  # (a claimant of an older release would not reset it)
    # FREE last: a newcomer may claim the slot the moment it reads it (the owner clears a
    # departed client's slot without its lock), and whatever we stored after would land
    # on the newcomer's record
    publish_fence()
    _store(seg, slot, "state", SlotState.FREE)


def clear_if_dead(seg: Segment, slot: int, gen: int) -> bool:
    """Clear ``slot`` if its holder is gone and nobody re-claimed it. True if cleared."""
    if not locks.try_lock(seg.fd, L.LOCK_CLIENT_BASE + slot):
        return False
    try:
        if record(seg, slot).gen != gen:
            return False
        clear(seg, slot, gen)
        return True
    finally:
        locks.unlock(seg.fd, L.LOCK_CLIENT_BASE + slot)


def share(seg: Segment, slot: int) -> WordView:
    """The slot's share of the cache (``records.SHARE_DTYPE``): its quota and what the
    owner counts of it."""
    return WordView(seg.buf, seg.geometry.slot_offset(slot) + L.SLOT_OFF_SHARE, L.SHARE_DTYPE)


def quota(seg: Segment, slot: int) -> int:
    """The slot's quota in blocks (0: none): the client's ask until the owner adopts it, then
    what the owner applied."""
    view = share(seg, slot)
    try:
        return int(view["quota"])
    finally:
        view.release()


def served(seg: Segment, slot: int) -> WordView:
    """The slot's served record (``records.SERVED_DTYPE``), words the owner writes."""
    return WordView(seg.buf, seg.geometry.slot_offset(slot) + L.SLOT_OFF_SERVED,
                    L.SERVED_DTYPE)


def holds(seg: Segment, slot: int) -> np.ndarray:
    g = seg.geometry
    return np.frombuffer(seg.buf, np.int32, g.hold_capacity, g.slot_offset(slot) + g.hold_offset)


def hold_mark(seg: Segment, slot: int) -> memoryview:
    """The slot's hold mark (``layout.SLOT_OFF_HOLD_MARK``) as a one-word u64 view."""
    off = seg.geometry.slot_offset(slot) + L.SLOT_OFF_HOLD_MARK
    return seg.buf[off:off + 8].cast("Q")


# Up to this many blocks, ``HoldScan.held`` compares every hold with each block's two codes
# (pin and lease) instead of sorting them all (np.isin): one to a few blocks, against the
# hundreds of holds of clients mid-load, is what a one-key store's claim asks.
_FEW = 8


class HoldScan:
    """Every slot's holds, for a claim to see which blocks someone holds: the views into the
    segment are made once (the caller closes them before the segment closes)."""

    def __init__(self, seg: Segment) -> None:
        g = seg.geometry
        self._marks = np.ndarray((g.max_clients,), np.uint64, seg.buf,
                                 g.clients_offset + L.SLOT_OFF_HOLD_MARK, (g.slot_bytes,))
        self._holds = [holds(seg, s) for s in range(g.max_clients)]
        self._cap = g.hold_capacity

    def held(self, blocks: np.ndarray) -> np.ndarray:
        """Which of ``blocks`` any slot holds (a load pin or a lookup lease), whoever it is:
        a claim must leave such a block to its reader. Reads each slot's mark, then its
        holds below the mark (the order the holder stores them in; a mark is its slot's own
        word, so it is clamped to the array)."""
        codes = self._codes()
        if codes is None:
            return np.zeros(len(blocks), bool)
        if len(blocks) <= _FEW:  # a claim's usual size: compare the codes, never sort them
            b = np.asarray(blocks, np.int32)[:, None]  # (the codes' type: no upcast)
            return ((codes == b) | (codes == L.lease_code(b))).any(axis=1)
        return np.isin(blocks, L.held_block(codes[codes != -1]))

    def held_one(self, block: int) -> bool:
        """``held`` of one block, in as few numpy operations as it takes (a one-key store's
        claim: a few microseconds however many holds and slots there are)."""
        codes = self._codes()
        if codes is None:
            return False
        return bool(np.count_nonzero((codes == block) | (codes == L.lease_code(block))))

    def _codes(self) -> np.ndarray | None:
        """A copy of every slot's holds below its mark (None: no slot holds anything). One
        copy, then comparisons of the copy: compared in place, a holder turning its lease
        into a pin (the same entry) between two comparisons could be missed."""
        cap, h = self._cap, self._holds
        parts = [h[s][:min(m, cap)] for s, m in enumerate(self._marks.tolist()) if m]
        return np.concatenate(parts) if parts else None

    def close(self) -> None:
        del self._marks, self._holds


def grants(seg: Segment, slot: int) -> tuple[WordView, np.ndarray]:
    """The slot's grant ring: its counts (``records.GRANT_HEAD_DTYPE``) and its
    ``GRANT_CAPACITY`` int32 block ids."""
    off = seg.geometry.slot_offset(slot) + seg.geometry.grants_offset
    return (WordView(seg.buf, off, L.GRANT_HEAD_DTYPE),
            np.frombuffer(seg.buf, np.int32, L.GRANT_CAPACITY, off + L.GRANT_HEAD_BYTES))


def counter_words(seg: Segment, slot: int) -> WordView:
    """The slot's own counters (``records.SLOT_COUNTERS_DTYPE``) by name, for its client."""
    return WordView(seg.buf, seg.geometry.slot_offset(slot) + L.SLOT_OFF_COUNTERS,
                    L.SLOT_COUNTERS_DTYPE)


def counters(seg: Segment, slot: int) -> np.ndarray:
    return np.frombuffer(seg.buf, np.uint64, len(L.SLOT_COUNTERS),
                         seg.geometry.slot_offset(slot) + L.SLOT_OFF_COUNTERS)


def ring_view(seg: Segment, slot: int, name: str) -> memoryview:
    g = seg.geometry
    off = g.slot_offset(slot) + g.rings_offset + L.RING_NAMES.index(name) * g.ring_region
    return seg.buf[off:off + g.ring_region]


def bell_view(seg: Segment, slot: int, name: str) -> memoryview:
    off = seg.geometry.slot_offset(slot) + seg.geometry.bells_offset + 64 * L.BELL_NAMES.index(name)
    return seg.buf[off:off + 8]
