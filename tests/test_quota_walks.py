"""An eviction beside clients with quotas walks only the blocks it may take.

A quota protects a client's blocks by refusing them to other clients' evictions. The
refusal alone is enough to be safe; these tests pin down that it is also cheap: the owner
files a quota'd client's blocks apart (a policy group), so an eviction that may not take
them never looks at them, however many there are and however old.
"""
from __future__ import annotations

import pytest

from kvshm.index.api import LookupResult
from kvshm.owner.manager import LocalManager

A, B = (1, 1), (2, 1)  # two clients' (slot, generation)


@pytest.fixture
def manager(make_segment):
    m = LocalManager(make_segment(num_blocks=64, policy="lru"))
    yield m
    m.shutdown()


def store(m: LocalManager, keys: list[bytes], client: tuple[int, int]) -> None:
    writer = (*client, 1)
    out = m.prepare_store(keys, writer)
    assert out is not None
    m.complete_store(out.keys_to_store, True, writer)


def asked_by_evictions(m: LocalManager) -> list[bytes]:
    """Every key the policy will ask an eviction's test about, from now on."""
    asked: list[bytes] = []
    evict = m.policy.evict

    def spying(n, can_evict, *args, **kw):
        return evict(n, lambda key: asked.append(key) or can_evict(key), *args, **kw)

    m.policy.evict = spying  # type: ignore[method-assign]
    return asked


def keys(prefix: bytes, n: int) -> list[bytes]:
    return [prefix + b"%04d" % i for i in range(n)]


def test_a_flood_never_looks_at_the_blocks_of_a_client_within_its_quota(manager):
    assert manager.quotas.set(A, 32) == 32
    protected = keys(b"a", 32)
    store(manager, protected, A)  # the oldest half of the cache
    store(manager, keys(b"b", 32), B)  # the cache is full
    asked = asked_by_evictions(manager)
    store(manager, keys(b"c", 16), B)
    assert asked and not set(asked) & set(protected)
    assert all(manager.key_status(key) == LookupResult.HIT for key in protected)


def test_a_client_over_its_quota_looks_only_at_its_own_blocks_first(manager):
    assert manager.quotas.set(A, 16) == 16
    others = keys(b"b", 40)
    store(manager, others, B)  # the oldest blocks are another client's
    mine = keys(b"a", 24)
    store(manager, mine, A)  # full, A 8 over its quota
    asked = asked_by_evictions(manager)
    store(manager, keys(b"n", 4), A)
    assert asked == mine[:4]  # its own oldest, and nothing else looked at
    assert all(manager.key_status(key) == LookupResult.HIT for key in others)


def test_a_quota_set_after_a_clients_stores_files_its_earlier_blocks_apart_too(manager):
    others = keys(b"b", 40)
    store(manager, others, B)
    mine = keys(b"a", 24)
    store(manager, mine, A)  # full, before A has a quota
    assert manager.quotas.set(A, 16) == 16  # now 8 over it
    asked = asked_by_evictions(manager)
    store(manager, keys(b"n", 4), A)
    assert asked == mine[:4]
    assert all(manager.key_status(key) == LookupResult.HIT for key in others)


def test_a_departed_clients_blocks_rejoin_the_common_order(manager):
    assert manager.quotas.set(A, 16) == 16
    mine = keys(b"a", 8)
    store(manager, mine, A)
    store(manager, keys(b"b", 8), B)
    manager.reclaim_writer(*A)  # A left: its blocks are nobody's to protect
    assert manager.policy.evict(8, lambda key: True, skip={A}) == mine  # no group to skip
