"""Eviction-order policies (LRU and ARC) for the owner's block index, chosen by name.

This package owns the order in which cached keys become eviction victims: the interface
(``base``), LRU (``lru``) and ARC (``arc``). It must never know about block ids, block
state, shared memory or rings (see ``base``).
"""
from __future__ import annotations

from collections.abc import Callable

from kvshm.errors import InvalidArgumentError
from kvshm.owner.policy.arc import ARCPolicy
from kvshm.owner.policy.base import CachePolicy, CanEvict, Group, Rank
from kvshm.owner.policy.lru import LRUPolicy
from kvshm.shm.layout import POLICY_NAMES  # recorded in the segment header, so defined there

__all__ = ["ARCPolicy", "CachePolicy", "CanEvict", "Group", "LRUPolicy", "Rank",
           "make_policy"]

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
