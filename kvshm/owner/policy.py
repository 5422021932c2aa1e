"""Eviction-order policies (LRU and ARC) for the owner's block index.

This module owns one thing: the order in which cached keys become eviction victims, plus
ARC's ghost lists and adaptive target. Keys are opaque ``bytes``. It must never know about
block ids, block state, shared memory or rings: the manager owns state (ready,
writing, pinned) and tells the policy through ``touch(key, ready)``, ``access(key, how)`` (a
request's accesses, classified by the engine integration) and the ``can_evict`` callback.
Semantics follow vLLM's v1 KV-offload ``LRUCachePolicy`` and ``ARCCachePolicy`` (0.20+:
atomic eviction; 0.33: ARC falls back to T1 when T2 has nothing, and LRU gives a running
request's keys a provisional rank: ``RANKED`` accesses and ranked inserts).

Not thread-safe: only the owner's single loop calls it.
"""
from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from itertools import islice, repeat

from kvshm.errors import InvalidArgumentError
from kvshm.index.access import INSERTED, MISSED, RANKED, REUSED  # how a request used a key
from kvshm.shm.layout import POLICY_NAMES  # recorded in the segment header, so defined there

CanEvict = Callable[[bytes], bool]
Rank = tuple[int, int]  # LRU: (n, sub), lowest first (see LRUPolicy)


def _no_victims(n: int) -> list[bytes]:
    # A negative count is a manager bug; failing loudly beats evicting nothing silently.
    if n < 0:
        raise InvalidArgumentError(f"evict needs a block count >= 0, got {n}")
    return []


