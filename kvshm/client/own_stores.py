"""A client's own stores on the grant path: what it took from its grant ring, and what it
published that the owner has not taken yet.

This module owns the client side of ``grants.py``: it is the consumer of the slot's grant
ring (``take``), it claims the blocks the owner offered there (still cached, READY, until
this client takes them for a store), it remembers the keys in flight (blocks taken, store
not completed) and the keys it published (``complete``: one-way ``Publish`` frames) until
the owner has taken their frame, so that the client reads its own completed stores back
(``confirm``).

A claim is the eviction handshake done by the client that evicts. A block someone already
holds (a lookup's lease, a load's pin) is left alone, kept aside to claim at a later store.
The others are turned EVICTING (no lookup reads them any more; a relet sees their sequence
numbers move), then, after a fence, every slot's holds below its hold mark are read again:
a lease that raced the claim gives its block back (READY), the rest become CLAIMED. A
reader writes its hold, fences, then re-reads the entry: one of the two always sees the
other. Only an offer to this client is ever written, and only its state. It never writes
the key index and never waits longer than ``CONFIRM_WAIT_S``.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvshm.client.owner_link import OwnerLink
from kvshm.crashpoints import crash_point
from kvshm.index import protocol as P
from kvshm.index.api import Running
from kvshm.shm import layout as L
from kvshm.shm import offers, slots
from kvshm.shm.fence import full_fence, publish_fence
from kvshm.shm.segment import Segment
from kvshm.shm.table import BlockTable

CONFIRM_WAIT_S = 0.05  # a read of our own just-published store waits this long at most
RETURNED_PER_FRAME = 64  # offers handed back per Publish (a frame's room is for its keys)


class OwnStores:
    """The grant-path stores of one client slot."""

    def __init__(self, segment: Segment, slot: int, gen: int, link: OwnerLink,
                 table: BlockTable) -> None:
        self._gw, ids = slots.grants(segment, slot)  # counts, and ids the owner hands us
        self._gi = ids.data
        self._link = link
        self._table, self._me = table, (slot, gen)
        self._holds = slots.HoldScan(segment)  # every slot's holds, which a claim spares
        self.taken = 0  # blocks taken from the grant ring (we alone store the word)
        # Taken from the ring and not used yet: ``spare`` are ours to write (free grants,
        # claimed offers), ``declined`` offers a reader held when we claimed (still READY
        # and offered to us: claimed again at a later store).
        self.spare: list[int] = []
        self.declined: list[int] = []
        # Offers a request used after they were offered (a lookup's load, ours or another
        # client's): never claimed, handed back with the next Publish so that the owner
        # caches them again; and the blocks this client loaded since its last store (its
        # own touches may still wait in its ring).
        self.returned: list[int] = []
        self.recent: set[int] = set()
        self.inflight: dict[bytes, int] = {}  # key -> granted block, store not completed
        # key -> request ring position past its Publish: ours, in the index once it is taken
        self.unconfirmed: dict[bytes, int] = {}
        self._stalled_at = -1  # request ring head when the owner last kept a read waiting

    def mine(self, key: bytes) -> bool:
        """Whether ``key`` is our store in flight, or published and not yet taken."""
        return key in self.inflight or key in self.unconfirmed

    def take(self, keys: list[bytes]) -> list[int]:
        """Granted blocks, ours to write, for the first of ``keys`` (now in flight): all of
        them when the ring and the blocks taken before hold enough, else as many as they
        hold (the caller asks the owner for the rest, after these: the oldest victims, the
        ones offered to us, go first, as an eviction at the owner would take them)."""
        n, spare = len(keys), self.spare
        if len(spare) < n and self.declined:
            declined, self.declined = self.declined, []
            self._claim(declined)
        gw, gi, cap = self._gw, self._gi, L.GRANT_CAPACITY
        while len(spare) < n:  # offers returned or declined leave room: take further
            t = self.taken
            m = min(n - len(spare), gw["granted"] - t)
            if m <= 0:
                break
            # The positions we take, announced before we read the count again: an owner
            # recalling our untaken ids lowers the count and then reads this word, so either
            # it sees us taking them and backs off, or we see the lowered count here.
            gw["intent"] = t + m
            full_fence()
            crash_point("client.take.after_intent")
            left = gw["granted"] - t
            if left < m:  # lowered by a recall: take what is left, and say so
                m = max(left, 0)
                gw["intent"] = t + m
                if not m:
                    break
            publish_fence()  # the count read before the ids it hands over
            ids = [gi[(t + i) % cap] for i in range(m)]
            crash_point("client.store.after_take")
            publish_fence()  # ids read before the count that lets the owner reuse their places
            self.taken = gw["taken"] = t + m
            # (the ring is the slot's memory, which only the owner should write: an id
            # outside the table is a scribble, taken and never used; numpy would wrap it)
            nb = self._table.num_blocks
            self._sort([b for b in ids if 0 <= b < nb])
        blocks, self.spare = spare[:n], spare[n:]
        self.inflight.update(zip(keys, blocks))
        self.recent.clear()
        return blocks

    def untake(self, keys: list[bytes]) -> None:
        """Put the blocks of ``keys`` (just taken, nothing written) back among the spare:
        their store was refused after all."""
        self.spare[:0] = [self.inflight.pop(k) for k in keys]

    def _sort(self, ids: list[int]) -> None:
        """Blocks just taken (ids in the table): free grants are ours at once, offers are
        claimed."""
        if len(ids) == 1:  # a one-key store's: the same, without numpy
            st = offers.state_one(self._table, ids[0])
            if st == L.GRANTED:
                self.spare.append(ids[0])
            elif st == L.READY:
                self._claim_one(ids[0])
            return
        b = np.array(ids, np.intp)
        state = offers.states(self._table, b)
        self.spare.extend(b[state == L.GRANTED].tolist())
        offered = b[state == L.READY]
        if offered.size:
            self._claim(offered.tolist())
        # Anything else was not handed to us as the protocol says (a damaged or hostile
        # slot): never written; it stays taken, and our goodbye or death ends it.

    def _claim(self, blocks: list[int]) -> None:
        """Claim offered ``blocks``: the claimed ones no reader holds join ``spare``, the
        ones a reader holds wait in ``declined`` (READY: a block held before we looked is
        never touched at all), the ones a request used since they were offered are
        ``returned``; a block that is no longer an offer to us (a later owner ended it) is
        dropped."""
        if len(blocks) == 1:
            self._claim_one(blocks[0])
        else:
            self._claim_many(blocks)

    def _claim_one(self, b: int) -> None:
        """``_claim`` of one block (a one-key store's), step for step without numpy."""
        table, (slot, gen) = self._table, self._me
        used = offers.used_since_offer_one(table, b) or b in self.recent
        held = self._holds.held_one(b)  # a load or lookup under way: leave it be
        if used or held:
            if offers.offered_to_one(table, b, slot, gen):
                (self.returned if used else self.declined).append(b)
            return
        if not offers.claim_one(table, b, slot, gen):  # EVICTING: no lookup reads it now
            if offers.offered_to_one(table, b, slot, gen):  # caught mid-settle: later
                self.declined.append(b)
            return
        crash_point("client.claim.before_check")
        full_fence()  # our claim before our reading of the holds: readers fence the other way
        if self._holds.held_one(b):  # a lease that raced the claim
            offers.unclaim_one(table, b)
            self.declined.append(b)
        else:
            offers.finish_one(table, b)
            self.spare.append(b)

    def _claim_many(self, blocks: list[int]) -> None:
        """``_claim`` of several blocks, each step for all of them at once."""
        b = np.array(blocks, np.intp)
        used = offers.used_since_offer(self._table, b)
        if self.recent:
            used |= np.isin(b, np.fromiter(self.recent, np.intp, len(self.recent)))
        held = self._holds.held(b)  # a load or lookup under way: leave it be
        if (used | held).any():
            mine = offers.offered_to(self._table, b, *self._me)
            self.returned.extend(b[used & mine].tolist())
            self.declined.extend(b[held & ~used & mine].tolist())
            b = b[~(used | held)]
        ok = offers.claim(self._table, b, *self._me)  # EVICTING: no lookup reads them now
        crash_point("client.claim.before_check")
        full_fence()  # our claims before our reading of the holds: readers fence the other way
        claimed = b[ok]
        held = self._holds.held(claimed)  # a lease that raced the claim
        offers.unclaim(self._table, claimed[held])
        self.declined.extend(claimed[held].tolist())
        offers.finish(self._table, claimed[~held])
        self.spare.extend(claimed[~held].tolist())
        still = b[~ok]  # e.g. caught mid-settle by a new owner: try again later if so
        if still.size:
            again = offers.offered_to(self._table, still, *self._me)
            self.declined.extend(still[again].tolist())

    def complete(self, keys: Sequence[bytes], success: bool, chunk: int,
                 running: Running | None = None
                 ) -> tuple[list[bytes], list[bytes], list[int]]:
        """Publish (or fail) those of ``keys`` in flight, one-way, ``chunk`` keys a frame (the
        owner ranks them for ``running``). Returns the keys that are not ours (their
        completion is a round trip), and the keys published and their blocks, in order."""
        inflight, mine, rest = self.inflight, {}, []
        for k in keys:
            b = inflight.get(k)
            if b is not None:
                mine[k] = b
            elif k not in mine and k not in self.unconfirmed:  # unconfirmed: done already
                rest.append(k)
        ks, bs = list(mine), list(mine.values())
        for i in range(0, len(ks), chunk):  # in flight until sent: a failed push can be redone
            part = ks[i:i + chunk]
            back = self.returned[:RETURNED_PER_FRAME]
            pos = self._link.push(P.Publish(0, part, bs[i:i + chunk], success,
                                            **P.running_fields(running, part), returned=back))
            del self.returned[:len(back)]
            for k in part:
                del inflight[k]
            if success:
                self.unconfirmed.update(dict.fromkeys(part, pos))
        return (rest, ks, bs) if success else (rest, [], [])

    def confirm(self, key: bytes) -> bool:
        """Whether the index now shows our store of ``key``, which it did not a moment ago:
        True once the owner took its Publish meanwhile (look again). False if it had taken
        it before (the key is gone: a miss), or takes longer than ``CONFIRM_WAIT_S`` (a
        stalled owner: the key stays ours, read as still being stored). A read waits once
        per stall: while the owner has not moved since, it does not wait again."""
        pos, requests = self.unconfirmed[key], self._link.requests
        if requests.consumed(pos):
            del self.unconfirmed[key]
            return False
        if requests.head() == self._stalled_at or \
                not self._link.wait_consumed(pos, CONFIRM_WAIT_S):
            self._stalled_at = requests.head()
            return False
        del self.unconfirmed[key]
        return True

    def prune(self) -> None:
        """Forget our stores the owner has published (oldest first, in ring order)."""
        u, consumed = self.unconfirmed, self._link.requests.consumed
        while u:
            k = next(iter(u))
            if not consumed(u[k]):
                return
            del u[k]

    def close(self) -> None:
        self._gw.release()
        self._gi.release()
        self._holds.close()
