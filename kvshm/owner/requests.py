"""What each request does to the index.

This module owns the owner's request handlers — ``(client, message, replay) -> reply parts``
— over its ``LocalManager``. ``Owner`` (``server.py``) runs the loop, the exactly-once
bookkeeping, goodbyes and liveness, and calls ``Handlers.handle``. A handler never blocks,
never copies block data, and under ``replay`` never executes afresh: it answers from the
record (the table and what the client still has pending).
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvshm.errors import KvshmError, ProtocolError
from kvshm.index import protocol as P
from kvshm.index.api import Running
from kvshm.owner.clients import Client
from kvshm.owner.coalesce import Merged
from kvshm.owner.manager import LocalManager
from kvshm.shm import keys as K
from kvshm.shm import layout as L
from kvshm.shm.segment import Segment

Handler = Callable[[Client, Any, bool], "list[P.Reply]"]


class Handlers:
    """The request handlers of one owner (epoch ``manager.epoch``), by message type.
    ``clients``: the adopted clients (the owner's roster), to whom changes are fanned out."""

    def __init__(self, seg: Segment, manager: LocalManager, clients: dict[int, Client]) -> None:
        self.seg, self.manager, self.clients = seg, manager, clients
        self.epoch = manager.epoch
        self.want_events()
        self._by_type: dict[type, Handler] = {
            P.Hello: self._hello, P.PrepareStore: self._prepare_store,
            P.CompleteStore: self._complete_store, P.Touch: self._touch,
            P.Publish: self._publish, P.TakeEvents: self._take_events,
            Merged: self._publish_merged,
        }

    def handle(self, c: Client, msg: P.Request, replay: bool) -> list[P.Reply]:
        """Execute ``msg`` of client ``c`` (or answer it from the record, under ``replay``).
        Raises what the handler raises; the caller turns it into an ``Error`` reply."""
        return self._by_type[type(msg)](c, msg, replay)

    # ``replay``: a dead owner began this request. Answer from the record (the table and
    # the keys it still has pending for this client), never execute it a second time.
    def _hello(self, c: Client, m: P.Hello, replay: bool) -> list[P.Reply]:
        if (m.slot, m.gen) != (c.slot, c.gen):
            return [P.Error(m.req, self.epoch, "ProtocolError",
                            f"hello names slot {m.slot} gen {m.gen} but came on slot {c.slot} "
                            f"gen {c.gen}")]
        c.events = m.events
        self.want_events()
        return [P.Ok(m.req, self.epoch, self.epoch)]

    def want_events(self) -> None:
        """Record events only while a client takes them (its slot record says so from its
        activation, its hello again): building and fanning out an event per store and
        eviction that nobody takes was a tenth of a one-key Publish. (Called at each hello
        and adoption; a client that left keeps them recorded until then: harmless.)"""
        self.manager.outcomes.enabled = any(c.events for c in self.clients.values())

    def _prepare_store(self, c: Client, m: P.PrepareStore, replay: bool) -> list[P.Reply]:
        writer = (c.slot, c.gen, m.req)
        c.stores = c.grants
        if replay:  # what the dead owner granted, and nothing more: evictions are unknown
            done = self.manager.pending_of(writer, m.req)
            c.largest_store = max(c.largest_store, len(done))
            return self._prepared(m.req, [k for k, _ in done], [b for _, b in done], [], True)
        out = self.manager.prepare_store(m.keys, writer, running=P.running_of(m))
        # counted once it reached the index (a refused one too: it waited all the same); a
        # frame the manager rejects raises first, and a replay answered from the record above
        self.seg.counter_add("round_trip_stores")
        self.fan_out()
        if out is None:
            return [P.NoRoom(m.req, self.epoch)]
        # the blocks it took, not the keys it offered (most may be cached already), with
        # what it took from its grant ring for the same store (since the last refill)
        took = c.grant_head["taken"] - c.taken_seen
        took = took if 0 <= took <= L.GRANT_CAPACITY else 0  # (its own word: bounded)
        c.largest_store = max(c.largest_store, len(out.keys_to_store) + took)
        return self._prepared(m.req, out.keys_to_store, out.block_ids, out.evicted_keys, False)

    def _prepared(self, req: int, keys: list[bytes], blocks: list[int], evicted: list[bytes],
                  replayed: bool) -> list[P.Reply]:
        """A Prepared reply, in as many frames as it needs."""
        n = P.keys_per_part(self.seg.geometry.ring_capacity)
        parts: list[P.Reply] = []
        i = j = 0
        while True:
            k, e = keys[i:i + n], evicted[j:j + max(0, n - len(keys[i:i + n]))]
            i, j = i + len(k), j + len(e)
            more = i < len(keys) or j < len(evicted)
            parts.append(P.Prepared(req, self.epoch, k, blocks[i - len(k):i], e, more,
                                    len(parts), replayed))
            if not more:
                return parts

    def _complete_store(self, c: Client, m: P.CompleteStore, replay: bool) -> list[P.Reply]:
        writer = (c.slot, c.gen, m.req)
        if replay or m.of_req:  # apply only to what is still ours (of that request)
            mine = {k for k, _ in self.manager.pending_of(writer, m.of_req or None)}
            self.manager.complete_store([k for k in m.keys if k in mine], m.success, writer)
        else:
            self.manager.complete_store(m.keys, m.success, writer)
        self.fan_out()
        return [P.Ok(m.req, self.epoch)]

    def _publish(self, c: Client, m: P.Publish, replay: bool) -> list[P.Reply]:
        """One-way: applied in ring order, harmlessly again after a failover (blocks no
        longer granted to the client are ignored)."""
        if len(m.keys) != len(m.blocks):
            raise ProtocolError(f"publish of {len(m.keys)} keys with {len(m.blocks)} blocks")
        K.check_keys(m.keys)
        try:
            running = P.running_of(m)
        except KvshmError:
            running = None  # ranks are advice: a bad one never costs a store
            self.seg.counter_add("errors")
        return self._apply_publish(c, m, running)

    def _publish_merged(self, c: Client, m: Merged, replay: bool) -> list[P.Reply]:
        """Publish frames taken together (``coalesce.py``; each checked as ``_publish``
        checks one): one Publish, each frame's keys at its own request's ranks."""
        return self._apply_publish(c, m, None, m.runs)

    def _apply_publish(self, c: Client, m: P.Publish, running: Running | None,
                       frames: list[tuple[Running | None, int]] | None = None
                       ) -> list[P.Reply]:
        c.stores = c.grants
        self.manager.grants.publish(c.slot, c.gen, m.keys, m.blocks, m.success,
                                    int(c.grant_head["taken"]), running, m.returned, frames)
        self.fan_out()
        return []

    def _touch(self, c: Client, m: P.Touch, replay: bool) -> list[P.Reply]:
        self.manager.touch(m.keys, m.how, running=P.running_of(m), client=(c.slot, c.gen))
        self.seg.counter_add("touches")
        return [P.Ok(m.req, self.epoch)]

    def _take_events(self, c: Client, m: P.TakeEvents, replay: bool) -> list[P.Reply]:
        # As many events as fit one reply frame; the rest wait for the next call. (A replay
        # finds an empty log: the events died with the owner that recorded them.)
        room, n = c.max_reply // 2, len(c.events_log)
        for i, (_, keys) in enumerate(c.events_log):
            room -= sum(len(k) + 3 for k in keys) + 8
            if room < 0:
                n = i
                break
        if n == 0 and c.events_log:  # one event too large for a reply (Publish frames taken
            rm, keys = c.events_log[0]  # together make one): its keys go out in parts
            room, cut = c.max_reply // 2 - 8, 0
            while room >= len(keys[cut]) + 3:  # (a key is far smaller than half a reply)
                room -= len(keys[cut]) + 3
                cut += 1
            c.events_log[0] = (rm, keys[cut:])
            return [P.Events(m.req, self.epoch, [rm], [keys[:cut]])]
        log_, c.events_log = c.events_log[:n], c.events_log[n:]
        return [P.Events(m.req, self.epoch, [rm for rm, _ in log_], [k for _, k in log_])]

    def fan_out(self) -> None:
        """Every client that asked for events sees every change of the shared cache."""
        events = self.manager.take_events()
        if events:
            for c in self.clients.values():
                c.record_events(events)
