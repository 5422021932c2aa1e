"""The clients an owner serves: adopting them, telling the living from the dead, reclaiming.

This module owns the owner's set of adopted clients (one ``Client`` per slot generation): it
adopts slots activated since it last looked (``discover``), decides liveness by the slot's
kernel lock alone (never by a pid, nor by a word the client writes), gives back everything
a dead client held (its unfinished stores and grants through the manager, its counters into
the segment's totals, its slot last), and quarantines a client whose rings or doorbell it
cannot use. It also answers which blocks clients hold against a store (``held``). It reads
no request frame and never blocks on a client.
"""
from __future__ import annotations

import logging
import time

import numpy as np

from kvshm.crashpoints import crash_point
from kvshm.errors import SegmentNotFoundError
from kvshm.owner import stocking
from kvshm.owner.clients import Client
from kvshm.owner.manager import LocalManager
from kvshm.shm import layout as L
from kvshm.shm import locks, slots
from kvshm.shm.fence import full_fence
from kvshm.shm.segment import Segment
from kvshm.shm.words import WordView

log = logging.getLogger("kvshm.owner")

# Slots an owner serves: clients, and clients a dead predecessor was saying goodbye to
# (their goodbye is still at the head of their ring and is finished like any request).
SERVED = (L.SlotState.CLIENT, L.SlotState.LEAVING)


