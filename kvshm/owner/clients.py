"""What the owner keeps of one adopted client: its rings, its records, its pending parts.

This module owns ``Client``: the owner's per-client state of one slot generation (its rings
and reply doorbell, the served record that makes its requests exactly-once, its grant ring,
replies waiting for room, a request arriving in parts, the events it has not taken). Any of
it may be hostile (the client writes its own slot): opening the rings fails into
``quarantined`` with the reason, never into an exception; its doorbell is a word of its slot,
which nothing it writes there can make unusable. It serves nothing itself.
"""
from __future__ import annotations

import time

import numpy as np

from kvshm.errors import KvshmError
from kvshm.index import protocol as P
from kvshm.index.api import OffloadingEvent
from kvshm.shm import slots
from kvshm.shm.ring import Doorbell, Ring
from kvshm.shm.segment import Segment

MAX_EVENTS = 10_000  # per client; older events are dropped


class Client:
    """What the owner knows of one adopted client slot (one generation of it)."""

    def __init__(self, seg: Segment, slot: int, gen: int, events: bool):
        self.slot, self.gen, self.events = slot, gen, events
        self.holds = slots.holds(seg, slot)
        self.hold_mark = slots.hold_mark(seg, slot)  # holds lie below it (the client's word)
        self.share = slots.share(seg, slot)  # its quota (its word), what we count of it
        self.quarantined = False  # its rings cannot be parsed: never read again
        self.why = ""  # why it is quarantined
        self.requests: Ring | None = None
        self.replies: Ring | None = None
        try:
            self.requests = Ring(slots.ring_view(seg, slot, "request"))
            self.replies = Ring(slots.ring_view(seg, slot, "reply"))
        except KvshmError as e:  # no service; its holds still count while it lives
            self.quarantined, self.why = True, f"unusable rings ({e})"
        self.bell = Doorbell(slots.bell_view(seg, slot, "reply"))  # a word: nothing to open
        self.served = slots.served(seg, slot)  # the requests it answered (owner_link.py)
        self.grant_head, self.grant_ids = slots.grants(seg, slot)
        self.stores = False  # it stores: keep its grant ring stocked
        self.merge = True  # its queued Publish frames are applied together (coalesce.py)
        # Its largest store so far, in keys (round trip, or grants taken between refills):
        # the owner keeps its grant ring at twice that, within the budget (``stocking.py``).
        self.largest_store = 0
        self.taken_seen = int(self.grant_head["taken"])
        self.taken_at = time.monotonic()  # when a refill last saw its taken count move
        # it takes grants: the slot says so from its activation, before any request
        self.grants = not self.grant_head["refused"]
        self.max_reply = Ring.max_payload(seg.geometry.ring_capacity)
        self.events_log: list[tuple[bool, list[bytes]]] = []
        # Reply frames of request `unsent_req` that did not fit the reply ring yet. While any
        # wait, the request stays at the head of the request ring and nothing else is read.
        self.unsent: list[bytes] = []
        self.unsent_req = 0
        # Keys of a request arriving in several frames (`parts_req`), until its last part,
        # and their token positions (None once a part came without).
        self.parts: list[bytes] = []
        self.parts_pos: list[int] | None = []
        self.parts_req = self.parts_next = 0
        self.parts_lost = False  # its first parts went with a dead owner: answer Retry
        self.parts_refused = ""  # why the request in parts is refused ("": it is not)

    def gather(self, msg: P.PrepareStore, max_keys: int
               ) -> tuple[list[bytes] | None, list[int] | None]:
        """Collect the parts of a request sent in several frames: its keys (and their token
        positions, if every part had them) once the last part is in, else None. Then
        ``parts_lost`` says whether a part never reached us, ``parts_refused`` why the
        request must be refused."""
        if self.parts_req != msg.req:
            self.parts, self.parts_req, self.parts_lost = [], msg.req, msg.part != 0
            self.parts_pos, self.parts_refused = [], ""
        elif self.parts_next != msg.part:
            self.parts_lost = True
        if len(self.parts) + len(msg.keys) > max_keys:  # a client that never ends a request
            self.parts_refused = (f"a prepare_store of more than {max_keys} keys; store "
                                  "fewer keys per call")  # must not fill our memory
        elif msg.positions is not None and len(msg.positions) != len(msg.keys):
            self.parts_refused = (f"{len(msg.positions)} token positions for "
                                  f"{len(msg.keys)} keys in part {msg.part}")
        elif not self.parts_refused:
            self.parts.extend(msg.keys)
            if self.parts_pos is not None and msg.positions is not None:
                self.parts_pos.extend(msg.positions)
            else:
                self.parts_pos = None
        self.parts_next = msg.part + 1
        if msg.more:
            return None, None
        keys, positions = self.parts, self.parts_pos
        self.parts, self.parts_pos, self.parts_req = [], [], 0
        return keys, positions

    def record_events(self, events: list[OffloadingEvent]) -> None:
        """Keep the shared cache's changes for this client's ``take_events`` (when it asked
        for events), the newest ``MAX_EVENTS``."""
        if self.events:
            self.events_log.extend((e.removed, e.keys) for e in events)
            del self.events_log[:-MAX_EVENTS]

    def marked_holds(self) -> np.ndarray:
        """Its hold entries below its hold mark (clamped: the mark is the client's word)."""
        return self.holds[:min(self.hold_mark[0], len(self.holds))]

    def close(self) -> None:
        self.hold_mark.release()
        self.share.release()
        self.bell.close()
        for r in (self.requests, self.replies):
            if r is not None:
                r.close()
