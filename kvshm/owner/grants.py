"""Block grants: blocks the owner hands each client ahead of its stores.

This module owns the owner's side of store-without-round-trip. The owner keeps every storing
client stocked with a few blocks (its *grant ring* in the client slot): free blocks while
there are any, and otherwise the victims the policy chooses as for any store, *offered*
instead of evicted: an offered block stays READY, cached and readable, until its client takes
it and claims it (``OwnStores.take``: CLAIMED, after the same handshake with other clients'
holds that an eviction makes), so grants hold no block out of the cache. A client's
``prepare_store`` takes blocks from its ring without asking anyone; its ``complete_store`` is
a one-way ``Publish`` frame that the owner applies in ring order. The owner alone enters keys
into the index, so two clients that stored the same key are resolved here: the first
published wins, the other block goes back to the free list.

Invariants (the table says it all, so a successor rebuilds it):
* a granted block is GRANTED in the table with its client's (slot, gen), no key, and in
  ``writer_req`` its position in the client's ring, from before its id enters the ring until
  the owner publishes or frees it; nobody else gets it. An offered block is READY with its
  key and the same three fields (CLAIMED once its client took it), out of the policy (never
  chosen again) but still in the index; the owner writes nothing of it but its last use
  until the client publishes it or dies. A successor ends no grant of a live client (its
  counts are its own to scribble, so any grant may be one it took): it hands over the ones
  whose position the ring's ``granted`` count never reached (their predecessor died
  handing them over), and keeps any it cannot hand over until the client goes;
* a client may publish only blocks it has taken (position below its ``taken`` count);
* a live client's untaken grants end early only by a recall (``stocking.recall``): its
  ring's count goes below them first, then its intent word shows it is not taking them;
* a published key that another client's unfinished round-trip store holds waits for that
  store (``deferred``, and GRANTED with its key in the table, so a successor knows): the
  completed block is published if that store fails or its writer dies, and freed if it
  succeeds, so a completed store is never lost to an unfinished one;
* ``publish`` of a block that is not granted to the sender is ignored, which makes a
  replayed ``Publish`` (an owner died applying it) harmless;
* a dead client's grants are freed only once no process registered to copy for it lives
  (``LocalManager.reclaim_writer``), as its unfinished stores are; an offer it never
  claimed is simply cached again.

How many blocks each client is kept stocked with is ``stocking.py``'s. This module never
copies block data and never blocks.
"""
from __future__ import annotations

import time
from collections.abc import Sequence

from kvshm.crashpoints import crash_point
from kvshm.index.api import Running
from kvshm.owner.entries import Client, Entries
from kvshm.owner.eviction import Evictor
from kvshm.owner.outcomes import Outcomes
from kvshm.owner.policy import Rank
from kvshm.owner.running import RankOf, RunningRanks
from kvshm.shm import layout as L
from kvshm.shm import offers
from kvshm.shm.fence import full_fence
from kvshm.shm.keyindex import tags_of
from kvshm.shm.offers import offer
from kvshm.shm.segment import Segment

# Evicting for a grant must respect every client's leases, the grantee's own too: unlike a
# store's reply, a grant cannot tell its client which of its leases it took away.
ALL_HOLDS = -1


def _by_frame(fns: list[RankOf | None], frames: Sequence[tuple[Running | None, int]],
              blocks: list[int], done: dict[bytes, int]) -> RankOf | None:
    """One ``RankOf`` for the keys ``done`` published (key -> block) from several frames
    taken together: each key by ``fns`` of the frame whose block of it was published (a
    block's first naming: a later one is ignored as no longer granted)."""
    if not any(fns):
        return None
    if len(fns) == 1:
        return fns[0]
    frame_of: dict[int, int] = {}  # block -> its frame
    start = 0
    for f, (_, n) in enumerate(frames):
        for b in blocks[start:start + n]:
            frame_of.setdefault(b, f)
        start += n
    of = {k: fns[frame_of[b]] for k, b in done.items()}

    def rank_of(key: bytes | None) -> Rank | None:
        f = None if key is None else of.get(key)
        return None if f is None else f(key)
    return rank_of


