"""The shared manager across real processes: sharing, crashes, failover, bad frames, leases.

Child processes are spawned (a fresh interpreter, like a real engine) and driven through
pipes; crashes are real SIGKILLs. Waiting for the owner to notice a death polls the segment
with a generous deadline — the deadline bounds a hang, it is not what the test asserts.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest

from kvshm.shm import layout as L
from kvshm.index import protocol as P
from kvshm.client.connect import connect
from kvshm.errors import ProtocolError
from kvshm.shm.segment import Segment
from kvshm.shm.table import BlockTable

from kvshm.index.api import LookupResult

import procs
from conftest import SMALL_GEOMETRY, TEST_LAYOUT, stop_owner

CTX = mp.get_context("spawn")
KEYS = [b"shared-key-%02d" % i for i in range(32)]


def wait_for(cond, what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)  # polling a condition; the assertion is on the condition


def spawn(target, name: str, *args, env: dict[str, str] | None = None, ctx=CTX):
    """Start ``target(name, conn, *args)`` in a fresh interpreter, with ``env`` added to its
    environment (a crash point, say); return (process, conn). ``ctx``: a child that uses
    torch starts quicker from ``torch_children.CTX``."""
    parent, child = ctx.Pipe()
    p = ctx.Process(target=target, args=(name, child, *args), daemon=True)
    saved = {k: os.environ.get(k) for k in env or {}}
    os.environ.update(env or {})
    try:
        p.start()  # a spawned child takes os.environ as it is now
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    return p, parent


def states(seg: Segment) -> list[int]:
    t = BlockTable(seg.buf, seg.geometry)
    out = [t.read(b).state for b in range(seg.geometry.num_blocks)]
    t.close()
    return out


@pytest.fixture
def cache(seg_name):
    """A client of a fresh 8-block segment (its owner is killed at teardown)."""
    mgr = connect(seg_name, TEST_LAYOUT, num_blocks=8, **SMALL_GEOMETRY)
    yield mgr
    pid = mgr.segment.owner_record()[0]
    mgr.shutdown()
    stop_owner(pid)


def test_block_stored_by_one_process_is_loaded_by_another(cache, seg_name):
    stored = procs.store(cache, KEYS[:4])
    p, conn = spawn(procs.load_and_verify, seg_name, KEYS[:4])
    result = conn.recv()
    p.join()
    assert stored == KEYS[:4]
    assert result["hits"] == 4 and result["verified"] == 4


def test_clients_get_distinct_slots(cache, seg_name):
    p, conn = spawn(procs.connect_and_report, seg_name)
    info = conn.recv()
    conn.send("go")
    p.join()
    assert info["slot"] != cache.slot


def test_killed_client_loses_its_pins_and_unfinished_stores(cache, seg_name):
    procs.store(cache, KEYS[:4])
    p, conn = spawn(procs.hold_and_wait, seg_name, KEYS[:4], KEYS[4:8])
    info = conn.recv()
    assert states(cache.segment).count(L.WRITING) == 4
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    wait_for(lambda: L.WRITING not in states(cache.segment), "the owner to free dead stores")
    # Everything the dead client pinned or leased is evictable again: all 8 blocks are ours.
    out = cache.prepare_store(KEYS[8:16])
    assert out is not None and len(out.keys_to_store) == 8
    assert info["slot"] != cache.slot


def test_killed_client_slot_is_reused(cache, seg_name):
    p, conn = spawn(procs.hold_and_wait, seg_name, [], KEYS[:2])
    dead_slot = conn.recv()["slot"]
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    # Free slots are claimed lowest first, so wait until the owner has reclaimed the dead
    # one (until then a newcomer rightly takes another free slot).
    from kvshm.shm import slots
    wait_for(lambda: slots.record(cache.segment, dead_slot).state == L.SlotState.FREE,
             "the owner to reclaim the dead client's slot")
    p2, conn2 = spawn(procs.connect_and_report, seg_name)
    info = conn2.recv()
    conn2.send("go")
    p2.join()
    assert info["slot"] == dead_slot


def test_owner_killed_keeps_ready_blocks_and_next_call_succeeds(cache):
    procs.store(cache, KEYS[:4])
    pending = cache.prepare_store(KEYS[4:6])
    pid, epoch = cache.segment.owner_record()[:2]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not cache.segment.owner_alive(), "the owner to die")
    # Our unfinished store survives the failover (we are alive) and completes normally.
    cache.complete_store(pending.keys_to_store)
    assert cache.segment.owner_record()[1] == epoch + 1
    assert cache.lookup(KEYS[:6]) == 6
    blocks = cache.prepare_load(KEYS[:4])
    planes = cache.segment.planes()
    assert all(procs.check(planes, b, k) for b, k in zip(blocks, KEYS[:4]))
    cache.complete_load(KEYS[:4])


def test_owner_restart_frees_stores_of_clients_that_died_meanwhile(cache, seg_name):
    procs.store(cache, KEYS[:2])
    p, conn = spawn(procs.hold_and_wait, seg_name, [], KEYS[2:5])
    conn.recv()
    owner = cache.segment.owner_record()[0]
    os.kill(owner, signal.SIGSTOP)  # the owner must not reclaim before it dies
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    os.kill(owner, signal.SIGKILL)
    assert states(cache.segment).count(L.WRITING) == 3
    out = cache.prepare_store(KEYS[5:11])  # starts a new owner, which rebuilds the index
    assert states(cache.segment).count(L.WRITING) == len(out.keys_to_store) == 6
    assert cache.lookup(KEYS[:2]) == 2


def test_client_death_is_invisible_to_other_clients(cache, seg_name):
    procs.store(cache, KEYS[:3])
    p, conn = spawn(procs.hold_and_wait, seg_name, KEYS[:3], KEYS[3:5])
    conn.recv()
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    assert cache.lookup(KEYS[:3]) == 3
    assert procs.store(cache, KEYS[5:7]) == KEYS[5:7]


def test_lookup_hit_stays_loadable_while_another_client_evicts(cache, seg_name):
    procs.store(cache, KEYS[:8])
    p, conn = spawn(procs.hold_and_wait, seg_name, KEYS[:2], [])
    conn.recv()  # the child leased KEYS[0:2] by lookup and pinned KEYS[0]
    out = cache.prepare_store(KEYS[8:14])  # needs 6 of the 8 blocks
    assert out is not None
    assert not set(out.evicted_keys) & set(KEYS[:2])
    assert cache.prepare_store(KEYS[14:16]) is None  # only the held blocks are left
    conn.send("go")
    p.join()


def test_a_prefix_asked_for_again_leases_only_what_still_holds_its_key(cache, seg_name):
    # Asking for the first key of a prefix loaded before leases the whole prefix at once; a
    # key another client evicted meanwhile, or stored again elsewhere, is not leased with it.
    prefix = KEYS[:8]
    procs.store(cache, prefix)
    assert cache.lookup(prefix) == 8
    cache.prepare_load(prefix)
    cache.complete_load(prefix)
    cache.release()
    p, conn = spawn(procs.evict_and_store_again, seg_name, prefix[:3], KEYS[8:13], prefix[5])
    assert conn.recv() == "done"
    p.join()
    answers = [cache.key_status(k) for k in prefix]
    assert answers == [LookupResult.HIT] * 3 + [LookupResult.MISS] * 2 + [LookupResult.HIT] + \
        [LookupResult.MISS] * 2
    blocks = cache.prepare_load([prefix[0], prefix[5]])
    planes = cache.segment.planes()
    assert all(procs.check(planes, b, k) for b, k in zip(blocks, [prefix[0], prefix[5]]))
    cache.complete_load([prefix[0], prefix[5]])


def test_a_prefix_loaded_with_a_repeated_key_is_leased_again_without_a_leaked_hold(
        cache, seg_name):
    # A load may name a key twice (two pins); leasing that prefix again takes one lease per
    # key, and releasing all leases leaves no hold behind: another client may evict it all.
    prefix = KEYS[:8]
    procs.store(cache, prefix)
    load = prefix[:2] + prefix[1:]  # 9 keys, the second one twice
    assert cache.lookup(prefix) == 8
    cache.prepare_load(load)
    cache.complete_load(load)
    cache.release()
    assert cache.held_blocks() == 0
    assert [cache.key_status(k) for k in prefix] == [LookupResult.HIT] * 8
    assert cache.held_blocks() == 8
    cache.release()
    assert cache.held_blocks() == 0
    p, conn = spawn(procs.store_and_report, seg_name, KEYS[8:16])
    assert conn.recv() == KEYS[8:16]  # every block was evictable
    p.join()


@pytest.fixture
def client(seg_name):
    """Connect to the test's segment (``connect``'s keywords); every client made is shut
    down and its owner killed at teardown."""
    made = []

    def new(**kw):
        made.append(connect(seg_name, TEST_LAYOUT, **kw))
        return made[-1]

    yield new
    for mgr in reversed(made):
        pid = mgr.segment.owner_record()[0]
        mgr.shutdown()
        stop_owner(pid)


def test_a_long_lookup_that_names_a_key_twice_leaks_no_hold(client, seg_name):
    # A lookup of 64 keys or more leases them in one batch: a key named twice is one lease,
    # so releasing all leases leaves no hold behind and another client may evict it all.
    mgr = client(num_blocks=80, ring_capacity=8192, hold_capacity=256)
    keys = [b"long-%03d" % i for i in range(70)]
    assert procs.store(mgr, keys) == keys
    assert mgr.lookup(keys[:1] + keys[:69]) == 70
    assert mgr.held_blocks() == 69
    mgr.release()
    assert mgr.held_blocks() == 0
    fresh = [b"fresh-%03d" % i for i in range(80)]
    p, conn = spawn(procs.store_and_report, seg_name, fresh)
    assert conn.recv() == fresh  # every block was evictable
    p.join()


def _loaded_before(cache, prefix) -> None:
    procs.store(cache, prefix)
    assert cache.lookup(prefix) == len(prefix)
    cache.prepare_load(prefix)
    cache.complete_load(prefix)
    cache.release()
    assert cache.held_blocks() == 0


@pytest.mark.parametrize("then", ["load", "release"])
def test_keys_leased_ahead_of_their_lookups_are_given_back(cache, seg_name, then):
    # Asking for the first key of a prefix loaded before leases the keys after it too, ahead
    # of their lookups. A caller that loads (the tier mover) or releases exactly what it
    # asked for must not be left holding the others: another client may evict them all.
    prefix = KEYS[:8]
    _loaded_before(cache, prefix)
    assert cache.key_status(prefix[0]) == LookupResult.HIT
    if then == "load":
        cache.prepare_load(prefix[:1])
        cache.complete_load(prefix[:1])
    else:
        cache.release(prefix[:1])
    assert cache.held_blocks() == 0
    p, conn = spawn(procs.store_and_report, seg_name, KEYS[8:16])
    assert conn.recv() == KEYS[8:16]  # every block was evictable
    p.join()


@pytest.mark.parametrize("ask", ["key_status", "lookup"])
def test_keys_asked_for_stay_leased_when_the_keys_leased_ahead_are_given_back(cache, seg_name,
                                                                              ask):
    # The scheduler asked for four keys of the prefix and loads two: the other two it was
    # told are hits stay leased (another client cannot evict them), the rest go.
    prefix = KEYS[:8]
    _loaded_before(cache, prefix)
    if ask == "key_status":
        assert [cache.key_status(k) for k in prefix[:4]] == [LookupResult.HIT] * 4
    else:
        assert cache.key_status(prefix[0]) == LookupResult.HIT  # leases the rest ahead
        assert cache.lookup(prefix[1:4]) == 3  # (prefix[0] again would count twice)
    cache.prepare_load(prefix[:2])
    cache.complete_load(prefix[:2])
    assert cache.held_blocks() == 2
    p, conn = spawn(procs.store_and_report, seg_name, KEYS[8:14])
    assert conn.recv() == KEYS[8:14]  # all but the two leased blocks
    p.join()
    blocks = cache.prepare_load(prefix[2:4])
    planes = cache.segment.planes()
    assert all(procs.check(planes, b, k) for b, k in zip(blocks, prefix[2:4]))
    cache.complete_load(prefix[2:4])


@pytest.mark.parametrize("ask", ["key_status", "prepare_load"])
def test_keys_leased_ahead_never_take_the_room_of_a_key_asked_for(client, ask):
    # With the smallest hold capacity (8 leases), asking for a loaded prefix's first key
    # leases the other 7 ahead; a lookup or a load of another key still gets its lease.
    mgr = client(num_blocks=16, ring_capacity=8192, hold_capacity=16)
    prefix, other = KEYS[:8], KEYS[8]
    assert procs.store(mgr, [other]) == [other]  # the least recent: evicted first
    _loaded_before(mgr, prefix)
    assert mgr.key_status(prefix[0]) == LookupResult.HIT
    if ask == "key_status":
        assert mgr.key_status(other) == LookupResult.HIT
    else:
        [block] = mgr.prepare_load([other])
        assert procs.check(mgr.segment.planes(), block, other)
        mgr.complete_load([other])


@pytest.fixture
def roomy(client):
    """A client of a fresh 320-block segment with room for the leases of a 300-key prefix
    (its owner is killed at teardown). No grants: all 320 blocks are for keys."""
    return client(num_blocks=320, ring_capacity=1 << 16, hold_capacity=1024, grants=False)


LONG = [b"long-prefix-%03d" % i for i in range(300)]


def _ask_whole(mgr, prefix) -> int:
    """One request: key by key over ``prefix``, load it all, release. How many blocks the
    first lookup alone left this client holding (the keys it leased ahead)."""
    assert mgr.key_status(prefix[0]) == LookupResult.HIT
    ahead = mgr.held_blocks()
    assert [mgr.key_status(k) for k in prefix[1:]] == [LookupResult.HIT] * (len(prefix) - 1)
    mgr.prepare_load(prefix)
    mgr.complete_load(prefix)
    mgr.release()
    assert mgr.held_blocks() == 0
    return ahead


def test_a_long_prefix_asked_for_whole_is_leased_further_ahead_until_one_lookup_covers_it(
        roomy, seg_name):
    # A prefix longer than one lease-ahead is leased in parts as the scheduler walks it; a
    # prefix that requests keep asking for whole is soon leased whole by its first lookup.
    _loaded_before(roomy, LONG)
    ahead = [_ask_whole(roomy, LONG) for _ in range(3)]
    assert ahead[0] < ahead[1] < ahead[2] == len(LONG)
    fresh = [b"evicts-%03d" % i for i in range(320)]
    p, conn = spawn(procs.store_and_report, seg_name, fresh, False)
    assert conn.recv() == fresh  # every block was evictable: no hold left behind
    p.join()


def test_a_request_asking_for_only_the_head_of_a_long_prefix_leases_less_ahead_next_time(
        roomy):
    # Once a prefix is leased whole by its first lookup, requests that share only its head
    # make the next first lookups take less ahead of them (less to give back each time).
    _loaded_before(roomy, LONG)
    assert max(_ask_whole(roomy, LONG) for _ in range(3)) == len(LONG)
    ahead = []
    for _ in range(4):
        assert roomy.key_status(LONG[0]) == LookupResult.HIT
        ahead.append(roomy.held_blocks())
        assert [roomy.key_status(k) for k in LONG[1:4]] == [LookupResult.HIT] * 3
        roomy.release(LONG[:4])
        assert roomy.held_blocks() == 0
    assert ahead[0] == len(LONG) and ahead == sorted(ahead, reverse=True)
    assert ahead[-1] < len(LONG) // 2


def test_a_lookup_in_a_new_step_is_not_taken_for_asking_past_the_last_steps_lease(roomy):
    # Leasing further ahead answers a request that walked past what the first lookup took.
    # A lookup after the step ended (everything given back) is another request's: it takes
    # the usual amount ahead, however the last step's lease of the same prefix went.
    _loaded_before(roomy, LONG)
    assert roomy.key_status(LONG[0]) == LookupResult.HIT
    first = roomy.held_blocks()
    roomy.release()
    assert roomy.key_status(LONG[150]) == LookupResult.HIT
    assert roomy.held_blocks() == first < len(LONG) - 150


def test_a_long_prefix_asked_from_many_places_keeps_few_lease_layouts(roomy):
    # Each place a prefix is first asked from remembers how its lease was laid out; asked
    # from everywhere, a long prefix must not keep one layout (up to its length) per key.
    from kvshm.client.runs import PLANS_KEPT
    _loaded_before(roomy, LONG)
    for off in range(0, len(LONG), 10):
        assert roomy.key_status(LONG[off]) == LookupResult.HIT
        roomy.release()
    run = roomy._h.runs.by_key[LONG[0]][0]
    assert 0 < len(run.plans) <= PLANS_KEPT < len(LONG) // 10


def test_a_prefix_leased_again_after_a_pin_took_a_hold_it_had_used_leaves_the_pin_alone(
        client, seg_name):
    # The first lookup of a prefix loaded before reuses the hold entries it leased it in last
    # time when they are free again. A load that took one of them meanwhile keeps it: the
    # pinned block stays safe from another client's stores, and its bytes intact.
    mgr = client(num_blocks=16, **SMALL_GEOMETRY)
    prefix, other = KEYS[:8], KEYS[8]
    assert procs.store(mgr, [other]) == [other]  # the least recent: evicted first
    _loaded_before(mgr, prefix)
    assert mgr.key_status(prefix[0]) == LookupResult.HIT  # leases all 8 ...
    mgr.release()  # ... and gives them back on top of the free entries
    [block] = mgr.prepare_load([other])  # takes a hold entry the prefix used
    assert mgr.key_status(prefix[0]) == LookupResult.HIT
    assert mgr.held_blocks() == 9
    mgr.release()
    assert mgr.held_blocks() == 1
    fresh = [b"fresh-%02d" % i for i in range(15)]
    p, conn = spawn(procs.store_and_report, seg_name, fresh)
    assert conn.recv() == fresh  # every block but the pinned one
    p.join()
    assert procs.check(mgr.segment.planes(), block, other)
    mgr.complete_load([other])


def test_a_refused_key_status_counts_as_no_lookup_and_no_hit(cache, seg_name):
    from kvshm.errors import InvalidArgumentError
    from kvshm.shm import slots
    procs.store(cache, KEYS[:1])
    for bad in ("a str key", 5):
        with pytest.raises(InvalidArgumentError):
            cache.key_status(bad)
    assert cache.key_status(KEYS[0]) == LookupResult.HIT
    assert cache.key_status(KEYS[1]) == LookupResult.MISS
    cache.release()
    ctr = dict(zip(L.SLOT_COUNTERS, slots.counters(cache.segment, cache.slot).tolist()))
    assert (ctr["lookups"], ctr["hits"]) == (2, 1)


def test_own_lookup_does_not_stop_own_store(cache):
    procs.store(cache, KEYS[:8])
    assert cache.lookup(KEYS[:8]) == 8
    out = cache.prepare_store(KEYS[8:16])
    assert out is not None and len(out.evicted_keys) == 8


def test_concurrent_connects_start_exactly_one_owner(seg_name):
    Segment.create(seg_name, TEST_LAYOUT, 8, **SMALL_GEOMETRY).close()
    kids = [spawn(procs.connect_and_report, seg_name) for _ in range(4)]
    infos = [conn.recv() for _, conn in kids]
    for p, conn in kids:
        conn.send("go")
        p.join()
    assert len({i["owner"] for i in infos}) == 1
    assert len({i["slot"] for i in infos}) == 4
    seg = Segment.attach(seg_name)
    pid = seg.owner_record()[0]
    seg.close()
    stop_owner(pid)


def test_four_clients_random_traffic_keep_every_invariant(seg_name):
    Segment.create(seg_name, TEST_LAYOUT, 16, **SMALL_GEOMETRY).close()
    kids = [spawn(procs.random_traffic, seg_name, seed, 300, 40) for seed in range(4)]
    stats = [conn.recv() for _, conn in kids]
    for p, _ in kids:
        p.join()
    seg = Segment.attach(seg_name)
    try:
        assert [s["errors"] for s in stats] == [[]] * 4
        assert sum(s["corrupt"] for s in stats) == 0
        assert sum(s["loads"] for s in stats) > 0
        wait_for(lambda: L.WRITING not in states(seg), "stores to settle")
        from kvshm.inspect.snapshot import verify
        assert verify(seg) == []
    finally:
        pid = seg.owner_record()[0]
        seg.close()
        stop_owner(pid)


# --- bad frames --------------------------------------------------------------------------
def _raw_call(mgr, frame: bytes):
    """Put raw bytes on ``mgr``'s request ring and return the decoded reply."""
    mgr._link.requests.put(frame, timeout=5)
    mgr._link.owner_bell.ring()
    assert mgr._link.reply_bell.wait(10, mgr._link.replies.pending, 0.001)
    return P.reply_decoder.decode(mgr._link.replies.try_get())


