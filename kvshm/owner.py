"""The owner process: serves every client's request ring from one authoritative index.

This module owns the serving loop: it holds the segment's ``LocalManager`` (and with it the
kernel-released owner lock), answers the frames clients put on their request rings, learns
which clients are alive, and reclaims what dead ones held. One doorbell wakes it for all
clients. It must never crash on a bad frame (every failure becomes an ``Error`` reply) and
never copies block data.

Run ``python -m kvshm.owner NAME`` (what clients start on demand) or ``kvshm serve NAME``.
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

from . import layout as L
from . import locks
from . import protocol as P
from . import slots
from . import writers  # [writers]
from .errors import KvshmError, OwnerUnavailableError
from .fence import full_fence
from .manager import LocalManager
from .ring import Doorbell, Ring
from .segment import Segment, sem_name

log = logging.getLogger("kvshm.owner")

SCAN_INTERVAL_S = 0.2  # a dead client is reclaimed within about this long
SPIN_S = 0.005  # keep polling this long after the last frame before sleeping
MAX_EVENTS = 10_000  # per client; older events are dropped


class _Client:
    """What the owner knows of one attached client slot."""

    def __init__(self, seg: Segment, slot: int, gen: int, events: bool):
        self.slot, self.gen, self.events = slot, gen, events
        self.requests = Ring(slots.ring_view(seg, slot, "request"))
        self.replies = Ring(slots.ring_view(seg, slot, "reply"))
        self.bell = Doorbell(slots.bell_view(seg, slot, "reply"),
                             sem_name(seg.name, f"c{slot}-reply"))
        self.holds = slots.holds(seg, slot)
        self.max_reply = Ring.max_payload(seg.geometry.ring_capacity)
        self.events_log: list[tuple[bool, list[bytes]]] = []


class Owner:
    """Serve segment ``name`` until ``stop()`` or until the segment is unlinked."""

    def __init__(self, name: str, *, idle_exit_s: float | None = None):
        self.seg = Segment.attach(name)
        self.clients: dict[int, _Client] = {}
        # [writers] a rebuild keeps a dead client's stores while a registered copier lives
        self.manager = LocalManager(self.seg, enable_events=True, held=self._held,
                                    writer_alive=lambda s, g: self._writer_alive(s, g)
                                    or writers.alive(self.seg, s, g))
        g = self.seg.geometry
        self.bell = Doorbell(self.seg.buf[L.OFF_OWNER_BELL:L.OFF_OWNER_BELL + 8],
                             sem_name(name, "owner"))
        self.bell.drain()  # a predecessor that died asleep leaves stale posts behind
        self.idle_exit_s = idle_exit_s
        self._inode = os.fstat(self.seg.fd).st_ino
        self._running = True
        self._last_client = time.monotonic()
        self._handlers = {
            P.Hello: self._hello, P.Lookup: self._lookup, P.PrepareStore: self._prepare_store,
            P.CompleteStore: self._complete_store, P.Touch: self._touch,
            P.TakeEvents: self._take_events, P.Bye: self._bye,
        }
        self._newcomer = self.seg.buf[L.OFF_NEWCOMER:L.OFF_NEWCOMER + 8].cast("Q")
        # Clients attached before a failover keep working; slots of the dead are cleared.
        self._discover()
        for slot in range(g.max_clients):
            if slot not in self.clients and self._slot_state(slot)[0] == L.SLOT_ACTIVE:
                self._reclaim(slot, self._slot_state(slot)[2])
        log.info("owner of %s (epoch %d): %s", name, self.manager.epoch, self.manager.recovered)

    # --- liveness -----------------------------------------------------------------------
    def _slot_state(self, slot: int) -> tuple:
        return slots.record(self.seg, slot)

    def _slot_gen(self, slot: int) -> int:
        return self._slot_state(slot)[2]

    def _writer_alive(self, slot: int, gen: int) -> bool:
        return 0 <= slot < self.seg.geometry.max_clients and \
            locks.is_held(self.seg.fd, L.LOCK_CLIENT_BASE + slot) and self._slot_gen(slot) == gen

    def _held(self, requester: int) -> set[int]:
        """Blocks that attached clients hold (dead ones too, until reclaimed): all pins, and
        the leases of clients other than ``requester`` — a client's own lookups do not stop
        its own stores, exactly as in a private cache."""
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
        # [writers] free quarantined stores whose copiers are gone
        self.seg.counter_add("reclaimed_blocks",
                             self.manager.reclaim_dead_writers(self._writer_alive))
        for slot in range(self.seg.geometry.max_clients):  # job channels hold nothing of
            state, _, gen, _, _ = self._slot_state(slot)   # ours: a dead one just goes FREE
            if state == slots.CHANNEL:
                slots.clear_if_dead(self.seg, slot, gen)
        if not self.clients and self.idle_exit_s is not None and \
                time.monotonic() - self._last_client > self.idle_exit_s:
            self._running = False
        try:  # an unlinked (or replaced) segment has no future clients: stop serving it
            if os.stat(f"/dev/shm/kvshm-{self.seg.name}").st_ino != self._inode:
                self._running = False
        except FileNotFoundError:
            self._running = False

    def _retire_counters(self, slot: int) -> None:
        """Fold a leaving client's own counters into the segment's totals."""
        for name, value in zip(L.SLOT_COUNTERS, slots.counters(self.seg, slot).tolist()):
            self.seg.counter_add(f"gone_{name}", value)

    def _reclaim(self, slot: int, gen: int) -> None:
        if self.clients.pop(slot, None) is not None and self._slot_gen(slot) == gen:
            self._retire_counters(slot)
        self._last_client = time.monotonic()
        freed = self.manager.reclaim_writer(slot, gen)
        # Clients only claim FREE slots, so nobody reformats rings we might still be reading.
        slots.clear_if_dead(self.seg, slot, gen)
        self.seg.counter_add("reclaimed_clients")
        self.seg.counter_add("reclaimed_blocks", freed)
        log.info("reclaimed client slot %d gen %d: %d unfinished stores freed", slot, gen, freed)

    # --- serving ------------------------------------------------------------------------
    def _pending(self) -> bool:
        if self._newcomer[0]:
            return True
        for c in self.clients.values():
            if c.requests.pending():
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
                    try:
                        self.clients[slot] = _Client(self.seg, slot, gen, False)
                    except KvshmError as e:  # its rings are not rings: ignore that client
                        log.warning("client slot %d: unusable rings (%s)", slot, e)
                        self.seg.counter_add("errors")
                        continue
                    self._last_client = time.monotonic()

    def serve_once(self) -> int:
        """Answer every frame waiting now. Returns how many were handled."""
        n = 0
        if self._newcomer[0]:
            self._discover()
        for c in list(self.clients.values()):
            if self._slot_gen(c.slot) != c.gen:
                # The client left without a goodbye and a new one took its slot: our ring
                # objects are stale. Reclaim; the newcomer is discovered afresh.
                self._reclaim(c.slot, c.gen)
                continue
            while True:
                try:
                    frame = c.requests.try_get()
                except KvshmError as e:  # the client scribbled over its own ring
                    log.warning("client slot %d: request ring unreadable (%s); dropping "
                                "the client", c.slot, e)
                    self.seg.counter_add("errors")
                    self.clients.pop(c.slot, None)
                    break
                if frame is None:
                    break
                n += 1
                self._handle(c, frame)
        if n:
            self.seg.counter_add("frames", n)
        return n

    def _handle(self, c: _Client, frame: bytes) -> None:
        req = 0
        try:
            msg = P.request_decoder.decode(frame)
            req = msg.req
            reply = self._handlers[type(msg)](c, msg)
        except (msgspec.DecodeError, msgspec.ValidationError) as e:
            self.seg.counter_add("errors")
            reply = P.Error(req, "ProtocolError", f"undecodable request frame: {e}")
        except KvshmError as e:
            self.seg.counter_add("errors")
            reply = P.error_reply(req, e)
        except Exception as e:  # never let a bad request take the owner down
            log.exception("request failed")
            self.seg.counter_add("errors")
            reply = P.Error(req, "ProtocolError", f"owner could not apply request: {e!r}")
        if reply is None or not (req or isinstance(reply, P.Error)):
            return
        try:
            frame = P.reply_encoder.encode(reply)
            if len(frame) > c.max_reply:
                self.seg.counter_add("errors")
                frame = P.reply_encoder.encode(P.Error(
                    req, "FrameTooLargeError", f"the reply ({len(frame)} bytes) exceeds the "
                    "ring's frame size; send fewer keys per request"))
            c.replies.put(frame, timeout=5.0)
            c.bell.ring()
        except KvshmError as e:  # a client that stopped draining its replies: drop it
            self.seg.counter_add("errors")
            log.warning("client slot %d: reply dropped: %s", c.slot, e)

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
            c.bell.close()
        self.bell.close()
        self._newcomer.release()
        self.seg.close()

    # --- handlers -----------------------------------------------------------------------
    def _hello(self, c: _Client, m: P.Hello) -> P.Reply:
        if (m.slot, m.gen) != (c.slot, c.gen):
            return P.Error(m.req, "ProtocolError",
                           f"hello names slot {m.slot} gen {m.gen} but came on slot {c.slot} "
                           f"gen {c.gen}")
        c.events = m.events
        return P.Ok(m.req, self.manager.epoch)

    def _lookup(self, c: _Client, m: P.Lookup) -> P.Reply:
        self.seg.counter_add("lookups_owner")
        return P.Ok(m.req, self.manager.lookup(m.keys))

    def _prepare_store(self, c: _Client, m: P.PrepareStore) -> P.Reply:
        writer = (c.slot, c.gen, m.req)
        if m.replay:  # the dead owner may have placed some keys: answer with those too
            done = self.manager.pending_of(writer, m.req)
            if done:
                rest = [k for k in m.keys if self.manager.block_of(k) is None]
                out = self.manager.prepare_store(rest, writer) if rest else None
                keys, blocks = [k for k, _ in done], [b for _, b in done]
                if out is not None:
                    keys, blocks = keys + out.keys_to_store, blocks + out.block_ids
                self._fan_out()
                return P.Prepared(m.req, keys, blocks, out.evicted_keys if out else [])
        out = self.manager.prepare_store(m.keys, writer)
        self._fan_out()
        if out is None:
            return P.NoRoom(m.req)
        return P.Prepared(m.req, out.keys_to_store, out.block_ids, out.evicted_keys)

    def _complete_store(self, c: _Client, m: P.CompleteStore) -> P.Reply:
        self.manager.complete_store(m.keys, m.success, (c.slot, c.gen, m.req))
        self._fan_out()
        return P.Ok(m.req)

    def _touch(self, c: _Client, m: P.Touch) -> P.Reply:
        self.manager.touch(m.keys)
        self.seg.counter_add("touches")
        return P.Ok(m.req)

    def _take_events(self, c: _Client, m: P.TakeEvents) -> P.Reply:
        # As many events as fit one reply frame; the rest wait for the next call.
        room, n = c.max_reply // 2, 0
        for n, (_, keys) in enumerate(c.events_log):
            room -= sum(len(k) + 3 for k in keys) + 8
            if room < 0:
                break
        else:
            n = len(c.events_log)
        log, c.events_log = c.events_log[:n], c.events_log[n:]
        return P.Events(m.req, [rm for rm, _ in log], [k for _, k in log])

    def _bye(self, c: _Client, m: P.Bye) -> P.Reply | None:
        self.manager.reclaim_writer(c.slot, c.gen)
        self._retire_counters(c.slot)
        self.clients.pop(c.slot, None)
        self._last_client = time.monotonic()
        return P.Ok(m.req) if m.req else None

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
        prog="python -m kvshm.owner",
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
