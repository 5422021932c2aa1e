"""Eviction in the owner's index: choosing victims, and the lease handshake.

This module owns how the index frees room: the policy proposes victims among evictable keys
(ready, unpinned, not held against the requester, not offered in the same store), and the
handshake with lock-free client lookups makes sure a block leased meanwhile is spared. It
never copies block data and never decides which keys to store.
"""
from __future__ import annotations

from collections.abc import Callable

from kvshm.crashpoints import crash_point
from kvshm.owner.entries import Client, Entries
from kvshm.owner.outcomes import Outcomes
from kvshm.owner.quotas import Allowed, Quotas
from kvshm.shm import layout as L
from kvshm.shm.fence import full_fence

# held(requester_slot) -> blocks other clients hold against that requester's stores
Held = Callable[[int], "set[int]"]


class Evictor:
    """Frees room in ``entries`` for one requester at a time."""

    def __init__(self, entries: Entries, outcomes: Outcomes, held: Held | None,
                 quotas: Quotas) -> None:
        self.entries = entries
        self.outcomes = outcomes
        self.held = held  # None: nobody but this process holds blocks (no handshake)
        self.quotas = quotas

    def choose(self, n: int, requester: int, client: Client | None = None
               ) -> list[bytes] | None:
        """``n`` victims the policy would evict now for ``client``'s store, taken out of its
        order but left in the entries and the index, READY: a grant offers them to a client,
        which claims them with the lease handshake itself. None (and nothing changed) if too
        few qualify."""
        held = self.held(requester) if self.held else set()
        by_key = self.entries.by_key

        def can_evict(k: bytes) -> bool:
            e = by_key[k]
            return e.ready and not e.pins and e.block not in held

        return self._victims(n, can_evict, client)[0]

    def _victims(self, n: int, can_evict: Callable[[bytes], bool], client: Client | None
                 ) -> tuple[list[bytes] | None, Callable[[bytes], bool]]:
        """``n`` victims for ``client``'s store (the policy's, out of its order), within
        what its quota and the others' allow (one pass after another), and the test they
        passed."""
        passes = self.quotas.passes(client)
        if passes is None:
            return self.entries.policy.evict(n, can_evict), can_evict
        by_key = self.entries.by_key
        for allowed, only, skip in passes:  # (groups a pass refuses whole are never walked)
            def test(k: bytes, allowed: Allowed = allowed) -> bool:
                return can_evict(k) and allowed(by_key[k])
            victims = self.entries.policy.evict(n, test, only, skip)
            if victims is not None:
                return victims, test
        return None, can_evict

    def evict(self, n: int, protected: set[bytes], requester: int,
              client: Client | None = None) -> list[bytes] | None:
        """Evict ``n`` keys for ``client``'s store, all or none (None: not enough are
        evictable); never one of ``protected`` (the keys the same store offers)."""
        held = self.held(requester) if self.held else set()
        by_key = self.entries.by_key

        def can_evict(k: bytes) -> bool:
            e = by_key[k]
            return e.ready and not e.pins and e.block not in held and k not in protected

        victims, passed = self._victims(n, can_evict, client)
        if victims is None:
            return None
        if self.held:  # (victims that turn out leased are replaced within the same pass)
            victims = self._fence_victims(victims, passed, requester)
            if victims is None:
                return None
        self.entries.drop_many(victims)
        crash_point("owner.evict.after_drop")
        self.outcomes.evicted(victims)
        return victims

    def _fence_victims(self, victims: list[bytes], can_evict: Callable[[bytes], bool],
                       requester: int) -> list[bytes] | None:
        """The eviction half of the lease handshake with lock-free client lookups.

        A client writes its lease, fences, then re-reads the block's state; we mark victims
        EVICTING, fence, then re-read the leases. Whatever the interleaving, one side sees
        the other: either the client sees EVICTING and reports a miss, or we see the lease
        and keep the block. Blocks that got leased meanwhile go back into the cache; their
        replacements pass ``can_evict``, whose quota counts still include the blocks kept
        (a replacement may be refused that a fresh eviction would take, never the reverse).
        """
        assert self.held is not None
        by_key, table, policy = self.entries.by_key, self.entries.table, self.entries.policy
        table.set_states([by_key[k].block for k in victims], L.EVICTING)
        crash_point("owner.evict.after_mark")
        full_fence()
        held = self.held(requester)
        lost = [k for k in victims if by_key[k].block in held]
        if not lost:
            return victims
        for k in lost:
            table.set_state(by_key[k].block, L.READY)
            self.entries.requeue(k, by_key[k])  # it is being read: most recent is right
        keep = [k for k in victims if k not in lost]
        more = policy.evict(len(lost), lambda k: by_key[k].block not in held and can_evict(k))
        if more is not None:
            more = self._fence_victims(more, can_evict, requester)
        if more is None:
            for k in keep:
                table.set_state(by_key[k].block, L.READY)
                self.entries.requeue(k, by_key[k])
            return None
        return keep + more
