"""Quotas: a client may keep a share of the shared cache, which no other client's stores
evict while it is within it; over it, its own stores evict its own blocks first.

Every test runs a real owner process (started by ``connect``) and clients of one segment;
the cache is small, so the stores evict.
"""
from __future__ import annotations

import os
import signal

import pytest

from kvshm.client.connect import connect, quota_blocks
from kvshm.errors import InvalidArgumentError
from kvshm.shm import layout as L
from kvshm.shm import slots
from kvshm.shm.table import BlockTable

import procs
from conftest import TEST_LAYOUT, stop_owner
from test_shared import spawn, wait_for

BLOCKS, CLIENTS = 64, 4


@pytest.fixture
def cache(seg_name):
    """A segment, its owner, and a way to connect clients to it (shut down at the end)."""
    first = connect(seg_name, TEST_LAYOUT, num_blocks=BLOCKS, max_clients=CLIENTS,
                    ring_capacity=8192, hold_capacity=64)
    made = [first]

    def client(**kw):
        m = connect(seg_name, **kw)
        made.append(m)
        return m
    yield client
    pid = first.segment.owner_record()[0]
    for m in reversed(made):
        if m.segment is not None:
            m.shutdown()
    stop_owner(pid)


def keys(tag: str, n: int) -> list[bytes]:
    return [b"%s-%04d" % (tag.encode(), i) for i in range(n)]


def cached(m, ks: list[bytes]) -> int:
    n = sum(m.lookup([k]) for k in ks)
    m.release()
    return n


def flood(m, n: int, batch: int = 8) -> None:
    for i in range(0, n, batch):
        procs.store(m, keys(f"flood{i}", batch))


def test_without_quotas_a_flood_evicts_another_clients_blocks(cache):
    a, b = cache(), cache()
    mine = keys("mine", 16)
    procs.store(a, mine)
    flood(b, 4 * BLOCKS)
    assert cached(a, mine) < len(mine)  # what the quota below is there to prevent


def test_a_client_within_its_quota_is_never_the_victim_of_a_flood(cache):
    # a stores by round trip: with a grant ring, a refill once the flood has filled the cache
    # may offer a's own blocks to a itself (a is at its quota), and an offered block, still
    # cached, no longer counts in a's share (seen: 8 of 16 counted, all 16 offered to a)
    a, b = cache(quota=16, grants=False), cache()
    mine = keys("mine", 16)
    procs.store(a, mine)
    flood(b, 4 * BLOCKS)
    assert cached(a, mine) == len(mine)
    share = slots.share(a.segment, a.slot)
    try:
        wait_for(lambda: share["cached"] == len(mine), "the owner to count a's share")
    except AssertionError as e:  # say what the owner counted, and whether it was replaced
        seg = a.segment
        raise AssertionError(f"{e}: {share['cached']} counted, quota {share['quota']}, "
                             f"failovers {seg.counter('failovers')}") from None
    finally:
        share.release()


def test_a_client_over_its_quota_evicts_its_own_blocks_first(cache):
    a, b = cache(quota=8), cache()
    theirs = keys("theirs", 24)
    procs.store(b, theirs)
    flood(a, 4 * BLOCKS)  # far over its 8 blocks: every eviction it needs is of its own
    assert cached(b, theirs) == len(theirs)


@pytest.mark.parametrize("grants", [False, True], ids=["round_trip", "grants"])
def test_a_quota_protects_what_its_client_stored_before_the_owner_died(cache, grants):
    a, b = cache(quota=16, grants=grants), cache()
    mine = keys("mine", 16)
    procs.store(a, mine)
    os.kill(a.segment.owner_record()[0], signal.SIGKILL)
    wait_for(lambda: not a.segment.owner_alive(), "the owner to die")
    flood(b, 4 * BLOCKS)  # its first store starts the successor, which counts a's share
    assert b.segment.counter("failovers") >= 1
    assert cached(a, mine) == len(mine)


def test_a_newcomer_a_successor_adopts_never_cuts_the_quota_of_a_client_served_before(
        seg_name):
    # The quotas together keep at most 48 of the 64 blocks, first come, first served. A has
    # 40. B asks for 40 in a lower slot just as the owner dies: its successor adopts both,
    # and must serve A's quota first, whatever the slot order.
    first = connect(seg_name, TEST_LAYOUT, num_blocks=BLOCKS, max_clients=CLIENTS,
                    ring_capacity=8192, hold_capacity=64)
    x = connect(seg_name)
    a = connect(seg_name, quota=40)
    assert a.quota == 40 and x.slot < a.slot
    free_slot = x.slot
    x.shutdown()  # B will take its slot, below A's, once the owner has given it back
    wait_for(lambda: slots.record(first.segment, free_slot).state == L.SlotState.FREE,
             "x's slot to be free")
    owner = first.segment.owner_record()[0]
    os.kill(owner, signal.SIGSTOP)  # B's hello waits: it is never adopted by this owner
    p, conn = spawn(procs.connect_with_quota_and_report, seg_name, 40)
    try:
        wait_for(lambda: slots.record(first.segment, free_slot).state == L.SlotState.CLIENT,
                 "B to activate its slot")
        os.kill(owner, signal.SIGKILL)  # B's connect starts the successor
        b = conn.recv()
        assert b["slot"] == free_slot
        assert (slots.quota(a.segment, a.slot), b["quota"]) == (40, 8)  # as applied
    finally:
        conn.send("go")
        p.join(30)
        pid = first.segment.owner_record()[0]
        a.shutdown()
        first.shutdown()
        stop_owner(pid)


