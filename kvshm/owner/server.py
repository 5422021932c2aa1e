"""The owner process: serves every client's request ring from one authoritative index.

This module owns the serving loop: it holds the segment's ``LocalManager`` (and with it the
kernel-released owner lock) and answers the frames clients put on their request rings,
exactly once (the served record, told in ``client/owner_link.py``), goodbyes included; the
clients themselves, alive or dead, are the ``Roster``'s, what each request does is
``requests.py``'s. One doorbell wakes it for all clients. It must never crash on a bad frame
(every failure becomes an ``Error`` reply) nor on a client's scribbled words (a failure
serving one client quarantines that client), and never copies block data.

It runs as ``python -m kvshm.owner NAME`` (what clients start on demand) or ``kvshm serve
NAME``: ``command.py``.
"""
from __future__ import annotations

import logging
import time

import msgspec

from kvshm.crashpoints import crash_point
from kvshm.errors import KvshmError, RequestDroppedError
from kvshm.index import protocol as P
from kvshm.owner import coalesce
from kvshm.owner.clients import Client
from kvshm.owner.grants import ALL_HOLDS
from kvshm.owner.manager import LocalManager
from kvshm.owner.requests import Handlers
from kvshm.owner.roster import Roster
from kvshm.owner.spin import SpinPolicy
from kvshm.owner.stocking import grant_budget, grant_target, stock_all
from kvshm.shm import layout as L
from kvshm.shm import slots
from kvshm.shm.fence import full_fence
from kvshm.shm.ring import Doorbell
from kvshm.shm.segment import Segment

log = logging.getLogger("kvshm.owner")

SCAN_INTERVAL_S = 0.2  # a dead client is reclaimed within about this long
FRAMES_PER_PASS = 64  # per client and pass: one busy client cannot starve the others
MAX_ATTEMPTS = 3  # owners that may die executing one request before it is dropped


