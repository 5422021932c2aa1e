"""A client's link to the owner: calls on the request ring, replies, failover, exactly-once.

This module owns how a client talks to the owner of its segment: it starts an owner when none
serves (``owner_start.py``), puts request frames on the client slot's request ring, waits for
the replies on the reply ring, and rides out owner deaths. It never reads or writes the block
table and never holds blocks (``holds.py``).

The protocol: every request is executed at most once
--------------------------------------------------------
Each client slot has a request ring, a reply ring, and a *served record* of u64 words that
only owners write (``records.SERVED_DTYPE``): ``consumed`` (the last request id an owner began
to execute), ``answered`` (the last request id whose whole reply is on the reply ring),
``attempts``, ``one_way`` and ``epoch``. Request ids increase per slot generation (u64, never
wrap: a link that used them all raises ``CounterLimitError``).

Owner, for the frame at the head of a client's request ring (``Owner._serve_frame``):

1. ``req <= answered``: a copy of a request already answered -> release it, no reply.
2. ``req == consumed``: a dead owner began it -> *replay*: answer from the record only (what
   the table shows was granted to ``(slot, gen, req)``; a completion is re-applied to the
   keys the client still has pending), never execute it afresh.
3. otherwise: write ``consumed = req``, execute, put the reply, write ``answered = req``, and
   only then release the frame from the request ring (advance its head).

The frame leaves the ring only after its reply is out, so a successor always finds a request
its predecessor did not finish, and the record tells it whether execution began. A death

* before step 3's ``consumed`` store: the successor executes the request (nothing happened);
* after it, before the reply: the successor replays it (the table holds what was done). A
  store its predecessor died in before granting anything is answered with no keys: those
  keys are not stored this time (a miss later). The successor cannot tell "granted
  nothing" from "its reply already reached the client", and granting afresh in the second
  case would leave blocks nobody writes — at most once is the promise, not exactly once;
* after the reply, before ``answered``: the successor replays and the client receives a
  second reply with the same id, which it ignores (it only accepts the id it waits for);
* after ``answered``, before the release: rule 1 drops the copy.

A ``PrepareStore`` too large for a frame is sent in parts; the owner executes it when the
last part arrives (step 3 starts there). If a successor finds a last part whose first parts
died with its predecessor and ``consumed`` is not that id, nothing was executed: it answers
``Retry`` and the client sends the request again under a new id. A request that ``MAX_ATTEMPTS``
owners died executing is answered with an error instead of killing owners forever. A one-way
frame (``Touch``, ``Publish``) has no id and no reply: an owner records its ring position in
``one_way`` before executing it, counts ``attempts`` the same way, and drops one that killed
``MAX_ATTEMPTS`` owners (counted in ``errors``, logged). Executing one again is harmless. The
blocks of a dropped ``Publish`` stay the client's until it goes (``stranded`` in the served
record and in ``kvshm-inspect show``): such a frame is no list of finished blocks to trust.
``Publish`` frames queued behind each other are executed as one and released together
(``owner/coalesce.py``); ``one_way`` then names the first, and once an owner died in one,
the successor serves that client's frames one at a time, so a frame that kills owners is
dropped alone.

Client (this module): it never resends a request on its own. While waiting it checks that an
owner lives (the kernel-released owner lock) and starts one if not; the successor finds the
request in the ring. Every reply carries its owner's epoch: a changed epoch tells the client
a failover happened, so it revalidates its leases (a replayed ``PrepareStore`` cannot list
the victims the dead owner evicted) and subscribes to events again. A call's deadline is set
once, before the first frame, and holds across failovers. A reply to a request the client
gave up on (its deadline passed) is undone: blocks it granted are freed at once.

The owner never blocks on a client: a reply that does not fit the reply ring waits in the
owner's memory (and the request stays at the head of the ring), a ring it cannot parse gets
its client quarantined (no more service, but its holds are honoured while it lives).
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

from kvshm.client.owner_start import OwnerProcess, start_owner
from kvshm.errors import (
    ClientQuarantinedError,
    CounterLimitError,
    ReplyTimeoutError,
    RingFullError,
)
from kvshm.index import protocol as P
from kvshm.logs import owner_log_path
from kvshm.shm import layout as L
from kvshm.shm import slots
from kvshm.shm.ring import Doorbell, Ring
from kvshm.shm.segment import Segment

# Spin this long for a reply before sleeping on the doorbell: long enough for a lookup or
# a small store round trip, short enough not to steal the owner's CPU on a busy host.
REPLY_SPIN_S = 200e-6
_CHECK_OWNER_S = 0.1  # while waiting, look whether the owner still lives this often
REQ_MAX = 2**64 - 1  # the last request id: the served record's words are u64


class OwnerLink:
    """Request/reply calls from one client slot (``slot``, ``gen``) to the segment's owner.

    ``on_failover`` runs (inside the call that noticed it, before it returns) when a reply
    comes from another owner than the last one; ``on_abandoned`` gets each reply part of a
    request the client gave up on. Calls are serialised by a lock.
    """

    def __init__(self, segment: Segment, slot: int, gen: int, timeout: float,
                 on_failover: Callable[[], None],
                 on_abandoned: Callable[[P.Reply], None] = lambda reply: None):
        self.segment, self.slot, self.gen, self.timeout = segment, slot, gen, timeout
        self.epoch = 0  # of the owner that sent the last reply (0: none yet)
        self._on_failover = on_failover
        self._on_abandoned = on_abandoned
        self._lock = threading.Lock()
        self._req = 0
        self._abandoned: set[int] = set()  # requests given up on: undo what they did
        self._backlog: list[bytes] = []  # posted frames that did not fit the ring yet
        self.requests = Ring(slots.ring_view(segment, slot, "request"))
        self.replies = Ring(slots.ring_view(segment, slot, "reply"))
        self._served = slots.served(segment, slot)
        self.reply_bell = Doorbell(slots.bell_view(segment, slot, "reply"))
        self.owner_bell = Doorbell(segment.buf[L.OFF_OWNER_BELL:L.OFF_OWNER_BELL + 8])
        self.max_frame = Ring.max_payload(segment.geometry.ring_capacity)
        self.owner_proc: OwnerProcess | None = None  # the last owner this link started

    def next_req(self) -> int:
        """A fresh request id: ids increase per slot generation, up to the served record's
        u64 words (``REQ_MAX``); a link that used them all asks for a new connection."""
        if self._req >= REQ_MAX:
            raise CounterLimitError(
                f"this client of {self.segment.name!r} (slot {self.slot}) has used every "
                f"request id (up to {REQ_MAX}); shut this manager down and connect again: "
                "a new connection starts its ids anew")
        self._req += 1
        return self._req

    def quarantined(self) -> bool:
        """Whether an owner stopped serving us for good (our rings, grant counts or
        generation word were found corrupt): no call of ours will be answered."""
        return bool(self._served["quarantined"])

    def _check_served(self) -> None:
        if self.quarantined():
            raise ClientQuarantinedError(
                f"the owner of {self.segment.name!r} quarantined this client (slot "
                f"{self.slot}): it found our slot's words (rings, grant counts or generation) "
                f"corrupt and will not serve us again (its log, "
                f"{owner_log_path(self.segment.name)}, says why); shut this manager down and "
                "connect again")

    def ensure_owner(self) -> None:
        proc = start_owner(self.segment)
        if proc is not None:
            self.owner_proc = proc

    def ring_owner(self) -> None:
        self.owner_bell.ring()

    # --- calls --------------------------------------------------------------------------
    def call(self, parts: list[P.Request]) -> list[P.Reply]:
        """Send one request (one frame, or several parts with the same id) and return its
        reply parts. Raises the owner's typed error, or ``ReplyTimeoutError``."""
        with self._lock:
            deadline = time.monotonic() + self.timeout
            while True:
                replies = self._exchange(parts, deadline)
                if not isinstance(replies[-1], P.Retry):
                    break
                if time.monotonic() > deadline:  # asked again and again (forged parts)
                    raise ReplyTimeoutError(
                        f"the owner of {self.segment.name!r} asked for request {parts[0].req} "
                        f"again until the {self.timeout:g}s timeout (its first parts never "
                        "reached it); send it again")
                req = self.next_req()  # provably never executed: send it again, new id
                parts = [type(p)(**{**_fields(p), "req": req}) for p in parts]
            if isinstance(replies[-1], P.Error):
                P.raise_error(replies[-1])
            return replies

    def send(self, msg: P.Request) -> None:
        """One-way request (``req == 0``): no reply. Dropped if the ring is full — only
        recency hints travel this way, and an engine must never block on them.

        The owner is not woken for it while the ring is less than a quarter full: it takes
        the hint at its next pass (within its scan interval, or with this client's next
        frame that wakes it, which the hint precedes in the ring), so an engine pays no
        owner wake-up per finished request, and the owner takes no core from it."""
        with self._lock:
            if self.requests.try_put(P.request_encoder.encode(msg)):
                if 4 * self.requests.depth() > self.requests.capacity:
                    self.owner_bell.ring()
            elif not self.segment.owner_alive():
                self.ensure_owner()

    def push(self, msg: P.Request) -> int:
        """A one-way request that must not be dropped (a ``Publish``): waits for room like a
        call's frame would. Returns the ring position past it, for ``wait_consumed``."""
        with self._lock:
            self._put(P.request_encoder.encode(msg), time.monotonic() + self.timeout)
            self.owner_bell.ring()
            return self.requests.tail

    def wait_consumed(self, pos: int, timeout: float) -> bool:
        """Wait up to ``timeout`` s until the owner has taken our frames before ring position
        ``pos`` (a one-way frame whose effect the caller is about to read), starting one if
        none lives. False if it has not (a stalled owner)."""
        if self.requests.consumed(pos):
            return True
        deadline = time.monotonic() + timeout
        with self._lock:
            self._send_backlog()
            while not self.requests.consumed(pos):
                if time.monotonic() > deadline:
                    return False
                if not self.segment.owner_alive():
                    self.ensure_owner()
                self.owner_bell.ring()
                while self.replies.pending():  # it may wait for room on our reply ring
                    self._stray(self._take_reply())
                self.reply_bell.wait(0.01, lambda: self.requests.consumed(pos), REPLY_SPIN_S)
        return True

    def post(self, msg: P.Request) -> None:
        """A request whose reply nobody waits for (an undo, a re-subscription); its reply is
        dropped as stray. Never blocks: while the ring is full it waits in a backlog that
        every call sends first. Call with the lock held (inside a call or a hook)."""
        self._backlog.append(P.request_encoder.encode(msg))
        self._send_backlog()

    def _send_backlog(self) -> None:
        while self._backlog and self.requests.try_put(self._backlog[0]):
            self._backlog.pop(0)
            self.owner_bell.ring()

    def _exchange(self, parts: list[P.Request], deadline: float) -> list[P.Reply]:
        req = parts[0].req
        for p in parts:
            self._put(P.request_encoder.encode(p), deadline)
            self.owner_bell.ring()
        got: list[P.Reply] = []
        next_check = time.monotonic() + _CHECK_OWNER_S
        while True:
            if self.reply_bell.wait(_CHECK_OWNER_S, self.replies.pending, REPLY_SPIN_S):
                reply = self._take_reply()
                if reply.req != req:
                    self._stray(reply)
                    continue
                self._saw_epoch(reply.epoch)
                if isinstance(reply, P.Prepared):
                    if reply.part == 0:
                        got = []  # a successor's replay restarts a reply cut short
                    got.append(reply)
                    if reply.more:
                        continue
                else:
                    got = [reply]
                return got
            now = time.monotonic()
            if now > deadline:
                self._abandoned.add(req)
                raise ReplyTimeoutError(
                    f"no reply from the owner of {self.segment.name!r} within "
                    f"{self.timeout:g}s; check 'kvshm-inspect show {self.segment.name}'")
            if now >= next_check:
                next_check = now + _CHECK_OWNER_S
                self._check_served()
                if not self.segment.owner_alive():
                    self.ensure_owner()  # the successor finds our request in the ring
                self.owner_bell.ring()

    def _stray(self, reply: P.Reply) -> None:
        """A reply we are not waiting for: to a post, a duplicate, or an abandoned request."""
        self._saw_epoch(reply.epoch)
        if reply.req not in self._abandoned:
            return
        if not getattr(reply, "more", False):
            self._abandoned.discard(reply.req)  # a later duplicate is ignored
        if isinstance(reply, P.Prepared) and reply.keys:
            # Nobody will write these blocks: free them rather than strand them. ``of_req``
            # limits the undo to blocks granted by that request, whatever arrives twice.
            self.post(P.CompleteStore(self.next_req(), reply.keys, False, reply.req))
        self._on_abandoned(reply)

    def _take_reply(self) -> P.Reply:
        """The next reply, once ``replies.pending()`` said there is one."""
        frame = self.replies.try_get()
        assert frame is not None  # a pending frame stays: this link is the ring's one consumer
        return P.reply_decoder.decode(frame)

    def _saw_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            known, self.epoch = self.epoch, epoch
            if known:
                self._on_failover()

    def _put(self, frame: bytes, deadline: float) -> None:
        """Queue ``frame`` (after the backlog), starting an owner if the ring stays full
        because none runs. Replies that arrive meanwhile are handled: the owner may be
        waiting for room on our reply ring before it reads our requests again."""
        self._send_backlog()
        while self._backlog or not self.requests.try_put(frame):
            while self.replies.pending():
                self._stray(self._take_reply())
            self._send_backlog()
            self._check_served()
            if time.monotonic() > deadline:
                raise RingFullError(
                    f"the owner of {self.segment.name!r} did not drain our requests within "
                    f"{self.timeout:g}s; check 'kvshm-inspect show {self.segment.name}'")
            if not self.segment.owner_alive():
                self.ensure_owner()
            self.owner_bell.ring()
            self.reply_bell.wait(0.01, self._requests_drained, 0.0)

    def _requests_drained(self) -> bool:
        return not self.requests.pending()

    def close(self) -> None:
        self._served.release()
        for r in (self.requests, self.replies):
            r.close()
        self.reply_bell.close()
        self.owner_bell.close()


def _fields(msg: P._Msg) -> dict:
    return {f: getattr(msg, f) for f in msg.__struct_fields__}
