"""Block grants: free blocks the owner hands each client ahead of its stores.

This module owns the owner's side of store-without-round-trip. The owner keeps every storing
client stocked with a few free blocks (its *grant ring* in the client slot, ``layout.GRANT_*``),
evicting in the background to refill it with the policy choosing victims as for any store.
A client's ``prepare_store`` takes blocks from its ring without asking anyone; its
``complete_store`` is a one-way ``Publish`` frame that the owner applies in ring order. The
owner alone enters keys into the index, so two clients that stored the same key are resolved
here: the first published wins, the other block goes back to the free list.

Invariants (the table says it all, so a successor rebuilds it):
* a granted block is GRANTED in the table with its client's (slot, gen), no key, and in
  ``writer_req`` its position in the client's ring, from before its id enters the ring until
  the owner publishes or frees it; nobody else gets it. A successor frees the blocks whose
  position the ring's ``granted`` count never reached (their predecessor died handing them
  over: the client cannot have taken them), and keeps the others, taken or not;
* a client may publish only blocks it has taken (position below its ``taken`` count);
* a published key that another client's unfinished round-trip store holds waits for that
  store (``deferred``, and GRANTED with its key in the table, so a successor knows): the
  completed block is published if that store fails or its writer dies, and freed if it
  succeeds, so a completed store is never lost to an unfinished one;
* ``publish`` of a block that is not granted to the sender is ignored, which makes a
  replayed ``Publish`` (an owner died applying it) harmless;
* a dead client's grants are freed only once no process registered to copy for it lives
  (``LocalManager.reclaim_writer``), as its unfinished stores are.

A granted block counts as used, so grants are kept small: a client is kept at
``grant_target`` (its share of a quarter of the cache) or at twice its largest store, the
growth beyond the share only while all grants together stay within ``grant_budget`` (that
quarter again), so grants never hold more than half the cache. It never copies block data
and never blocks.
"""
from __future__ import annotations

import time
from typing import Protocol

import numpy as np

from kvshm.crashpoints import crash_point
from kvshm.errors import InvalidArgumentError
from kvshm.index.api import Running
from kvshm.owner.entries import Client, Entries
from kvshm.owner.eviction import Evictor
from kvshm.owner.outcomes import Outcomes
from kvshm.owner.running import RunningRanks
from kvshm.shm import layout as L
from kvshm.shm.fence import publish_fence
from kvshm.shm.layout import Geometry
from kvshm.shm.segment import Segment
from kvshm.shm.words import WordView

# Evicting for a grant must respect every client's leases, the grantee's own too: unlike a
# store's reply, a grant cannot tell its client which of its leases it took away.
ALL_HOLDS = -1