class CachePolicy(ABC):
    """Eviction order over cached keys. ``can_evict`` must not call back into the policy."""

    name: str

    @abstractmethod
    def insert(self, key: bytes, rank: Rank | None = None) -> None:
        """A key was just allocated (store in flight). Caller guarantees it is not cached.
        ``rank``: a running request's provisional rank for it (LRU), else most recent."""

    def insert_many(self, keys: Sequence[bytes]) -> None:
        """``insert`` of each key in order, most recent (the last ends most recent). A
        policy may do it in bulk."""
        for k in keys:
            self.insert(k)

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Drop a key without evicting it (failed store): no ghost. Unknown key: no-op."""

    def remove_many(self, keys: Sequence[bytes]) -> None:
        """``remove`` of each key (unknown ones: no-op). A policy may do it in bulk."""
        for k in keys:
            self.remove(k)

    @abstractmethod
    def touch(self, key: bytes, ready: bool) -> None:
        """Recency hit on one key. Unknown key: no-op."""

    def touch_many(self, keys: Sequence[bytes], ready: Sequence[bool]) -> None:
        """``touch`` of each key in order (the last ends most recent)."""
        for k, r in zip(keys, ready):
            self.touch(k, r)

    @abstractmethod
    def access(self, key: bytes, how: int, rank: Rank | None = None) -> None:
        """One classified access (``SEEN``, ``INSERTED``, ``REUSED``, ``MISSED``) of a finished
        request, as vLLM's ``on_request_finished``/``on_store_miss`` apply it, or a running
        request's (``RANKED``, with its provisional ``rank``). Unknown key: no-op."""

    def new_rank(self) -> int:
        """Take the next rank number for a running request's provisional rank (LRU)."""
        return 0

    @abstractmethod
    def evict(self, n: int, can_evict: CanEvict) -> list[bytes] | None:
        """Remove and return exactly ``n`` evictable victims, or return None and change nothing."""

    @abstractmethod
    def order(self) -> list[bytes]:
        """Cached keys, next victim first (as if every key were evictable)."""

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...


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
    """

    name = "lru"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity  # unused by LRU; kept so both policies build the same way
        self._fresh: dict[bytes, int] = {}  # fresh ranks (n, 0) by n, lowest first
        self._prov: dict[bytes, Rank] = {}  # provisional ranks (never a key of _fresh)
        self._heap: list[tuple[Rank, bytes]] = []  # provisional ranks
        self._next = 0

    def new_rank(self) -> int:
        self._next += 1
        return self._next

    def _rank(self, key: bytes) -> Rank | None:
        n = self._fresh.get(key)
        return (n, 0) if n is not None else self._prov.get(key)

    def _freshen(self, key: bytes) -> None:
        self._prov.pop(key, None)
        self._fresh.pop(key, None)
        self._fresh[key] = self.new_rank()

    def _freshen_all(self, keys: Sequence[bytes]) -> None:
        """``_freshen`` of each key in order, in C-level passes (a store's batch)."""
        if len(set(keys)) != len(keys):  # a key twice: it ends where its last freshen puts it
            for k in keys:
                self._freshen(k)
            return
        if self._prov:
            deque(map(self._prov.pop, keys, repeat(None)), 0)
        start = self._next + 1
        self._next += len(keys)
        deque(map(self._fresh.pop, keys, repeat(None)), 0)  # present ones move to the end
        self._fresh.update(zip(keys, range(start, self._next + 1)))

    def _provisional(self, key: bytes, rank: Rank) -> None:
        self._prov[key] = rank
        self._fresh.pop(key, None)
        heapq.heappush(self._heap, (rank, key))
        if len(self._heap) > 2 * len(self._prov) + 64:  # mostly stale
            self._heap = [(r, k) for k, r in self._prov.items()]
            heapq.heapify(self._heap)

    def insert(self, key: bytes, rank: Rank | None = None) -> None:
        if rank is None:
            self._freshen(key)
        else:
            self._provisional(key, rank)

    def insert_many(self, keys: Sequence[bytes]) -> None:
        self._freshen_all(keys)

    def remove(self, key: bytes) -> None:
        if self._fresh.pop(key, None) is None:
            self._prov.pop(key, None)

    def remove_many(self, keys: Sequence[bytes]) -> None:
        # (a key is in one of the two at most; a stale heap entry is skipped like any other)
        deque(map(self._fresh.pop, keys, repeat(None)), 0)
        if self._prov:
            deque(map(self._prov.pop, keys, repeat(None)), 0)

    def touch(self, key: bytes, ready: bool) -> None:
        if key in self:  # a key evicted between lookup and touch is not an error
            self._freshen(key)

    def touch_many(self, keys: Sequence[bytes], ready: Sequence[bool]) -> None:
        self._freshen_all([k for k in keys if k in self._fresh or k in self._prov])

    def access(self, key: bytes, how: int, rank: Rank | None = None) -> None:
        if how == RANKED:
            # vLLM 0.33's on_request_access: a running request's rank, never an older one
            now = self._rank(key)
            if rank is not None and now is not None and now < rank:
                self._provisional(key, rank)
        elif how != MISSED:
            self.touch(key, True)

    def _current(self) -> tuple[Rank, bytes] | None:
        """The heap's lowest current entry (stale ones above it are dropped), or None."""
        heap, prov = self._heap, self._prov
        while heap:
            rank, key = heap[0]
            if prov.get(key) == rank:
                return heap[0]
            heapq.heappop(heap)
        return None

    def evict(self, n: int, can_evict: CanEvict) -> list[bytes] | None:
        if n <= 0:
            return _no_victims(n)
        top = self._current()
        fresh = self._fresh
        if top is None:  # fresh ranks only (no running request's): the dict's order, in C
            victims = list(islice(filter(can_evict, fresh), n))
            if len(victims) < n:
                return None
            deque(map(fresh.pop, victims), 0)
            return victims
        heap = self._heap
        victims = []
        popped: list[tuple[Rank, bytes]] = []  # current heap entries taken out while scanning
        seen: set[bytes] = set()
        scan = iter(fresh)  # not mutated before the scan ends
        f = next(scan, None)
        while len(victims) < n and (f is not None or top is not None):
            if f is not None and (top is None or ((fresh[f], 0), f) < top):
                key, f = f, next(scan, None)
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
            if fresh.pop(key, None) is None:
                del self._prov[key]
        return victims

    def order(self) -> list[bytes]:
        ranked = [((n, 0), k) for k, n in self._fresh.items()]
        return [k for _, k in sorted(ranked + [(r, k) for k, r in self._prov.items()])]

    def __contains__(self, key: object) -> bool:
        return key in self._fresh or key in self._prov

    def __len__(self) -> int:
        return len(self._fresh) + len(self._prov)


class ARCPolicy(CachePolicy):
    """Adaptive Replacement Cache: T1 (seen once), T2 (seen again), ghosts B1/B2 (keys only).

    ``target`` is the adaptive size goal for T1: a hit in B1 says T1 was evicted too eagerly
    (grow it), a hit in B2 says T2 was (shrink it).
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self._target: float = 0.0
        self._t1: OrderedDict[bytes, None] = OrderedDict()
        self._t2: OrderedDict[bytes, None] = OrderedDict()
        self._b1: OrderedDict[bytes, None] = OrderedDict()
        self._b2: OrderedDict[bytes, None] = OrderedDict()

    @property
    def target(self) -> float:
        return self._target

    def lists(self) -> dict[str, list[bytes]]:
        """Copies of T1, T2, B1, B2 (LRU first), for inspection and tests."""
        return {n: list(d) for n, d in (("t1", self._t1), ("t2", self._t2),
                                        ("b1", self._b1), ("b2", self._b2))}

    def insert(self, key: bytes, rank: Rank | None = None) -> None:
        self._t1[key] = None
        self._b1.pop(key, None)
        self._b2.pop(key, None)

    def remove(self, key: bytes) -> None:
        # No ghost entry: a failed store says nothing about the access pattern.
        if key in self._t1:
            del self._t1[key]
        else:
            self._t2.pop(key, None)

    def touch(self, key: bytes, ready: bool) -> None:
        if key in self._t1:
            if ready:
                del self._t1[key]
                self._t2[key] = None
            else:
                # Just prepared for store, not "seen twice": refresh recency only.
                self._t1.move_to_end(key)
        elif key in self._t2:
            self._t2.move_to_end(key)
        else:
            self._ghost_hit(key)

    def _ghost_hit(self, key: bytes) -> None:
        if key in self._b1:
            delta = max(1.0, len(self._b2) / len(self._b1))
            self._target = min(self._target + delta, float(self.capacity))
            self._b1.move_to_end(key)  # keep a repeatedly-missed ghost fresh, as vLLM does
        elif key in self._b2:
            delta = max(1.0, len(self._b1) / len(self._b2))
            self._target = max(self._target - delta, 0.0)
            self._b2.move_to_end(key)

    def access(self, key: bytes, how: int, rank: Rank | None = None) -> None:
        if how == MISSED:  # (RANKED: vLLM's ARC keeps no provisional order)
            if key not in self:
                self._ghost_hit(key)
        elif how == REUSED:  # one frequency hit, whether or not a store is in flight again
            if key in self._t1:
                del self._t1[key]
                self._t2[key] = None
            elif key in self._t2:
                self._t2.move_to_end(key)
        elif how == INSERTED:  # a store is not a frequency hit: recency within its list
            for lst in (self._t1, self._t2):
                if key in lst:
                    lst.move_to_end(key)
                    break

    def _select(self, n: int, can_evict: CanEvict) -> list[tuple[bytes, bool]] | None:
        """Choose n victims as (key, from_t1) without mutating anything.

        Lazy cursors over T1 and T2 make this O(scanned keys) and call ``can_evict`` at most
        once per key; T1's size is simulated so each choice sees the previous ones.
        """
        cursors: dict[bool, Iterator[bytes]] = {
            True: (k for k in self._t1 if can_evict(k)),
            False: (k for k in self._t2 if can_evict(k)),
        }
        t1_size, target = len(self._t1), int(self._target)
        chosen: list[tuple[bytes, bool]] = []
        while len(chosen) < n:
            prefer_t1 = t1_size >= target
            for from_t1 in (prefer_t1, not prefer_t1):
                key = next(cursors[from_t1], None)
                if key is not None:
                    break
            else:
                return None
            if from_t1:
                t1_size -= 1
            chosen.append((key, from_t1))
        return chosen

    def evict(self, n: int, can_evict: CanEvict) -> list[bytes] | None:
        if n <= 0:
            return _no_victims(n)
        chosen = self._select(n, can_evict)
        if chosen is None:
            return None
        for key, from_t1 in chosen:
            if from_t1:
                del self._t1[key]
                self._b1[key] = None
            else:
                del self._t2[key]
                self._b2[key] = None
        for ghost in (self._b1, self._b2):  # ghosts remember at most one cache's worth
            while len(ghost) > self.capacity:
                ghost.popitem(last=False)
        return [key for key, _ in chosen]

    def order(self) -> list[bytes]:
        chosen = self._select(len(self), lambda _k: True)
        assert chosen is not None  # every cached key is a candidate
        return [key for key, _ in chosen]

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)


_POLICIES: dict[str, Callable[[int], CachePolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}


def make_policy(name: str, capacity: int) -> CachePolicy:
    """Build a policy by name ("lru" or "arc", any case) for a cache of ``capacity`` blocks."""
    cls = _POLICIES.get(name.lower()) if isinstance(name, str) else None
    if cls is None:
        raise InvalidArgumentError(
            f"unknown cache policy {name!r}; choose one of: {', '.join(POLICY_NAMES)}"
        )
    if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
        raise InvalidArgumentError(
            f"cache policy capacity must be an integer >= 1 (the number of blocks), "
            f"got {capacity!r}"
        )
    return cls(capacity)
