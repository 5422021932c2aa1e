"""Client slots in the segment: claim one, activate it, view its rings, give it back.

This module owns the life cycle of a slot. A slot belongs to whoever holds its kernel lock
(``LOCK_CLIENT_BASE + slot``); its record says what it is (free, a manager client, or a job
channel between an engine's scheduler and a worker). Only slots whose record is FREE are
claimed, so nobody reformats rings that an owner may still be reading: a dead client's slot
is cleared (under its lock) by the owner or ``kvshm-inspect gc`` first.
It never talks to the owner and never imports torch.
"""
from __future__ import annotations

import os
import sys
import time
from typing import Callable

import numpy as np

from . import layout as L
from . import locks
from .errors import ClientSlotsExhaustedError
from .fence import full_fence
from .ring import Ring
from .segment import Segment

FREE, CLIENT, CHANNEL = 0, L.SLOT_ACTIVE, 2


def record(seg: Segment, slot: int) -> tuple[int, int, int, int, bytes]:
    """(state, pid, generation, attached_ns, name) of ``slot``."""
    return L.SLOT.unpack_from(seg.buf, seg.geometry.slot_offset(slot))


def claim(seg: Segment, wait_for_reclaim: Callable[[], None] | None = None,
          timeout: float = 5.0) -> tuple[int, int]:
    """Lock a FREE slot and return (slot, next generation).

    Dead clients' slots are not FREE until reclaimed; ``wait_for_reclaim`` is called (e.g.
    to make sure an owner runs) between attempts while such slots exist.
    """
    g, fd = seg.geometry, seg.fd
    deadline = time.monotonic() + timeout
    while True:
        dirty = False
        for slot in range(g.max_clients):
            if not locks.try_lock(fd, L.LOCK_CLIENT_BASE + slot):
                continue
            state, _, gen, _, _ = record(seg, slot)
            if state == FREE:
                return slot, gen + 1
            locks.unlock(fd, L.LOCK_CLIENT_BASE + slot)
            dirty = True
        if not dirty or wait_for_reclaim is None or time.monotonic() > deadline:
            raise ClientSlotsExhaustedError(
                f"all {g.max_clients} client slots of segment {seg.name!r} are in use"
                + (" or wait to be reclaimed (run 'kvshm-inspect gc')" if dirty else "")
                + "; close unused clients or create the segment with more max_clients")
        wait_for_reclaim()
        time.sleep(0.05)  # polling the owner's reclaim, bounded by the deadline


def activate(seg: Segment, slot: int, gen: int, state: int = CLIENT) -> None:
    """Reset a claimed slot (holds, counters, rings) and publish its record."""
    g, buf = seg.geometry, seg.buf
    base = g.slot_offset(slot)
    holds(seg, slot)[:] = -1
    counters(seg, slot)[:] = 0
    for name in L.RING_NAMES:
        Ring.format(ring_view(seg, slot, name), g.ring_capacity)
    name = os.path.basename(sys.argv[0] or "python")[:32].encode()
    full_fence()
    L.SLOT.pack_into(buf, base, state, os.getpid(), gen, time.time_ns(), name)
    full_fence()


def release(seg: Segment, slot: int, gen: int) -> None:
    """Clear a slot we hold and unlock it."""
    clear(seg, slot, gen)
    locks.unlock(seg.fd, L.LOCK_CLIENT_BASE + slot)


def clear(seg: Segment, slot: int, gen: int) -> None:
    """Mark ``slot`` FREE (caller holds its lock), keeping the generation count."""
    holds(seg, slot)[:] = -1
    L.SLOT.pack_into(seg.buf, seg.geometry.slot_offset(slot), FREE, 0, gen, 0, b"")


def clear_if_dead(seg: Segment, slot: int, gen: int) -> bool:
    """Clear ``slot`` if its holder is gone and nobody re-claimed it. True if cleared."""
    if not locks.try_lock(seg.fd, L.LOCK_CLIENT_BASE + slot):
        return False
    try:
        if record(seg, slot)[2] != gen:
            return False
        clear(seg, slot, gen)
        return True
    finally:
        locks.unlock(seg.fd, L.LOCK_CLIENT_BASE + slot)


def holds(seg: Segment, slot: int) -> np.ndarray:
    g = seg.geometry
    return np.frombuffer(seg.buf, np.int32, g.hold_capacity, g.slot_offset(slot) + g.hold_offset)


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
