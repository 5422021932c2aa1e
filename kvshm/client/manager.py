"""Engine-side access to a shared segment: the ``SharedManager`` proxy.

This module owns the manager API of a client process and its lock-free reads (``connect.py``
attaches or creates the segment and builds one). It composes a client slot (claimed with a
kernel-released lock), the link to the owner (``owner_link.py``: calls, exactly-once,
failover), the hold table (``holds.py``: counted leases and pins) and its own stores
(``own_stores.py``). Lookups and loads never go through the owner: they read the key index
and the block table and lease what they find. A ``prepare_store`` the client's grant ring
covers sends nothing and its ``complete_store`` is a one-way ``Publish``; a larger store is
one atomic round trip. ``touch`` is one-way. When the owner dies mid-call, the client starts
another (``owner_start.py``) and the successor finishes the call: callers see a delay, not an
error. It never copies block data."""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence

import numpy as np

from kvshm.client.decisions import decided_ready
from kvshm.client.holds import HoldTable
from kvshm.client.own_stores import OwnStores
from kvshm.client.owner_link import OwnerLink
from kvshm.client.owner_start import start_owner
from kvshm.crashpoints import crash_point
from kvshm.errors import BlockStateError, HoldsExhaustedError, InvalidArgumentError, UnknownKeyError
from kvshm.index import protocol as P
from kvshm.index.api import (
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    Running,
)
from kvshm.shm import keys as K
from kvshm.shm import layout as L
from kvshm.shm import slots
from kvshm.shm.fence import full_fence
from kvshm.shm.keyindex import KeyIndex
from kvshm.shm.segment import Segment
from kvshm.shm.table import BlockTable

_HIT = LookupResult.HIT


