"""The LRU eviction order, as vLLM's ``LRUCachePolicy``: fresh and provisional ranks, groups.

This module owns LRU's ranks and the structures that keep them in order, and the groups a
caller files keys under (``base``). It must never know about blocks, block state or shared
memory: which key may go is ``can_evict``'s to say.
"""
from __future__ import annotations

import heapq
from collections import deque
from collections.abc import Collection, Iterator, Sequence
from itertools import islice, repeat
from operator import itemgetter

from kvshm.index.access import MISSED, RANKED  # how a request used a key
from kvshm.owner.policy.base import CachePolicy, CanEvict, Group, Rank, no_victims

Fresh = dict[bytes, int]  # key -> fresh rank n, in rank order (a touch re-adds at the end)
_KEY = itemgetter(1)


class LRUPolicy(CachePolicy):
    """Keys ordered by rank, the lowest (least recent) first, as vLLM's ``LRUCachePolicy``.

    A rank is ``(n, sub)``. Every insertion or touch takes a fresh ``n`` from one counter, so
    without provisional ranks this is plain LRU. A running request's keys may instead share a
    provisional rank (``RANKED`` accesses and ranked inserts, vLLM 0.33): ``(r, -position)``
    with ``r`` taken from the same counter when the request first needed it (``new_rank``), so
    its tails precede its heads and everything ranked after ``r`` outlives them. Ties (keys of
    one request at one position) go by key bytes, as in vLLM's heap.

    Fresh ranks only ever grow, so keys holding one sit in a dict ``key -> n`` in rank order
    (a touch pops and re-adds a key: cheaper per key than an OrderedDict, for every store);
    keys holding a provisional rank in ``key -> rank`` and a heap of ``(rank, key)``, lazily
    invalidated. Eviction merges the two in rank order, skipping keys ``can_evict`` refuses;
    the heap only holds keys of running requests: the common case is a plain LRU's cost.

    A group other than None keeps its keys' fresh ranks in a dict of its own, in rank order
    as well, so an eviction that may not take a group's keys never walks them: it merges the
    dicts of the groups it may take from. Without such groups (no quotas) every key is in the
    common dict, and nothing costs more than a plain LRU.
    """

    name = "lru"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # unused by LRU; kept so both policies build the same way
        self._fresh: Fresh = {}  # the common group's fresh ranks, lowest first
        self._groups: dict[Group, Fresh] = {}  # every other group's, lowest first; none empty
        self._prov: dict[bytes, Rank] = {}  # provisional ranks (never a key of a Fresh)
        self._pgroup: dict[bytes, Group] = {}  # a provisional key's group, if not None
        self._heap: list[tuple[Rank, bytes]] = []  # provisional ranks
        self._next = 0

    def new_rank(self) -> int:
        self._next += 1
        return self._next

    # --- where a key is -------------------------------------------------------------------
    def _where(self, key: bytes) -> tuple[Group, Fresh] | None:
        """The group and the dict holding ``key``'s fresh rank, or None."""
        if key in self._fresh:
            return None, self._fresh
        for g, d in self._groups.items():
            if key in d:
                return g, d
        return None

    def _dict_of(self, group: Group) -> Fresh:
        if group is None:
            return self._fresh
        d = self._groups.get(group)
        if d is None:
            d = self._groups[group] = {}
        return d

    def _tidy(self) -> None:
        """Forget emptied groups (so that no group left means the plain LRU's paths)."""
        for g in [g for g, d in self._groups.items() if not d]:
            del self._groups[g]

    def _rank(self, key: bytes) -> Rank | None:
        where = self._where(key)
        return (where[1][key], 0) if where is not None else self._prov.get(key)

    # --- changes ------------------------------------------------------------------------
    def _freshen(self, key: bytes, group: Group = None) -> None:
        """``key`` takes a fresh rank in its group: the one it is filed under if it is
        cached (a provisional key's too), else ``group``."""
        if key in self._prov:
            del self._prov[key]
            group = self._pgroup.pop(key, None)
        else:
            where = self._where(key)
            if where is not None:
                group, home = where
                del home[key]
        self._dict_of(group)[key] = self.new_rank()

    def _provisional(self, key: bytes, rank: Rank, group: Group = None) -> None:
        if key in self._prov:
            group = self._pgroup.get(key)
        elif (where := self._where(key)) is not None:
            group, home = where
            del home[key]
            self._tidy()
        self._prov[key] = rank
        if group is not None:
            self._pgroup[key] = group
        heapq.heappush(self._heap, (rank, key))
        if len(self._heap) > 2 * len(self._prov) + 64:  # mostly stale
            self._heap = [(r, k) for k, r in self._prov.items()]
            heapq.heapify(self._heap)

    def insert(self, key: bytes, rank: Rank | None = None, group: Group = None) -> None:
        if rank is None:
            self._freshen(key, group)
        else:
            self._provisional(key, rank, group)

    def insert_many(self, keys: Sequence[bytes], group: Group = None) -> None:
        if not keys:
            return
        if len(set(keys)) != len(keys):  # a key twice: it ends where its last insert puts it
            for k in keys:
                self._freshen(k, group)
            return
        # New keys (the caller's promise), in C-level passes: a store's batch.
        if self._prov:
            deque(map(self._prov.pop, keys, repeat(None)), 0)
            deque(map(self._pgroup.pop, keys, repeat(None)), 0)
        start = self._next + 1
        self._next += len(keys)
        deque(map(self._fresh.pop, keys, repeat(None)), 0)
        self._dict_of(group).update(zip(keys, range(start, self._next + 1)))

    def regroup(self, keys: Sequence[bytes], group: Group) -> None:
        moved: list[tuple[int, bytes]] = []
        for k in keys:
            if k in self._prov:
                self._pgroup.pop(k, None)
                if group is not None:
                    self._pgroup[k] = group
            elif (where := self._where(k)) is not None and where[1] is not self._dict_of(group):
                moved.append((where[1].pop(k), k))
        if moved:  # into the group's dict, each at its rank: the dict rebuilt in rank order
            target = self._dict_of(group)
            merged = list(heapq.merge(list(zip(target.values(), target)), sorted(moved)))
            target.clear()
            target.update(zip(map(_KEY, merged), map(itemgetter(0), merged)))
        self._tidy()

    def remove(self, key: bytes) -> None:
        if key in self._prov:
            del self._prov[key]
            self._pgroup.pop(key, None)
        elif (where := self._where(key)) is not None:
            del where[1][key]
            self._tidy()

    def remove_many(self, keys: Sequence[bytes]) -> None:
        # (a key is in one dict at most; a stale heap entry is skipped like any other)
        deque(map(self._fresh.pop, keys, repeat(None)), 0)
        if self._prov:
            deque(map(self._prov.pop, keys, repeat(None)), 0)
            deque(map(self._pgroup.pop, keys, repeat(None)), 0)
        if self._groups:
            for d in self._groups.values():
                deque(map(d.pop, keys, repeat(None)), 0)
            self._tidy()

    def touch(self, key: bytes, ready: bool) -> None:
        if key in self:  # a key evicted between lookup and touch is not an error
            self._freshen(key)

    def touch_many(self, keys: Sequence[bytes], ready: Sequence[bool]) -> None:
        if self._groups or self._pgroup:  # each key stays in its group: one at a time
            for k in keys:
                self.touch(k, True)
            return
        keys = [k for k in keys if k in self._fresh or k in self._prov]
        if len(set(keys)) != len(keys):  # a key twice: it ends where its last touch puts it
            for k in keys:
                self._freshen(k)
            return
        if self._prov:
            deque(map(self._prov.pop, keys, repeat(None)), 0)
        start = self._next + 1
        self._next += len(keys)
        deque(map(self._fresh.pop, keys, repeat(None)), 0)  # present ones move to the end
        self._fresh.update(zip(keys, range(start, self._next + 1)))

    def access(self, key: bytes, how: int, rank: Rank | None = None) -> None:
        if how == RANKED:
            # vLLM 0.33's on_request_access: a running request's rank, never an older one
            now = self._rank(key)
            if rank is not None and now is not None and now < rank:
                self._provisional(key, rank)
        elif how != MISSED:
            self.touch(key, True)

    # --- eviction -----------------------------------------------------------------------
    def _current(self) -> tuple[Rank, bytes] | None:
        """The heap's lowest current entry (stale ones above it are dropped), or None."""
        heap, prov = self._heap, self._prov
        while heap:
            rank, key = heap[0]
            if prov.get(key) == rank:
                return heap[0]
            heapq.heappop(heap)
        return None

    def _scanned(self, only: Collection[Group] | None, skip: Collection[Group]
                 ) -> list[Fresh]:
        """The dicts of fresh ranks an eviction may take from."""
        if not self._groups:
            return [self._fresh] if None not in skip and (only is None or None in only) \
                else []
        return [d for g, d in ((None, self._fresh), *self._groups.items())
                if d and g not in skip and (only is None or g in only)]

    @staticmethod
    def _pairs(dicts: list[Fresh]) -> Iterator[tuple[int, bytes]]:
        """``(n, key)`` of every key of ``dicts``, lowest rank first."""
        if len(dicts) == 1:
            return zip(dicts[0].values(), dicts[0])
        return heapq.merge(*(zip(d.values(), d) for d in dicts))

    def evict(self, n: int, can_evict: CanEvict, only: Collection[Group] | None = None,
              skip: Collection[Group] = ()) -> list[bytes] | None:
        if n <= 0:
            return no_victims(n)
        top = self._current()
        dicts = self._scanned(only, skip)
        if top is None:  # fresh ranks only (no running request's): in C, one dict at least
            scan = iter(dicts[0]) if len(dicts) == 1 else map(_KEY, self._pairs(dicts))
            victims = list(islice(filter(can_evict, scan), n))
            if len(victims) < n:
                return None
            for d in dicts:
                deque(map(d.pop, victims, repeat(None)), 0)
            if len(dicts) > 1 or dicts[0] is not self._fresh:
                self._tidy()
            return victims
        heap = self._heap
        victims = []
        popped: list[tuple[Rank, bytes]] = []  # current heap entries taken out while scanning
        seen: set[bytes] = set()
        pairs = self._pairs(dicts)  # not mutated before the scan ends
        f = next(pairs, None)
        while len(victims) < n and (f is not None or top is not None):
            if f is not None and (top is None or ((f[0], 0), f[1]) < top):
                key, f = f[1], next(pairs, None)
            else:
                assert top is not None  # the loop runs while either has a key
                key = top[1]
                popped.append(heapq.heappop(heap))
                top = self._current()
                if key in seen:
                    continue  # a second entry of an unchanged rank
            seen.add(key)
            if can_evict(key):
                victims.append(key)
        taken = set(victims) if len(victims) == n else set()  # all-or-nothing
        for entry in popped:  # whatever is not evicted goes back
            if entry[1] not in taken:
                heapq.heappush(heap, entry)
        if not taken:
            return None
        for key in victims:
            if key in self._prov:
                del self._prov[key]
                self._pgroup.pop(key, None)
            else:
                del self._where(key)[1][key]  # type: ignore[index]
        self._tidy()
        return victims

    def order(self) -> list[bytes]:
        ranked = [((n, 0), k) for d in (self._fresh, *self._groups.values())
                  for k, n in d.items()]
        return [k for _, k in sorted(ranked + [(r, k) for k, r in self._prov.items()])]

    def __contains__(self, key: object) -> bool:
        return key in self._fresh or key in self._prov or \
            any(key in d for d in self._groups.values())

    def __len__(self) -> int:
        return len(self._fresh) + len(self._prov) + sum(map(len, self._groups.values()))
