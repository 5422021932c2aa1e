"""Stores without a round trip: the owner stocks each storing client with granted blocks, a
``prepare_store`` takes them without a frame, and ``complete_store`` is a one-way ``Publish``.

Every test runs a real owner process (started by ``connect``) and real client processes where
a death matters. The semantics of the manager suite hold unchanged on this path; these tests
pin down what is particular to it: no request reaches the owner in a steady scheduler step,
a client reads its own completed stores at once, two clients storing one key keep one block,
and granted blocks always come back.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from kvshm.index import protocol as P
from kvshm.index.client import connect
from kvshm.index.grants import grant_target
from kvshm.index.api import LookupResult
from kvshm.shm import layout as L
from kvshm.shm import slots
from kvshm.shm.table import BlockTable

from conftest import TEST_LAYOUT, stop_owner
import procs
from test_shared import wait_for

BLOCKS, CLIENTS = 256, 4  # 16 blocks granted to each storing client


@pytest.fixture
def mgr(seg_name):
    m = connect(seg_name, TEST_LAYOUT, num_blocks=BLOCKS, max_clients=CLIENTS,
                ring_capacity=8192)
    yield m
    pid = m.segment.owner_record()[0]
    m.shutdown()
    stop_owner(pid)


def _stocked(m, n: int = 1) -> None:
    """Make ``m`` a storing client (one round-trip store) and wait for its grants."""
    procs.store(m, [b"warm-%d-%d" % (m.slot, i) for i in range(2)])
    words, _ = slots.grants(m.segment, m.slot)
    wait_for(lambda: int(words[L.GRANT_WORD_GRANTED]) - m._taken >= n, "grants to arrive")


def _states(seg) -> list[int]:
    t = BlockTable(seg.buf, seg.geometry)
    try:
        return [t.read(b).state for b in range(seg.geometry.num_blocks)]
    finally:
        t.close()


def _blocks_of(seg, key: bytes) -> list[int]:
    t = BlockTable(seg.buf, seg.geometry)
    try:
        return [b for b in range(seg.geometry.num_blocks)
                if t.read(b).key == key and t.read(b).state == L.READY]
    finally:
        t.close()


def test_the_grant_target_is_a_small_share_of_the_cache(mgr):
    g = mgr.segment.geometry
    assert grant_target(g) == 16
    assert grant_target(g) * g.max_clients <= g.num_blocks // 4


def test_a_steady_scheduler_step_sends_no_request_to_the_owner(mgr):
    _stocked(mgr, 8)
    cached = procs.store(mgr, [b"cached-%d" % i for i in range(4)])
    assert mgr.lookup(cached) == 4
    mgr.release()
    # Every round trip takes a request id (client) and is recorded consumed (owner) before
    # it runs; one-way frames (touch, publish) have neither.
    served = slots.served(mgr.segment, mgr.slot)
    consumed, req = int(served[1]), mgr._link._req
    # one step: lookups (a hit prefix), a load of it, a touch, and a store of new keys
    new = [b"new-%d" % i for i in range(8)]
    assert mgr.lookup(cached + new) == 4
    blocks = mgr.prepare_load(cached)
    mgr.complete_load(cached)
    mgr.touch(cached)
    out = mgr.prepare_store(new)
    assert out.keys_to_store == new and len(set(out.block_ids)) == 8
    procs.fill_all(mgr.segment.planes(), out.block_ids, new)
    mgr.complete_store(new)
    assert len(blocks) == 4
    assert mgr._link._req == req  # no request id was used: no round trip
    assert int(served[1]) == consumed  # the owner executed no request of ours
    assert mgr.lookup(new) == 8  # read back at once: the owner took the one-way frames
    assert mgr._link._req == req and int(served[1]) == consumed


def test_a_client_reads_its_own_completed_store_before_others_see_it(mgr, seg_name):
    _stocked(mgr, 2)
    other = connect(seg_name)
    try:
        keys = [b"mine-0", b"mine-1"]
        out = mgr.prepare_store(keys)
        procs.fill_all(mgr.segment.planes(), out.block_ids, keys)
        owner = mgr.segment.owner_record()[0]
        os.kill(owner, signal.SIGSTOP)
        try:
            mgr.complete_store(keys)  # one-way: returns while the owner is frozen
            assert other.key_status(keys[0]) == LookupResult.MISS  # not published yet
        finally:
            os.kill(owner, signal.SIGCONT)
        assert mgr.lookup(keys) == 2  # waits for the owner to take the frame
        assert other.lookup(keys) == 2
    finally:
        other.shutdown()


def test_a_key_being_stored_from_grants_is_pending_for_its_client(mgr):
    _stocked(mgr)
    out = mgr.prepare_store([b"k"])
    assert mgr.key_status(b"k") == LookupResult.PENDING
    assert mgr.lookup([b"k"]) == 0
    mgr.complete_store(out.keys_to_store)
    assert mgr.key_status(b"k") == LookupResult.HIT


def test_two_clients_storing_one_key_keep_one_block(mgr, seg_name):
    other = connect(seg_name)
    try:
        _stocked(mgr)
        _stocked(other)
        a, b = mgr.prepare_store([b"both"]), other.prepare_store([b"both"])
        assert a.keys_to_store == b.keys_to_store == [b"both"]
        assert a.block_ids != b.block_ids
        planes = mgr.segment.planes()
        procs.fill_all(planes, a.block_ids, [b"both"])
        procs.fill_all(planes, b.block_ids, [b"both"])
        mgr.complete_store([b"both"])
        other.complete_store([b"both"])
        assert mgr.lookup([b"both"]) == 1 and other.lookup([b"both"]) == 1
        assert _blocks_of(mgr.segment, b"both") == a.block_ids  # the first published won
        assert _states(mgr.segment)[b.block_ids[0]] == L.FREE  # the other came back
        assert mgr.prepare_load([b"both"]) == a.block_ids == other.prepare_load([b"both"])
        mgr.complete_load([b"both"])
        other.complete_load([b"both"])
    finally:
        other.shutdown()


def test_a_failed_store_gives_its_granted_blocks_back(mgr):
    _stocked(mgr)
    out = mgr.prepare_store([b"fails"])
    assert _states(mgr.segment)[out.block_ids[0]] == L.GRANTED
    mgr.complete_store([b"fails"], success=False)
    assert mgr.lookup([b"fails"]) == 0
    mgr.take_events()  # a round trip, after the publish: the owner has applied it
    assert _states(mgr.segment)[out.block_ids[0]] == L.FREE


def test_refilling_grants_never_evicts_a_leased_block(seg_name):
    m = connect(seg_name, TEST_LAYOUT, num_blocks=64, max_clients=2, ring_capacity=8192)
    other = connect(seg_name)
    try:
        leased = procs.store(m, [b"leased-%d" % i for i in range(40)])  # cache nearly full
        assert other.lookup(leased) == 40  # other leases them all
        for i in range(6):  # m stores on and on: grants are refilled by evicting
            procs.store(m, [b"more-%d-%d" % (i, j) for j in range(4)])
        assert other.prepare_load(leased) and other.lookup(leased) == 40
        other.complete_load(leased)
    finally:
        other.shutdown()
        pid = m.segment.owner_record()[0]
        m.shutdown()
        stop_owner(pid)


_HOLDER = """
import sys, time
sys.path.insert(0, sys.argv[2])
from kvshm.index import protocol as P
from kvshm.index.client import connect
from kvshm.shm import layout as L, slots
import procs
m = connect(sys.argv[1])
procs.store(m, [b"holder-warm"])
words, _ = slots.grants(m.segment, m.slot)
while int(words[L.GRANT_WORD_GRANTED]) - m._taken < 4:
    time.sleep(0.01)