class Owner:
    """Serve segment ``name`` until ``stop()`` or until the segment is unlinked."""

    def __init__(self, name: str, *, idle_exit_s: float | None = None):
        self.seg = Segment.attach(name)
        self.roster = Roster(self.seg)
        try:  # (a segment removed meanwhile) its descriptor holds the owner lock: close it
            self.manager = LocalManager(self.seg, enable_events=True, held=self.roster.held,
                                        writer_alive=self.roster.writer_alive)
            self.bell = Doorbell(self.seg.buf[L.OFF_OWNER_BELL:L.OFF_OWNER_BELL + 8])
        except BaseException:
            self.seg.close()
            raise
        self.epoch = self.manager.epoch
        self.handlers = Handlers(self.seg, self.manager, self.roster.clients)
        self._max_keys = 4 * self.seg.geometry.num_blocks + 65536  # per request
        self.bell.reset()  # a predecessor that died asleep left its flag raised
        self.idle_exit_s = idle_exit_s
        self._running = True
        self._grant_target = grant_target(self.seg.geometry)
        self._grant_budget = grant_budget(self.seg.geometry)
        self._newcomer = self.seg.buf[L.OFF_NEWCOMER:L.OFF_NEWCOMER + 8].cast("Q")
        self._adopt = False  # a raised newcomer flag brought a slot to adopt
        # Clients attached before a failover keep working; slots of the dead are cleared.
        self._discover()
        self.roster.reclaim_unadopted(self.manager)
        self.manager.entries.park_held(self.roster.held(ALL_HOLDS))  # loads under way
        log.info("owner of %s (epoch %d): %s", name, self.epoch, self.manager.recovered)

    def _discover(self) -> None:
        self._adopt = False
        self.roster.discover(self.manager, self._newcomer)
        self.handlers.want_events()  # an adopted client may take them
        if self.roster.removed:  # no client has a future here
            self._running = False

    def _scan(self) -> None:
        self.roster.scan(self.manager)
        entries = self.manager.entries
        if entries.parked:  # freed while a client held them: reused once nobody does
            entries.unpark(self.roster.held(ALL_HOLDS))
        if not self.roster.clients and self.idle_exit_s is not None and \
                time.monotonic() - self.roster.last_client > self.idle_exit_s:
            log.info("no client for %gs: exiting", self.idle_exit_s)
            self._running = False
        if self.seg.removed():  # (perhaps replaced) no future clients: stop serving it
            self._running = False

    # --- serving ------------------------------------------------------------------------
    def _pending(self) -> bool:
        """Whether a frame or a newcomer waits (the doorbell's ``ready``). What clients
        write must not keep it true for nothing: each ring is asked with our own position,
        and a raised newcomer flag is cleared and counts only with a slot to adopt."""
        if self._newcomer_waits():
            return True
        for c in self.roster.clients.values():
            if not (c.quarantined or c.unsent) and c.requests is not None and \
                    c.requests.waiting():
                return True
        return False

    def _newcomer_waits(self) -> bool:
        if self._newcomer[0]:
            self._newcomer[0] = 0
            full_fence()  # cleared before we look: a newcomer from now on raises it again
            self._adopt = self._adopt or self.roster.newcomer_waits()
        return self._adopt

    def serve_once(self) -> int:
        """Answer what waits now, at most ``FRAMES_PER_PASS`` frames per client (so one
        chatty client cannot starve the others). Returns how many frames were handled."""
        n = t0 = 0
        if self._newcomer_waits():
            self._discover()
        clients = self.roster.clients
        for c in list(clients.values()):
            if c.quarantined or (c.unsent and not self._flush(c)):
                continue
            requests = c.requests
            assert requests is not None  # a client whose rings did not open is quarantined
            left = FRAMES_PER_PASS  # (frames taken together count one each)
            while left > 0:
                try:
                    view = requests.peek()
                    if view is None:
                        break
                    frame = view.tobytes()
                    view.release()
                except KvshmError as e:  # the client scribbled over its own ring
                    self.roster.quarantine(c, f"request ring unreadable ({e})")
                    break
                if not n:  # the CPU clock is a system call: read it only for a busy pass
                    t0 = time.thread_time_ns()
                try:
                    done = self._serve_frame(c, frame, left)
                except Exception as e:  # its words, not the owner, are at fault: never die
                    n += 1
                    log.exception("serving client slot %d failed", c.slot)
                    self.roster.quarantine(c, f"serving it failed ({e!r})")
                    break
                n, left = n + done, left - done
                if clients.get(c.slot) is not c or c.quarantined or c.unsent:
                    break  # gone (goodbye), unusable, or its reply waits for room
        if n:
            self._refill()
            self.seg.counter_add("frames", n)  # and the CPU time they took, refills included
            self.seg.counter_add("owner_busy_ns", time.thread_time_ns() - t0)
        return n

    def _refill(self) -> None:
        """Keep every storing client's grant ring stocked (evicting if need be), so that
        its next stores need no round trip: at twice its largest store, all clients' grants
        together within the budget."""
        if not self._grant_target:
            self._count_shares()
            return
        stocked = [c for c in self.roster.clients.values() if c.stores and not c.quarantined]
        for c, why in stock_all(self.manager.grants, stocked, self._grant_target,
                                self._grant_budget):
            self.roster.quarantine(c, why)
        self.handlers.fan_out()
        self._count_shares()

    def _count_shares(self) -> None:
        """Show each client with a quota what it has cached (kvshm-inspect reads it)."""
        quotas = self.manager.quotas
        for c in self.roster.clients.values():
            if (c.slot, c.gen) in quotas.limits:
                c.share["cached"] = quotas.used((c.slot, c.gen))

    def _serve_frame(self, c: Client, frame: bytes, room: int = 1) -> int:
        """One frame, exactly once: record it consumed, execute, reply, record it answered,
        and only then release it from the request ring (see ``owner_link.py``). A Publish
        takes up to ``room`` - 1 queued behind it along (``coalesce``). Returns the frames
        served."""
        requests = c.requests
        assert requests is not None  # a client whose rings did not open is quarantined
        try:
            msg = P.request_decoder.decode(frame)
        except Exception as e:
            # (DecodeError, ValidationError, a UnicodeDecodeError for a name that is not
            # UTF-8, ...) is the frame's fault, and must never take the owner down.
            self.seg.counter_add("errors")
            requests.advance()
            self._reply(c, 0, [P.Error(0, self.epoch, "ProtocolError",
                                       f"undecodable request frame: {e}")])
            return 1
        req = msg.req
        served = c.served
        if req and req <= served["answered"]:  # answered (by a dead owner): drop the copy
            requests.advance()
            return 1
        if not req and not isinstance(msg, (P.Touch, P.Publish)):  # one-way kinds only
            self.seg.counter_add("errors")
            requests.advance()
            self._reply(c, 0, [P.Error(0, self.epoch, "ProtocolError",
                                       f"{type(msg).__name__} needs a request id")])
            return 1
        replay = bool(req) and req == served["consumed"]
        if isinstance(msg, P.PrepareStore) and (msg.more or msg.part):
            keys, positions = c.gather(msg, self._max_keys)
            if keys is None:
                requests.advance()
                return 1  # more parts to come; nothing executed yet
            if c.parts_refused:
                self.seg.counter_add("errors")
                self._answer(c, req, [P.Error(req, self.epoch, "InvalidArgumentError",
                                              c.parts_refused)])
                c.parts_refused = ""
                return 1
            if not replay and c.parts_lost:  # its first parts died with an owner that
                c.parts_lost = False         # never executed it: provably safe to resend
                self._answer(c, req, [P.Retry(req, self.epoch)])
                return 1
            msg = msgspec.structs.replace(msg, keys=keys, positions=positions)
        if req:
            attempts = int(served["attempts"]) + 1 if replay else 1
            if attempts > MAX_ATTEMPTS:  # it killed every owner that began it: drop it.
                # What those owners granted stays pending for the client: a reply may have
                # reached it, so it may be copying; its goodbye or its death frees them.
                self._answer(c, req, [P.error_reply(req, self.epoch, RequestDroppedError(
                    f"request {req} was in progress when {MAX_ATTEMPTS} owners died; it was "
                    "dropped, not executed (retry it; if it fails so again, it kills owners: "
                    "report it)"))])
                return 1
            served["epoch"], served["attempts"] = self.epoch, attempts
            served["consumed"] = req  # from here on a successor replays instead of executing
            crash_point("owner.request.after_consume")
        elif not self._begin_one_way(c, msg):
            return 1
        elif served["attempts"] > 1:  # a dead owner began it: from now on one at a time, so
            c.merge = False           # that a frame killing owners is dropped alone
        frames = 1
        if c.merge and coalesce.plain(msg):
            msg, frames = coalesce.merge(requests, msg, room)  # (released by one advance)
        if isinstance(msg, P.Bye):
            self._goodbye(c, msg)
            return 1
        replies = self._execute(c, msg, replay)
        if frames > 1:
            if msg.success:  # each frame is a completed store, as one by one
                self.seg.counter_add("stores", frames - 1)
            crash_point("owner.publish.merged")
        crash_point("owner.request.after_execute")
        if req:
            self._answer(c, req, replies)
        else:
            requests.advance()
        return frames

    def _begin_one_way(self, c: Client, msg: P.Request) -> bool:
        """Record that an owner begins the one-way frame at the head of ``c``'s request ring
        (known by its position: it has no id), or drop it (False) if it killed the last
        ``MAX_ATTEMPTS`` owners that began it: no reply can fail it, so without this count
        every successor would begin it again and die. A dropped Publish's blocks stay the
        client's until it goes, counted as ``stranded``: a frame that killed owners is no
        list of finished blocks to trust, and freeing a block it still writes would serve
        wrong bytes."""
        requests = c.requests
        assert requests is not None  # a client whose rings did not open is quarantined
        served, pos = c.served, requests.position() + 1
        attempts = int(served["attempts"]) + 1 if served["one_way"] == pos else 1
        if attempts > MAX_ATTEMPTS:
            self.seg.counter_add("errors")
            n = len(msg.blocks) if isinstance(msg, P.Publish) else 0
            served["stranded"] = min(int(served["stranded"]) + n, 2**63)
            log.error("client slot %d: a one-way frame was in progress when %d owners died; "
                      "it was dropped (the %d blocks it published stay the client's until it "
                      "goes)", c.slot, MAX_ATTEMPTS, n)
            requests.advance()
            return False
        served["epoch"], served["attempts"], served["one_way"] = self.epoch, attempts, pos
        crash_point("owner.one_way.after_begin")
        return True

    def _execute(self, c: Client, msg: P.Request, replay: bool) -> list[P.Reply]:
        req = msg.req
        try:
            return self.handlers.handle(c, msg, replay)
        except KvshmError as e:
            self.seg.counter_add("errors")
            return [P.error_reply(req, self.epoch, e)]
        except Exception as e:  # never let a bad request take the owner down
            log.exception("request failed")
            self.seg.counter_add("errors")
            return [P.Error(req, self.epoch, "ProtocolError",
                            f"owner could not apply request: {e!r}")]

    def _answer(self, c: Client, req: int, replies: list[P.Reply]) -> None:
        c.unsent_req = req
        self._reply(c, req, replies)

    def _reply(self, c: Client, req: int, replies: list[P.Reply]) -> None:
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

    def _flush(self, c: Client) -> bool:
        """Put what waits for ``c``'s reply ring; never blocks. True once all is out, the
        request is recorded answered and released from the request ring."""
        requests, replies, bell = c.requests, c.replies, c.bell
        # A client whose rings did not open is quarantined: nothing is ever sent to it.
        assert requests is not None and replies is not None
        try:
            while c.unsent:
                if not replies.try_put(c.unsent[0]):
                    bell.ring()
                    return False  # it does not drain its replies: try again next pass
                c.unsent.pop(0)
        except Exception as e:  # KvshmError for a scribbled ring; never die of one
            self.roster.quarantine(c, f"reply ring unusable ({e!r})")
            return False
        bell.ring()
        if c.unsent_req:
            crash_point("owner.request.after_reply")
            c.served["answered"] = c.unsent_req
            requests.advance()
            c.unsent_req = 0
        return True

    def _goodbye(self, c: Client, m: P.Bye) -> None:
        """Free the client's unfinished stores, answer, free its slot and forget it — in
        that order. Recorded like any request, so a successor finishes a goodbye its
        predecessor died in. The slot is let go of last: while we hold its served lock
        nobody may claim it, so neither the reply nor the clearing can land in a
        newcomer's freshly activated slot, whatever the client wrote in its state. It
        is marked LEAVING first: a copy worker that registers from then on sees the client's
        generation dead and copies nothing, so the registry read by ``reclaim_writer``
        cannot miss a worker about to copy (the same order as for a death)."""
        slots.leave(self.seg, c.slot)
        self.manager.reclaim_writer(c.slot, c.gen)
        crash_point("owner.goodbye.mid")
        self.roster.retire_counters(c.slot)
        self._answer(c, m.req, [P.Ok(m.req, self.epoch)])  # if it does not fit, the client
        slots.clear(self.seg, c.slot, c.gen)               # times out and goes all the same
        self.roster.drop(c.slot)  # only now may a newcomer claim it (its served lock)

    def run(self) -> None:
        next_scan = 0.0
        spin = SpinPolicy()  # busy-polls only while recent gaps between frames were short
        idle_since: float | None = None
        woke = False  # the last wait ended because something seemed to wait
        while self._running:
            adopted = len(self.roster.clients)
            if self.serve_once():
                woke = False
                if idle_since is not None:
                    spin.observe(time.monotonic() - idle_since)
                    idle_since = None
                if time.monotonic() >= next_scan:  # busy all along: the dead still go, and
                    next_scan = self._housekeep()  # parked blocks come back (the pass refilled)
                continue
            if woke and len(self.roster.clients) <= adopted:
                self.seg.counter_add("idle_wakeups")  # woken for nothing
            now = time.monotonic()
            if idle_since is None:
                idle_since = now
            if now >= next_scan:
                next_scan = self._housekeep()
                self._refill()  # (a quiet owner stocks the grant rings here)
            woke = self.bell.wait(min(SCAN_INTERVAL_S, max(0.0, next_scan - now)),
                                  self._pending, spin_s=spin.budget(now - idle_since))

    def _housekeep(self) -> float:
        """Adopt newcomers, reclaim the dead; returns when to do so again."""
        self._discover()
        self._scan()
        return time.monotonic() + SCAN_INTERVAL_S

    def stop(self) -> None:
        self._running = False

    def close(self) -> None:
        self.roster.close()  # (its slots' served locks go before a successor can start)
        self.manager.shutdown()
        self.bell.close()
        self._newcomer.release()
        self.seg.close()
