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
import random
import signal
import subprocess
import sys
import zlib

import pytest

from kvshm.index import protocol as P
from kvshm.client.connect import connect
from kvshm.owner.stocking import grant_budget, grant_target
from kvshm.index.api import LookupResult
from kvshm.errors import (BlockStateError, ClientQuarantinedError, InvalidArgumentError,
                          ProtocolError)
from kvshm.shm import layout as L
from kvshm.shm import slots
from kvshm.inspect.snapshot import verify
from kvshm.shm.table import BlockTable

from conftest import TEST_LAYOUT, stop_owner
import procs
from test_shared import spawn, wait_for

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
    wait_for(lambda: int(words["granted"]) - m._own.taken >= n, "grants to arrive")


def _states(seg) -> list[int]:
    t = BlockTable(seg.buf, seg.geometry)
    try:
        return [t.read(b).state for b in range(seg.geometry.num_blocks)]
    finally:
        t.close()


def _grant_marks(seg, blocks: list[int]) -> list[tuple[int, int, int, int]]:
    """Each block's state, writer slot, generation and grant ring position."""
    t = BlockTable(seg.buf, seg.geometry)
    try:
        return [(e.state, e.writer, e.writer_gen, e.writer_req) for e in map(t.read, blocks)]
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


def test_a_client_storing_more_than_its_share_is_granted_enough_for_its_next_store(mgr):
    g = mgr.segment.geometry
    share, budget = grant_target(g), grant_budget(g)
    size = share + 8  # more than the first share: this store is a round trip
    _stocked(mgr, share)
    req = mgr._link._req
    first = [b"first-%d" % i for i in range(size)]
    assert procs.store(mgr, first) == first
    assert mgr._link._req > req
    words, _ = slots.grants(mgr.segment, mgr.slot)
    level = lambda: int(words["granted"]) - mgr._own.taken  # noqa: E731
    wait_for(lambda: level() >= 2 * size, "the grants to grow to twice the store")
    req = mgr._link._req
    second = [b"second-%d" % i for i in range(size)]
    assert procs.store(mgr, second) == second
    assert mgr._link._req == req  # from the grants: no round trip
    assert level() <= 2 * size <= budget


def test_grants_grow_with_the_blocks_a_store_took_not_with_the_keys_it_offered(mgr, seg_name):
    # A store that offers many cached keys and a few new ones is sized by the new ones: the
    # grants it leaves behind are blocks taken out of the cache.
    cached = [b"cached-%d" % i for i in range(40)]
    p, conn = spawn(procs.store_and_report, seg_name, cached, False)  # no grants of its own
    assert conn.recv() == cached
    p.join()
    g = mgr.segment.geometry
    share = grant_target(g)
    _stocked(mgr, share)
    words, _ = slots.grants(mgr.segment, mgr.slot)
    level = lambda: int(words["granted"]) - mgr._own.taken  # noqa: E731
    assert level() == share
    new = [b"new-%d" % i for i in range(share + 1)]  # one more than the ring holds
    req = mgr._link._req
    assert procs.store(mgr, cached + new) == new
    assert mgr._link._req > req  # a round trip
    wait_for(lambda: level() >= 2 * len(new), "the grants to grow to twice the store")
    assert level() == 2 * len(new) < grant_budget(g)


