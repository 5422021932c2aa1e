"""The owner's entries: which key sits in which block, and which blocks are free.

This module owns the index's state (one ``Entry`` per cached key: block, readiness, load
pins, the writer of an unfinished store; the free list; the writer -> keys map of unfinished
stores, for reclaiming a dead writer's) and the eviction clock, and keeps its mirrors in step
with every change: the eviction policy's order, the block table and the key index in the
segment, which other processes read and a successor rebuilds from. It applies no manager
semantics (``manager.py`` does), chooses no victim (``eviction.py``) and copies no block data.
"""
from __future__ import annotations

from collections import Counter, deque
from collections.abc import Container, Iterable
from operator import attrgetter

from kvshm.errors import BlockStateError, UnknownKeyError
from kvshm.owner.policy import CachePolicy
from kvshm.owner.running import RankOf
from kvshm.shm import layout as L
from kvshm.shm.keyindex import KeyIndex, tags_of
from kvshm.shm.table import BlockTable

Client = tuple[int, int]  # (client slot, client generation): who writes a block
_TENANT = attrgetter("tenant")


class Entry:
    """One cached key: everything the owner knows of it, in one place."""
    __slots__ = ("block", "ready", "pins", "writer", "tenant")

    def __init__(self, block: int, ready: bool, writer: Client | None,
                 tenant: Client | None) -> None:
        self.block = block
        self.ready = ready
        self.pins = 0  # load pins taken by prepare_load (only ready keys are pinned)
        self.writer = writer  # (slot, gen) whose store is unfinished; None once ready
        self.tenant = tenant  # (slot, gen) that stored it (its share counts it), or None