m.prepare_store([b"holder-%d" % i for i in range(4)])  # taken, never completed
print(m.slot, flush=True)
sys.stdin.read()
"""


def test_a_dead_clients_granted_blocks_come_back(mgr, seg_name):
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, seg_name, os.path.dirname(__file__)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    slot = int(p.stdout.readline())
    assert L.GRANTED in _states(mgr.segment)
    p.kill()
    p.wait()
    p.stdin.close()
    p.stdout.close()
    wait_for(lambda: slots.record(mgr.segment, slot).state == L.SlotState.FREE,
             "the dead client to be reclaimed")
    theirs = [b for b, s in enumerate(_states(mgr.segment)) if s == L.GRANTED]
    words, ids = slots.grants(mgr.segment, mgr.slot)
    assert set(theirs) <= {int(ids[i % L.GRANT_CAPACITY]) for i in
                           range(mgr._taken, int(words[L.GRANT_WORD_GRANTED]))}  # only ours


def test_grants_and_unpublished_stores_survive_an_owner_death(mgr):
    _stocked(mgr, 3)
    keys = [b"across-%d" % i for i in range(3)]
    out = mgr.prepare_store(keys)
    procs.fill_all(mgr.segment.planes(), out.block_ids, keys)
    owner = mgr.segment.owner_record()[0]
    os.kill(owner, signal.SIGKILL)
    wait_for(lambda: not mgr.segment.owner_alive(), "the owner to die")
    mgr.complete_store(keys)  # queued for the successor, which this lookup starts
    assert mgr.lookup(keys) == 3
    blocks = mgr.prepare_load(keys)
    assert blocks == out.block_ids
    assert all(procs.check(mgr.segment.planes(), b, k) for b, k in zip(blocks, keys))
    mgr.complete_load(keys)


def test_a_completed_store_is_not_lost_to_another_clients_unfinished_store(mgr, seg_name):
    # mgr stores k from its grants while other's round-trip store of k is still unfinished:
    # mgr's completed block waits for it, and is published when that store fails.
    other = connect(seg_name)
    try:
        _stocked(mgr)
        k = b"contended"
        mine = mgr.prepare_store([k])
        theirs = other.prepare_store([k] + [b"theirs-%d" % i for i in range(40)])  # round trip
        assert k in theirs.keys_to_store
        procs.fill_all(mgr.segment.planes(), mine.block_ids, [k])
        mgr.complete_store([k])
        assert mgr.key_status(k) == LookupResult.PENDING  # their store of k is unfinished
        other.complete_store(theirs.keys_to_store, success=False)
        assert mgr.lookup([k]) == 1
        assert mgr.prepare_load([k]) == mine.block_ids
        assert procs.check(mgr.segment.planes(), mine.block_ids[0], k)
        mgr.complete_load([k])
    finally:
        other.shutdown()


def test_a_completed_store_behind_a_successful_one_gives_its_block_back(mgr, seg_name):
    other = connect(seg_name)
    try:
        _stocked(mgr)
        k = b"contended"
        mine = mgr.prepare_store([k])
        theirs = other.prepare_store([k] + [b"theirs-%d" % i for i in range(40)])
        procs.fill_all(mgr.segment.planes(), mine.block_ids, [k])
        procs.fill_all(mgr.segment.planes(), theirs.block_ids, theirs.keys_to_store)
        mgr.complete_store([k])
        other.complete_store(theirs.keys_to_store)
        assert mgr.lookup([k]) == 1
        assert mgr.prepare_load([k]) != mine.block_ids  # theirs won: it was indexed first
        mgr.complete_load([k])
        assert _states(mgr.segment)[mine.block_ids[0]] == L.FREE
    finally:
        other.shutdown()


def test_a_block_still_in_the_grant_ring_cannot_be_published(mgr):
    _stocked(mgr, 2)
    words, ids = slots.grants(mgr.segment, mgr.slot)
    untaken = int(ids[mgr._taken % L.GRANT_CAPACITY])
    mgr._link.push(P.Publish(0, [b"forged"], [untaken], True))  # a buggy client's frame
    mgr.take_events()  # a round trip after it: the owner has applied (ignored) it
    assert mgr.lookup([b"forged"]) == 0
    assert _states(mgr.segment)[untaken] == L.GRANTED


def test_an_owner_dying_while_it_hands_grants_over_leaks_none(seg_name):
    from test_exactly_once import owner_proc
    from kvshm.shm.segment import Segment
    Segment.create(seg_name, TEST_LAYOUT, 64, max_clients=4, ring_capacity=8192).close()
    first = owner_proc(seg_name, "owner.grant.before_count:1")
    m = connect(seg_name)
    try:
        procs.store(m, [b"rt-%d" % i for i in range(5)])  # a round trip: then it refills
        assert first.wait() == -signal.SIGKILL  # blocks GRANTED, ids in the ring, no count
        procs.store(m, [b"rt2-%d" % i for i in range(5)])  # a successor serves (and refills)
        words, _ = slots.grants(m.segment, m.slot)
        wait_for(lambda: int(words[L.GRANT_WORD_GRANTED]) - m._taken >= 4, "grants")
        level = int(words[L.GRANT_WORD_GRANTED]) - m._taken
        assert _states(m.segment).count(L.GRANTED) == level  # none stranded
    finally:
        pid = m.segment.owner_record()[0]
        m.shutdown()
        stop_owner(pid)
