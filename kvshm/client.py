"""Engine-side access to a shared segment: ``connect()`` and the ``SharedManager`` proxy.

This module owns a client's slot in the segment (claimed with a kernel-released lock), its
request/reply rings to the owner, and its *holds*: the blocks it leased by a lookup or pinned
for a load. Reads never go through the owner:

* ``lookup``/``key_status`` read the key index and block table in the segment directly.
* A hit is *leased*: the block id goes into this client's hold array, then the block is
  re-checked after a full fence. The owner marks a victim EVICTING, fences, then reads every
  client's holds and spares held blocks, so one of the two always sees the other (see
  ``LocalManager._fence_victims``). A leased hit therefore stays loadable until
  ``prepare_load`` turns the lease into a pin or ``release`` drops it. A client holds at most
  ``hold_capacity // 2`` leases: past that, lookups report misses (always safe) until it
  releases some — a connector releases a request's leases once it is scheduled or done.
* ``prepare_load``/``complete_load`` only change holds; ``touch`` is a one-way frame.
Stores go through the owner: ``prepare_store`` and ``complete_store`` are round trips.

When the owner dies mid-call, the client starts another (or waits for one) and repeats the
request if the dead owner had consumed it unanswered; callers see a delay, not an error.
It never copies block data and never imports torch.
"""
from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import threading
import time
from typing import Sequence

import msgspec
import numpy as np

from . import layout as L
from . import slots
from . import protocol as P
from .api import LookupResult, OffloadingEvent, OffloadingManager, PrepareStoreOutput
from .errors import (BlockStateError, CacheFullError, OwnerUnavailableError,
                     ReplyTimeoutError, RingFullError, UnknownKeyError)
from .fence import full_fence
from .layout import Layout
from .ring import Doorbell, Ring
from .segment import Segment, sem_name
from .table import BlockTable, KeyIndex

# Spin this long for a reply before sleeping on the semaphore: long enough for a lookup or
# a small store round trip, short enough not to steal the owner's CPU on a busy host.
REPLY_SPIN_S = 200e-6
# A held block is READY, or EVICTING for the instant an eviction honours our hold.
_LOADABLE = (L.READY, L.EVICTING)
OWNER_START_TIMEOUT_S = 20.0
OWNER_IDLE_EXIT_S = 10.0


def connect(name: str, layout: Layout | None = None, *, num_blocks: int | None = None,
            nbytes: int | None = None, policy: str = "lru", mode: int = 0o600,
            events: bool = False, timeout: float = 30.0, **create_kw: int) -> "SharedManager":
    """Attach this process to shared cache ``name`` and return its manager.

    Give ``num_blocks`` or ``nbytes`` (with ``layout``) to create the segment if it does not
    exist yet; without them the segment must exist. ``layout``, when given, must match the
    segment's. An owner process is started if none is serving. ``events=True`` makes
    ``take_events`` report every store and eviction in the shared cache.
    """
    if num_blocks is None and nbytes is not None:
        if layout is None:
            raise TypeError("connect(nbytes=...) needs the layout to size blocks")
        num_blocks = L.blocks_for_bytes(layout, nbytes)
    if num_blocks is not None:
        if layout is None:
            raise TypeError("connect(num_blocks=...) needs the layout of the blocks")
        seg = Segment.create(name, layout, num_blocks, mode=mode, policy=policy,
                             exist_ok=True, **create_kw)
    else:
        seg = Segment.attach(name, layout)
    try:
        return SharedManager(seg, events=events, timeout=timeout)
    except BaseException:
        seg.close()
        raise