def test_a_client_whose_taken_count_runs_ahead_is_not_granted_the_whole_cache(mgr, seg_name):
    # A client that says it took every granted block and publishes none (its slot scribbled,
    # or a bug) is refilled while its grants stay within the budget, not at every refill
    # until the cache is all granted to it: other clients' blocks stay cached.
    g = mgr.segment.geometry
    share, budget = grant_target(g), grant_budget(g)
    cached = [b"cached-%d" % i for i in range(g.num_blocks // 2)]
    p, conn = spawn(procs.store_and_report, seg_name, cached, False)
    assert conn.recv() == cached
    p.join()
    _stocked(mgr, share)
    words, _ = slots.grants(mgr.segment, mgr.slot)
    for _ in range(2 * g.num_blocks // share):  # refills enough to grant the whole cache
        words["taken"] = words["granted"]
        mgr.take_events()  # a round trip: the owner refills after each frame it serves
    assert _states(mgr.segment).count(L.GRANTED) <= budget + share
    assert mgr.lookup(cached) == len(cached)
    mgr.release()


def test_the_owner_counts_each_store_its_clients_grants_could_not_cover(mgr):
    seg = mgr.segment
    _stocked(mgr, grant_target(seg.geometry))  # by a round trip: it had no grants yet
    assert seg.counter("round_trip_stores") == 1
    procs.store(mgr, [b"granted-%d" % i for i in range(4)])  # from its grant ring
    mgr.take_events()  # (a round trip of another kind: the owner took the Publish first)
    assert seg.counter("round_trip_stores") == 1
    over = [b"over-%d" % i for i in range(grant_budget(seg.geometry) + 1)]  # more than any
    assert procs.store(mgr, over) == over  # ring holds: a round trip, in two parts
    assert seg.counter("round_trip_stores") == 2  # (one store: counted once)
    with pytest.raises(InvalidArgumentError):  # a frame the manager rejects is no store
        mgr._link.call([P.PrepareStore(mgr._link.next_req(), [b"bad"], request=7,
                                       positions=[1, 2])])
    assert seg.counter("round_trip_stores") == 2


def test_a_steady_scheduler_step_sends_no_request_to_the_owner(mgr):
    _stocked(mgr, 8)
    cached = procs.store(mgr, [b"cached-%d" % i for i in range(4)])
    assert mgr.lookup(cached) == 4
    mgr.release()
    # Every round trip takes a request id (client) and is recorded consumed (owner) before
    # it runs; one-way frames (touch, publish) have neither.
    served = slots.served(mgr.segment, mgr.slot)
    consumed, req = int(served["consumed"]), mgr._link._req
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
    assert int(served["consumed"]) == consumed  # the owner executed no request of ours
    assert mgr.lookup(new) == 8  # read back at once: the owner took the one-way frames
    assert mgr._link._req == req and int(served["consumed"]) == consumed


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


def _crc32_twins() -> tuple[bytes, bytes]:
    """Two different keys with one crc32 (the key index's tag): a birthday search over
    seeded random keys, which ends after about 10^5 of them."""
    rng, seen = random.Random(0), {}
    while True:
        k = rng.randbytes(36)
        twin = seen.setdefault(zlib.crc32(k), k)
        if twin != k:
            return twin, k


def test_a_key_with_the_tag_of_an_indexed_key_is_stored_from_grants(mgr):
    """The key index tags keys with their crc32 and a key is present only if its entry
    holds it. A new key whose tag an indexed key had was left out of keys_to_store, though
    absent (tools/bench_ring.py met one in every run of 100,000 stores)."""
    indexed, new = _crc32_twins()
    procs.store(mgr, [indexed])
    _stocked(mgr)  # the grant path: no owner in the loop to catch it
    out = mgr.prepare_store([new])
    assert out is not None and out.keys_to_store == [new] and len(out.block_ids) == 1, out
    mgr.complete_store([new])
    mgr.take_events()  # a round trip after the publish: applied first (a loaded host's
    # owner may take longer than a lookup waits for its client's own store)
    assert mgr.lookup([indexed, new]) == 2
    mgr.release()


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
        mgr.take_events()  # a round trip after its publish: applied first
        other.complete_store([b"both"])
        other.take_events()
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
from kvshm.client.connect import connect
from kvshm.shm import layout as L, slots
import procs
m = connect(sys.argv[1])
procs.store(m, [b"holder-warm"])
words, _ = slots.grants(m.segment, m.slot)
while int(words["granted"]) - m._own.taken < 4:
    time.sleep(0.01)
out = m.prepare_store([b"holder-%d" % i for i in range(4)])  # taken, never completed
print(m.slot, m.gen, *out.block_ids, flush=True)
sys.stdin.read()
"""

_COPIER = """
import sys
from kvshm.shm import writers
from kvshm.shm.segment import Segment
reg = writers.Registrations(Segment.attach(sys.argv[1]))
assert reg.register(int(sys.argv[2]), int(sys.argv[3]))
print("registered", flush=True)
sys.stdin.read()
"""


def _holder(seg_name: str) -> tuple[subprocess.Popen, int, int, list[int]]:
    """A client process holding 4 blocks taken from its grants, never completed."""
    p = subprocess.Popen([sys.executable, "-c", _HOLDER, seg_name, os.path.dirname(__file__)],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    slot, gen, *blocks = map(int, p.stdout.readline().split())
    return p, slot, gen, blocks


def _kill(p: subprocess.Popen) -> None:
    p.kill()
    p.wait()
    p.stdin.close()
    p.stdout.close()


def test_a_dead_clients_granted_blocks_come_back(mgr, seg_name):
    p, slot, _, _ = _holder(seg_name)
    assert L.GRANTED in _states(mgr.segment)
    _kill(p)
    wait_for(lambda: slots.record(mgr.segment, slot).state == L.SlotState.FREE,
             "the dead client to be reclaimed")
    theirs = [b for b, s in enumerate(_states(mgr.segment)) if s == L.GRANTED]
    words, ids = slots.grants(mgr.segment, mgr.slot)
    assert set(theirs) <= {int(ids[i % L.GRANT_CAPACITY]) for i in
                           range(mgr._own.taken, int(words["granted"]))}  # only ours


def test_a_dead_clients_taken_grants_wait_for_its_live_copier(mgr, seg_name):
    # A process copying for the client (registered under its slot and generation) may still
    # write into the blocks it took: they stay out of reach until that process is gone.
    p, slot, gen, blocks = _holder(seg_name)
    copier = subprocess.Popen([sys.executable, "-c", _COPIER, seg_name, str(slot), str(gen)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert copier.stdout.readline().strip() == b"registered"
    _kill(p)
    wait_for(lambda: slots.record(mgr.segment, slot).state == L.SlotState.FREE,
             "the dead client to be reclaimed")
    assert mgr.segment.counters()["quarantined_blocks"] > 0
    assert [_states(mgr.segment)[b] for b in blocks] == [L.GRANTED] * 4  # nobody got them
    _kill(copier)
    wait_for(lambda: all(_states(mgr.segment)[b] == L.FREE for b in blocks),
             "the blocks to come back once the copier is gone")


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

K = b"contended"


def _contend(mgr, other):
    """mgr takes K from its grants and writes it; other's round-trip store of K (and 40
    more keys) is still unfinished. Returns both PrepareStoreOutputs."""
    _stocked(mgr)
    mine = mgr.prepare_store([K])
    theirs = other.prepare_store([K] + [b"theirs-%d" % i for i in range(40)])  # round trip
    assert K in theirs.keys_to_store
    procs.fill_all(mgr.segment.planes(), mine.block_ids, [K])
    return mine, theirs


@pytest.fixture
def other(mgr, seg_name):
    o = connect(seg_name)
    yield o
    o.shutdown()


def test_a_completed_store_is_not_lost_to_another_clients_unfinished_store(mgr, other):
    # mgr's completed block waits for other's store of K, and is published when it fails.
    mine, theirs = _contend(mgr, other)
    mgr.complete_store([K])
    assert mgr.key_status(K) == LookupResult.PENDING  # their store of K is unfinished
    other.complete_store(theirs.keys_to_store, success=False)
    assert mgr.lookup([K]) == 1
    assert mgr.prepare_load([K]) == mine.block_ids
    assert procs.check(mgr.segment.planes(), mine.block_ids[0], K)
    mgr.complete_load([K])


def test_a_completed_store_behind_a_successful_one_gives_its_block_back(mgr, other):
    mine, theirs = _contend(mgr, other)
    procs.fill_all(mgr.segment.planes(), theirs.block_ids, theirs.keys_to_store)
    mgr.complete_store([K])
    other.complete_store(theirs.keys_to_store)
    assert mgr.lookup([K]) == 1
    assert mgr.prepare_load([K]) != mine.block_ids  # theirs won: it was indexed first
    mgr.complete_load([K])
    assert _states(mgr.segment)[mine.block_ids[0]] == L.FREE


def test_a_block_still_in_the_grant_ring_cannot_be_published(mgr):
    _stocked(mgr, 2)
    words, ids = slots.grants(mgr.segment, mgr.slot)
    untaken = int(ids[mgr._own.taken % L.GRANT_CAPACITY])
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
        m.take_events()  # a successor takes over: it hands them over, as it would have
        words, _ = slots.grants(m.segment, m.slot)
        assert int(words["granted"]) > 0 and m._own.taken == 0
        procs.store(m, [b"rt2-%d" % i for i in range(5)])  # from the ring they reached
        assert m.lookup([b"rt2-%d" % i for i in range(5)]) == 5

        def stranded() -> int:  # GRANTED, and not in the ring (a refill marks them first)
            return _states(m.segment).count(L.GRANTED) - (int(words["granted"]) - m._own.taken)
        wait_for(lambda: stranded() == 0, "every granted block in the ring")
    finally:
        pid = m.segment.owner_record()[0]
        m.shutdown()
        stop_owner(pid)


def test_a_deferred_store_survives_an_owner_death(mgr, other):
    mine, theirs = _contend(mgr, other)
    mgr.complete_store([K])
    mgr.take_events()  # a round trip after the publish: the owner has deferred it
    assert verify(mgr.segment) == []  # a deferred store is no damage
    os.kill(mgr.segment.owner_record()[0], signal.SIGKILL)
    wait_for(lambda: not mgr.segment.owner_alive(), "the owner to die")
    other.complete_store(theirs.keys_to_store, success=False)  # a successor serves it
    assert mgr.lookup([K]) == 1
    assert mgr.prepare_load([K]) == mine.block_ids
    assert procs.check(mgr.segment.planes(), mine.block_ids[0], K)
    mgr.complete_load([K])
    words, _ = slots.grants(mgr.segment, mgr.slot)
    level = int(words["granted"]) - mgr._own.taken
    t = BlockTable(mgr.segment.buf, mgr.segment.geometry)
    try:
        mine_granted = sum(t.read(b).state == L.GRANTED and t.read(b).writer == mgr.slot
                           for b in range(BLOCKS))
    finally:
        t.close()
    assert mine_granted == level  # nothing stranded


def test_a_read_of_an_own_store_never_waits_out_a_stopped_owner(seg_name):
    # Reads are the scheduler's per-step calls: while the owner is frozen, our own store it
    # has not taken yet reads as still being stored (no error), and as a hit once it runs.
    m = connect(seg_name, TEST_LAYOUT, num_blocks=BLOCKS, max_clients=CLIENTS,
                ring_capacity=8192, timeout=2.0)
    owner = m.segment.owner_record()[0]
    try:
        _stocked(m, 2)
        os.kill(owner, signal.SIGSTOP)
        try:
            assert procs.store(m, [b"mine"]) == [b"mine"]  # from grants: one-way
            assert m.key_status(b"mine") == LookupResult.PENDING
            assert m.lookup([b"mine"]) == 0
            with pytest.raises(BlockStateError):
                m.prepare_load([b"mine"])
        finally:
            os.kill(owner, signal.SIGCONT)
        wait_for(lambda: m.lookup([b"mine"]) == 1, "the owner to take the publish")
    finally:
        m.shutdown()
        stop_owner(owner)


def test_a_client_refusing_grants_is_not_stocked_by_a_successor(seg_name):
    # The successor adopts the client before it hears from it: its first request after the
    # failover (a store) must not get it stocked, whatever the client says afterwards.
    m = connect(seg_name, TEST_LAYOUT, num_blocks=BLOCKS, max_clients=CLIENTS,
                ring_capacity=8192, grants=False)
    try:
        procs.store(m, [b"before-%d" % i for i in range(2)])
        words, _ = slots.grants(m.segment, m.slot)
        assert int(words["granted"]) == 0
        os.kill(m.segment.owner_record()[0], signal.SIGKILL)
        wait_for(lambda: not m.segment.owner_alive(), "the owner to die")
        procs.store(m, [b"after-%d" % i for i in range(2)])  # starts and meets the successor
        m.take_events()  # a round trip behind whatever the failover made the client send
        assert int(words["granted"]) == 0
        assert _states(m.segment).count(L.GRANTED) == 0
    finally:
        pid = m.segment.owner_record()[0]
        m.shutdown()
        stop_owner(pid)


def test_a_scribbled_granted_count_never_frees_blocks_its_client_took(mgr):
    """A client that lowered the owner's granted count below its taken count (a stray write
    into its own slot) must not have the blocks it is writing freed by the next owner's
    takeover: another store would get them while its copy still lands there."""
    _stocked(mgr, 3)
    keys = [b"scribbled-%d" % i for i in range(3)]
    out = mgr.prepare_store(keys)
    words, _ = slots.grants(mgr.segment, mgr.slot)
    words["granted"] = 0  # below taken: impossible counts
    owner = mgr.segment.owner_record()[0]
    os.kill(owner, signal.SIGKILL)
    wait_for(lambda: not mgr.segment.owner_alive(), "the owner to die")
    mgr.lookup([b"start-a-successor"])
    mgr._link.ensure_owner()
    wait_for(mgr.segment.owner_alive, "a successor")
    mgr.touch([b"start-a-successor"])  # a frame the successor serves after its takeover
    wait_for(lambda: mgr._link.requests.consumed(mgr._link.requests.tail), "the touch")
    assert [_states(mgr.segment)[b] for b in out.block_ids] == [L.GRANTED] * 3


def test_lowered_grant_counts_never_free_blocks_their_client_took_at_a_takeover(mgr):
    """A client that lowered both its granted and taken counts (still possible counts) must
    not have the blocks it took freed by the next owner: they look never handed over, and
    another store would get them while its copy still lands there. They stay granted, and
    the client's store of them completes."""
    _stocked(mgr, 3)
    keys = [b"lowered-%d" % i for i in range(3)]
    out = mgr.prepare_store(keys)
    assert len(out.block_ids) == 3
    before = _grant_marks(mgr.segment, out.block_ids)
    words, _ = slots.grants(mgr.segment, mgr.slot)
    words["granted"] = words["taken"] = int(words["taken"]) - 3  # as before the take
    owner = mgr.segment.owner_record()[0]
    os.kill(owner, signal.SIGKILL)
    wait_for(lambda: not mgr.segment.owner_alive(), "the owner to die")
    mgr._link.ensure_owner()
    wait_for(mgr.segment.owner_alive, "a successor")
    mgr.touch([b"start-a-successor"])  # a frame the successor serves after its takeover
    wait_for(lambda: mgr._link.requests.consumed(mgr._link.requests.tail), "the touch")
    assert _grant_marks(mgr.segment, out.block_ids) == before  # granted to it, in place
    words["taken"] = mgr._own.taken  # its word mended, its store completes
    mgr.complete_store(keys)
    wait_for(lambda: mgr.lookup(keys) == 3, "the store to be published")
    assert sorted(b for k in keys for b in _blocks_of(mgr.segment, k)) == sorted(out.block_ids)


def test_grant_counts_at_the_top_of_their_range_never_take_the_owner_down(mgr):
    """A client that set both of its grant counts to the largest u64 (level 0, so the
    counts look possible) must not crash the owner that refills it: the next positions
    do not fit a table entry. It is quarantined; the owner keeps serving."""
    _stocked(mgr, 1)
    owner, errors = mgr.segment.owner_record()[0], mgr.segment.counter("errors")
    words, _ = slots.grants(mgr.segment, mgr.slot)
    words["granted"] = words["taken"] = 2**64 - 1
    other = connect(mgr.segment.name)
    try:
        procs.store(other, [b"wakes-the-owner-%d" % i for i in range(3)])  # passes that refill
        wait_for(lambda: mgr.segment.counter("errors") > errors, "the refill to fail")
        assert procs.store(other, [b"after-the-quarantine"]) == [b"after-the-quarantine"]
        assert mgr.segment.owner_record()[0] == owner and mgr.segment.owner_alive()
    finally:
        other.shutdown()


def test_a_quarantined_client_is_told_so_at_once_instead_of_timing_out(mgr):
    """Once the owner stops serving a client, that client's calls (and its goodbye) must
    not wait out their whole timeout for a reply that never comes: they fail with an error
    that says why and what to do."""
    _stocked(mgr, 1)
    errors = mgr.segment.counter("errors")
    words, _ = slots.grants(mgr.segment, mgr.slot)
    words["granted"] = words["taken"] = 2**64 - 1
    other = connect(mgr.segment.name)
    try:
        procs.store(other, [b"wakes-the-owner-%d" % i for i in range(3)])
    finally:
        other.shutdown()
    wait_for(lambda: mgr.segment.counter("errors") > errors, "the owner to quarantine us")
    with pytest.raises(ClientQuarantinedError, match="quarantined"):
        mgr.take_events()
