"""The owner process: serves every client's request ring from one authoritative index.

This module owns the serving loop: it holds the segment's ``LocalManager`` (and with it the
kernel-released owner lock), answers the frames clients put on their request rings, learns
which clients are alive, and reclaims what dead ones held. One doorbell wakes it for all
clients. It must never crash on a bad frame (every failure becomes an ``Error`` reply) and
never copies block data.

Run ``python -m kvshm.index.owner NAME`` (what clients start on demand) or ``kvshm serve NAME``.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time

import msgspec
import numpy as np

from kvshm.shm import layout as L
from kvshm.shm import locks
from kvshm.index import protocol as P
from kvshm.shm import slots
from kvshm.shm import writers
from kvshm.errors import KvshmError, OwnerUnavailableError
from kvshm.crashpoints import crash_point
from kvshm.shm.fence import full_fence
from kvshm.index.manager import LocalManager
from kvshm.shm.ring import Doorbell, Ring
from kvshm.shm.segment import Segment, sem_name

log = logging.getLogger("kvshm.index.owner")

SCAN_INTERVAL_S = 0.2  # a dead client is reclaimed within about this long
SPIN_S = 0.005  # keep polling this long after the last frame before sleeping
MAX_EVENTS = 10_000  # per client; older events are dropped
FRAMES_PER_PASS = 64  # per client and pass: one busy client cannot starve the others
MAX_ATTEMPTS = 3  # owners that may die executing one request before it is dropped


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
        self.bell = Doorbell(slots.bell_view(seg, slot, "reply"),
                             sem_name(seg.name, f"c{slot}-reply"), like_fd=seg.fd)
        self.served = slots.served(seg, slot)  # epoch, consumed, answered, attempts
        self.max_reply = Ring.max_payload(seg.geometry.ring_capacity)
        self.events_log: list[tuple[bool, list[bytes]]] = []
        # Reply frames of request `unsent_req` that did not fit the reply ring yet. While any
        # wait, the request stays at the head of the request ring and nothing else is read.
        self.unsent: list[bytes] = []
        self.unsent_req = 0
        # Keys of a request arriving in several frames (`parts_req`), until its last part.
        self.parts: list[bytes] = []
        self.parts_req = self.parts_next = 0
        self.parts_lost = False  # its first parts went with a dead owner: answer Retry
        self.parts_over = False  # it sent more keys than one request may hold

    def close(self) -> None:
        self.bell.close()
        for r in (self.requests, self.replies):
            if r is not None:
                r.close()


class Owner:
    """Serve segment ``name`` until ``stop()`` or until the segment is unlinked."""

    def __init__(self, name: str, *, idle_exit_s: float | None = None):
        self.seg = Segment.attach(name)
        self.clients: dict[int, _Client] = {}
        # A rebuild keeps a dead client's stores while a registered copier lives
        self.manager = LocalManager(self.seg, enable_events=True, held=self._held,
                                    writer_alive=lambda s, g: self._writer_alive(s, g)
                                    or writers.alive(self.seg, s, g))
        self.epoch = self.manager.epoch
        self._max_keys = 4 * self.seg.geometry.num_blocks + 65536  # per request
        g = self.seg.geometry
        self.bell = Doorbell(self.seg.buf[L.OFF_OWNER_BELL:L.OFF_OWNER_BELL + 8],
                             sem_name(name, "owner"), like_fd=self.seg.fd)
        self.bell.drain()  # a predecessor that died asleep leaves stale posts behind
        self.idle_exit_s = idle_exit_s
        self._inode = os.fstat(self.seg.fd).st_ino
        self._running = True
        self._last_client = time.monotonic()
        self._handlers = {
            P.Hello: self._hello, P.Lookup: self._lookup, P.PrepareStore: self._prepare_store,
            P.CompleteStore: self._complete_store, P.Touch: self._touch,
            P.TakeEvents: self._take_events,
        }
        self._newcomer = self.seg.buf[L.OFF_NEWCOMER:L.OFF_NEWCOMER + 8].cast("Q")
        # Clients attached before a failover keep working; slots of the dead are cleared.
        self._discover()
        self._reclaim_unadopted()
        log.info("owner of %s (epoch %d): %s", name, self.epoch, self.manager.recovered)

    # --- liveness -----------------------------------------------------------------------
    def _slot_state(self, slot: int) -> tuple:
        return slots.record(self.seg, slot)

    def _slot_gen(self, slot: int) -> int:
        return self._slot_state(slot)[2]

    def _writer_alive(self, slot: int, gen: int) -> bool:
        return 0 <= slot < self.seg.geometry.max_clients and \
            locks.is_held(self.seg.fd, L.LOCK_CLIENT_BASE + slot) and self._slot_gen(slot) == gen

    def _held(self, requester: int) -> set[int]:
        """Blocks that adopted clients hold (dead and quarantined ones too, until reclaimed):
        all pins, and the leases of clients other than ``requester`` — a client's own lookups
        do not stop its own stores, exactly as in a private cache."""
        parts = []
        for c in self.clients.values():
            h = c.holds
            if c.slot == requester:
                parts.append(h[h >= 0])
            else:
                h = h[h != -1]
                parts.append(np.where(h >= 0, h, -2 - h))
        if not parts:
            return set()
        return set(np.concatenate(parts).tolist())

    def _scan(self) -> None:
        for slot, c in list(self.clients.items()):
            if not self._writer_alive(slot, c.gen):
                self._reclaim(slot, c.gen)
        # Free quarantined stores whose copiers are gone.
        self.seg.counter_add("reclaimed_blocks",
                             self.manager.reclaim_dead_writers(self._writer_alive))
        self._reclaim_unadopted()
        if not self.clients and self.idle_exit_s is not None and \
                time.monotonic() - self._last_client > self.idle_exit_s:
            self._running = False
        try:  # an unlinked (or replaced) segment has no future clients: stop serving it
            if os.stat(f"/dev/shm/kvshm-{self.seg.name}").st_ino != self._inode:
                self._running = False
        except FileNotFoundError:
            self._running = False

    def _reclaim_unadopted(self) -> None:
        """Dead slots we never adopted (a client killed before its hello was served, a job
        channel whose scheduler died) go back to FREE: nobody else clears them while we live."""
        for slot in range(self.seg.geometry.max_clients):
            if slot in self.clients:
                continue
            state, _, gen, _, _ = self._slot_state(slot)
            if state == slots.CLIENT and not self._writer_alive(slot, gen):
                self._reclaim(slot, gen)
            elif state == slots.CHANNEL:  # holds nothing of ours: it just goes FREE
                slots.clear_if_dead(self.seg, slot, gen)

    def _retire_counters(self, slot: int) -> None:
        """Fold a leaving client's own counters into the segment's totals."""
        ctr = slots.counters(self.seg, slot)
        for name, value in zip(L.SLOT_COUNTERS, ctr.tolist()):
            self.seg.counter_add(f"gone_{name}", value)
        ctr[:] = 0  # folded once, whoever retires it again

    def _drop_client(self, slot: int) -> None:
        c = self.clients.pop(slot, None)
        if c is not None:
            c.close()

    def _reclaim(self, slot: int, gen: int) -> None:
        """Release everything a dead client held, then free its slot (after we stopped
        reading its rings, so nobody can re-format them under us)."""
        if self._slot_gen(slot) == gen:
            self._retire_counters(slot)
        self._drop_client(slot)
        self._last_client = time.monotonic()
        freed = self.manager.reclaim_writer(slot, gen)
        crash_point("owner.reclaim.mid")
        slots.clear_if_dead(self.seg, slot, gen)
        self.seg.counter_add("reclaimed_clients")
        self.seg.counter_add("reclaimed_blocks", freed)
        log.info("reclaimed client slot %d gen %d: %d unfinished stores freed", slot, gen, freed)

    def _quarantine(self, c: _Client, why: str) -> None:
        """Stop reading a client we cannot parse. Its holds still count while it lives."""
        c.quarantined = True
        c.unsent = []
        self.seg.counter_add("errors")
        log.warning("client slot %d gen %d quarantined: %s", c.slot, c.gen, why)

    # --- serving ------------------------------------------------------------------------
    def _pending(self) -> bool:
        if self._newcomer[0]:
            return True
        for c in self.clients.values():
            if not (c.quarantined or c.unsent) and c.requests.pending():
                return True
        return False

    def _discover(self) -> None:
        """Adopt slots activated since we last looked (their hello waits on their ring)."""
        self._newcomer[0] = 0
        full_fence()  # clear the flag before reading states, or a newcomer could be missed
        g = self.seg.geometry
        for slot in range(g.max_clients):
            if slot not in self.clients:
                state, _, gen, _, _ = self._slot_state(slot)
                if state == L.SLOT_ACTIVE and self._writer_alive(slot, gen):
                    c = self.clients[slot] = _Client(self.seg, slot, gen, False)
                    if c.quarantined:
                        self._quarantine(c, c.why)
                    self._last_client = time.monotonic()

    def serve_once(self) -> int:
        """Answer what waits now, at most ``FRAMES_PER_PASS`` frames per client (so one
        chatty client cannot starve the others). Returns how many frames were handled."""
        n = 0
        if self._newcomer[0]:
            self._discover()
        for c in list(self.clients.values()):
            if c.quarantined or (c.unsent and not self._flush(c)):
                continue
            for _ in range(FRAMES_PER_PASS):
                try:
                    view = c.requests.peek()
                    if view is None:
                        break
                    frame = view.tobytes()
                    view.release()
                except KvshmError as e:  # the client scribbled over its own ring
                    self._quarantine(c, f"request ring unreadable ({e})")
                    break
                n += 1
                self._serve_frame(c, frame)
                if self.clients.get(c.slot) is not c or c.quarantined or c.unsent:
                    break  # gone (goodbye), unusable, or its reply waits for room
        if n:
            self.seg.counter_add("frames", n)
        return n

    def _serve_frame(self, c: _Client, frame: bytes) -> None:
        """One frame, exactly once: record it consumed, execute, reply, record it answered,
        and only then release it from the request ring (see ``owner_link.py``)."""
        try:
            msg = P.request_decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.seg.counter_add("errors")
            c.requests.advance()
            self._reply(c, 0, [P.Error(0, self.epoch, "ProtocolError",
                                       f"undecodable request frame: {e}")])
            return
        req = msg.req
        served = c.served
        if req and req <= served[2]:  # answered already (by a dead owner): drop the copy
            c.requests.advance()
            return
        if not req and not isinstance(msg, P.Touch):  # only hints may go unanswered
            self.seg.counter_add("errors")
            c.requests.advance()
            self._reply(c, 0, [P.Error(0, self.epoch, "ProtocolError",
                                       f"{type(msg).__name__} needs a request id")])
            return
        replay = bool(req) and req == served[1]
        if isinstance(msg, P.PrepareStore) and (msg.more or msg.part):
            keys = self._gather(c, msg)
            if keys is None:
                c.requests.advance()
                return  # more parts to come; nothing executed yet
            if c.parts_over:
                c.parts_over = False
                self._answer(c, req, [P.Error(req, self.epoch, "InvalidArgumentError",
                                              f"a prepare_store of more than {self._max_keys} "
                                              "keys; store fewer keys per call")])
                return
            if not replay and c.parts_lost:  # its first parts died with an owner that
                c.parts_lost = False         # never executed it: provably safe to resend
                self._answer(c, req, [P.Retry(req, self.epoch)])
                return
            msg = msgspec.structs.replace(msg, keys=keys)
        if req:
            attempts = int(served[3]) + 1 if replay else 1
            if attempts > MAX_ATTEMPTS:  # it killed every owner that began it: drop it,
                writer = (c.slot, c.gen, req)  # and whatever those owners granted for it
                granted = [k for k, _ in self.manager.pending_of(writer, req)]
                if granted:
                    self.manager.complete_store(granted, False, writer)
                self._answer(c, req, [P.Error(req, self.epoch, "ProtocolError",
                                              f"request {req} was in progress when "
                                              f"{MAX_ATTEMPTS} owners died; it was dropped")])
                return
            served[0], served[3] = self.epoch, attempts
            served[1] = req  # consumed: from here on a successor replays instead of executing
            crash_point("owner.request.after_consume")
        if isinstance(msg, P.Bye):
            self._goodbye(c, msg)
            return
        replies = self._execute(c, msg, replay)
        crash_point("owner.request.after_execute")
        if req:
            self._answer(c, req, replies)
        else:
            c.requests.advance()

    def _gather(self, c: _Client, msg: P.PrepareStore) -> list[bytes] | None:
        """Collect the parts of a request sent in several frames: its keys once the last
        part is in, else None. ``c.parts_lost`` says whether a part never reached us."""
        if c.parts_req != msg.req:
            c.parts, c.parts_req, c.parts_lost = [], msg.req, msg.part != 0
            c.parts_over = False
        elif c.parts_next != msg.part:
            c.parts_lost = True
        if len(c.parts) + len(msg.keys) > self._max_keys:
            c.parts_over = True  # a client that never ends a request must not fill our memory
        else:
            c.parts.extend(msg.keys)
        c.parts_next = msg.part + 1
        if msg.more:
            return None
        keys, c.parts, c.parts_req = c.parts, [], 0
        return keys

    def _execute(self, c: _Client, msg: P._Msg, replay: bool) -> list[P._Msg]:
        req = msg.req
        try:
            return self._handlers[type(msg)](c, msg, replay)
        except KvshmError as e:
            self.seg.counter_add("errors")
            return [P.error_reply(req, self.epoch, e)]
        except Exception as e:  # never let a bad request take the owner down
            log.exception("request failed")
            self.seg.counter_add("errors")
            return [P.Error(req, self.epoch, "ProtocolError",
                            f"owner could not apply request: {e!r}")]

    def _answer(self, c: _Client, req: int, replies: list[P._Msg]) -> None:
        c.unsent_req = req
        self._reply(c, req, replies)

    def _reply(self, c: _Client, req: int, replies: list[P._Msg]) -> None:
        frames = []
        for r in replies:
            frame = P.reply_encoder.encode(r)
            if len(frame) > c.max_reply:
                self.seg.counter_add("errors")
                frame = P.reply_encoder.encode(P.Error(
                    req, self.epoch, "FrameTooLargeError", f"a reply part ({len(frame)} "
                    "bytes) exceeds the ring's frame size; send fewer keys per request"))
            frames.append(frame)
        c.unsent = frames
        self._flush(c)

    def _flush(self, c: _Client) -> bool:
        """Put what waits for ``c``'s reply ring; never blocks. True once all is out, the
        request is recorded answered and released from the request ring."""
        try:
            while c.unsent:
                if not c.replies.try_put(c.unsent[0]):
                    c.bell.ring()
                    return False  # it does not drain its replies: try again next pass
                c.unsent.pop(0)
        except KvshmError as e:
            self._quarantine(c, f"reply ring unusable ({e})")
            return False
        c.bell.ring()
        if c.unsent_req:
            crash_point("owner.request.after_reply")
            c.served[2] = c.unsent_req  # answered
            c.requests.advance()
            c.unsent_req = 0
        return True

    def run(self) -> None:
        next_scan = 0.0
        last_work = time.monotonic()
        while self._running:
            if self.serve_once():
                last_work = time.monotonic()
                continue
            now = time.monotonic()
            if now >= next_scan:
                self._discover()
                self._scan()
                next_scan = now + SCAN_INTERVAL_S
            spin = SPIN_S if now - last_work < SPIN_S else 0.0
            self.bell.wait(min(SCAN_INTERVAL_S, max(0.0, next_scan - now)), self._pending,
                           spin_s=spin)

    def stop(self) -> None:
        self._running = False

    def close(self) -> None:
        self.manager.shutdown()
        for c in self.clients.values():
            c.close()
        self.bell.close()
        self._newcomer.release()
        self.seg.close()

    # --- handlers: (client, message, replay) -> reply parts -----------------------------
    # ``replay``: a dead owner began this request. Answer from the record (the table and
    # the keys it still has pending for this client), never execute it a second time.
    def _hello(self, c: _Client, m: P.Hello, replay: bool) -> list[P._Msg]:
        if (m.slot, m.gen) != (c.slot, c.gen):
            return [P.Error(m.req, self.epoch, "ProtocolError",
                            f"hello names slot {m.slot} gen {m.gen} but came on slot {c.slot} "
                            f"gen {c.gen}")]
        c.events = m.events
        return [P.Ok(m.req, self.epoch, self.epoch)]

    def _lookup(self, c: _Client, m: P.Lookup, replay: bool) -> list[P._Msg]:
        self.seg.counter_add("lookups_owner")
        return [P.Ok(m.req, self.epoch, self.manager.lookup(m.keys))]

    def _prepare_store(self, c: _Client, m: P.PrepareStore, replay: bool) -> list[P._Msg]:
        writer = (c.slot, c.gen, m.req)
        if replay:  # what the dead owner granted, and nothing more: evictions are unknown
            done = self.manager.pending_of(writer, m.req)
            return self._prepared(m.req, [k for k, _ in done], [b for _, b in done], [], True)
        out = self.manager.prepare_store(m.keys, writer)
        self._fan_out()
        if out is None:
            return [P.NoRoom(m.req, self.epoch)]
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

    def _touch(self, c: _Client, m: P.Touch, replay: bool) -> list[P._Msg]:
        self.manager.touch(m.keys)
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
        may claim it, so the reply cannot land in a newcomer's freshly formatted ring."""
        self.manager.reclaim_writer(c.slot, c.gen)
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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m kvshm.index.owner",
        description="Serve a kvshm segment's index (clients start this on demand).")
    ap.add_argument("name", help="segment name (as given to kvshm.connect)")
    ap.add_argument("--idle-exit", type=float, default=None, metavar="S",
                    help="exit after S seconds without any attached client")
    ap.add_argument("--log-level", default="WARNING")
    args = ap.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s kvshm-owner[%(process)d] %(message)s")
    try:
        owner = Owner(args.name, idle_exit_s=args.idle_exit)
    except OwnerUnavailableError as e:  # someone else won the race: that is success
        log.info("%s", e)
        return 0
    except KvshmError as e:
        print(f"kvshm owner: error: {e}", file=sys.stderr)
        return 2
    signal.signal(signal.SIGTERM, lambda *_: owner.stop())
    signal.signal(signal.SIGINT, lambda *_: owner.stop())
    try:
        owner.run()
    finally:
        owner.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
