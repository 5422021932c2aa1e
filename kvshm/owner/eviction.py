"""Eviction in the owner's index: choosing victims, and the lease handshake.

This module owns how ``LocalManager`` frees room: the policy proposes victims among evictable
keys (ready, unpinned, not held against the requester, not offered in the same store), and
the handshake with lock-free client lookups makes sure a block leased meanwhile is spared.
It is a mixin over ``LocalManager``'s state (entries, policy, table, held); it never copies
block data and never decides which keys to store.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

from kvshm.crashpoints import crash_point
from kvshm.index.api import OffloadingEvent
from kvshm.shm import layout as L
from kvshm.shm.fence import full_fence

if TYPE_CHECKING:
    from kvshm.owner.manager import _Entry
    from kvshm.owner.policy import CachePolicy
    from kvshm.shm.segment import Segment
    from kvshm.shm.table import BlockTable


class Eviction:
    """The eviction methods of ``LocalManager`` (which provides the attributes below)."""

    _entries: dict[bytes, "_Entry"]
    _held: Callable[[int], set[int]] | None
    policy: "CachePolicy"
    table: "BlockTable"
    segment: "Segment"
    enable_events: bool
    _events: list[OffloadingEvent]
    _drop_many: Callable[[list[bytes]], None]  # forget keys and free their blocks

    def _evict(self, n: int, protected: set[bytes], requester: int) -> list[bytes] | None:
        held = self._held(requester) if self._held else set()
        entries = self._entries

        def can_evict(k: bytes) -> bool:
            e = entries[k]
            return e.ready and not e.pins and e.block not in held and k not in protected

        victims = self.policy.evict(n, can_evict)
        if victims is None:
            return None
        if self._held:
            victims = self._fence_victims(victims, can_evict, requester)
            if victims is None:
                return None
        self._drop_many(victims)
        crash_point("owner.evict.after_drop")
        self.segment.counter_add("evictions", len(victims))
        if self.enable_events:
            self._events.append(OffloadingEvent(victims, removed=True))
        return victims

    def _fence_victims(self, victims: list[bytes], can_evict: Callable[[bytes], bool],
                       requester: int) -> list[bytes] | None:
        """The eviction half of the lease handshake with lock-free client lookups.

        A client writes its lease, fences, then re-reads the block's state; we mark victims
        EVICTING, fence, then re-read the leases. Whatever the interleaving, one side sees
        the other: either the client sees EVICTING and reports a miss, or we see the lease
        and keep the block. Blocks that got leased meanwhile go back into the cache.
        """
        self.table.set_states([self._entries[k].block for k in victims], L.EVICTING)
        crash_point("owner.evict.after_mark")
        full_fence()
        held = self._held(requester)
        lost = [k for k in victims if self._entries[k].block in held]
        if not lost:
            return victims
        for k in lost:
            self.table.set_state(self._entries[k].block, L.READY)
            self.policy.insert(k)  # it is being read: most recent is right
        keep = [k for k in victims if k not in lost]
        more = self._evict_more(len(lost), can_evict, held, requester)
        if more is None:
            for k in keep:
                self.table.set_state(self._entries[k].block, L.READY)
                self.policy.insert(k)
            return None
        return keep + more

    def _evict_more(self, n: int, can_evict: Callable[[bytes], bool], held: set[int],
                    requester: int) -> list[bytes] | None:
        victims = self.policy.evict(n, lambda k: can_evict(k) and self._entries[k].block not in held)
        if victims is None:
            return None
        return self._fence_victims(victims, can_evict, requester)

