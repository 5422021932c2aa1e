"""What each request does to the index, and what the owner keeps per client to serve it.

This module owns the owner's request handlers — ``(client, message, replay) -> reply parts``
— and ``_Client``, the per-client state of one adopted slot generation (its rings, the served
record, replies waiting for room, a request arriving in parts). ``Owner`` (``owner.py``) runs
the loop, the exactly-once bookkeeping and liveness; it mixes these handlers in. A handler
never blocks, never copies block data, and under ``replay`` never executes afresh: it answers
from the record (the table and what the client still has pending).
"""
from __future__ import annotations

import time

from kvshm.crashpoints import crash_point
from kvshm.errors import KvshmError, ProtocolError, SegmentPermissionError
from kvshm.index import protocol as P
from kvshm.owner.manager import LocalManager
from kvshm.shm import keys as K
from kvshm.shm import layout as L
from kvshm.shm import slots
from kvshm.shm.ring import Doorbell, Ring
from kvshm.shm.segment import Segment

MAX_EVENTS = 10_000  # per client; older events are dropped


class _Client:
    """What the owner knows of one adopted client slot (one generation of it)."""

    def __init__(self, seg: Segment, slot: int, gen: int, events: bool):
        self.slot, self.gen, self.events = slot, gen, events
        self.holds = slots.holds(seg, slot)
        self.quarantined = False  # its rings cannot be parsed: never read again
        self.requests = self.replies = None
        try:
            self.requests = Ring(slots.ring_view(seg, slot, "request"))
            self.replies = Ring(slots.ring_view(seg, slot, "reply"))
        except KvshmError as e:  # no service; its holds still count while it lives
            self.quarantined, self.why = True, f"unusable rings ({e})"
        self.bell: Doorbell | None = None
        try:
            self.bell = Doorbell(slots.bell_view(seg, slot, "reply"),
                                 seg.object_name(f"c{slot}-reply"), like_fd=seg.fd)
        except SegmentPermissionError as e:  # it made its doorbell ours to not open
            self.quarantined, self.why = True, f"unusable reply doorbell ({e})"
        self.served = slots.served(seg, slot)  # layout.SERVED_FIELDS
        self.grant_words, self.grant_ids = slots.grants(seg, slot)
        self.stores = False  # it stores: keep its grant ring stocked
        # Its largest store so far, in keys (round trip, or grants taken between refills):
        # the owner keeps its grant ring at twice that, within the budget (``grants.py``).
        self.largest_store = 0
        self.taken_seen = int(self.grant_words[L.GRANT_WORD_TAKEN])
        # it takes grants: the slot says so from its activation, before any request
        self.grants = not self.grant_words[L.GRANT_WORD_REFUSED]
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

    def close(self) -> None:
        if self.bell is not None:
            self.bell.close()
        for r in (self.requests, self.replies):
            if r is not None:
                r.close()