class Grants:
    """The granted blocks of every client, beside the owner's ``Entries``: a granted block is
    in neither the entries nor the free list until it is published or freed."""

    def __init__(self, entries: Entries, evictor: Evictor, running: RunningRanks,
                 outcomes: Outcomes, segment: Segment) -> None:
        self.entries, self.evictor, self.running = entries, evictor, running
        self.outcomes, self.segment = outcomes, segment
        # (slot, gen) -> {granted block: its position in that client's ring}
        self.blocks: dict[Client, dict[int, int]] = {}
        # offered block -> the key it still holds in the index (None: gone from it, the block
        # was found CLAIMED by a rebuild); also in ``blocks``
        self.offered: dict[int, bytes | None] = {}
        self.deferred: dict[bytes, int] = {}  # key -> completed block waiting for a store

    def held(self, writer: Client | None = None) -> int:
        """Blocks granted (to ``writer``; to anyone if None) and not yet published or freed."""
        if writer is not None:
            return len(self.blocks.get(writer, ()))
        return sum(map(len, self.blocks.values()))

    def adopt(self, block: int, writer: Client, pos: int, offered: bytes | None = None,
              claimed: bool = False) -> None:
        """A rebuild found ``block`` granted to a live ``writer`` at ring position ``pos``:
        GRANTED, offered while still holding (indexed) key ``offered``, or ``claimed``."""
        self.blocks.setdefault(writer, {})[block] = pos
        if offered is not None or claimed:
            self.offered[block] = offered

    def hold(self, block: int, writer: Client) -> None:
        """A rebuild found ``block`` WRITING for a live ``writer`` under a key another store
        holds too (damage): no key may name it, and the writer may still copy into it. It
        is held for the writer like a claimed grant that was surely handed over (position
        -1), freed when the writer goes, or when a Publish names it (never published: it
        was not claimed)."""
        self.adopt(block, writer, -1, claimed=True)

    def settle(self, slot: int, gen: int, granted: int, taken: int, intent: int
               ) -> list[int]:
        """At takeover: the grants of live client (slot, gen) whose position its ring's
        ``granted`` count never reached. A predecessor died handing them over: the ones
        from ``granted`` on, as long as their positions run on and the ring has room, are
        returned for the caller to hand over (ids, then the count, as a refill does), an
        offer it left mid-rewrite as it lies (the client's claim closes its round). Any
        other stays granted, never handed over, until the client goes, and none is ended
        or freed: the counts are the client's to scribble, so it may have taken any of
        them, and may be inside its claim round of an offer (odd and READY, as an offer its
        predecessor died writing looks). One that died recalling them (``stocking.recall``)
        may have lowered the count below positions the client was taking (announced in
        ``intent``): a taken count above it, up to the intent, is that, and the run must
        reach it. Nothing when the counts are impossible: its death ends everything."""
        cut_short = granted < taken <= intent  # (a recall: the run must reach ``taken``)
        if not cut_short and grant_level(granted, taken) is None:
            return []
        mine = self.blocks.get((slot, gen), {})
        room = L.GRANT_CAPACITY - (granted - taken)
        run: list[int] = []
        for pos, b in sorted((pos, b) for b, pos in mine.items() if pos >= granted):
            if pos != granted + len(run) or len(run) >= room:
                break
            run.append(b)
        return [] if granted + len(run) < taken else run

    def take_back(self, writer: Client, first: int) -> int:
        """End ``writer``'s grants at ring positions from ``first`` on, which its ring's count
        no longer reaches and its client is not taking (``stocking.recall``): a free grant
        goes FREE, an offer is cached again (``_end``). The highest position goes first, so
        that an owner dying midway leaves the rest a run from ``first`` on, which a
        successor hands over again (``settle``). Returns how many."""
        mine = self.blocks.get(writer, {})
        back = sorted((b for b, pos in mine.items() if pos >= first), key=mine.__getitem__,
                      reverse=True)
        for b in back:
            del mine[b]
            if b not in self.offered:  # (FREE first, or a successor adopts it as granted)
                self.entries.table.write(b, L.FREE, b"")
            self._end([b])
            crash_point("owner.recall.mid")
        if back:
            self.segment.counter_add("recalled_blocks", len(back))
        return len(back)

    def _end(self, blocks: list[int]) -> None:
        """Blocks granted to nobody any more: a free grant, or an offer the client claimed,
        goes back to the free list (an offer's old key leaves the index first); an offer it
        never claimed (or whose claim it never finished) is cached again, most recent, as if
        a request had just used it."""
        table, entries, free = self.entries.table, self.entries, []
        for b in blocks:
            if b not in self.offered:
                free.append(b)
                continue
            key = self.offered.pop(b)
            e = entries.get(key) if key is not None else None
            if key is None or e is None or e.block != b:  # claimed in a past life (or its
                free.append(b)                # key torn): nothing of it indexed here
            elif table.read(b).state in (L.READY, L.EVICTING):  # never claimed, or the claim
                table.reset_ready(b)  # never finished: nothing written, READY as ever
                entries.requeue(key, e)
                entries.unoffered(e)
            else:  # CLAIMED (its data may be half new): forget its key, then free it
                entries.forget(key)
                self.outcomes.evicted([key])
                free.append(b)
        self._free(free)

    def grant(self, slot: int, gen: int, n: int, first: int) -> list[int]:
        """Up to ``n`` blocks for (slot, gen): free ones first (GRANTED), then victims the
        policy chooses, offered (still READY, cached until the client claims them); fewer
        when too little can be chosen. Each is marked in the table before the caller rings
        it, free grants first in the ring."""
        entries = self.entries
        free = entries.take_free(min(n, len(entries.free)))
        short = n - len(free)
        victims = self.evictor.choose(short, ALL_HOLDS, (slot, gen)) if short > 0 else None
        crash_point("owner.offer.after_choose")
        chosen = [entries.by_key[k] for k in victims or ()]
        for e in chosen:
            entries.offered(e)  # going: no later choice counts it in its tenant's share
        offers = [e.block for e in chosen]
        pos = range(first, first + len(free) + len(offers))
        entries.table.write_many(free, L.GRANTED, None, slot, gen, pos[:len(free)],
                                 entries.tick)
        if offers:
            offer(entries.table, offers, slot, gen, pos[len(free):], entries.tick)
            self.offered.update(zip(offers, victims or ()))
            self.segment.counter_add("offered_blocks", len(offers))
        out = free + offers
        self.blocks.setdefault((slot, gen), {}).update(zip(out, pos))
        self.segment.counter_add("granted_blocks", len(out))
        return out

    def publish(self, slot: int, gen: int, keys: list[bytes], blocks: list[int],
                success: bool, taken: int, running: Running | None = None,
                returned: Sequence[int] = (),
                frames: Sequence[tuple[Running | None, int]] | None = None
                ) -> None:
        """Apply a client's ``Publish``: each granted block becomes its key, READY and in the
        index (unless the key is cached already, or the store failed: then it is freed), at
        ``running``'s provisional rank when it has one (``frames``: for several frames taken
        together, each frame's running request and key count instead); the ``returned`` offers
        (taken, never claimed) are cached again. Blocks not granted to the sender, or not
        yet taken by it (position at or above its ``taken`` count), are ignored."""
        entries = self.entries
        if frames is None:
            frames = [(running, len(keys))]
        # ranks are advice: a bad one costs no store
        fns, bad = self.running.rank_of_frames(frames, (slot, gen)) if success else ([], 0)
        if bad:
            self.segment.counter_add("errors", bad)
        mine = self.blocks.get((slot, gen), {})
        back = [b for b in dict.fromkeys(returned) if mine.get(b, taken) < taken]
        for b in back:
            del mine[b]
        self._end(back)
        entries.tick += 1
        done, freed = self._sort_publish(slot, gen, keys, blocks, mine, taken, success)
        rank_of = _by_frame(fns, frames, blocks, done)
        if not mine:
            self.blocks.pop((slot, gen), None)
        if freed:
            entries.release(freed)
        keys, blocks = list(done), list(done.values())
        tags = tags_of(keys)  # one crc32 per key, for the table's checksums and the index
        # A tick per key, in order: the recency a successor rebuilds is the order the keys
        # were published in (frames taken together included: ``coalesce.py``)
        uses = range(entries.tick, entries.tick + len(keys))
        entries.tick += max(len(keys) - 1, 0)  # (the last key's)
        entries.table.write_many(blocks, L.READY, keys, -1, 0, 0, uses, time.time_ns(), tags,
                                 slot, gen)
        if keys:
            crash_point("owner.publish.mid")
        entries.adopt_many(blocks, keys, None, rank_of, tenant=(slot, gen), tags=tags)
        self.outcomes.stored(keys, success, len(freed))

    def _sort_publish(self, slot: int, gen: int, keys: list[bytes], blocks: list[int],
                      mine: dict[int, int], taken: int, success: bool
                      ) -> tuple[dict[bytes, int], list[int]]:
        """``publish``'s general case, a key at a time: which of the sender's taken blocks
        are published (key -> block) and which are freed; a block behind another client's
        unfinished store of its key is deferred. Blocks sorted leave ``mine``."""
        entries, done, freed = self.entries, {}, []
        ours = []  # (key, block, position): granted to the sender and taken by it
        pos_of = mine.get
        for k, b in zip(keys, blocks):
            pos = pos_of(b, taken)
            if pos >= taken:
                continue  # published already (a replayed frame), never ours, or not taken
            del mine[b]
            ours.append((k, b, pos))
        offered = self.offered
        unclaimed = self._claimed([b for _, b, _ in ours if b in offered])
        get, deferred = entries.by_key.get, self.deferred
        for k, b, pos in ours:
            if b in unclaimed:
                continue
            e = get(k)
            if e is None and success and k not in done:  # (the common case first)
                done[k] = b
            elif success and e is not None and not e.ready and k not in deferred:
                # Another client's store of k is unfinished: wait for it, keyed in the
                # table so that a successor owner still knows (``adopt``).
                entries.table.write(b, L.GRANTED, k, slot, gen, pos, entries.tick, tenant=slot,
                                    tenant_gen=gen)
                deferred[k] = b
            else:  # failed, or stored first
                freed.append(b)
        return done, freed

    def _claimed(self, blocks: list[int]) -> set[int]:
        """Offered blocks in a Publish: their old keys leave the index (an eviction each),
        and the ones their client did not claim before writing are returned, never
        published (a client that never claimed a block may have written into one others
        read), and freed once nobody holds them (``_free``)."""
        if not blocks:
            return set()
        entries, old = self.entries, list(map(self.offered.pop, blocks))
        get = entries.by_key.get
        gone = [k for k, b in zip(old, blocks)
                if k is not None and (e := get(k)) is not None and e.block == b]
        if gone:
            entries.forget_many(gone)
            self.outcomes.evicted(gone)
        crash_point("owner.publish.after_forget")
        state = offers.states_of(entries.table, blocks)
        bad = {b for b, s in zip(blocks, state) if s != L.CLAIMED}
        if bad:
            self.segment.counter_add("errors", len(bad))
            self._free(sorted(bad))
        return bad

    def _free(self, blocks: list[int]) -> None:
        """Free blocks that hold nothing any more. One a reader may still hold (READY or
        EVICTING in the table: an offer whose key is gone, or one written without a claim)
        goes FREE before the holds are read, as an eviction marks before it reads (a reader
        from now on sees it gone, one that came earlier is seen), and is parked while held
        (``free_unless_held``): only a claim, which reads every client's holds, may take a
        block from a load under way."""
        if not blocks:  # (a Publish that returned nothing: most of them)
            return
        entries = self.entries
        state = offers.states_of(entries.table, blocks)
        readable = [b for b, s in zip(blocks, state) if s in (L.READY, L.EVICTING)]
        entries.release([b for b, s in zip(blocks, state) if s not in (L.READY, L.EVICTING)])
        if readable:
            entries.table.write_many(readable, L.FREE)
            full_fence()
            held = self.evictor.held(ALL_HOLDS) if self.evictor.held else set()
            crash_point("owner.free.after_holds")
            entries.free_unless_held(readable, held)

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
        mark = entries.table.read(b)  # GRANTED to the client that stored it
        tenant = (mark.writer, mark.writer_gen) if mark.writer >= 0 else None
        entries.table.write(b, L.READY, key, -1, 0, 0, entries.tick, time.time_ns(), 0,
                            *(tenant or (-1, 0)))
        entries.adopt(b, key, None, tenant=tenant)  # in its client's share
        self.outcomes.stored([key], True, 0)

    def end_unclaimed(self, writer: Client) -> int:
        """End ``writer``'s offers it never finished claiming (READY, or EVICTING: a claim
        marked, undecided) as ``_end`` does: cached again, or freed if no index names it (a
        claim a rebuild kept, READY again: given back, or a dead owner began its publish,
        its copies over). Nothing is ever written into an offer before its claim ends, so
        not even a live copier of a dead writer can land in one; a reader waiting for the
        claim's decision gets it (every round left open is closed: settled, or by the FREE
        write). Returns how many."""
        mine, table = self.blocks.get(writer, {}), self.entries.table
        ours = [b for b in mine if b in self.offered]
        state = offers.states_of(table, ours)  # (the state bytes: nobody rewrites them now)
        # Its client is dead: a claim round it left open is closed (a claim stores the state
        # byte alone), or every reader would spin on it. Not the round of a readable offer no
        # index names: one a rebuild kept odd may be a dead owner's publish of its claim
        # (READY over the old key and checksum, the new key's bytes in the block). Its round
        # stays open until the FREE write in ``_end`` ends it (a write goes on from an odd
        # sequence number): settled first, it would look intact to the next owner if this
        # one died in between.
        for b, s in zip(ours, state):
            if self.offered[b] is not None or s not in (L.READY, L.EVICTING):
                table.settle(b)
        crash_point("owner.unclaimed.settled")
        done = [b for b, s in zip(ours, state) if s in (L.READY, L.EVICTING)]
        for b in done:
            del mine[b]
        self._end(done)
        return len(done)

    def free(self, writer: Client) -> int:
        """End every grant of ``writer`` (its client is gone, with its copiers): free blocks
        and claimed offers are freed, offers it never claimed are cached again."""
        blocks = self.blocks.pop(writer, {})
        self._end(sorted(blocks))
        return len(blocks)


def grant_level(granted: int, taken: int) -> int | None:
    """Blocks in a client's grant ring from its two counts, or None if the counts are
    impossible (the client scribbled on its slot): taken above granted, more than the ring
    holds, or a granted count so high that the next positions would not fit a table entry's
    u64 (counts only grow, by a block at a time)."""
    level = granted - taken
    if 0 <= level <= L.GRANT_CAPACITY and granted <= 2**64 - 1 - L.GRANT_CAPACITY:
        return level
    return None
