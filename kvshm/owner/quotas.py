"""Quotas: a client's share of the cache, kept by whose stores may evict which blocks.

This module owns the quotas the owner applies, per client (slot, generation), when a client
asked for one (``connect(..., quota=...)``, in its slot's share record): a client over its
quota evicts its own blocks first; a client within its quota is never the victim of another
client's stores. Clients without a quota, and the blocks of clients that left, are nobody's
to protect: the policy orders them as ever (a new owner counts each client's blocks from the
table, which names every block's tenant, so protection survives a takeover). It counts
nothing itself (``Entries.usage`` does) and decides no order (the policy does): it only says
which blocks a requester's eviction may take.
"""
from __future__ import annotations

from collections.abc import Callable, Collection
from typing import NamedTuple

from kvshm.owner.entries import Client, Entries, Entry

Allowed = Callable[[Entry], bool]


class Pass(NamedTuple):
    """One pass of an eviction: the blocks it may take, and the policy groups (tenants
    with a quota, ``Entries.grouped``) it is sure to refuse whole, so never walks."""
    allowed: Allowed
    only: Collection[Client] | None  # it takes none but these groups' blocks (None: any)
    skip: Collection[Client]  # it takes none of these groups' blocks


def quota_room(num_blocks: int) -> int:
    """The blocks all quotas together may keep of a cache of ``num_blocks``: three quarters.
    The rest stays anybody's, so that grants can be stocked and clients without a quota
    can store, whatever the others asked."""
    return num_blocks * 3 // 4


class Quotas:
    """The quotas of the adopted clients of one segment of ``num_blocks`` blocks."""

    def __init__(self, entries: Entries, num_blocks: int) -> None:
        self.entries, self.num_blocks = entries, num_blocks
        self.room = quota_room(num_blocks)
        self.limits: dict[Client, int] = {}  # client -> blocks it may keep cached
        entries.grouped = self.limits  # a client with a quota: its blocks in a group of theirs

    def set(self, client: Client, blocks: int) -> int:
        """``client`` asked to keep ``blocks`` cached (0: no quota). Its own word, and
        promises beyond the cache cannot all be kept, so it gets at most what the quotas
        set before it left of ``room`` (first come, first served; 0: none). Returns the
        quota it got."""
        self.limits.pop(client, None)
        left = self.room - sum(self.limits.values())
        blocks = max(0, min(int(blocks), left))
        if blocks > 0:
            self.limits[client] = blocks
            if self.used(client):  # a successor adopting a client the table names: one
                # pass over the entries per quota, once per takeover
                self.entries.policy.regroup(
                    [k for k, e in self.entries.by_key.items() if e.tenant == client], client)
        return blocks

    def drop(self, client: Client) -> None:
        """``client`` left: its blocks are nobody's to protect from now on (back in the
        policy's common group, so that evictions walk one order again)."""
        if self.limits.pop(client, None) is not None:
            self.entries.policy.dissolve(client)

    def used(self, client: Client) -> int:
        return self.entries.usage.get(client, 0)

    def passes(self, client: Client | None) -> list[Pass] | None:
        """The blocks an eviction for ``client`` may take, as passes to try in order (None:
        no quotas, any evictable block). A client at or over its quota takes its own first;
        no pass takes the blocks of another client within its quota, nor more of one over
        it than it has over it. A pass is asked once per block it may take and counts what
        it allowed (the policy takes every block its test passes), so each eviction needs
        passes of its own."""
        if not self.limits:
            return None
        usage = self.entries.usage
        # another client with a quota -> how many of its blocks this eviction may still take
        spare = {c: usage.get(c, 0) - limit for c, limit in self.limits.items() if c != client}

        def unprotected(e: Entry) -> bool:
            t = e.tenant
            if t is None or (left := spare.get(t)) is None:
                return True  # nobody's, no quota, or the requester's own
            if left <= 0:
                return False
            spare[t] = left - 1
            return True

        # the clients within their quota: none of their blocks is unprotected
        protected = {c for c, left in spare.items() if left <= 0}
        if client is not None and client in self.limits and \
                usage.get(client, 0) >= self.limits[client]:
            return [Pass(lambda e: e.tenant == client, (client,), ()),
                    Pass(unprotected, None, protected)]
        return [Pass(unprotected, None, protected)]
