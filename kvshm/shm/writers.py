"""The writer registry: which live processes may still copy into blocks for which scheduler.

A scheduler's stores are copied by other processes (its job-channel worker, an engine's worker
processes), and those can outlive it. When a scheduler dies the owner frees its WRITING blocks
and grants them to the next client; a copy still in flight would then land in that client's
blocks and be published under its key. So every process that copies for a scheduler's manager
slot registers under that slot *and its generation* before copying, and the owner keeps a
dead generation's WRITING blocks (quarantines them) while any such registration lives.

This module owns registrations. A registration is a shared kernel-released lock of the
generation's copier byte (``copier_lock``): it is alive exactly while held, a registrant that
dies drops it without anyone's help, and any number of processes hold it at once, so no
copier is ever left unregistered (a vLLM worker may not fail a job: it would copy all the
same). Beside it, a registrant fills a record of the registry region (``records.WRITER_DTYPE``,
locked at ``layout.LOCK_WRITER_BASE + record``) that says who copies for whom; records decide
nothing, and a registration that finds them all taken goes without one. Registration is
ordered against the scheduler's death (Dekker-style): the registrant takes the lock, then
checks that the generation still lives, and the owner sees the death before it asks for the
lock. So either the owner sees the registration, or the registrant sees the death and copies
nothing.

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


def copier_lock(slot: int, gen: int) -> int:
    """The lock byte every process copying for client ``gen`` of ``slot`` shares."""
    return L.LOCK_COPIER_BASE + (slot << 32) + gen


def alive(seg: Segment, slot: int, gen: int) -> bool:
    """Whether any live process is registered as copying for client ``slot`` generation
    ``gen``. The owner asks this after it saw that generation die."""
    full_fence()  # ask only after the death was observed
    return slots.is_client(seg, slot, gen) and locks.is_held(_query_fd(seg), copier_lock(slot, gen))


def generation_alive(seg: Segment, slot: int, gen: int) -> bool:
    """Whether the client of ``slot`` generation ``gen`` still lives, as a copier must see
    it: its generation's lock is held (the one an owner asks, so a copier never sees alive
    a generation whose stores an owner already freed; a client lets go of it before its
    slot's) and its slot is CLIENT (LEAVING: its goodbye is being served)."""
    # (the state first: a CLIENT read after the lock could be the slot's next client's)
    return slots.is_client(seg, slot, gen) and \
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
    """One copying party's registrations, through an open file description of its own (two
    parties in one process must not share, or end, each other's locks).

    Not thread-safe: the caller serialises ``admit``/``retire`` against the bookkeeping of
    which jobs are in flight (WorkerConnector holds its lock around both).
    """

    def __init__(self, seg: Segment) -> None:
        self.seg = seg
        self._fd = locks.query_fd(seg.fd)
        self._mine: dict[tuple[int, int], int] = {}  # (slot, gen) -> record, -1 for none

    def register(self, slot: int, gen: int) -> bool:
        """Register under (slot, gen) (once). False only for a (slot, gen) that cannot be
        a client's, or a copier lock somebody holds exclusively (no kvshm process does).
        Serialised in this process: its OFD locks are shared by every thread, so two
        registrations could otherwise both "take" one record."""
        with _REGISTERING:
            return self._register(slot, gen)

    def _register(self, slot: int, gen: int) -> bool:
        if (slot, gen) in self._mine:
            return True
        if not slots.is_client(self.seg, slot, gen) or not locks.try_share(self._fd,
                                                                   copier_lock(slot, gen)):
            log.error("kvshm: cannot register as a copier for client slot %d generation %d "
                      "of segment %r; its store jobs are refused", slot, gen, self.seg.name)
            return False
        self._mine[(slot, gen)] = self._record(slot, gen)
        full_fence()  # registered before we look at the scheduler's liveness
        return True

    def _record(self, slot: int, gen: int) -> int:
        """Fill a free record saying who we copy for; its index, -1 if none is free."""
        recs = _records(self.seg)
        for i in range(len(recs)):
            if recs[i]["slot"] >= 0 and locks.is_held(_query_fd(self.seg),
                                                      L.LOCK_WRITER_BASE + i):
                continue  # cheap skip of live records; try_lock decides
            if not locks.try_lock(self._fd, L.LOCK_WRITER_BASE + i):
                continue
            off = self.seg.geometry.writers_offset + i * L.WRITER_BYTES
            # the slot last: a record names its generation before it names the slot
            words.store_fields(self.seg.buf, off, L.WRITER_DTYPE, pid=os.getpid(), gen=gen,
                               since_ns=time.time_ns())
            words.store_fields(self.seg.buf, off, L.WRITER_DTYPE, slot=slot)
            return i
        return -1

    def admit(self, slot: int, gen: int) -> bool:
        """Register under (slot, gen), then say whether that generation still lives: True
        means a copy for it may start now (the owner will keep its blocks while we live)."""
        return self.register(slot, gen) and generation_alive(self.seg, slot, gen)

    def unregister(self, slot: int, gen: int) -> None:
        i = self._mine.pop((slot, gen), None)
        if i is None:
            return
        if i >= 0:
            off = self.seg.geometry.writers_offset + i * L.WRITER_BYTES
            words.store_fields(self.seg.buf, off, L.WRITER_DTYPE, slot=-1)  # first: unnamed
            words.store_fields(self.seg.buf, off, L.WRITER_DTYPE, pid=0, gen=0, since_ns=0)
            full_fence()
            locks.unlock(self._fd, L.LOCK_WRITER_BASE + i)
        locks.unlock(self._fd, copier_lock(slot, gen))

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
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
