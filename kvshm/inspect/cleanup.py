"""What ``kvshm-inspect gc`` and ``rm`` do to a segment, apart from their command line.

This module owns the part of kvshm-inspect that writes to a segment or looks past it:
``reclaim`` (what ``gc`` does: frees what dead clients and a dead owner left, as a temporary
owner, only while no owner runs) and ``users`` (who still uses a segment, which ``rm`` asks
before it unlinks; from the kernel's locks when the segment cannot be read). It prints
nothing: ``cli.py`` reports.
"""
from __future__ import annotations

from typing import Any

from kvshm.errors import OwnerUnavailableError, SegmentNotFoundError, SegmentPermissionError
from kvshm.shm import layout as L
from kvshm.shm import locks, slots
from kvshm.shm.names import shm_name
from kvshm.shm.segment import Segment


def reclaim(seg: Segment) -> dict[str, Any]:
    """``gc``: if no owner runs, reclaim what dead clients and a dead owner left, as a
    temporary owner; the ``kvshm.gc/1`` document of what was done (or why not)."""
    out: dict[str, Any] = {"schema": "kvshm.gc/1", "name": seg.name, "acted": False,
                           "reason": "", "freed_blocks": 0, "kept_ready": 0,
                           "kept_pending": 0, "reclaimed_clients": []}

    def owned() -> dict[str, Any]:
        return {**out, "reason": f"owner pid {seg.owner_record()[0]} is alive and reclaims "
                "dead clients itself; nothing done"}

    if seg.owner_alive():
        return owned()
    from kvshm.owner.manager import LocalManager, build_loops  # only gc needs the manager
    build_loops()  # before the lock, as an owner does: a hung compiler keeps no owner out
    if not locks.try_lock(seg.fd, L.LOCK_OWNER):  # OFD lock: LocalManager re-takes it below
        return owned()
    g, live = seg.geometry, seg.clients_alive()
    dead_owner = seg.owner_record()  # pid 0 unless the last owner died holding the segment
    try:  # the rebuild frees stores whose writer died and settles torn entries (but a live
        # client's offers and claims, which that client or the next owner to serve it ends)
        mgr = LocalManager(seg, writer_alive=lambda i, gen: slots.generation_held(seg, i, gen))
    except OwnerUnavailableError:  # cannot happen while we hold the lock; be safe anyway
        locks.unlock(seg.fd, L.LOCK_OWNER)
        return {**out, "reason": "an owner started meanwhile; nothing done"}
    try:
        for i in range(g.max_clients):
            state, pid, gen, _, name, _ = slots.record(seg, i)
            holds = int((slots.holds(seg, i) != -1).sum())
            if state != L.SlotState.FREE and i not in live and slots.clear_if_dead(seg, i, gen):
                out["reclaimed_clients"].append({"slot": i, "pid": pid, "holds": holds, "name":
                                                 name.rstrip(b"\0").decode("utf-8", "replace")})
        seg.counter_add("reclaimed_clients", len(out["reclaimed_clients"]))
        seg.counter_add("reclaimed_blocks", mgr.recovered["freed"])
    finally:
        if dead_owner[0]:  # gc is no failover: the next real owner counts that death
            seg.counter_add("failovers", -1)
        mgr.shutdown(dead_pid=dead_owner[0])
    return {**out, "acted": True, "freed_blocks": mgr.recovered["freed"],
            "kept_ready": mgr.recovered["ready"], "kept_pending": mgr.recovered["pending"],
            "reason": "no owner alive: reclaimed as a temporary owner"}



def users(name: str) -> tuple[list[dict[str, int]], bool]:
    """Live client slots and whether an owner lives; for a damaged segment, from its locks."""
    shm_name(name)  # a bad name is an error, not a damaged segment
    try:
        with Segment.attach(name) as seg:
            return [{"slot": i, "pid": L.SLOT.unpack_from(seg.buf, seg.geometry.slot_offset(i))[1]}
                    for i in sorted(seg.clients_alive())], seg.owner_alive()
    except (SegmentNotFoundError, SegmentPermissionError):
        raise
    except Exception:  # not (or no longer) a readable kvshm segment: ask the kernel
        import posix_ipc
        shm = posix_ipc.SharedMemory(shm_name(name))
        try:
            return ([{"slot": i, "pid": 0} for i in sorted(locks.held_among(
                shm.fd, L.LOCK_CLIENT_BASE, 1024))], locks.is_held(shm.fd, L.LOCK_OWNER))
        finally:
            shm.close_fd()