class Entries:
    """The cached keys of one segment, mirrored into ``policy``, ``table`` and ``index``."""

    def __init__(self, policy: CachePolicy, table: BlockTable, index: KeyIndex,
                 tick: int) -> None:
        self.policy, self.table, self.index = policy, table, index
        self.by_key: dict[bytes, Entry] = {}
        # writer (slot, gen) -> keys whose entry names it: kept by adopt_many/unpend only
        self.pending: dict[Client, set[bytes]] = {}
        # Free blocks, granted oldest-freed first (popleft) and freed at the tail (append). A
        # late writer still copying into a block freed under it (its store was failed or
        # reclaimed) then lands in the block least likely to have been granted again.
        self.free: deque[int] = deque()
        self.parked: set[int] = set()  # freed, but a client may still read them: not reused
        self.tick = tick  # the eviction clock: +1 per touch, store or publish; in last_use
        # client (slot, gen) -> entries it stored (its share of the cache, for quotas), less
        # those offered to a grant (going, whatever quotas say by the time they are claimed);
        # a client that left stays here until its entries go, as nobody's to protect
        self.usage: dict[Client, int] = {}
        # tenants whose keys the policy files under a group of their own, so that an eviction
        # that may not take them never walks them (those with a quota: ``Quotas`` keeps it)
        self.grouped: Container[Client] = ()

    def __len__(self) -> int:
        return len(self.by_key)

    def __contains__(self, key: bytes) -> bool:
        return key in self.by_key

    def get(self, key: bytes) -> Entry | None:
        return self.by_key.get(key)

    def require_ready(self, key: bytes) -> Entry:
        e = self.by_key.get(key)
        if e is None:
            raise UnknownKeyError(f"key {key.hex()[:16]}… is not cached; lookup() first")
        if not e.ready:
            raise BlockStateError(f"key {key.hex()[:16]}… is still being stored; retry later")
        return e

    def adopt(self, block: int, key: bytes, writer: Client | None,
              tenant: Client | None = None) -> None:
        """Enter ``key`` at ``block``, most recent: ready without a writer, else pending for
        ``writer``; stored by ``tenant`` (the writer, when there is one)."""
        self.adopt_many([block], [key], writer, tenant=tenant)

    def adopt_many(self, blocks: list[int], keys: list[bytes], writer: Client | None,
                   rank_of: RankOf | None = None, tenant: Client | None = None,
                   tags: list[int] | None = None, indexed: bool = False) -> None:
        """``adopt`` of every key (distinct, none entered) at its block: one pass each over
        the entries, the policy and the index, as a batch of stores needs. With a running
        request's ``rank_of``, each key is ranked as it is inserted, as ``adopt`` one by one
        would: the request takes its rank at its first key with a position, after the
        fresh ranks of the keys before it. The table entries are the caller's to write;
        ``tags``: the keys' index tags, if the caller computed them for that write;
        ``indexed``: the key index names them already (a takeover kept their slots)."""
        ready = writer is None
        tenant = tenant or writer
        self.by_key.update(zip(keys, [Entry(b, ready, writer, tenant) for b in blocks]))
        if tenant is not None and keys:
            self.usage[tenant] = self.usage.get(tenant, 0) + len(keys)
        if writer is not None and keys:  # no empty record: nothing would ever remove it
            self.pending.setdefault(writer, set()).update(keys)
        group = self._group(tenant)
        if rank_of is None:
            self.policy.insert_many(keys, group)
        else:
            for k in keys:
                self.policy.insert(k, rank_of(k), group)
        if not indexed:
            self.index.insert_many(blocks, tags_of(keys) if tags is None else tags)

    def requeue(self, key: bytes, e: Entry) -> None:
        """``key`` (cached at ``e``, out of the policy's order) is back in it, most recent, in
        its tenant's group."""
        self.policy.insert(key, None, self._group(e.tenant))

    def _group(self, tenant: Client | None) -> Client | None:
        """The policy group of ``tenant``'s keys: its own while it has a quota."""
        return tenant if tenant in self.grouped else None

    def unpend(self, key: bytes, e: Entry) -> None:
        """The store of ``key`` is over (published or freed): forget its writer."""
        if e.writer is not None:
            keys = self.pending[e.writer]
            keys.discard(key)
            if not keys:
                del self.pending[e.writer]
            e.writer = None

    def drop_many(self, keys: list[bytes]) -> list[Entry]:
        """Forget every key (distinct) and free its block, the table's entries in one batch
        write (no eviction bookkeeping: an eviction's victims, failed or reclaimed stores).
        Returns their entries, as they were."""
        gone = list(map(self.by_key.pop, keys))
        for k, e in zip(keys, gone):
            if e.writer is not None:
                self.unpend(k, e)
        blocks = [e.block for e in gone]
        self._unindex(keys, blocks)
        self._unuse_many(gone)
        self.release(blocks)
        return gone

    def _unindex(self, keys: list[bytes], blocks: list[int]) -> None:
        """``keys`` (at ``blocks``, already out of ``by_key``) leave the policy and the
        index, in a batch each."""
        self.policy.remove_many(keys)
        self.index.remove_many(blocks, tags_of(keys))

    def _unuse_many(self, gone: list[Entry]) -> None:
        """``gone`` left the cache: they no longer count in their tenants' shares."""
        if len(gone) == 1:
            self._unuse(gone[0])
            return
        for tenant, n in Counter(map(_TENANT, gone)).items():
            if tenant is not None:
                left = self.usage.get(tenant, 0) - n
                if left > 0:
                    self.usage[tenant] = left
                else:
                    self.usage.pop(tenant, None)

    def _unuse(self, e: Entry) -> None:
        """``e`` leaves the cache: it no longer counts in its tenant's share."""
        if e.tenant is not None:
            n = self.usage.get(e.tenant, 0) - 1
            if n > 0:
                self.usage[e.tenant] = n
            else:
                self.usage.pop(e.tenant, None)

    def offered(self, e: Entry) -> None:
        """``e`` was offered to a grant: it no longer counts in its tenant's share (it is
        going as soon as its grantee claims it, and no quota is checked again then)."""
        self._unuse(e)

    def unoffered(self, e: Entry) -> None:
        """An offer of ``e`` ended unclaimed: it is cached again, in its tenant's share."""
        if e.tenant is not None:
            self.usage[e.tenant] = self.usage.get(e.tenant, 0) + 1

    def forget(self, key: bytes) -> Entry:
        """Take a ready ``key`` out of the entries and the index (and the policy, if still
        there) but leave its block to the caller: an offered block whose client claimed it
        (out of its tenant's share since it was offered)."""
        return self.forget_many([key])[0]

    def forget_many(self, keys: list[bytes]) -> list[Entry]:
        """``forget`` of every key (distinct, ready), in a batch: their entries, as they were
        (already out of their tenants' shares, as offered blocks)."""
        gone = list(map(self.by_key.pop, keys))
        self._unindex(keys, [e.block for e in gone])
        return gone

    def take_free(self, n: int) -> list[int]:
        """``n`` free blocks, oldest freed first (the caller checked there are enough)."""
        popleft = self.free.popleft
        return [popleft() for _ in range(n)]

    def release(self, blocks: Iterable[int]) -> None:
        """Blocks that hold nothing any more: FREE in the table, then on the free list."""
        blocks = list(blocks)
        self.table.write_many(blocks, L.FREE)
        self.free.extend(blocks)

    def free_unless_held(self, blocks: list[int], held: set[int]) -> None:
        """Blocks already FREE in the table onto the free list, but those a client holds
        (``held``, read after the table said FREE) parked until nobody does (``unpark``),
        so that no store writes into a block a load may be reading."""
        self.parked.update(blocks)
        self.unpark(held)

    def unpark(self, held: set[int]) -> None:
        """Parked blocks nobody holds any more (``held`` names those still held) go on the
        free list."""
        back = [b for b in self.parked if b not in held]
        self.parked.difference_update(back)
        self.free.extend(back)

    def park_held(self, held: set[int]) -> None:
        """A takeover's free list without the blocks a client holds (a predecessor parked
        them, or its rebuild freed them as damaged): parked until nobody does."""
        if held.intersection(self.free):
            self.parked.update(b for b in self.free if b in held)
            self.free = deque(b for b in self.free if b not in held)
