"""The ARC eviction order: Adaptive Replacement Cache, as vLLM's ``ARCCachePolicy``.

This module owns ARC's lists (T1 seen once, T2 seen again), its ghost lists and its adaptive
target. It ignores groups (``base``): its victims are whatever ``can_evict`` accepts in its
order, which is all a group may change. It must never know about blocks or shared memory.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterator

from kvshm.index.access import INSERTED, MISSED, REUSED  # how a request used a key
from kvshm.owner.policy.base import CachePolicy, CanEvict, Group, Rank, no_victims


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

    def insert(self, key: bytes, rank: Rank | None = None, group: Group = None) -> None:
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

    def evict(self, n: int, can_evict: CanEvict, only: Collection[Group] | None = None,
              skip: Collection[Group] = ()) -> list[bytes] | None:
        if n <= 0:
            return no_victims(n)
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
