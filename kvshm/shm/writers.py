"""The writer registry: which live processes may still copy into blocks for which scheduler.

A scheduler's stores are copied by other processes (its job-channel worker, an engine's worker
processes), and those can outlive it. When a scheduler dies the owner frees its WRITING blocks
and grants them to the next client; a copy still in flight would then land in that client's
blocks and be published under its key. So every process that copies for a scheduler's manager
slot registers under that slot *and its generation* before copying, and the owner keeps a
dead generation's WRITING blocks (quarantines them) while any such registration lives.

This module owns the registry region of the segment (``records.WRITER_DTYPE`` records) and its lock
bytes (``layout.LOCK_WRITER_BASE + record``): a registration is alive exactly while its
kernel-released lock is held, so a registrant that dies drops it without anyone's help.
Registration is ordered against the scheduler's death (Dekker-style): the registrant publishes
its record, fences, then checks that the generation still lives, and the owner sees the death
before it reads the records. So either the owner sees the record, or the registrant sees the
death and copies nothing.

It never decides what to free (the manager does) and never copies data.
"""
from __future__ import annotations

import logging
import os
import threading
import time

import numpy as np

from kvshm.shm import layout as L
from kvshm.shm import locks, slots, words
from kvshm.shm.fence import full_fence
from kvshm.shm.segment import Segment

log = logging.getLogger(__name__)

def _records(seg: Segment) -> np.ndarray:
    g = seg.geometry
    return np.frombuffer(seg.buf, L.WRITER_DTYPE, g.writer_records, g.writers_offset)


def _query_fd(seg: Segment) -> int:
    # Our own OFD locks are invisible through our own descriptor; the segment keeps a
    # second one for liveness questions, so registrations made through ``seg.fd`` count.
    return seg._query_fd()


def alive(seg: Segment, slot: int, gen: int) -> bool:
    """Whether any live process is registered as copying for client ``slot`` generation
    ``gen``. The owner asks this after it saw that generation die."""
    full_fence()  # read the records only after the death was observed
    recs = _records(seg)
    hits = np.flatnonzero((recs["slot"] == slot) & (recs["gen"] == gen))
    fd = _query_fd(seg)
    # A record's lock is what makes it true: a match whose lock is free is a dead record.
    return any(locks.is_held(fd, L.LOCK_WRITER_BASE + int(i)) for i in hits)


def generation_alive(seg: Segment, slot: int, gen: int) -> bool:
    """Whether the client of ``slot`` generation ``gen`` still lives, as a copier must see
    it: its generation's lock is held (the one an owner asks, so a copier never sees alive
    a generation whose stores an owner already freed; a client lets go of it before its
    slot's) and its slot is CLIENT (LEAVING: its goodbye is being served)."""
    # (the state first: a CLIENT read after the lock could be the slot's next client's)
    return 0 <= slot < seg.geometry.max_clients and \
        slots.record(seg, slot).state == L.SlotState.CLIENT and \
        slots.generation_held(seg, slot, gen)


def registrations(seg: Segment) -> list[dict]:
    """Live registrations, for kvshm-inspect and tests: slot, gen, pid, since_ns, record."""
    recs, fd = _records(seg), _query_fd(seg)
    return [{"record": int(i), "slot": int(r["slot"]), "gen": int(r["gen"]),
             "pid": int(r["pid"]), "since_ns": int(r["since_ns"])}
            for i, r in enumerate(recs) if r["slot"] >= 0 and
            locks.is_held(fd, L.LOCK_WRITER_BASE + i)]


_REGISTERING = threading.Lock()  # see Registrations.register


class Registrations:
    """One copying party's registrations, through its own descriptor of the segment.

    Not thread-safe: the caller serialises ``admit``/``retire`` against the bookkeeping of
    which jobs are in flight (WorkerConnector holds its lock around both).
    """

    def __init__(self, seg: Segment) -> None:
        self.seg = seg
        self._mine: dict[tuple[int, int], int] = {}  # (slot, gen) -> record

    def register(self, slot: int, gen: int) -> bool:
        """Register under (slot, gen) (once). False if the registry is full. Serialised
        in this process: its OFD locks are shared by every thread, so two registrations
        could otherwise both "take" one record."""
        with _REGISTERING:
            return self._register(slot, gen)

    def _register(self, slot: int, gen: int) -> bool:
        if (slot, gen) in self._mine:
            return True
        recs, fd = _records(self.seg), self.seg.fd
        for i in range(len(recs)):
            if recs[i]["slot"] >= 0 and locks.is_held(_query_fd(self.seg),
                                                      L.LOCK_WRITER_BASE + i):
                continue  # cheap skip of live records; try_lock decides
            if not locks.try_lock(fd, L.LOCK_WRITER_BASE + i):
                continue
            off = self.seg.geometry.writers_offset + i * L.WRITER_BYTES
            # the slot last: a record names its generation before it names the slot
            words.store_fields(self.seg.buf, off, L.WRITER_DTYPE, pid=os.getpid(), gen=gen,
                               since_ns=time.time_ns())
            words.store_fields(self.seg.buf, off, L.WRITER_DTYPE, slot=slot)
            full_fence()  # the record is visible before we look at the scheduler's liveness
            self._mine[(slot, gen)] = i
            return True
        log.error("kvshm: the writer registry of segment %r is full (%d records); jobs for "
                  "client slot %d are refused", self.seg.name, len(recs), slot)
        return False

    def admit(self, slot: int, gen: int) -> bool:
        """Register under (slot, gen), then say whether that generation still lives: True
        means a copy for it may start now (the owner will keep its blocks while we live)."""
        return self.register(slot, gen) and generation_alive(self.seg, slot, gen)

    def unregister(self, slot: int, gen: int) -> None:
        i = self._mine.pop((slot, gen), None)
        if i is None:
            return
        off = self.seg.geometry.writers_offset + i * L.WRITER_BYTES
        words.store_fields(self.seg.buf, off, L.WRITER_DTYPE, slot=-1)  # first: unnamed
        words.store_fields(self.seg.buf, off, L.WRITER_DTYPE, pid=0, gen=0, since_ns=0)
        full_fence()
        locks.unlock(self.seg.fd, L.LOCK_WRITER_BASE + i)

    def retire(self, busy: set[tuple[int, int]]) -> None:
        """Unregister every dead generation with no copy in flight (``busy`` are those with
        one). A dead generation never comes back, so nothing of it is admitted again."""
        for key in list(self._mine):
            if key not in busy and not generation_alive(self.seg, *key):
                self.unregister(*key)

    def registered(self) -> set[tuple[int, int]]:
        return set(self._mine)

    def close(self) -> None:
        """Unregister everything (the caller waited for its copies)."""
        for key in list(self._mine):
            self.unregister(*key)