class SharedManager(OffloadingManager):
    """The manager proxy of one client process. Same semantics as ``LocalManager``.

    Not for concurrent use from several threads without external locking of the read path
    (calls to the owner are serialised internally). ``quota``: blocks this client may keep
    cached (0: none; ``connect`` takes a fraction of the cache too).
    """

    def __init__(self, segment: Segment, *, events: bool = False, grants: bool = True,
                 timeout: float = 30.0, quota: int = 0):
        self.segment, self.timeout = segment, timeout
        self.quota = quota  # blocks it may keep cached, protected from others (0: no quota)
        self._grants = grants
        g = segment.geometry
        self.table = BlockTable(segment.buf, g)
        self.index = KeyIndex(segment.buf, g, self.table)
        self._events = events
        self._chunk_keys = P.keys_per_part(g.ring_capacity)  # requests cut like the replies
        self.slot, self.gen = slots.claim(segment, lambda: start_owner(segment))
        try:
            self._ctr = slots.counter_words(segment, self.slot)
            self._lk_n = self._lk_miss = 0  # key_status calls and non-hits, not yet in _ctr
            self._h = HoldTable(slots.holds(segment, self.slot), self.table,
                                slots.hold_mark(segment, self.slot))
            slots.activate(segment, self.slot, self.gen, takes_grants=grants, quota=quota,
                           events=events)
            self._link = OwnerLink(segment, self.slot, self.gen, timeout,
                                   self._after_failover, self._abandoned)
            self._own = OwnStores(segment, self.slot, self.gen, self._link, self.table)
            self._newcomer = segment.buf[L.OFF_NEWCOMER:L.OFF_NEWCOMER + 8].cast("Q")
            self._newcomer[0] = 1  # after CLIENT is visible: the owner clears, fences, scans
            crash_point("client.connect.after_activate")
            self._link.ensure_owner()
            self._link.ring_owner()
            self._link.call([self._hello()])
            self.quota = slots.quota(segment, self.slot)  # as applied: cut if others took it
        except BaseException:
            # Leave the slot CLIENT and unlocked: the owner (or gc) reclaims it, and it is
            # the only one that may, since it may have adopted it already.
            slots.unlock(segment, self.slot, self.gen)
            self._close_views()
            raise

    # --- owner link hooks ---------------------------------------------------------------
    def _after_failover(self) -> None:
        """A new owner serves us: repair what the old one's death may have hidden."""
        self._h.revalidate()
        if self._events:  # the new owner does not know what we asked
            self._link.post(self._hello())

    def _hello(self) -> P.Hello:
        return P.Hello(self._link.next_req(), self.slot, self.gen, os.getpid(), self._events)

    def _abandoned(self, reply: P.Reply) -> None:
        """A reply to a request we gave up on: forget leases its evictions took away."""
        if isinstance(reply, P.Prepared):
            self._h.forget(reply.evicted)

    # --- reads and holds ----------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> int:
        """See ``OffloadingManager.lookup``. Bad input is refused with InvalidArgumentError
        (``keys.key_seq``/``check_key``): items are checked where lookup examines them
        (the first miss, anything unhashable), so a list of bytes costs no extra pass."""
        if type(keys) is not list and type(keys) is not tuple:
            keys = K.key_seq(keys)
        try:
            return self._lookup(keys)
        except TypeError:  # an unhashable or unjoinable item (bytearray, list, str)
            for k in keys:
                K.check_key(k)
            raise

    def _lookup(self, keys: Sequence[bytes]) -> int:
        # Keys we lease already are known hits: only our own stores may evict them, and
        # prepare_store drops the leases of what it evicted. A scheduler re-asks the same
        # prefixes every step, so this is the common path.
        leases = self._h.leases
        n, held = len(keys), 0
        for k in keys:
            if k not in leases:
                break
            held += 1
        if held:  # each hit counts one lookup of its lease (``holds.py``)
            self._h.asked(keys if held == n else keys[:held])
            self._count_lookup(held, held)
            return n if held == n else self._rest(keys, held)
        karr = K.key_array(keys) if n >= 64 else None  # measured: below 64 keys the per-key
        if karr is not None:                            # loop is cheaper than numpy's setup
            blocks, states = self.index.find_prefix(keys, karr)
            ready = states == L.READY
            hits = n if ready.all() else int(np.argmin(ready))
            hits = self._h.lease_many(keys, karr, blocks, hits)
        else:
            hits = self._h.lease_prefix(keys, self.index)
        if hits:
            self._h.asked(keys[:hits])
        self._count_lookup(n, hits)
        if hits < n and keys[hits] in self._own.unconfirmed and self._own.confirm(keys[hits]):
            return self._rest(keys, hits)  # our own store, now in the index
        return hits

    def _rest(self, keys: Sequence[bytes], hits: int) -> int:
        """``hits`` (their lookups counted) plus the lookup of the keys after them."""
        try:
            return hits + self._lookup(keys[hits:])
        except BaseException:  # refused: a lookup that raises reports no hit
            self._h.release(keys[:hits])
            raise

    def _count_lookup(self, n: int = 0, hits: int = 0) -> None:
        """Store the lookup counters (kvshm-inspect's), with what key_status counted."""
        if n or self._lk_n:  # (most stores of a step: counted already, nothing to store)
            ctr = self._ctr
            ctr["lookups"] += hits + (hits < n) + self._lk_n  # the hits and the first miss
            ctr["hits"] += hits + self._lk_n - self._lk_miss
            self._lk_n = self._lk_miss = 0

    def key_status(self, key: bytes) -> LookupResult:
        # The scheduler's per-key call: a leased key is a dict hit (one more lookup counted
        # on its lease); the first key asked for of a prefix loaded before leases that
        # prefix (``relet``). Counters: calls and non-hits only, stored by the next call that
        # ends a step (``_count_lookup``).
        h = self._h
        asks = h.asks
        try:
            if key in asks:  # leased and asked for before
                asks[key] += 1
                self._lk_n += 1
                return _HIT
            if key in h.leases:  # leased ahead of its lookup (relet): asked for now (and
                asks[key] = 1    # so no longer ahead, though still named there)
                self._lk_n += 1
                return _HIT
            if type(key) is bytes and h.relet(key):  # (never lease under a caller's buffer)
                h.asks[key] = 1
                self._lk_n += 1
                return _HIT
        except TypeError:  # unhashable: refuse it by name
            K.check_key(key)
            raise
        if type(key) is not bytes:
            K.check_key(key)  # refused: not a lookup, counted nowhere
        self._lk_n += 1
        state = h.lease_key(key, self.index)
        if state == L.READY:
            h.asks[key] = 1
            return _HIT
        self._lk_miss += 1
        if state == -1 and key in self._own.unconfirmed and self._own.confirm(key):
            self._lk_n -= 1
            self._lk_miss -= 1
            return self.key_status(key)  # our own store, now in the index
        if state == L.WRITING or self._own.mine(key):
            return LookupResult.PENDING
        return LookupResult.MISS

    def release(self, keys: Sequence[bytes] | None = None) -> None:
        """Give back one lookup of each of ``keys`` (all leases if None): a key's lease goes
        with the last lookup that reported it as a hit. Pins are unaffected."""
        self._count_lookup()
        self._h.release(keys)

    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        keys = K.key_seq(keys)
        h = self._h
        taken: list[tuple[bytes, int]] = []
        shared: list[bytes] = []  # pinned beside a lease that other lookups still count on
        blocks = []
        try:
            for k in keys:
                K.check_key(k)
                i = h.lease_to_pin(k, shared)  # takes one lookup of the lease
                if i < 0:
                    i = self._lease_for_load(k)
                taken.append((k, i))
                block = h.block(i)
                # Lease -> pin (a pin protects against our own stores too, a lease does not)
                h._hv[i] = block
                blocks.append(block)
            full_fence()  # one fence for the batch: every pin is stored before any re-check
            keys = keys if type(keys) is list else list(keys)
            proven = h.runs.proven(keys, blocks)  # a prefix loaded before, unchanged: all at once
            for (k, _), block in zip(taken, blocks) if not proven else ():
                # (an eviction in flight sees our hold and gives the block back: wait for it)
                if not h.still_ready(k, block) and not decided_ready(
                        self.table, block, k, self.timeout, self._link.ensure_owner):
                    raise UnknownKeyError(f"key {k.hex()[:16]}… is no longer cached; "
                                          "lookup() again")  # never half-written or reused
        except BaseException:
            h.unload(taken, shared)  # nothing pinned, no lookup taken
            raise
        h.pin(taken)
        self._own.recent.update(blocks)  # used now: an offer of ours among them is kept
        h.drop_ahead()  # what a relet took ahead and nobody asked for: no load needs it
        if not proven:
            h.runs.follow(keys, blocks)
        self._count_lookup()
        self._ctr["loads"] += 1
        self._ctr["load_blocks"] += len(blocks)
        return blocks

    def _lease_for_load(self, k: bytes) -> int:
        """The hold index of a fresh lease on ``k`` for ``prepare_load``, or the error that
        says why it cannot be loaded."""
        h = self._h
        state = h.lease_key(k, self.index)
        if state == -1 and k in self._own.unconfirmed and self._own.confirm(k):
            state = h.lease_key(k, self.index)  # our own store, now in the index
        if state == L.WRITING or (state == -1 and self._own.mine(k)):
            raise BlockStateError(f"key {k.hex()[:16]}… is still being stored; retry later")
        if state == -2 and not h.free:
            raise HoldsExhaustedError(
                f"this client holds {len(h.holds)} blocks already (its hold_capacity); "
                "complete_load or release() some first")
        if state != L.READY:
            raise UnknownKeyError(f"key {k.hex()[:16]}… is not cached; lookup() first")
        return h.leases.pop(k)

    def complete_load(self, keys: Sequence[bytes]) -> None:
        keys = K.key_seq(keys)
        pins = self._h.pins
        need: dict[bytes, int] = {}
        for k in keys:
            K.check_key(k)
            need[k] = need.get(k, 0) + 1
            if len(pins.get(k, ())) < need[k]:
                if self.index.find(k)[0] < 0 and not self._own.mine(k):
                    raise UnknownKeyError(f"complete_load of key {k.hex()[:16]}… which is "
                                          "not cached")
                raise BlockStateError(f"complete_load of key {k.hex()[:16]}… without a "
                                      "matching prepare_load")
        self._h.unpin(keys)

    def held_blocks(self) -> int:
        """How many holds (leases + pins) this client has."""
        return len(self._h)

    def add_bytes(self, loaded: int = 0, stored: int = 0) -> None:
        """Count bytes moved by this process's transfers (shown by kvshm-inspect)."""
        self._ctr["bytes_in"] += loaded
        self._ctr["bytes_out"] += stored

    # --- owner round trips --------------------------------------------------------------
    def touch(self, keys: Sequence[bytes], how: bytes | None = None, *,
              running: Running | None = None) -> None:
        keys = K.key_seq(keys)
        for k in keys:
            K.check_key(k)
        if how is not None and len(how) != len(keys):
            raise InvalidArgumentError("touch: 'how' needs one access kind per key")
        # Tail pieces first: the owner makes each touched key most recent in reverse order,
        # so the prefix head must be touched last.
        n = self._chunk_keys
        for i, part in reversed(list(enumerate(self._chunks(keys)))):
            self._link.send(P.Touch(0, part, None if how is None else bytes(how[i * n:(i + 1) * n]),
                                    **P.running_fields(running, part)))

    def _chunks(self, keys: Sequence[bytes]) -> list[list[bytes]]:
        """``keys`` in pieces whose request and reply each fit one ring frame."""
        keys, n = list(keys), self._chunk_keys
        return [keys[i:i + n] for i in range(0, len(keys), n)] or [[]]

    def prepare_store(self, keys: Iterable[bytes], *,
                      running: Running | None = None) -> PrepareStoreOutput | None:
        """See ``OffloadingManager.prepare_store``: from this client's grant ring when it holds
        enough blocks (no frame at all; ``complete_store`` ranks them), else what the ring
        holds and one atomic round trip, however many keys, for the rest."""
        keys = K.key_seq(keys)
        K.check_keys(keys)
        running = running and running.for_store()
        own, probe, find = self._own, self.index.probe, self.index.find
        own.prune()
        self._count_lookup()
        # Present: ours in flight or unconfirmed, or indexed. A tag is a candidate only: a
        # key whose crc32 an indexed key has (1 in 2**32 per key cached) is verified.
        new = [k for k in dict.fromkeys(keys)
               if not own.mine(k) and (probe(k) < 0 or find(k)[0] < 0)]
        blocks = own.take(new) if self._grants else []
        if len(blocks) == len(new):
            return PrepareStoreOutput(new, blocks, [])
        # The owner needs every offered key (none may be evicted for this store) but ours in
        # flight (it would grant them again); our earlier Publish frames are applied first.
        chunks = self._chunks([k for k in keys if k not in own.inflight])
        req, taken = self._link.next_req(), new[:len(blocks)]
        try:
            replies = self._link.call([P.PrepareStore(req, c, i + 1 < len(chunks), i,
                                                      **P.running_fields(running, c))
                                       for i, c in enumerate(chunks)])
        except BaseException:  # failed: what we took goes back, or its keys stay ours for
            own.untake(taken)  # good (a late reply is undone by ``OwnerLink``)
            raise
        if isinstance(replies[0], P.NoRoom):
            own.untake(taken)
            return None
        out = PrepareStoreOutput(taken, blocks, [])
        for r in replies:
            assert isinstance(r, P.Prepared)  # call() raised an Error; NoRoom returned above
            out.keys_to_store += r.keys
            out.block_ids += r.blocks
            out.evicted_keys += r.evicted
        self._h.forget(out.evicted_keys)  # our own store may evict what we leased
        crash_point("client.store.after_prepare")
        return out

    def complete_store(self, keys: Sequence[bytes], success: bool = True, *,
                       running: Running | None = None) -> None:
        """See ``OffloadingManager.complete_store``: a one-way frame for stores served from
        the grant ring (our own lookups wait briefly for the owner to take it), else a round
        trip."""
        keys = K.key_seq(keys)
        K.check_keys(keys)
        running = running and running.for_store()
        rest, published, blocks = self._own.complete(keys, success, self._chunk_keys, running)
        self._h.runs.stored_by_us(published, blocks)
        for part in self._chunks(rest) if rest else ():  # a subset is a valid completion
            self._link.call([P.CompleteStore(self._link.next_req(), part, success)])

    def take_events(self) -> list[OffloadingEvent]:
        r = self._link.call([P.TakeEvents(self._link.next_req())])[0]
        assert isinstance(r, P.Events)  # the one reply to TakeEvents (call() raised an Error)
        return [OffloadingEvent(k, removed=rm) for rm, k in zip(r.removed, r.keys)]

    def shutdown(self) -> None:
        """Say goodbye (the owner frees our unfinished stores and our slot), then unlock
        the slot. Without an answer the owner reclaims the slot once it sees us gone."""
        if self.segment is None:
            return
        seg = self.segment
        crash_point("client.shutdown.before_bye")
        self._count_lookup()  # before the goodbye: the owner folds them into the totals
        try:
            if seg.owner_alive() and not self._link.quarantined():
                self._link.call([P.Bye(self._link.next_req())])
        except Exception:
            pass  # the owner reclaims a vanished client anyway
        slots.unlock(seg, self.slot, self.gen)
        self._close_views()
        seg.close()
        self.segment = None  # type: ignore[assignment]

    def _close_views(self) -> None:
        """Close the owner link and our views of the slot (a failed construction's too, so
        that nothing it opened outlives it); what was not opened yet is skipped."""
        for name, end in (("_link", "close"), ("_own", "close"), ("_newcomer", "release"),
                          ("_ctr", "release"), ("_h", "clear")):
            part = self.__dict__.pop(name, None)
            if part is not None:
                getattr(part, end)()

    def __enter__(self) -> SharedManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