class RequestHandlers:
    """The request handlers of ``Owner`` (which provides the attributes below)."""

    seg: Segment
    manager: LocalManager
    epoch: int
    clients: dict[int, _Client]

    # ``replay``: a dead owner began this request. Answer from the record (the table and
    # the keys it still has pending for this client), never execute it a second time.
    def _hello(self, c: _Client, m: P.Hello, replay: bool) -> list[P._Msg]:
        if (m.slot, m.gen) != (c.slot, c.gen):
            return [P.Error(m.req, self.epoch, "ProtocolError",
                            f"hello names slot {m.slot} gen {m.gen} but came on slot {c.slot} "
                            f"gen {c.gen}")]
        c.events = m.events
        return [P.Ok(m.req, self.epoch, self.epoch)]

    def _prepare_store(self, c: _Client, m: P.PrepareStore, replay: bool) -> list[P._Msg]:
        writer = (c.slot, c.gen, m.req)
        c.stores = c.grants
        if replay:  # what the dead owner granted, and nothing more: evictions are unknown
            done = self.manager.pending_of(writer, m.req)
            c.largest_store = max(c.largest_store, len(done))
            return self._prepared(m.req, [k for k, _ in done], [b for _, b in done], [], True)
        out = self.manager.prepare_store(m.keys, writer, running=P.running_of(m))
        self._fan_out()
        if out is None:
            return [P.NoRoom(m.req, self.epoch)]
        # the blocks it took, not the keys it offered (most may be cached already)
        c.largest_store = max(c.largest_store, len(out.keys_to_store))
        return self._prepared(m.req, out.keys_to_store, out.block_ids, out.evicted_keys, False)

    def _prepared(self, req: int, keys: list[bytes], blocks: list[int], evicted: list[bytes],
                  replayed: bool) -> list[P._Msg]:
        """A Prepared reply, in as many frames as it needs."""
        n = max(1, (Ring.max_payload(self.seg.geometry.ring_capacity) - 64)
                // (L.MAX_KEY_BYTES + 16))
        parts, i, j = [], 0, 0
        while True:
            k, e = keys[i:i + n], evicted[j:j + max(0, n - len(keys[i:i + n]))]
            i, j = i + len(k), j + len(e)
            more = i < len(keys) or j < len(evicted)
            parts.append(P.Prepared(req, self.epoch, k, blocks[i - len(k):i], e, more,
                                    len(parts), replayed))
            if not more:
                return parts

    def _complete_store(self, c: _Client, m: P.CompleteStore, replay: bool) -> list[P._Msg]:
        writer = (c.slot, c.gen, m.req)
        if replay or m.of_req:  # apply only to what is still ours (of that request)
            mine = {k for k, _ in self.manager.pending_of(writer, m.of_req or None)}
            self.manager.complete_store([k for k in m.keys if k in mine], m.success, writer)
        else:
            self.manager.complete_store(m.keys, m.success, writer)
        self._fan_out()
        return [P.Ok(m.req, self.epoch)]

    def _publish(self, c: _Client, m: P.Publish, replay: bool) -> list[P._Msg]:
        """One-way: applied in ring order, harmlessly again after a failover (blocks no
        longer granted to the client are ignored)."""
        if len(m.keys) != len(m.blocks):
            raise ProtocolError(f"publish of {len(m.keys)} keys with {len(m.blocks)} blocks")
        K.check_keys(m.keys)
        c.stores = c.grants
        try:
            running = P.running_of(m)
        except KvshmError:
            running = None  # ranks are advice: a bad one never costs a store
            self.seg.counter_add("errors")
        self.manager.grants.publish(c.slot, c.gen, m.keys, m.blocks, m.success,
                                    int(c.grant_words[L.GRANT_WORD_TAKEN]), running)
        self._fan_out()
        return []

    def _touch(self, c: _Client, m: P.Touch, replay: bool) -> list[P._Msg]:
        self.manager.touch(m.keys, m.how, running=P.running_of(m), client=(c.slot, c.gen))
        self.seg.counter_add("touches")
        return [P.Ok(m.req, self.epoch)]

    def _take_events(self, c: _Client, m: P.TakeEvents, replay: bool) -> list[P._Msg]:
        # As many events as fit one reply frame; the rest wait for the next call. (A replay
        # finds an empty log: the events died with the owner that recorded them.)
        room, n = c.max_reply // 2, 0
        for n, (_, keys) in enumerate(c.events_log):
            room -= sum(len(k) + 3 for k in keys) + 8
            if room < 0:
                break
        else:
            n = len(c.events_log)
        log_, c.events_log = c.events_log[:n], c.events_log[n:]
        return [P.Events(m.req, self.epoch, [rm for rm, _ in log_], [k for _, k in log_])]

    def _goodbye(self, c: _Client, m: P.Bye) -> None:
        """Free the client's unfinished stores, answer, forget it and free its slot — in
        that order. Recorded like any request, so a successor finishes a goodbye its
        predecessor died in. The slot is cleared last: while the record says ACTIVE nobody
        may claim it, so the reply cannot land in a newcomer's freshly formatted ring. It
        is marked LEAVING first: a copy worker that registers from then on sees the client's
        generation dead and copies nothing, so the registry read by ``reclaim_writer``
        cannot miss a worker about to copy (the same order as for a death)."""
        slots.leave(self.seg, c.slot)
        self.manager.reclaim_writer(c.slot, c.gen)
        crash_point("owner.goodbye.mid")
        self._retire_counters(c.slot)
        self._answer(c, m.req, [P.Ok(m.req, self.epoch)])  # if it does not fit, the client
        self._drop_client(c.slot)                          # times out and goes all the same
        self._last_client = time.monotonic()
        slots.clear(self.seg, c.slot, c.gen)

    def _fan_out(self) -> None:
        """Every client that asked for events sees every change of the shared cache."""
        events = self.manager.take_events()
        if not events:
            return
        for c in self.clients.values():
            if c.events:
                c.events_log.extend((e.removed, e.keys) for e in events)
                del c.events_log[:-MAX_EVENTS]