def grant_target(g: Geometry) -> int:
    """Blocks a storing client is kept stocked with at first: its share of a quarter of the
    cache (0: tiny caches store by round trip)."""
    return min(L.GRANT_CAPACITY, g.num_blocks // (4 * g.max_clients))


def grant_budget(g: Geometry) -> int:
    """Blocks all clients' grants together may hold: a quarter of the cache."""
    return g.num_blocks // 4 if grant_target(g) else 0


class Grants:
    """The granted blocks of every client, beside the owner's ``Entries``: a granted block is
    in neither the entries nor the free list until it is published or freed."""

    def __init__(self, entries: Entries, evictor: Evictor, running: RunningRanks,
                 outcomes: Outcomes, segment: Segment) -> None:
        self.entries, self.evictor, self.running = entries, evictor, running
        self.outcomes, self.segment = outcomes, segment
        # (slot, gen) -> {granted block: its position in that client's ring}
        self.blocks: dict[Client, dict[int, int]] = {}
        self.deferred: dict[bytes, int] = {}  # key -> completed block waiting for a store

    def held(self, writer: Client | None = None) -> int:
        """Blocks granted (to ``writer``; to anyone if None) and not yet published or freed."""
        if writer is not None:
            return len(self.blocks.get(writer, ()))
        return sum(map(len, self.blocks.values()))

    def adopt(self, block: int, writer: Client, pos: int) -> None:
        """A rebuild found ``block`` GRANTED to a live ``writer`` at ring position ``pos``."""
        self.blocks.setdefault(writer, {})[block] = pos

    def settle(self, slot: int, gen: int, granted: int, taken: int) -> int:
        """At takeover: free the blocks of (slot, gen) whose position its ring's ``granted``
        count never reached (never handed over). Returns how many. Nothing when the counts
        are impossible (the client scribbled on its slot): ``granted`` then proves nothing,
        and a block it took may be being written; its death frees them all."""
        if grant_level(granted, taken) is None:
            return 0
        mine = self.blocks.get((slot, gen), {})
        lost = [b for b, pos in mine.items() if pos >= granted]
        for b in lost:
            del mine[b]
        self.entries.release(lost)
        return len(lost)

    def grant(self, slot: int, gen: int, n: int, first: int) -> list[int]:
        """Up to ``n`` blocks for (slot, gen), evicting if the free list is short (fewer when
        too little can be evicted). Each is GRANTED in the table before the caller rings it."""
        entries = self.entries
        short = n - len(entries.free)
        if short > 0 and self.evictor.evict(short, set(), ALL_HOLDS) is None:
            n = len(entries.free)
        out = entries.take_free(n)
        entries.table.write_many(out, L.GRANTED, None, slot, gen, range(first, first + n),
                                 entries.tick)
        self.blocks.setdefault((slot, gen), {}).update(zip(out, range(first, first + n)))
        self.segment.counter_add("granted_blocks", len(out))
        return out

    def publish(self, slot: int, gen: int, keys: list[bytes], blocks: list[int],
                success: bool, taken: int, running: Running | None = None) -> None:
        """Apply a client's ``Publish``: each granted block becomes its key, READY and in the
        index (unless the key is cached already, or the store failed: then it is freed), at
        ``running``'s provisional rank when it has one. Blocks not granted to the sender, or
        not yet taken by it (position at or above its ``taken`` count), are ignored."""
        entries = self.entries
        try:
            rank_of = self.running.rank_of(running, (slot, gen)) if success else None
        except InvalidArgumentError:
            rank_of = None  # ranks are advice: a bad one never costs a store
            self.segment.counter_add("errors")
        mine = self.blocks.get((slot, gen), {})
        entries.tick += 1
        done: dict[bytes, int] = {}  # key -> block, published by this frame
        freed = []
        for k, b in zip(keys, blocks):
            pos = mine.get(b, taken)
            if pos >= taken:
                continue  # published already (a replayed frame), never ours, or not taken
            del mine[b]
            e = entries.get(k)
            if success and e is not None and not e.ready and k not in self.deferred:
                # Another client's store of k is unfinished: wait for it, keyed in the
                # table so that a successor owner still knows (``adopt``).
                entries.table.write(b, L.GRANTED, k, slot, gen, pos, entries.tick)
                self.deferred[k] = b
            elif not success or e is not None or k in done:  # failed, or stored first
                freed.append(b)
            else:
                done[k] = b
        if not mine:
            self.blocks.pop((slot, gen), None)
        entries.release(freed)
        keys, blocks = list(done), list(done.values())
        entries.table.write_many(blocks, L.READY, keys, -1, 0, 0, entries.tick, time.time_ns())
        if keys:
            crash_point("owner.publish.mid")
        entries.adopt_many(blocks, keys, None, rank_of)
        self.outcomes.stored(keys, success, len(freed))

    def resolve(self, key: bytes) -> None:
        """The unfinished store of ``key`` ended: a block deferred behind it is published if
        the key is gone (that store failed, or its writer died), else freed."""
        b = self.deferred.pop(key, None)
        if b is None:
            return
        entries = self.entries
        if key in entries:
            entries.release([b])
            return
        entries.table.write(b, L.READY, key, -1, 0, 0, entries.tick, time.time_ns())
        entries.adopt(b, key, None)
        self.outcomes.stored([key], True, 0)

    def free(self, writer: Client) -> int:
        """Free every block granted to ``writer`` (its client is gone, with its copiers)."""
        blocks = self.blocks.pop(writer, {})
        self.entries.release(sorted(blocks))
        return len(blocks)


class StockedClient(Protocol):
    """What ``stock`` reads and keeps of a client (the owner's ``_Client``)."""
    slot: int
    gen: int
    grant_head: WordView  # its slot's grant counts (records.GRANT_HEAD_DTYPE)
    grant_ids: np.ndarray  # its slot's grant ring
    taken_seen: int  # its taken count at the last refill
    largest_store: int  # in blocks, the most it took between two refills or in one store


def grant_level(granted: int, taken: int) -> int | None:
    """Blocks in a client's grant ring from its two counts, or None if the counts are
    impossible (the client scribbled on its slot): taken above granted, more than the ring
    holds, or a granted count so high that the next positions would not fit a table entry's
    u64 (counts only grow, by a block at a time)."""
    level = granted - taken
    if 0 <= level <= L.GRANT_CAPACITY and granted <= 2**64 - 1 - L.GRANT_CAPACITY:
        return level
    return None


def sized_target(grants: Grants, level: int, writer: tuple[int, int], share: int,
                 largest: int, room: int) -> int:
    """The level to refill ``writer``'s ring to: twice its ``largest`` store, so one store
    takes at most half and a refill (at half) follows every store; never less than its
    ``share`` (counting its taken, unpublished blocks, so a client whose taken count runs
    ahead of its publishes is not refilled without end); the growth beyond the share within
    ``room``. It never shrinks: a scheduler's step sizes recur."""
    inflight = grants.held(writer) - level
    grown = min(L.GRANT_CAPACITY, max(share, 2 * largest))
    return min(grown, max(share - inflight, level + room, 0))


def refill(grants: Grants, head: WordView, ids: np.ndarray, slot: int, gen: int,
           granted: int, level: int, target: int) -> int:
    """Top up one client's grant ring (``granted`` pushed so far, ``level`` in it, from
    ``grant_level``) to ``target`` blocks, when it is half empty. The ids go in first, then
    the count that publishes them. Returns the blocks granted."""
    if level > target // 2:
        return 0
    blocks = grants.grant(slot, gen, target - level, granted)
    for i, b in enumerate(blocks):
        ids[(granted + i) % L.GRANT_CAPACITY] = b
    crash_point("owner.grant.before_count")
    publish_fence()  # ids before the count that hands them over
    head["granted"] = granted + len(blocks)
    return len(blocks)


def stock(grants: Grants, c: StockedClient, share: int, room: int) -> int | None:
    """One refill of client ``c``'s grant ring, sized by ``sized_target`` (its largest store
    so far grows from the blocks it took since the last refill). Returns the blocks
    granted, or None if its ring's counts are impossible (grant it nothing)."""
    head = c.grant_head
    granted, taken = head["granted"], head["taken"]
    level = grant_level(granted, taken)
    if level is None:
        return None
    if 0 < taken - c.taken_seen <= L.GRANT_CAPACITY:
        c.largest_store = max(c.largest_store, taken - c.taken_seen)
    c.taken_seen = taken
    target = sized_target(grants, level, (c.slot, c.gen), share, c.largest_store, room)
    return refill(grants, head, c.grant_ids, c.slot, c.gen, granted, level, target)
