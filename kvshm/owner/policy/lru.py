"""The LRU eviction order, as vLLM's ``LRUCachePolicy``: fresh and provisional ranks, groups.

This module owns LRU's ranks and the structures that keep them in order, and the groups a
caller files keys under (``base``). It must never know about blocks, block state or shared
memory: which key may go is ``can_evict``'s to say.
"""
from __future__ import annotations

import heapq
from collections import OrderedDict, deque
from collections.abc import Collection, Iterator, Sequence
from itertools import islice, repeat
from operator import itemgetter

from kvshm.index.access import MISSED, RANKED  # how a request used a key
from kvshm.owner.policy.base import CachePolicy, CanEvict, Group, Rank, no_victims

Entry = tuple[int, int, bytes]  # a provisional rank's heap entry: (n, sub, key). Flat, not
# ((n, sub), key): a heap step compares entries, and a nested rank tuple took twice as long
# (1.6 against 0.8 us a pop and push at 65,536 entries).
Fresh = OrderedDict[bytes, int]  # key -> fresh rank n, in rank order (a touch re-adds at
# the end). Ordered, not a plain dict: evictions delete at the front, and a plain dict keeps
# a deleted entry's place until it resizes, so every scan from the front walked thousands of
# them (13-20 us an eviction of one key at 65,536 keys, against 1 us).
_KEY = itemgetter(1)