@pytest.mark.parametrize("frame", [
    b"\xff\x00garbage",
    P.request_encoder.encode(P.PrepareStore(7, [b"k"] * 3))[:-4],  # truncated
    P.request_encoder.encode(["PrepareStore", "not-an-int", [1, 2]]),  # wrong types
    P.request_encoder.encode(["NoSuchOp", 1]),
    b"\x92\xa3\x89\x1c\xdb\x01",  # an op name that is not UTF-8
    b"",
], ids=["garbage", "truncated", "wrong-types", "unknown-op", "op-not-utf8", "empty"])
def test_malformed_frame_gets_an_error_and_the_owner_keeps_serving(cache, frame):
    reply = _raw_call(cache, frame)
    assert isinstance(reply, P.Error) and reply.kind == "ProtocolError"
    with pytest.raises(ProtocolError):
        P.raise_error(reply)
    assert procs.store(cache, KEYS[:2]) == KEYS[:2]
    assert cache.segment.counter("errors") >= 1


def test_bad_arguments_get_typed_errors_from_the_owner(cache):
    from kvshm.errors import BlockStateError, UnknownKeyError
    with pytest.raises(UnknownKeyError):
        cache.complete_store([b"never-prepared"])
    cache.prepare_store([b"mine"])
    reply = _raw_call(cache, P.request_encoder.encode(P.CompleteStore(cache._link.next_req(), [b"zzz"])))
    assert reply.kind == "UnknownKeyError"
    with pytest.raises(BlockStateError):
        cache.complete_load([b"mine"])
    cache.complete_store([b"mine"])
    assert cache.lookup([b"mine"]) == 1


def test_requests_larger_than_one_frame_are_split(client):
    mgr = client(num_blocks=64, **{**SMALL_GEOMETRY, "hold_capacity": 256})
    keys = [b"k" * 60 + b"%04d" % i for i in range(60)]  # ~4 KiB: several frames
    out = mgr.prepare_store(keys)
    assert out.keys_to_store == keys and len(set(out.block_ids)) == 60
    mgr.complete_store(keys)
    mgr.touch(keys)
    assert mgr.lookup(keys) == 60


def test_the_owner_counts_the_cpu_time_it_spends_serving_frames(cache):
    # A pass adds its time once its replies are out, so the count follows the reply.
    before = cache.segment.counter("owner_busy_ns")
    cache.take_events()
    wait_for(lambda: cache.segment.counter("owner_busy_ns") > before,
             "the owner to count the pass that served the request")