class Roster:
    """The adopted clients of one owner. It exists before the owner's ``LocalManager`` (whose
    rebuild asks ``writer_alive``), so the methods that change the index take the manager."""

    def __init__(self, seg: Segment) -> None:
        self.seg = seg
        self.clients: dict[int, Client] = {}
        self.last_client = time.monotonic()  # when the roster last changed (idle exit)
        self.removed = False  # discover found the segment removed: no client has a future

    # --- liveness -----------------------------------------------------------------------
    def writer_alive(self, slot: int, gen: int) -> bool:
        """Whether client ``gen`` of ``slot`` may live: its generation's kernel lock is held
        (``slots.generation_held``). The generation its slot record shows is a word the
        client writes: a client found under a word whose lock nobody holds is never served,
        and a dead generation's stores kept for its copiers come back when those go, though
        the slot's next client lives."""
        return slots.generation_held(self.seg, slot, gen)

    def slot_held(self, slot: int) -> bool:
        """Whether someone holds ``slot`` (its kernel lock): its record and holds are theirs."""
        return locks.is_held(self.seg.fd, L.LOCK_CLIENT_BASE + slot)

    def held(self, requester: int) -> set[int]:
        """Blocks that adopted clients hold (dead and quarantined ones too, until reclaimed):
        all pins, and the leases of clients other than ``requester`` — a client's own lookups
        do not stop its own stores, exactly as in a private cache."""
        parts = []
        for c in self.clients.values():
            h = c.marked_holds()
            if c.slot == requester:
                parts.append(h[h >= 0])
            else:
                h = h[h != -1]
                parts.append(L.held_block(h))
        if not parts:
            return set()
        return set(np.concatenate(parts).tolist())

    # --- adoption -----------------------------------------------------------------------
    def discover(self, manager: LocalManager, newcomer: memoryview) -> None:
        """Adopt slots activated since we last looked (their hello waits on their ring).
        ``newcomer``: the header flag a client sets after activating its slot."""
        newcomer[0] = 0
        full_fence()  # clear the flag before reading states, or a newcomer could be missed
        adopted: list[Client] = []
        for slot in range(self.seg.geometry.max_clients):
            if slot in self.clients:
                continue
            if slots.record(self.seg, slot).state not in SERVED:
                continue
            # Hold the slot before reading it for good: once the lock is ours nobody can
            # claim it, so the record read now is the client we serve until we drop it
            if not locks.try_lock(self.seg.fd, L.LOCK_SERVED_BASE + slot):
                continue  # (a closing predecessor still lets go of it: next time)
            rec = slots.record(self.seg, slot)
            if rec.state not in SERVED or not self.writer_alive(slot, rec.gen):
                if rec.state in SERVED and self.slot_held(slot):
                    self._refuse(slot, rec.gen)
                locks.unlock(self.seg.fd, L.LOCK_SERVED_BASE + slot)
                continue
            try:
                c = self.clients[slot] = Client(self.seg, slot, rec.gen, bool(rec.events))
            except SegmentNotFoundError:  # removed: no client has a future here
                locks.unlock(self.seg.fd, L.LOCK_SERVED_BASE + slot)
                self.removed = True
                return
            if c.quarantined:
                self.quarantine(c, c.why)
            # blocks a predecessor died handing over are handed over now; a client it
            # stocked keeps being stocked (not one leaving)
            granted = int(c.grant_head["granted"])
            run = manager.grants.settle(slot, rec.gen, granted, int(c.grant_head["taken"]),
                                        int(c.grant_head["intent"]))
            if run:
                granted = stocking.hand_over(c.grant_head, c.grant_ids, granted, run)
            c.stores = bool(granted) and c.grants and rec.state == L.SlotState.CLIENT
            adopted.append(c)
            self.last_client = time.monotonic()
        # Quotas are first come, first served. A client an earlier owner served (it began a
        # request of it) holds the quota that owner applied: it comes before a newcomer that
        # only asked, whatever their slots, so a takeover never cuts a quota it was given.
        for c in sorted(adopted, key=lambda c: (not c.served["epoch"], c.slot)):
            self._set_quota(manager, c)

    def _set_quota(self, manager: LocalManager, c: Client) -> None:
        """Apply the quota ``c`` asked for, cut to what the others' left; the quota applied
        goes back in its share record, for people and for a successor owner."""
        asked = int(c.share["quota"])
        got = manager.quotas.set((c.slot, c.gen), asked)
        if got != asked:
            c.share["quota"] = got
            log.warning("client slot %d gen %d asked for a quota of %d blocks; %d applied "
                        "(all quotas together keep at most %d of the %d blocks)", c.slot,
                        c.gen, asked, got, manager.quotas.room, manager.quotas.num_blocks)

    def _refuse(self, slot: int, gen: int) -> None:
        """A live holder of ``slot`` whose record names generation ``gen``, which nobody
        holds: it rewrote that word (a client's record is written before the state that
        makes it ours to adopt). Never served, it is told so once, as a quarantined client
        is: its calls fail at once instead of waiting out their timeout."""
        served = slots.served(self.seg, slot)
        try:
            if not served["quarantined"]:
                self._tell_quarantined(served, slot, gen, "its record names a generation it "
                                       "does not hold; never served")
        finally:
            served.release()

    def newcomer_waits(self) -> bool:
        """Whether a slot waits to be adopted (activated, its holder alive): what a raised
        newcomer flag must bring for the owner to look further. Reads the slot states,
        and the lock of a candidate only."""
        for slot in range(self.seg.geometry.max_clients):
            if slot not in self.clients:
                rec = slots.record(self.seg, slot)
                if rec.state in SERVED and self.writer_alive(slot, rec.gen):
                    return True
        return False

    def quarantine(self, c: Client, why: str) -> None:
        """Stop reading a client we cannot parse. Its holds still count while it lives."""
        c.quarantined = True
        c.unsent = []
        self._tell_quarantined(c.served, c.slot, c.gen, why)

    def _tell_quarantined(self, served: WordView, slot: int, gen: int, why: str) -> None:
        served["quarantined"] = 1  # its calls fail at once, not at their timeout
        self.seg.counter_add("errors")
        log.warning("client slot %d gen %d quarantined: %s", slot, gen, why)

    # --- departure ----------------------------------------------------------------------
    def scan(self, manager: LocalManager) -> None:
        """Reclaim dead clients, adopted or not, and the quarantined stores of dead copiers."""
        for slot, c in list(self.clients.items()):
            if not self.writer_alive(slot, c.gen):
                self.reclaim(manager, slot, c.gen)
        # Free quarantined stores whose copiers are gone.
        self.seg.counter_add("reclaimed_blocks", manager.reclaim_dead_writers(self.writer_alive))
        self.reclaim_unadopted(manager)

    def reclaim_unadopted(self, manager: LocalManager) -> None:
        """Dead slots we never adopted (a client killed before its hello was served, a job
        channel whose scheduler died) go back to FREE: nobody else clears them while we live."""
        for slot in range(self.seg.geometry.max_clients):
            if slot in self.clients:
                continue
            rec = slots.record(self.seg, slot)
            if rec.state == L.SlotState.CHANNEL:  # holds nothing of ours: it just goes FREE
                slots.clear_if_dead(self.seg, slot, rec.gen)
            elif rec.state != L.SlotState.FREE and not self.slot_held(slot):
                # CLIENT or LEAVING, or any word its client left there: the state is the
                # client's to write, so a dead holder's slot goes back whatever it says
                self.reclaim(manager, slot, rec.gen)

    def retire_counters(self, slot: int) -> None:
        """Fold a leaving client's own counters into the segment's totals."""
        ctr = slots.counters(self.seg, slot)
        for name, value in zip(L.SLOT_COUNTERS, ctr.tolist()):
            self.seg.counter_add(f"gone_{name}", value)
        ctr[:] = 0  # folded once, whoever retires it again

    def drop(self, slot: int) -> None:
        """Stop serving ``slot`` (it left, or died): close our views of it, then let the slot
        be claimed again (once it is FREE)."""
        c = self.clients.pop(slot, None)
        if c is not None:
            c.close()
            locks.unlock(self.seg.fd, L.LOCK_SERVED_BASE + slot)
        self.last_client = time.monotonic()

    def reclaim(self, manager: LocalManager, slot: int, gen: int) -> None:
        """Release everything a dead client held, then free its slot (after we stopped
        reading its rings, so nobody can re-format them under us)."""
        if slots.record(self.seg, slot).gen == gen:
            self.retire_counters(slot)
        self.drop(slot)
        freed = manager.reclaim_writer(slot, gen)
        crash_point("owner.reclaim.mid")
        slots.clear_if_dead(self.seg, slot, gen)
        self.seg.counter_add("reclaimed_clients")
        self.seg.counter_add("reclaimed_blocks", freed)
        log.info("reclaimed client slot %d gen %d: %d unfinished stores freed", slot, gen, freed)

    def close(self) -> None:
        for slot in list(self.clients):
            self.drop(slot)