class LRUPolicy(CachePolicy):
    """Keys ordered by rank, the lowest (least recent) first, as vLLM's ``LRUCachePolicy``.

    A rank is ``(n, sub)``. Every insertion or touch takes a fresh ``n`` from one counter, so
    without provisional ranks this is plain LRU. A running request's keys may instead share a
    provisional rank (``RANKED`` accesses and ranked inserts, vLLM 0.33): ``(r, -position)``
    with ``r`` taken from the same counter when the request first needed it (``new_rank``), so
    its tails precede its heads and everything ranked after ``r`` outlives them. Ties (keys of
    one request at one position) go by key bytes, as in vLLM's heap.

    Fresh ranks only ever grow, so keys holding one sit in an ordered dict ``key -> n`` in
    rank order (a touch pops and re-adds a key);
    keys holding a provisional rank in ``key -> entry`` and a heap of those entries
    ``(n, sub, key)``, lazily invalidated (an entry is current while the dict holds that very
    tuple). Eviction merges the two in rank order, skipping keys ``can_evict`` refuses;
    the heap only holds keys of running requests: the common case is a plain LRU's cost.

    A group other than None keeps its keys' fresh ranks in a dict of its own, in rank order
    as well, so an eviction that may not take a group's keys never walks them: it merges the
    dicts of the groups it may take from. Without such groups (no quotas) every key is in the
    common dict, and nothing costs more than a plain LRU.
    """

    name = "lru"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # unused by LRU; kept so both policies build the same way
        self._fresh: Fresh = OrderedDict()  # the common group's fresh ranks, lowest first
        self._groups: dict[Group, Fresh] = {}  # every other group's, lowest first; none empty
        self._group_of: dict[bytes, Group] = {}  # the group of each key of a ``_groups`` dict
        self._prov: dict[bytes, Entry] = {}  # provisional ranks (never a key of a Fresh)
        self._pgroup: dict[bytes, Group] = {}  # a provisional key's group, if not None
        self._heap: list[Entry] = []  # provisional ranks, stale entries among them
        self._next = 0

    def new_rank(self) -> int:
        self._next += 1
        return self._next

    # --- a key's group ------------------------------------------------------------------
    def _plain(self) -> bool:
        """No key in a group but the common one: the plain LRU's paths serve."""
        return not self._group_of and not self._pgroup

    def _file(self, key: bytes, n: int, group: Group) -> None:
        """Give ``key`` (in no dict) fresh rank ``n`` in ``group``."""
        if group is None:
            self._fresh[key] = n
            return
        d = self._groups.get(group)
        if d is None:
            d = self._groups[group] = OrderedDict()
        d[key] = n
        self._group_of[key] = group

    def _unfile(self, key: bytes) -> tuple[bool, Group]:
        """Take ``key``'s fresh rank out of its dict: (whether it had one, its group)."""
        if self._fresh.pop(key, None) is not None:
            return True, None
        g = self._group_of.pop(key, None)
        if g is None:
            return False, None
        d = self._groups[g]
        del d[key]
        if not d:
            del self._groups[g]
        return True, g

    def _unfile_many(self, keys: Sequence[bytes]) -> None:
        """``_unfile`` of each of ``keys`` (absent ones: no-op)."""
        deque(map(self._fresh.pop, keys, repeat(None)), 0)
        if self._group_of:
            for k in keys:
                g = self._group_of.pop(k, None)
                if g is not None:
                    del self._groups[g][k]
            self._tidy()

    def _tidy(self) -> None:
        """Forget emptied groups (so that no group left means the plain LRU's paths)."""
        for g in [g for g, d in self._groups.items() if not d]:
            del self._groups[g]

    def _rank(self, key: bytes) -> Rank | None:
        n = self._fresh.get(key)
        if n is None and (g := self._group_of.get(key)) is not None:
            n = self._groups[g][key]
        if n is not None:
            return (n, 0)
        e = self._prov.get(key)
        return None if e is None else (e[0], e[1])

    # --- changes ------------------------------------------------------------------------
    def _freshen(self, key: bytes, group: Group = None) -> None:
        """``key`` takes a fresh rank in its group: the one it is filed under if it is
        cached (a provisional key's too), else ``group``."""
        if group is None and not self._group_of and not self._pgroup:  # (plain)
            self._prov.pop(key, None)
            self._fresh.pop(key, None)
            self._fresh[key] = self.new_rank()
            return
        if key in self._prov:
            del self._prov[key]
            group = self._pgroup.pop(key, None)
        else:
            found, g = self._unfile(key)
            if found:
                group = g
        self._file(key, self.new_rank(), group)

    def _provisional(self, key: bytes, rank: Rank, group: Group = None) -> None:
        if group is None and not self._group_of and not self._pgroup:  # (plain)
            self._fresh.pop(key, None)
        elif key in self._prov:
            group = self._pgroup.get(key)
        else:
            found, g = self._unfile(key)
            if found:
                group = g
        self._prov[key] = entry = (rank[0], rank[1], key)
        if group is not None:
            self._pgroup[key] = group
        heapq.heappush(self._heap, entry)
        if len(self._heap) > 2 * len(self._prov) + 64:  # mostly stale
            self._heap = list(self._prov.values())
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
        # New keys (the caller's promise; one cached all the same moves, as a touch would),
        # in C-level passes: a store's batch.
        if self._prov:
            deque(map(self._prov.pop, keys, repeat(None)), 0)
            if self._pgroup:
                deque(map(self._pgroup.pop, keys, repeat(None)), 0)
        self._unfile_many(keys)
        start = self._next + 1
        self._next += len(keys)
        ranks = zip(keys, range(start, self._next + 1))
        if group is None:
            self._fresh.update(ranks)
            return
        d = self._groups.get(group)
        if d is None:
            d = self._groups[group] = OrderedDict()
        d.update(ranks)
        self._group_of.update(zip(keys, repeat(group)))

    def regroup(self, keys: Sequence[bytes], group: Group) -> None:
        moved: list[tuple[int, bytes]] = []
        for k in keys:
            if k in self._prov:
                self._pgroup.pop(k, None)
                if group is not None:
                    self._pgroup[k] = group
                continue
            n = self._fresh.get(k) if group is not None else None
            g = self._group_of.get(k)
            if n is not None or (g is not None and g != group):
                moved.append((n if n is not None else self._groups[g][k], k))
                self._unfile(k)
        self._merge_into(group, moved)

    def dissolve(self, group: Group) -> None:
        """File every key of ``group`` under the common group, each keeping its place (the
        group's reason to exist is gone: a client with a quota left)."""
        if group is None:
            return
        for k in [k for k, g in self._pgroup.items() if g == group]:
            del self._pgroup[k]
        d = self._groups.pop(group, None)
        if d:
            deque(map(self._group_of.pop, d), 0)
            self._merge_into(None, list(zip(d.values(), d)))

    def _merge_into(self, group: Group, moved: list[tuple[int, bytes]]) -> None:
        """File ``moved`` (``(n, key)``, keys in no dict) under ``group`` at their ranks:
        its dict is rebuilt in rank order (one linear merge)."""
        if not moved:
            return
        if group is None:
            target = self._fresh
        else:
            target = self._groups.setdefault(group, OrderedDict())
            self._group_of.update(zip(map(_KEY, moved), repeat(group)))
        merged = list(heapq.merge(list(zip(target.values(), target)), sorted(moved)))
        target.clear()
        target.update(zip(map(_KEY, merged), map(itemgetter(0), merged)))

    def remove(self, key: bytes) -> None:
        if key in self._prov:
            del self._prov[key]
            self._pgroup.pop(key, None)
        else:
            self._unfile(key)

    def remove_many(self, keys: Sequence[bytes]) -> None:
        # (a key is in one dict at most; a stale heap entry is skipped like any other)
        if self._prov:
            deque(map(self._prov.pop, keys, repeat(None)), 0)
            if self._pgroup:
                deque(map(self._pgroup.pop, keys, repeat(None)), 0)
        self._unfile_many(keys)

    def touch(self, key: bytes, ready: bool) -> None:
        # a key evicted between lookup and touch is not an error
        if key in self._fresh or key in self._prov or key in self._group_of:
            self._freshen(key)

    def touch_many(self, keys: Sequence[bytes], ready: Sequence[bool]) -> None:
        if not self._plain():  # each key stays in its group: one at a time
            for k in keys:
                self.touch(k, True)
            return
        # (cached keys move to the end, which is what insert_many does with them)
        self.insert_many([k for k in keys if k in self._fresh or k in self._prov])

    def access(self, key: bytes, how: int, rank: Rank | None = None) -> None:
        if how == RANKED:
            # vLLM 0.33's on_request_access: a running request's rank, never an older one
            now = self._rank(key)
            if rank is not None and now is not None and now < rank:
                self._provisional(key, rank)
        elif how != MISSED:
            self.touch(key, True)

    # --- eviction -----------------------------------------------------------------------
    def _current(self) -> Entry | None:
        """The heap's lowest current entry (stale ones above it are dropped), or None."""
        heap, prov = self._heap, self._prov
        while heap:
            top = heap[0]
            if prov.get(top[2]) is top:
                return top
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
            if dicts[0] is self._fresh and len(dicts) == 1:
                deque(map(self._fresh.pop, victims), 0)
            else:
                self._unfile_many(victims)
            return victims
        heap = self._heap
        victims = []
        popped: list[Entry] = []  # current heap entries taken out while scanning
        pairs = self._pairs(dicts)  # not mutated before the scan ends
        f = next(pairs, None)
        while len(victims) < n and (f is not None or top is not None):
            if f is not None and (top is None or (f[0], 0, f[1]) < top):
                key, f = f[1], next(pairs, None)
            else:
                assert top is not None  # the loop runs while either has a key
                key = top[2]
                popped.append(heapq.heappop(heap))
                top = self._current()  # (a key has one current entry: never seen twice)
            if can_evict(key):
                victims.append(key)
        taken = set(victims) if len(victims) == n else set()  # all-or-nothing
        for entry in popped:  # whatever is not evicted goes back
            if entry[2] not in taken:
                heapq.heappush(heap, entry)
        if not taken:
            return None
        for key in victims:
            self.remove(key)
        return victims

    def order(self) -> list[bytes]:
        ranked = [(n, 0, k) for d in (self._fresh, *self._groups.values())
                  for k, n in d.items()]
        return [e[2] for e in sorted(ranked + list(self._prov.values()))]

    def __contains__(self, key: object) -> bool:
        return key in self._fresh or key in self._prov or key in self._group_of

    def __len__(self) -> int:
        return len(self._fresh) + len(self._prov) + len(self._group_of)
