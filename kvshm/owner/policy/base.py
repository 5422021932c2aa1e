"""What every eviction-order policy offers the owner's index.

This module owns the interface (``CachePolicy``) and its few shared definitions. A policy
orders opaque ``bytes`` keys; it must never know about block ids, block state, shared memory
or rings: the manager owns state (ready, writing, pinned) and tells the policy through
``touch(key, ready)``, ``access(key, how)`` (a request's accesses, classified by the engine
integration) and the ``can_evict`` callback. Semantics follow vLLM's v1 KV-offload
``LRUCachePolicy`` and ``ARCCachePolicy`` (0.20+: atomic eviction; 0.33: ARC falls back to
T1 when T2 has nothing, and LRU gives a running request's keys a provisional rank:
``RANKED`` accesses and ranked inserts).

Groups: a caller may file a key under a *group* (any hashable; None is the common group)
and, when it evicts, name groups whose keys ``can_evict`` is sure to refuse (``skip``) or
the only groups whose keys it may accept (``only``). A policy may then never look at those
keys; one that ignores groups (ARC) asks ``can_evict`` as ever. Groups are a way to skip
work, never a rule: ``can_evict`` alone decides what may go, so no key is ever taken
against its word; but an eviction passes over the keys of the groups it was told to skip,
so those groups must be exact (the caller vouches for them).

Not thread-safe: only the owner's single loop calls a policy.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Hashable, Sequence

from kvshm.errors import InvalidArgumentError

CanEvict = Callable[[bytes], bool]
Rank = tuple[int, int]  # LRU: (n, sub), lowest first (see LRUPolicy)
Group = Hashable  # a key's group; None: the common one


def no_victims(n: int) -> list[bytes]:
    """What ``evict`` of ``n`` <= 0 keys returns (a negative count is a manager bug; failing
    loudly beats evicting nothing silently)."""
    if n < 0:
        raise InvalidArgumentError(f"evict needs a block count >= 0, got {n}")
    return []


class CachePolicy(ABC):
    """Eviction order over cached keys. ``can_evict`` must not call back into the policy."""

    name: str

    @abstractmethod
    def insert(self, key: bytes, rank: Rank | None = None, group: Group = None) -> None:
        """A key was just allocated (store in flight). Caller guarantees it is not cached.
        ``rank``: a running request's provisional rank for it (LRU), else most recent.
        ``group``: the group it is filed under (see the module's docstring)."""

    def insert_many(self, keys: Sequence[bytes], group: Group = None) -> None:
        """``insert`` of each key in order, most recent (the last ends most recent), all in
        ``group``. A policy may do it in bulk."""
        for k in keys:
            self.insert(k, None, group)

    def regroup(self, keys: Sequence[bytes], group: Group) -> None:
        """File cached ``keys`` under ``group``, each keeping its place in the order.
        Unknown keys: no-op. A policy without groups has nothing to do."""
        return None

    def dissolve(self, group: Group) -> None:
        """File every key of ``group`` under the common group, each keeping its place in the
        order. A policy without groups has nothing to do."""
        return None

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Drop a key without evicting it (failed store): no ghost. Unknown key: no-op."""

    def remove_many(self, keys: Sequence[bytes]) -> None:
        """``remove`` of each key (unknown ones: no-op). A policy may do it in bulk."""
        for k in keys:
            self.remove(k)

    @abstractmethod
    def touch(self, key: bytes, ready: bool) -> None:
        """Recency hit on one key, which stays in its group. Unknown key: no-op."""

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
    def evict(self, n: int, can_evict: CanEvict, only: Collection[Group] | None = None,
              skip: Collection[Group] = ()) -> list[bytes] | None:
        """Remove and return exactly ``n`` evictable victims, or return None and change
        nothing. The caller vouches that ``can_evict`` refuses every key filed under a group
        in ``skip``, and, when ``only`` is given, every key filed under a group not in it."""

    @abstractmethod
    def order(self) -> list[bytes]:
        """Cached keys, next victim first (as if every key were evictable)."""

    @abstractmethod
    def __contains__(self, key: object) -> bool: ...

    @abstractmethod
    def __len__(self) -> int: ...
