"""What a quota protects survives a takeover: a new owner counts each client's share from
the tenants the block table names, offers and all.

In-process managers on one segment play the owners: one shuts down holding its state in the
table, the next rebuilds from it (``LocalManager(seg, writer_alive=...)``).
"""
from __future__ import annotations

import pytest

from kvshm.index.api import LookupResult
from kvshm.owner.manager import LocalManager

A, B = (1, 1), (2, 1)  # two clients' (slot, generation)


def keys(prefix: bytes, n: int) -> list[bytes]:
    return [prefix + b"%04d" % i for i in range(n)]


def store(m: LocalManager, ks: list[bytes], client: tuple[int, int]) -> None:
    writer = (*client, 1)
    out = m.prepare_store(ks, writer)
    assert out is not None
    m.complete_store(out.keys_to_store, True, writer)


def tenants_disagree(m: LocalManager) -> list:
    """Cached keys (offers aside) whose tenant the owner and the table name differently."""
    return [(k, e.tenant, m.table.read(e.block).stored_by) for k, e in m.entries.by_key.items()
            if e.block not in m.grants.offered and e.tenant != m.table.read(e.block).stored_by]


@pytest.mark.parametrize("ends", ["returned", "client_gone"])
def test_an_offer_of_a_clients_own_block_stays_in_its_share_across_a_takeover(make_segment,
                                                                             ends):
    seg = make_segment(num_blocks=64, policy="lru")
    m = LocalManager(seg)
    assert m.quotas.set(A, 16) == 16
    mine = keys(b"a", 16)
    store(m, mine, A)  # A at its quota
    store(m, keys(b"b", 48), B)  # the cache is full
    [offered] = m.grants.grant(*A, 1, 0)  # A at its quota: its own oldest block, offered
    assert m.table.read(offered).key == mine[0]
    m.shutdown()
    m = LocalManager(seg, writer_alive=lambda slot, gen: True)  # the successor
    try:
        m.quotas.set(A, 16)  # as it does when it adopts A
        if ends == "returned":  # a request used it since: A gives the offer back
            m.grants.publish(*A, [], [], True, 1, returned=[offered])
        else:  # its client went before it claimed it
            m.grants.free(A)
        assert tenants_disagree(m) == [] and m.entries.usage[A] == 16
        for i in range(8):  # B floods
            store(m, keys(b"c%d" % i, 8), B)
        assert [m.key_status(k) for k in mine].count(LookupResult.HIT) == 16
    finally:
        m.shutdown()
