"""A client's hold table: the blocks it leased by a lookup or pinned for a load.

This module owns the client side of the lease handshake and the client's hold array in its
slot (``hold_capacity`` int32 entries the owner reads before it evicts). A hold entry is -1
(empty), a block id (a load pin: protects the block from everyone's stores) or
``layout.lease_code(block)`` (a lookup lease: protects it from *other* clients' stores).

Leasing: write the lease into the hold array, full fence, re-check that the block still holds
the key and is READY. The owner marks a victim EVICTING, fences, then reads every client's
holds and spares held blocks (``owner/eviction.py``), so one of the two always sees the
other: a leased hit stays loadable until it is pinned or released. A client holds at most
``hold_capacity // 2`` leases; past that lookups report misses (always safe).

Leases are counted. Two requests of one scheduler step may ask for the same key: the client
holds one lease for it (one hold entry per key, which is all the owner reads), but counts
per leased key the lookups that answered it as a hit (``asks``, in this process only). A
``release`` gives back one of them, a ``prepare_load`` takes one (the lease becomes the load's
pin with the last; before that the pin is a hold of its own), and the lease goes when none is
left; ``release()`` of all drops every count. Without the count, one request's release took
the lease from under the other, whose load then failed once another client evicted the
block. A key named twice counts twice. A key that our own store evicted (or an owner
failover lost) is forgotten whatever its count: it is no hit any more.

A scheduler asks for the same prefixes over and over, so the client remembers, per key it
verified, the block and the entry's sequence number then (``seen``): the table's writer bumps
it on every rewrite, so an unchanged number proves the entry still holds that key in that
state (trusting that a u32 does not wrap back to the same value in between, 2**31 rewrites
of one block). A prefix the client loaded or stored is kept the same way as a whole
(``runs.py``), so the next request's first lookup of it leases much of it with one fence
(``relet``) and the lookups after it are dict hits. Keys leased so, ahead of their lookups,
are ``ahead`` until asked for: nobody was told they are hits, so they count no lookup and
are given back at the next ``relet``, ``prepare_load`` or ``release``. It never talks to the
owner and never writes the block table.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvshm.client.decisions import verdict
from kvshm.client.runs import Runs
from kvshm.shm import layout as L
from kvshm.shm.fence import full_fence, publish_fence
from kvshm.shm.keyindex import KeyIndex
from kvshm.shm.keys import check_key
from kvshm.shm.table import BlockTable


class HoldTable:
    """Leases (key -> hold index, with its count of lookups) and pins (key -> hold indexes)
    over a slot's hold array."""

    def __init__(self, holds: np.ndarray, table: BlockTable, mark: memoryview):
        self.holds = holds
        self._hv = holds.data  # scalar stores: several times cheaper than numpy's
        self.table = table
        self.free = list(range(len(holds) - 1, -1, -1))  # a stack: see ``Plan``
        # The slot's hold mark (layout.SLOT_OFF_HOLD_MARK): 1 + the highest entry ever used,
        # stored before an entry above it is written, so a reader that bounds its read by it
        # (a claim, an eviction) sees every hold. The free stack hands out low entries first.
        self._mark, self.mark = mark, 0
        self.leases: dict[bytes, int] = {}
        # Leased key -> lookups that answered it as a hit and were not given back yet (>= 1);
        # absent for a key leased ahead of its lookups. The client counts them (``asked``).
        self.asks: dict[bytes, int] = {}  # a plain dict: its hot-path ops are specialised
        self.pins: dict[bytes, list[int]] = {}
        self.lease_limit = len(holds) // 2
        self.seen: dict[bytes, tuple[int, int]] = {}  # key -> (block, seq) verified READY
        self._seen_limit = 4 * len(holds)
        self.runs = Runs(table, self._seen_limit)  # the prefixes this client loaded
        # Keys ``relet`` leased ahead of their lookups. One counted in ``asks`` was asked for
        # since and is ahead no more: ``key_status`` leaves it named here, as a set discard
        # per hit cost as much as the rest of the hit; ``drop_ahead`` skips it.
        self.ahead: set[bytes] = set()

    def __len__(self) -> int:
        """How many holds (leases + pins) are taken."""
        return len(self.holds) - len(self.free)

    def block(self, i: int) -> int:
        code = self._hv[i]
        return code if code >= 0 else -2 - code

    def cover(self, top: int) -> None:
        """Make the hold mark cover entries below ``top`` before any of them is written."""
        if top > self.mark:
            self.mark = self._mark[0] = top

    def _lower_mark(self) -> None:
        """Nothing held: the hold mark comes down to 0, so that a claim or an eviction reads
        none of our entries (a long prefix leased once would otherwise cost every claim a
        copy of all the entries it used). Safe as every entry is -1 already, stored before
        the mark; ``cover`` raises it again before an entry above is written."""
        if self.mark and len(self.free) == len(self.holds):
            publish_fence()  # the entries' -1 before the mark that stops covering them
            self.mark = self._mark[0] = 0

    def unhold(self, i: int) -> None:
        self._hv[i] = -1
        self.free.append(i)

    def room(self) -> int:
        """How many more leases this client may take now."""
        return min(len(self.free), self.lease_limit - len(self.leases))

    def make_room(self, n: int) -> int:
        """``room()``, after giving back the leases nobody asked for if it is below ``n``:
        they never stand in the way of a key that is asked for."""
        room = self.room()
        if room < n and self.ahead:
            self.drop_ahead()
            room = self.room()
        return room

    def asked(self, keys: Sequence[bytes]) -> None:
        """``keys``, leased, were answered as hits: count one lookup of each (per time it is
        named); theirs now, never dropped as ahead."""
        asks = self.asks
        get = asks.get
        for k in keys:
            asks[k] = get(k, 0) + 1
        if self.ahead:
            self.ahead.difference_update(keys)

    def drop_ahead(self) -> None:
        """Give back the leases ``relet`` took ahead of lookups that never came."""
        if not self.ahead:
            return
        pop, asks = self.leases.pop, self.asks  # (nobody asked for them: no count to drop)
        idx = [i for i in [pop(k, -1) for k in self.ahead if k not in asks] if i >= 0]
        # (counted by what is given back: a key whose lease went another way, pinned or
        # forgotten, may still be named in ``ahead``; it went unasked by no one)
        self.runs.unasked(len(idx))
        self.ahead.clear()
        if idx:  # a relet can take a long prefix ahead: give it back in one numpy call
            self.holds[np.array(idx, np.intp)] = -1
            self.free.extend(idx)

    def relet(self, key: bytes) -> bool:
        """Lease ``key`` and the keys that followed it in a prefix this client loaded, all
        with one handshake (``Runs.relet``). False: ``key`` not leased, ask ``lease_key``."""
        return self.runs.relet(self, key)

    def write_holds(self, ia: np.ndarray, codes: np.ndarray, top: int) -> None:
        """Take the top ``len(ia)`` entries of the free stack, which are ``ia`` (the caller
        read them off the stack; ``top``: 1 + the highest), and write ``codes`` into them.
        The caller then fences and re-checks, and gives back what does not hold
        (``give_back``)."""
        del self.free[-len(ia):]
        self.cover(top)
        self.holds[ia] = codes

    def give_back(self, ia: np.ndarray) -> None:
        """Empty the hold entries ``ia`` and put them back on the free stack."""
        self.holds[ia] = -1
        self.free.extend(ia.tolist())

    def lease_key(self, key: bytes, index: KeyIndex) -> int:
        """Find ``key`` and lease it if it is READY: returns its state (READY: leased now),
        -1 if absent, -2 if READY but this client may not lease more (a miss).

        The lease is taken on the candidate block before the one verifying read (hold,
        fence, read: the handshake), so a fresh hit costs one entry read, and a key seen
        before costs one sequence-number read.
        """
        if key in self.leases:
            if self.ahead:
                self.ahead.discard(key)
            return L.READY  # only our own stores evict a leased block, and they drop it
        if self.make_room(1) <= 0:
            state = index.find(key)[1]
            return -2 if state == L.READY else state
        seen = self.seen.pop(key, None)  # put back by _take while it still holds
        block = seen[0] if seen is not None else index.probe(key)
        if block < 0:
            return -1
        state = self._take(key, block, seen[1] if seen is not None else -1)
        if state == L.READY or (seen is None and state >= 0):
            return state
        block, state = index.find(key)  # moved, or a tag collision: the full search
        return self._take(key, block, -1) if state == L.READY else state

    def lease_prefix(self, keys: Sequence[bytes], index: KeyIndex) -> int:
        """``lease_key`` of each of ``keys`` up to the first that is no hit: how many are
        leased hits (their lookups not counted yet). A key refused on the way (not bytes:
        ``check_key``) gives back the leases taken for the keys before it: a lookup that
        raises reports no hit, so nobody would ever give them back."""
        hits, lease = 0, self.lease_key
        try:
            for k in keys:
                if type(k) is not bytes:  # never lease under a str or a caller's buffer
                    check_key(k)
                if lease(k, index) != L.READY:
                    break
                hits += 1
        except BaseException:
            for k in keys[:hits]:
                i = self.leases.pop(k, None) if k not in self.asks else None
                if i is not None:  # leased by this lookup (or ahead: nobody's either)
                    self.unhold(i)
            raise
        return hits

    def _take(self, key: bytes, block: int, seq: int) -> int:
        """Lease ``block`` for ``key`` if it holds it READY (proven by an unchanged ``seq``
        when one is given, else by reading the entry); else its state there, unheld."""
        i = self.free.pop()
        if i >= self.mark:
            self.cover(i + 1)
        self._hv[i] = -2 - block
        full_fence()  # our hold before our re-check: the owner fences the other way round
        if seq < 0 or self.table.seq(block) != seq:
            seq, state = self.table.checked_state(block, key)
            if state != L.READY:
                self.unhold(i)
                return state
        self.leases[key] = i
        if self.ahead:
            self.ahead.discard(key)
        if len(self.seen) >= self._seen_limit:
            self.seen.clear()
        self.seen[key] = (block, seq)
        return L.READY

    def still_ready(self, key: bytes, block: int) -> bool:
        """Whether ``block`` provably still holds ``key`` READY, from ``seen`` or ``runs``
        alone (False: ask the table)."""
        seen = self.seen.get(key)
        if seen is not None:
            return seen[0] == block and self.table.seq(block) == seen[1]
        return self.runs.still_ready(key, block)

    def lease_many(self, keys: Sequence[bytes], karr: np.ndarray, blocks: np.ndarray,
                   hits: int) -> int:
        """Vectorised ``lease`` of the first ``hits`` keys (found READY at ``blocks``): one
        fence for the batch. Returns how many leading keys are leased hits."""
        leases = self.leases
        for i in range(hits):  # drop stale leases (our own store evicted the block since)
            j = leases.get(keys[i])
            if j is not None and self.block(j) != int(blocks[i]):
                self.unhold(leases.pop(keys[i]))
                self.asks.pop(keys[i], None)
        kept = None
        if self.ahead:  # leased ahead and asked for now: never dropped to make room here
            kept = self.ahead.intersection(keys[:hits])
            self.ahead -= kept
        first: dict[bytes, int] = {}  # a key asked for twice is leased once
        for i in range(hits):
            if keys[i] not in leases:
                first.setdefault(keys[i], i)
        new = list(first.values())
        room = max(0, self.make_room(len(new)))
        if len(new) > room:
            hits, new = new[room], new[:room]
        if new:
            idx = np.array(self.free[-len(new):][::-1], np.intp)
            del self.free[-len(new):]
            sel = np.array(new, np.intp)
            self.cover(int(idx.max()) + 1)
            self.holds[idx] = L.lease_code(blocks[sel])
            full_fence()  # our holds before our re-check: the owner fences the other way
            ok = self.table.states_if_keys(blocks[sel], karr[sel]) == L.READY
            if not ok.all():
                bad = int(np.argmin(ok))
                hits = min(hits, new[bad])
                self.holds[idx[bad:]] = -1
                self.free.extend(idx[bad:].tolist())
                idx, new = idx[:bad], new[:bad]
            leases.update(zip((keys[i] for i in new), idx.tolist()))
        if kept:  # beyond the hits after all: still nobody's
            kept.difference_update(keys[:hits])
            self.ahead |= kept
        return hits

    def release(self, keys: Sequence[bytes] | None = None) -> None:
        """Give back one lookup of each of ``keys`` (per time it is named), dropping a lease
        when none is left; None: drop every lease. Pins are unaffected."""
        if keys is None:  # the scheduler's end of step: all at once
            idx = list(self.leases.values())
            self.leases.clear()
            self.asks.clear()
            self.ahead.clear()
            self.runs.step_over()  # the next lookup asks past nothing
            if idx:
                self.holds[np.array(idx, np.intp)] = -1
                self.free.extend(idx)
            self._lower_mark()
            return
        asks = self.asks
        for k in keys:
            n = asks.get(k, 0)
            if n > 1:
                asks[k] = n - 1  # another lookup still counts on it
                continue
            i = self.leases.pop(k, None)
            if i is not None:
                asks.pop(k, None)
                self.unhold(i)
        self.drop_ahead()
        self._lower_mark()

    def forget(self, keys: Sequence[bytes]) -> None:
        """Drop the leases of ``keys`` whatever their counts: their blocks no longer hold them
        (our own store evicted them)."""
        for k in keys:
            i = self.leases.pop(k, None)
            if i is not None:
                self.asks.pop(k, None)
                self.unhold(i)

    def lease_to_pin(self, key: bytes, shared: list[bytes]) -> int:
        """For ``prepare_load``: the hold index to pin leased ``key`` in (-1: not leased), which
        takes one of its lookups. With the last (or none: leased ahead) the lease itself
        becomes the pin; while other lookups still count on it, the lease stays and the pin is
        a fresh hold, written here, and ``key`` is appended to ``shared`` (for ``unload``).
        With no hold free (leases taken ahead given back first), the lease becomes the pin
        anyway (the others' loads lease again)."""
        i = self.leases.get(key)
        if i is None:
            return -1
        n = self.asks.get(key, 0)
        if n > 1 and not self.free:
            self.drop_ahead()  # leases nobody asked for give way to one a lookup counts on
        if n > 1 and self.free:
            self.asks[key] = n - 1
            shared.append(key)
            j = self.free.pop()
            self.cover(j + 1)
            self._hv[j] = self.block(i)
            return j
        del self.leases[key]
        self.asks.pop(key, None)
        return i

    def unload(self, taken: list[tuple[bytes, int]], shared: list[bytes]) -> None:
        """Undo a ``prepare_load`` that failed: free the holds it took (a lease that became
        the pin goes with it) and give back the lookups it took from leases that stay."""
        for _, i in taken:
            self.unhold(i)
        for k in shared:
            if k in self.leases:
                self.asks[k] += 1

    def revalidate(self) -> None:
        """After an owner failover: drop leases whose block no longer holds their key (a
        replayed store cannot say what its dead owner evicted). One caught mid-eviction stays:
        its evictor sees the lease and gives the block back."""
        for k, i in list(self.leases.items()):
            if verdict(self.table, self.block(i), k) is False:
                self.unhold(self.leases.pop(k))
                self.asks.pop(k, None)

    def pin(self, taken: list[tuple[bytes, int]]) -> None:
        for k, i in taken:
            self.pins.setdefault(k, []).append(i)

    def unpin(self, keys: Sequence[bytes]) -> None:
        """Give back one pin of each of ``keys`` (each has one: the caller checked)."""
        for key in keys:
            pins = self.pins[key]
            self.unhold(pins.pop())
            if not pins:
                del self.pins[key]
        self._lower_mark()

    def clear(self) -> None:
        self.leases.clear()
        self.asks.clear()
        self.ahead.clear()
        self.pins.clear()
        self.seen.clear()
        self.runs.clear()
        self._hv.release()
        self._mark.release()