class SharedManager(OffloadingManager):
    """The manager proxy of one client process. Same semantics as ``LocalManager``.

    Not for concurrent use from several threads without external locking of the read path
    (calls to the owner are serialised internally).
    """

    def __init__(self, segment: Segment, *, events: bool = False, timeout: float = 30.0):
        self.segment = segment
        self.timeout = timeout
        g = segment.geometry
        self.table = BlockTable(segment.buf, g)
        self.index = KeyIndex(segment.buf, g, self.table)
        self._lock = threading.Lock()
        self._req = 0
        self._failed_over = False
        self._events = events
        self._epoch = 0
        self._owner_proc: subprocess.Popen | None = None
        self._leases: dict[bytes, int] = {}  # key -> hold index
        self._pins: dict[bytes, list[int]] = {}  # key -> hold indexes, one per prepare_load
        self._lease_limit = g.hold_capacity // 2
        # A prepare_store reply carries keys, block ids and evicted keys: size requests so
        # that it fits one frame too.
        self._chunk_keys = max(1, Ring.max_payload(g.ring_capacity) // (3 * (L.MAX_KEY_BYTES + 8)))
        self.slot, self.gen = slots.claim(segment, self._ensure_owner)
        self._holds = slots.holds(segment, self.slot)
        self._free_holds = list(range(g.hold_capacity - 1, -1, -1))
        self._ctr = slots.counters(segment, self.slot)
        self._reply_bell = Doorbell(slots.bell_view(segment, self.slot, "reply"),
                                    sem_name(segment.name, f"c{self.slot}-reply"),
                                    like_fd=segment.fd)
        self._owner_bell = Doorbell(segment.buf[L.OFF_OWNER_BELL:L.OFF_OWNER_BELL + 8],
                                    sem_name(segment.name, "owner"), like_fd=segment.fd)
        self._newcomer = segment.buf[L.OFF_NEWCOMER:L.OFF_NEWCOMER + 8].cast("Q")
        slots.activate(segment, self.slot, self.gen)
        self._requests = Ring(slots.ring_view(segment, self.slot, "request"))
        self._replies = Ring(slots.ring_view(segment, self.slot, "reply"))
        self._newcomer[0] = 1  # after ACTIVE is visible: the owner clears, fences, then scans
        self._ensure_owner()
        self._owner_bell.ring()
        self._epoch = self._call(P.Hello(self._next_req(), self.slot, self.gen, os.getpid(),
                                         events)).value

    # --- owner --------------------------------------------------------------------------
    def _ensure_owner(self) -> None:
        if self.segment.owner_alive():
            return
        err = tempfile.TemporaryFile()
        proc = subprocess.Popen(
            [sys.executable, "-m", "kvshm.owner", self.segment.name, "--idle-exit",
             str(OWNER_IDLE_EXIT_S)], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=err, start_new_session=True, close_fds=True)
        deadline = time.monotonic() + OWNER_START_TIMEOUT_S
        while not self.segment.owner_alive():
            rc = proc.poll()
            if rc not in (None, 0) or time.monotonic() > deadline:
                err.seek(0)
                why = err.read().decode(errors="replace").strip().splitlines()[-3:]
                raise OwnerUnavailableError(
                    f"could not start an owner for segment {self.segment.name!r} (exit "
                    f"{rc}): {' | '.join(why) or 'no output'}; run 'kvshm serve "
                    f"{self.segment.name}' to see why")
            time.sleep(0.005)  # polling the child's start, bounded by the deadline
        self._owner_proc = proc

    def _next_req(self) -> int:
        self._req += 1
        return self._req

    def _owner_gone(self) -> bool:
        """The owner we talked to is dead, or was replaced (another client restarted it
        between two of our polls): either way our last request may need repeating."""
        return not self.segment.owner_alive() or self.segment.owner_record()[1] != self._epoch

    def _put(self, frame: bytes, deadline: float) -> None:
        """Queue ``frame``, restarting a dead owner if the ring stays full meanwhile."""
        while not self._requests.try_put(frame):
            if time.monotonic() > deadline:
                raise RingFullError(
                    f"the owner of {self.segment.name!r} did not drain our requests within "
                    f"{self.timeout:g}s; check 'kvshm-inspect show {self.segment.name}'")
            if not self.segment.owner_alive():
                self._ensure_owner()
            self._owner_bell.ring()
            self._reply_bell.wait(0.01, self._requests_drained, 0.0)

    def _requests_drained(self) -> bool:
        return not self._requests.pending()

    def _call(self, msg: P._Msg) -> P.Reply:
        """Send one request and wait for its reply, riding out owner failovers."""
        with self._lock:
            deadline = time.monotonic() + self.timeout
            self._put(P.request_encoder.encode(msg), deadline)
            self._owner_bell.ring()
            resent = False
            while True:
                if self._reply_bell.wait(0.1, self._replies.pending, REPLY_SPIN_S):
                    reply = P.reply_decoder.decode(self._replies.try_get())
                    if reply.req != msg.req:
                        self._abandoned(reply)
                        continue
                    if self._failed_over:
                        self._after_failover()
                    if isinstance(reply, P.Error):
                        if resent and reply.kind == "UnknownKeyError" and \
                                isinstance(msg, P.CompleteStore):
                            # The dead owner was rewriting those entries as it died and its
                            # successor freed them: the stores are lost, not wrong.
                            return P.Ok(msg.req)
                        P.raise_error(reply)
                    return reply
                if time.monotonic() > deadline:
                    raise ReplyTimeoutError(
                        f"no reply from the owner of {self.segment.name!r} within "
                        f"{self.timeout:g}s; check 'kvshm-inspect show {self.segment.name}'")
                if self._owner_gone():
                    self._ensure_owner()
                    self._epoch = self.segment.owner_record()[1]
                    self._failed_over = True
                    deadline = time.monotonic() + self.timeout  # a rebuild takes its time
                    if not self._requests.pending() and not self._replies.pending():
                        # The dead owner consumed the request without answering: repeat it.
                        if isinstance(msg, P.PrepareStore):
                            msg = msgspec.structs.replace(msg, replay=True)
                        self._put(P.request_encoder.encode(msg), deadline)
                        resent = True
                    self._owner_bell.ring()

    def _abandoned(self, reply: P.Reply) -> None:
        """A reply to a request we gave up on (timeout): undo what it did for us."""
        if isinstance(reply, P.Prepared):
            for k in reply.evicted:
                i = self._leases.pop(k, None)
                if i is not None:
                    self._unhold(i)
            if reply.keys:  # nobody will write these blocks: free them, don't strand them
                self._put(P.request_encoder.encode(
                    P.CompleteStore(self._next_req(), reply.keys, False)),
                    time.monotonic() + self.timeout)
                self._owner_bell.ring()

    def _after_failover(self) -> None:
        """A new owner serves us: repair what the old one's death may have hidden."""
        self._failed_over = False
        self._revalidate_leases()
        if self._events:  # the new owner does not know we subscribed
            self._put(P.request_encoder.encode(P.Hello(
                self._next_req(), self.slot, self.gen, os.getpid(), True)),
                time.monotonic() + self.timeout)
            self._owner_bell.ring()

    def _send(self, msg: P._Msg) -> None:
        """One-way request (``req == 0``): no reply. Dropped if the ring is full — only
        recency hints travel this way, and an engine must never block on them."""
        with self._lock:
            if self._requests.try_put(P.request_encoder.encode(msg)):
                self._owner_bell.ring()
            elif not self.segment.owner_alive():
                self._ensure_owner()

    # --- reads and holds ----------------------------------------------------------------
    def _lease(self, key: bytes, block: int) -> bool:
        i = self._leases.get(key)
        if i is not None:
            if L.held_block(int(self._holds[i])) == block:
                return True
            self._unhold(self._leases.pop(key))  # stale: our own store evicted it since
        if not self._free_holds or len(self._leases) >= self._lease_limit:
            return False  # a miss is always safe; a hit we could not keep would not be
        i = self._free_holds.pop()
        self._holds[i] = L.lease_code(block)
        full_fence()  # our hold before our re-check: the owner fences the other way round
        if self.table.state_if_key(block, key) != L.READY:
            self._holds[i] = -1
            self._free_holds.append(i)
            return False
        self._leases[key] = i
        return True

    def _revalidate_leases(self) -> None:
        """After an owner failover: drop leases whose block no longer holds their key.

        Only our own stores may evict what we lease, and each prepare_store reply lists what
        it evicted — except a replayed one, whose evictions died with the owner.
        """
        self._failed_over = False
        for k, i in list(self._leases.items()):
            if self.table.state_if_key(L.held_block(int(self._holds[i])), k) not in _LOADABLE:
                self._unhold(self._leases.pop(k))

    def _unhold(self, i: int) -> None:  # noqa: D401 - free one hold entry
        self._holds[i] = -1
        self._free_holds.append(i)

    def lookup(self, keys: Sequence[bytes]) -> int:
        """See ``OffloadingManager.lookup``. Bad input is refused with InvalidArgumentError
        (``layout.key_seq``/``check_key``): items are checked where lookup examines them
        (the first miss, anything unhashable), so a list of bytes costs no extra pass."""
        if type(keys) is not list and type(keys) is not tuple:
            keys = L.key_seq(keys)
        try:
            return self._lookup(keys)
        except TypeError:  # an unhashable or unjoinable item (bytearray, list, str)
            for k in keys:
                L.check_key(k)
            raise

    def _lookup(self, keys: Sequence[bytes]) -> int:
        # Keys we lease already are known hits: only our own stores may evict them, and
        # prepare_store drops the leases of what it evicted. A scheduler re-asks the same
        # prefixes every step, so this is the common path.
        leases = self._leases
        n = len(keys)
        held = 0
        for k in keys:
            if k not in leases:
                break
            held += 1
        if held == n:
            self._count_lookup(n, n)
            return n
        if held:
            self._count_lookup(held, held)
            return held + self._lookup(keys[held:])
        if n >= 64:  # measured: below this the per-key loop is cheaper than numpy's setup
            klen = len(keys[0])
            joined = b"".join(keys)
            if len(joined) == n * klen and all(type(k) is bytes and len(k) == klen
                                               for k in keys):
                return self._lookup_many(keys, np.frombuffer(joined, np.uint8).reshape(n, klen))
        hits = 0
        find = self.index.find
        for k in keys:
            if type(k) is not bytes:  # never lease under a str or a caller's buffer
                L.check_key(k)
            block, state = find(k)
            if state != L.READY or not self._lease(k, block):
                break
            hits += 1
        self._count_lookup(n, hits)
        return hits

    def _count_lookup(self, n: int, hits: int) -> None:
        self._ctr[0] += hits + (hits < n)  # keys examined: the hits and the first miss
        self._ctr[1] += hits

    def _lookup_many(self, keys: Sequence[bytes], karr: np.ndarray) -> int:
        """Vectorised prefix lookup + leasing: one fence for the whole batch."""
        blocks, states = self.index.find_prefix(keys, karr)
        ready = states == L.READY
        hits = len(keys) if ready.all() else int(np.argmin(ready))
        leases = self._leases
        for i in range(hits):  # drop stale leases (our own store evicted the block since)
            j = leases.get(keys[i])
            if j is not None and L.held_block(int(self._holds[j])) != int(blocks[i]):
                self._unhold(leases.pop(keys[i]))
        new = [i for i in range(hits) if keys[i] not in leases]
        room = max(0, min(len(self._free_holds), self._lease_limit - len(leases)))
        if len(new) > room:
            hits, new = new[room], new[:room]
        if new:
            idx = np.array(self._free_holds[-len(new):][::-1], np.intp)
            del self._free_holds[-len(new):]
            sel = np.array(new, np.intp)
            self._holds[idx] = L.lease_code(blocks[sel])
            full_fence()  # our holds before our re-check: the owner fences the other way
            ok = self.table.states_if_keys(blocks[sel], karr[sel]) == L.READY
            if not ok.all():
                bad = int(np.argmin(ok))
                hits = min(hits, new[bad])
                self._holds[idx[bad:]] = -1
                self._free_holds.extend(idx[bad:].tolist())
                idx, new = idx[:bad], new[:bad]
            leases.update(zip((keys[i] for i in new), idx.tolist()))
        self._count_lookup(len(keys), hits)
        return hits

    def key_status(self, key: bytes) -> LookupResult:
        if type(key) is not bytes:
            L.check_key(key)
        self._ctr[0] += 1
        i = self._leases.get(key)  # a lease is only as good as the block it still names
        if i is not None and self.table.state_if_key(L.held_block(int(self._holds[i])),
                                                     key) == L.READY:
            self._ctr[1] += 1
            return LookupResult.HIT
        block, state = self.index.find(key)
        if state == L.READY and self._lease(key, block):
            self._ctr[1] += 1
            return LookupResult.HIT
        return LookupResult.PENDING if state == L.WRITING else LookupResult.MISS

    def release(self, keys: Sequence[bytes] | None = None) -> None:
        """Drop the lookup leases of ``keys`` (all leases if None); pins are unaffected."""
        for k in list(self._leases) if keys is None else keys:
            i = self._leases.pop(k, None)
            if i is not None:
                self._unhold(i)

    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        if type(keys) is not list and type(keys) is not tuple:
            keys = L.key_seq(keys)
        taken: list[tuple[bytes, int]] = []
        blocks = []
        try:
            for k in keys:
                L.check_key(k)
                i = self._leases.pop(k, None)
                if i is None:
                    block, state = self.index.find(k)
                    if state == L.WRITING:
                        raise BlockStateError(f"key {k.hex()[:16]}… is still being stored; "
                                              "retry later")
                    if state == L.READY and not self._free_holds:
                        raise CacheFullError(
                            f"this client holds {len(self._holds)} blocks already (its "
                            "hold_capacity); complete_load or release() some first")
                    if state != L.READY or not self._lease(k, block):
                        raise UnknownKeyError(f"key {k.hex()[:16]}… is not cached; lookup() "
                                              "first")
                    i = self._leases.pop(k)
                taken.append((k, i))
                block = L.held_block(int(self._holds[i]))
                if self.table.state_if_key(block, k) not in _LOADABLE:  # never half-written
                    raise UnknownKeyError(f"key {k.hex()[:16]}… is no longer cached; "
                                          "lookup() again")
                self._holds[i] = block  # lease -> pin: now it protects against our own stores
                blocks.append(block)
        except BaseException:
            for _, i in taken:
                self._unhold(i)
            raise
        for k, i in taken:
            self._pins.setdefault(k, []).append(i)
        self._ctr[2] += 1
        self._ctr[3] += len(blocks)
        return blocks

    def complete_load(self, keys: Sequence[bytes]) -> None:
        if type(keys) is not list and type(keys) is not tuple:
            keys = L.key_seq(keys)
        need: dict[bytes, int] = {}
        for k in keys:
            L.check_key(k)
            need[k] = need.get(k, 0) + 1
            if len(self._pins.get(k, ())) < need[k]:
                if self.index.find(k)[0] < 0:
                    raise UnknownKeyError(f"complete_load of key {k.hex()[:16]}… which is "
                                          "not cached")
                raise BlockStateError(f"complete_load of key {k.hex()[:16]}… without a "
                                      "matching prepare_load")
        for k in keys:
            pins = self._pins[k]
            self._unhold(pins.pop())
            if not pins:
                del self._pins[k]

    def held_blocks(self) -> int:
        """How many holds (leases + pins) this client has."""
        return len(self._holds) - len(self._free_holds)

    def add_bytes(self, loaded: int = 0, stored: int = 0) -> None:
        """Count bytes moved by this process's transfers (shown by kvshm-inspect)."""
        self._ctr[4] += loaded
        self._ctr[5] += stored

    # --- owner round trips --------------------------------------------------------------
    def touch(self, keys: Sequence[bytes]) -> None:
        if type(keys) is not list and type(keys) is not tuple:
            keys = L.key_seq(keys)
        for k in keys:
            L.check_key(k)
        for part in self._chunks(keys):
            self._send(P.Touch(0, part))

    def _chunks(self, keys: Sequence[bytes]) -> list[list[bytes]]:
        """``keys`` in pieces whose request and reply each fit one ring frame."""
        keys, n = list(keys), self._chunk_keys
        return [keys[i:i + n] for i in range(0, len(keys), n)] or [[]]

    def prepare_store(self, keys: Sequence[bytes]) -> PrepareStoreOutput | None:
        """See ``OffloadingManager.prepare_store``. A request too large for one ring frame
        is sent in pieces; all-or-nothing eviction then holds per piece, and if a later
        piece finds no room the keys placed so far are returned."""
        if type(keys) is not list and type(keys) is not tuple:
            keys = L.key_seq(keys)
        for k in keys:
            L.check_key(k)
        out = PrepareStoreOutput([], [], [])
        for part in self._chunks(keys):
            reply = self._call(P.PrepareStore(self._next_req(), part))
            if isinstance(reply, P.NoRoom):
                return out if out.keys_to_store else None
            for k in reply.evicted:  # our own store may evict what we leased: forget those
                i = self._leases.pop(k, None)
                if i is not None:
                    self._unhold(i)
            out.keys_to_store += reply.keys
            out.block_ids += reply.blocks
            out.evicted_keys += reply.evicted
        return out

    def complete_store(self, keys: Sequence[bytes], success: bool = True) -> None:
        if type(keys) is not list and type(keys) is not tuple:
            keys = L.key_seq(keys)
        for k in keys:
            L.check_key(k)
        for part in self._chunks(keys):
            self._call(P.CompleteStore(self._next_req(), part, success))

    def owner_lookup(self, keys: Sequence[bytes]) -> int:
        """``lookup`` answered by the owner (a ring round trip; no lease). For benchmarks."""
        return self._call(P.Lookup(self._next_req(), list(keys))).value

    def take_events(self) -> list[OffloadingEvent]:
        r = self._call(P.TakeEvents(self._next_req()))
        return [OffloadingEvent(k, removed=rm) for rm, k in zip(r.removed, r.keys)]

    def shutdown(self) -> None:
        """Say goodbye (the owner frees our unfinished stores), drop holds, free the slot."""
        if self.segment is None:
            return
        seg = self.segment
        try:
            if seg.owner_alive():
                self._call(P.Bye(self._next_req()))
        except Exception:
            pass  # the owner reclaims a vanished client anyway
        slots.release(seg, self.slot, self.gen)
        for r in (self._requests, self._replies):
            r.close()
        self._reply_bell.close()
        self._owner_bell.close()
        self._newcomer.release()
        del self._holds, self._ctr
        self._leases.clear()
        self._pins.clear()
        seg.close()
        self.segment = None  # type: ignore[assignment]

    def __enter__(self) -> "SharedManager":
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