def test_a_quota_is_blocks_or_a_fraction_of_the_cache():
    assert quota_blocks(None, 64) == 0
    assert quota_blocks(16, 64) == 16 and quota_blocks(0.25, 64) == 16
    assert quota_blocks(0.001, 64) == 1  # at least one block
    for bad in (0, 65, -1, 0.0, 1.5, "16", True):
        with pytest.raises(InvalidArgumentError):
            quota_blocks(bad, 64)


@pytest.mark.parametrize("grants", [False, True], ids=["round_trip", "grants"])
def test_a_flood_never_takes_a_client_below_its_quota(cache, grants):
    a, b = cache(quota=8), cache(grants=grants)
    mine = keys("mine", 12)  # 4 over its quota: a flood may take those 4, no more
    procs.store(a, mine)
    flood(b, 4 * BLOCKS, batch=24)  # each eviction needs more blocks than a has over it
    assert cached(a, mine) >= 8



def test_offers_never_take_a_client_below_its_quota(cache):
    """Victims offered to a grant count as gone from the moment they are offered: a refill
    while earlier offers wait in the grantee's ring, unclaimed, takes no more than the
    spare."""
    a, b = cache(quota=8), cache()
    mine = keys("mine", 24)  # 16 over its quota
    procs.store(a, mine)
    head, _ = slots.grants(b.segment, b.slot)
    try:
        for i in range(4 * BLOCKS):  # one block a store, each from b's grant ring
            procs.store(b, keys(f"flood{i}", 1))
            # the owner refilled b's ring (to 4, once down to 2): offers wait in it
            wait_for(lambda: head["granted"] - head["taken"] >= 3, "b's ring refilled")
    finally:
        head.release()
    assert cached(a, mine) >= 8


def test_a_quota_of_the_whole_cache_leaves_others_room_to_store(cache):
    """One client asking for the whole cache must not stop every other client storing."""
    greedy, other = cache(quota=1.0, grants=False), cache(grants=False)
    flood(greedy, 2 * BLOCKS)  # fills the cache with blocks within its quota
    assert procs.store(other, keys("other", 8)) != []  # refused for ever on the old owner


def test_quotas_asked_beyond_the_cache_are_cut_to_what_can_be_kept(cache):
    """Quotas summing to more than the cache cannot all be kept: the owner cuts the later
    one, and shows what it applies; a client keeps at least the quota shown for it."""
    first, second = cache(quota=40, grants=False), cache(quota=40, grants=False)
    flood(first, 2 * BLOCKS)
    mine = keys("mine", 40)
    for i in range(0, len(mine), 8):
        procs.store(second, mine[i:i + 8])
    share = slots.share(second.segment, second.slot)
    try:
        assert second.quota == share["quota"] == 3 * BLOCKS // 4 - 40  # what first left
        assert cached(second, mine) >= share["quota"]
    finally:
        share.release()



def test_a_store_published_after_a_rivals_failed_store_counts_in_its_share(cache):
    """A granted store of a key whose rival round-trip store is unfinished waits for it;
    published when the rival fails, it is still its client's block, in its share."""
    rival, mine = cache(grants=False), cache(quota=16)
    key = keys("contested", 1)
    head, _ = slots.grants(mine.segment, mine.slot)
    share = slots.share(mine.segment, mine.slot)
    try:
        procs.store(mine, keys("first", 1))  # a client that stores: its ring is stocked
        wait_for(lambda: head["granted"] > head["taken"], "mine's grant ring stocked")
        out = mine.prepare_store(key)  # from the ring, before the rival's store began
        assert rival.prepare_store(key).keys_to_store == key  # unfinished
        procs.fill(mine.segment.planes(), out.block_ids[0], key[0])
        mine.complete_store(key)  # waits behind the rival's: GRANTED, keyed in the table
        table = BlockTable(mine.segment.buf, mine.segment.geometry)
        wait_for(lambda: table.read(out.block_ids[0]).key == key[0], "the store to wait")
        rival.complete_store(key, success=False)  # the waiting block is published
        assert cached(mine, key) == 1
        wait_for(lambda: share["cached"] == 2, "the owner to count it in mine's share")
    finally:
        head.release()
        share.release()
