"""Lookup leases are counted: each lookup that answered a key as a hit is given back once.

Two requests of one scheduler may look up the same key in one step; the client holds one
lease for it, and the release of one request (its load was not needed, or a lower tier said
"not yet") must not take it from the other, which was told the key is a hit. Here the test
process is one client of a real owner process; another client, spawned like a real engine,
stores fresh keys that need every block of the cache: whatever it can evict, it evicts.
"""
from __future__ import annotations

import random

import pytest

from kvshm.index.api import LookupResult
from kvshm.client.connect import connect
from kvshm.errors import (BlockStateError, HoldsExhaustedError, InvalidArgumentError,
                          UnknownKeyError)
from kvshm.shm import layout as L
from kvshm.shm import slots
from kvshm.shm.table import BlockTable

import procs
from conftest import SMALL_GEOMETRY, TEST_LAYOUT, stop_owner
from test_shared import spawn, wait_for

KEYS = [b"lease-key-%02d" % i for i in range(24)]
FRESH = KEYS[8:16]  # what the other client stores: as many keys as the cache has blocks


@pytest.fixture
def cache(seg_name):
    """A client of a fresh 8-block segment holding KEYS[:8] (its owner is killed at
    teardown). 8 blocks get no grants: every store is one all-or-nothing round trip."""
    mgr = connect(seg_name, TEST_LAYOUT, num_blocks=8, **SMALL_GEOMETRY)
    assert procs.store(mgr, KEYS[:8]) == KEYS[:8]
    yield mgr
    pid = mgr.segment.owner_record()[0]
    mgr.shutdown()
    stop_owner(pid)


def other_client_stores(seg_name: str, keys: list[bytes]) -> list[bytes]:
    """Another client process stores ``keys`` (evicting what it may); the keys it stored."""
    p, conn = spawn(procs.store_and_report, seg_name, keys)
    stored = conn.recv()
    p.join()
    return stored


def ask(mgr, key: bytes, how: str) -> None:
    if how == "key_status":
        assert mgr.key_status(key) == LookupResult.HIT
    else:
        assert mgr.lookup([key]) == 1


def load_and_check(mgr, keys: list[bytes]) -> None:
    blocks = mgr.prepare_load(keys)
    planes = mgr.segment.planes()
    assert all(procs.check(planes, b, k) for b, k in zip(blocks, keys))
    mgr.complete_load(keys)


@pytest.mark.parametrize("how", ["key_status", "lookup"])
def test_a_key_two_requests_looked_up_stays_leased_when_one_releases_it(cache, seg_name, how):
    key = KEYS[0]
    ask(cache, key, how)  # request 1: a hit
    ask(cache, key, how)  # request 2, same step: a hit
    cache.release([key])  # request 1 will not load it (the generic connector releases)
    stored = other_client_stores(seg_name, FRESH)  # evicts all it may
    load_and_check(cache, [key])  # request 2 loads what it was told is a hit
    assert stored == []  # the key stayed leased: no room for all 8


def test_each_lookup_of_a_key_is_given_back_by_one_release(cache, seg_name):
    key = KEYS[0]
    ask(cache, key, "key_status")
    ask(cache, key, "lookup")
    assert cache.lookup(KEYS[:2]) == 2
    assert cache.held_blocks() == 2  # one hold per key, however often it was asked for
    cache.release([key, KEYS[1]])
    cache.release([key])
    assert cache.held_blocks() == 1
    cache.release([key, KEYS[1]])  # a key not leased any more is ignored
    assert cache.held_blocks() == 0
    assert other_client_stores(seg_name, FRESH) == FRESH  # every block was evictable


def test_release_of_all_drops_every_count(cache, seg_name):
    for _ in range(3):
        assert cache.lookup(KEYS[:8]) == 8
    cache.release()
    assert cache.held_blocks() == 0
    assert other_client_stores(seg_name, FRESH) == FRESH


def test_a_load_takes_one_lookup_and_leaves_the_others_leased(cache, seg_name):
    key = KEYS[0]
    ask(cache, key, "key_status")
    ask(cache, key, "lookup")
    cache.prepare_load([key])  # request 1 loads: its lease becomes a pin, request 2's stays
    assert cache.held_blocks() == 2
    cache.complete_load([key])
    assert cache.held_blocks() == 1
    assert other_client_stores(seg_name, FRESH) == []
    load_and_check(cache, [key])  # request 2 loads: the last lookup of it is taken
    assert cache.held_blocks() == 0
    assert other_client_stores(seg_name, FRESH) == FRESH


def test_a_load_naming_a_key_twice_takes_two_lookups(cache):
    key = KEYS[0]
    ask(cache, key, "key_status")
    ask(cache, key, "key_status")
    cache.prepare_load([key, key])
    assert cache.held_blocks() == 2  # two pins, no lease left
    cache.complete_load([key, key])
    assert cache.held_blocks() == 0


def test_a_failed_load_takes_no_lookup(cache, seg_name):
    # The generic connector releases a request's hits after its load failed: the other
    # request's lookup of the same key must survive that release.
    key = KEYS[0]
    ask(cache, key, "key_status")
    ask(cache, key, "key_status")
    with pytest.raises(UnknownKeyError):
        cache.prepare_load([key, b"never-stored"])
    cache.release([key])
    assert cache.held_blocks() == 1
    assert other_client_stores(seg_name, FRESH) == []
    load_and_check(cache, [key])


def test_our_own_store_that_evicts_a_key_asked_for_twice_drops_its_lease(cache):
    # However often it was asked for, a key our own store evicted is no hit any more.
    assert cache.lookup(KEYS[:8]) == 8
    assert cache.lookup(KEYS[:8]) == 8
    out = cache.prepare_store(FRESH)
    assert out is not None and sorted(out.evicted_keys) == KEYS[:8]
    assert cache.held_blocks() == 0
    assert cache.key_status(KEYS[0]) == LookupResult.MISS
    cache.complete_store(out.keys_to_store, success=False)


def ask_two_of_a_prefix_loaded_before(cache) -> list[bytes]:
    """Load KEYS[:8], release it, then ask for its first two keys: the first lookup leases
    all 8, 7 of them ahead of their lookups, and the second asks for one of those."""
    prefix = KEYS[:8]
    assert cache.lookup(prefix) == 8
    load_and_check(cache, prefix)
    cache.release()
    assert cache.key_status(prefix[0]) == LookupResult.HIT
    assert cache.key_status(prefix[1]) == LookupResult.HIT
    return prefix


def test_a_key_leased_ahead_counts_only_the_lookups_that_asked_for_it(cache, seg_name):
    # Asking for the first key of a prefix loaded before leases the rest ahead of their
    # lookups; those count from the first lookup that asks for them, not before.
    prefix = ask_two_of_a_prefix_loaded_before(cache)
    cache.release([prefix[1]])  # its one lookup given back; the keys leased ahead go too
    assert cache.held_blocks() == 1
    cache.release([prefix[0]])
    assert cache.held_blocks() == 0
    assert other_client_stores(seg_name, FRESH) == FRESH


def test_a_key_asked_for_after_it_was_leased_ahead_keeps_its_lease_when_the_rest_go(cache):
    prefix = ask_two_of_a_prefix_loaded_before(cache)
    cache.release([prefix[0]])  # gives back its lookup and the 6 keys nobody asked for
    assert set(cache._h.leases) == {prefix[1]}
    assert cache.held_blocks() == 1
    cache.release([prefix[1]])
    assert cache.held_blocks() == 0


@pytest.mark.parametrize("seed", range(3))
def test_random_lookups_loads_and_releases_keep_the_counts_a_model_predicts(cache, seed):
    # One client, random calls; a model counts, per key, the lookups that reported it as a
    # hit and were not given back. A key is leased exactly when the model says its count is
    # positive, or it was leased ahead of its lookups (counted by none: nobody asked yet).
    import random
    rng = random.Random(seed)
    h = cache._h
    count: dict[bytes, int] = {}
    for _ in range(300):
        op = rng.choice(["key_status", "lookup", "release", "release", "load", "all"])
        some = [rng.choice(KEYS[:8]) for _ in range(rng.randint(1, 4))]
        if op == "key_status":
            assert cache.key_status(some[0]) == LookupResult.HIT
            count[some[0]] = count.get(some[0], 0) + 1
        elif op == "lookup":
            assert cache.lookup(some) == len(some)
            for k in some:
                count[k] = count.get(k, 0) + 1
        elif op == "release":
            cache.release(some)
            for k in some:
                count[k] = max(0, count.get(k, 0) - 1)
        elif op == "load":
            if rng.random() < 0.2:
                some = KEYS[:8]  # a whole prefix: later lookups lease it ahead
            cache.prepare_load(some)
            cache.complete_load(some)
            for k in some:
                count[k] = max(0, count.get(k, 0) - 1)
        else:
            cache.release()
            count.clear()
        assert h.asks == {k: n for k, n in count.items() if n}
        # every leased key is asked for or named ahead; ``ahead`` may still name keys asked
        # for since, or whose lease went another way
        assert set(h.asks) <= set(h.leases) and set(h.leases) - set(h.asks) <= h.ahead
        assert cache.held_blocks() == len(h.leases)
    cache.release()
    assert cache.held_blocks() == 0


def test_a_long_lookup_counts_each_hit_it_reports(seg_name):
    # 64 keys or more are leased in one batch (one fence); their lookups count as anywhere.
    mgr = connect(seg_name, TEST_LAYOUT, num_blocks=80, ring_capacity=8192, hold_capacity=256)
    try:
        keys = [b"long-%03d" % i for i in range(70)]
        assert procs.store(mgr, keys) == keys
        assert mgr.lookup(keys[:1] + keys[:69]) == 70  # the first key named twice
        assert mgr.lookup(keys) == 70  # all leased now: the dict-hit path
        mgr.release(keys)
        assert mgr.held_blocks() == 69  # keys[69] had one lookup, keys[0] three
        mgr.release(keys[:69])
        assert mgr.held_blocks() == 1
        mgr.release(keys[:1])
        assert mgr.held_blocks() == 0
    finally:
        pid = mgr.segment.owner_record()[0]
        mgr.shutdown()
        stop_owner(pid)


def test_a_lease_a_failover_lost_is_no_hit_whatever_its_count(cache):
    key = KEYS[0]
    assert cache.key_status(key) is LookupResult.HIT
    assert cache.key_status(key) is LookupResult.HIT  # two lookups counted on one lease
    block = cache.index.find(key)[0]
    # what a dead owner's successor may leave: the block now holds another key
    table = BlockTable(cache.segment.buf, cache.segment.geometry)
    table.write(block, L.READY, b"other")
    table.close()
    cache._after_failover()  # the client's repair once a new owner serves it
    assert key not in cache._h.leases and key not in cache._h.asks
    assert cache.key_status(key) is not LookupResult.HIT


def test_a_refused_lookup_keeps_no_lease_and_counts_no_lookup(cache, seg_name):
    # A lookup that raises InvalidArgumentError reports no hit, so no release the caller
    # knows to send gives back a lease it took: each refusal left its hits leased, which
    # other clients could never evict and which filled this client's lease room.
    for k in KEYS[:8]:
        with pytest.raises(InvalidArgumentError):
            cache.lookup([k, "not bytes"])
    assert cache.held_blocks() == 0
    ask(cache, KEYS[0], "lookup")  # one lookup reported...
    with pytest.raises(InvalidArgumentError):
        cache.lookup(KEYS[:1] + [bytearray(b"not bytes either")])  # ...and one refused
    cache.release(KEYS[:1])  # gives back the one reported
    assert cache.held_blocks() == 0
    assert other_client_stores(seg_name, FRESH) == FRESH  # every block was evictable


def test_keys_leased_ahead_give_way_to_a_pin_beside_a_lease_another_request_counts_on(
        seg_name):
    # 16 holds: 8 loads in flight, a key two requests hit, and the first key of a prefix
    # loaded before, which leases the other 7 keys ahead: no hold is free. Request 1's load
    # of the shared key needs a hold for its pin beside the lease request 2 still counts on;
    # the leases nobody asked for must give way, not request 2's lease.
    mgr = connect(seg_name, TEST_LAYOUT, num_blocks=24, ring_capacity=8192, hold_capacity=16)
    try:
        prefix, key, loading = KEYS[:8], KEYS[8], KEYS[9:17]
        assert procs.store(mgr, prefix + [key] + loading) == prefix + [key] + loading
        assert mgr.lookup(prefix) == 8
        load_and_check(mgr, prefix)
        mgr.release()
        ask(mgr, key, "key_status")  # request 1
        ask(mgr, key, "key_status")  # request 2
        mgr.prepare_load(loading)  # loads in flight (8 pins)
        ask(mgr, prefix[0], "key_status")  # request 3: the rest of the prefix leased ahead
        load_and_check(mgr, [key])  # request 1 loads
        fresh = [b"ahead-fresh-%02d" % i for i in range(15)]
        assert other_client_stores(seg_name, fresh) == []  # the leased key is not evictable
        load_and_check(mgr, [key])  # request 2 loads what it was told is a hit
        mgr.complete_load(loading)
    finally:
        pid = mgr.segment.owner_record()[0]
        mgr.shutdown()
        stop_owner(pid)


# Prefixes for the random walks below: longer than one relet's first reach, sharing a head,
# and a key in two loaded prefixes (remembered runs) at once.
HEAD = [b"walk-head-%03d" % i for i in range(170)]
PREFIXES = [HEAD, HEAD[:40] + [b"walk-fork-%03d" % i for i in range(30)],
            [b"walk-other-%03d" % i for i in range(20)] + HEAD[100:140], HEAD[:150],
            [b"walk-short-%03d" % i for i in range(12)]]
WALKED = list(dict.fromkeys(k for p in PREFIXES for k in p))


def holds_agree(mgr, count: dict[bytes, int]) -> None:
    """Every hold entry is free, a lease or a pin (once), each on a block that holds its key,
    and the leases' lookup counts are the model's."""
    h, loadable = mgr._h, (L.READY, L.EVICTING)
    free, leases = h.free, h.leases
    pinned = [i for v in h.pins.values() for i in v]
    used = list(leases.values()) + pinned
    assert len(set(free)) == len(free) and len(set(used)) == len(used)
    assert set(free).isdisjoint(used) and len(free) + len(used) == len(h.holds)
    # every leased key is asked for or named ahead; ahead may still name a key asked for
    # since, or whose lease a failed load or our own store took: skipped
    assert set(h.asks) <= set(leases) and set(leases) - set(h.asks) <= h.ahead
    assert h.asks == {k: n for k, n in count.items() if n}
    assert mgr.held_blocks() == len(used)
    # claims and evictions read a slot's holds below its mark only: it covers every one
    assert h.mark == hold_mark(mgr) and all(i < h.mark for i in used)
    holds = h.holds.tolist()
    assert all(holds[i] == -1 for i in free)
    for k, i in leases.items():
        assert holds[i] < -1 and mgr.table.state_if_key(L.lease_code(holds[i]), k) in loadable
    for k, v in h.pins.items():
        assert all(holds[i] >= 0 and mgr.table.state_if_key(holds[i], k) in loadable for i in v)


def random_walks(mgr, rng, other, steps: int) -> None:
    h, planes, count, loading, fresh = mgr._h, mgr.segment.planes(), {}, [], iter(range(10**6))

    def no_hit_is_right(k: bytes) -> bool:  # not READY, or no lease room left
        return mgr.index.find(k)[1] != L.READY or h.room() <= 0

    def loaded(ks: list[bytes], blocks: list[int]) -> None:
        assert all(procs.check(planes, b, k) for b, k in zip(blocks, ks))
        for k in ks:
            count[k] = max(0, count.get(k, 0) - 1)
            if not h.free and k not in h.asks:
                count.pop(k)  # no hold was free: the lease itself became the pin

    for _ in range(steps):
        p = rng.choice(PREFIXES)
        op = rng.choice(["walk", "walk", "request", "request", "request", "lookup", "load",
                         "complete", "release", "release all"])
        if rng.random() < 0.08:
            op = rng.choice(["theirs", "ours"])
        elif rng.random() < 0.01:
            op = "failover"
        if op in ("walk", "request"):  # key by key, as a scheduler, up to the first no-hit
            a = rng.choice([0, 0, 0, 1, 10, 45])
            asked = []
            for k in p[a:a + rng.choice([1, 4, len(p) // 2, len(p)])]:
                if mgr.key_status(k) != LookupResult.HIT:
                    assert no_hit_is_right(k)
                    break
                asked.append(k)
                count[k] = count.get(k, 0) + 1
            if op == "request" and asked and h.free:
                blocks = mgr.prepare_load(asked)
                loaded(asked, blocks)
                mgr.complete_load(asked)
        elif op == "lookup":
            ks = p[rng.choice([0, 0, 5, 30]):][:rng.choice([3, 64, 100, 200])]
            hits = mgr.lookup(ks)
            for k in ks[:hits]:
                count[k] = count.get(k, 0) + 1
            assert hits == len(ks) or no_hit_is_right(ks[hits])
        elif op == "load":  # the asked head of a prefix, or keys nobody asked for
            m = next((i for i, k in enumerate(p) if not count.get(k)), len(p))
            ks = p[:m if rng.random() < 0.8 else rng.randint(1, len(p))]
            try:
                blocks = mgr.prepare_load(ks) if ks else []
            except (UnknownKeyError, BlockStateError, HoldsExhaustedError):
                for k in ks:  # a lease that became the failed load's pin went with it
                    if k not in h.asks:
                        count.pop(k, None)
            else:
                loaded(ks, blocks)
                loading.append((ks, blocks))
        elif op == "complete" and loading:
            ks, blocks = loading.pop(rng.randrange(len(loading)))
            assert all(procs.check(planes, b, k) for b, k in zip(blocks, ks))
            mgr.complete_load(ks)
        elif op == "release":
            ks = [k for k in p if count.get(k)]
            ks = rng.sample(ks, min(len(ks), rng.randint(1, 40)))
            mgr.release(ks)
            for k in ks:
                count[k] -= 1
        elif op == "release all":
            mgr.release()
            count.clear()
        elif op == "theirs":  # evicts what we do not hold, may store our keys anew elsewhere
            ks = [b"walk-fresh-%06d" % next(fresh) for _ in range(rng.randint(1, 60))]
            other.send(ks + rng.sample(WALKED, rng.randint(0, 30)))
            other.recv()
        elif op == "ours":  # may evict keys we leased: they are no hits any more
            ks = [b"walk-fresh-%06d" % next(fresh) for _ in range(rng.randint(1, 40))]
            out = mgr.prepare_store(ks + rng.sample(WALKED, rng.randint(0, 20)))
            if out is not None:
                for k in out.evicted_keys:
                    count.pop(k, None)
                procs.fill_all(planes, out.block_ids, out.keys_to_store)
                mgr.complete_store(out.keys_to_store)
        elif op == "failover":  # the next call starts an owner; our client revalidates
            stop_owner(mgr.segment.owner_record()[0])
            wait_for(lambda: not mgr.segment.owner_alive(), "the owner to die")
            mgr.take_events()
        holds_agree(mgr, count)
    for ks, blocks in loading:
        assert all(procs.check(planes, b, k) for b, k in zip(blocks, ks))
        mgr.complete_load(ks)
    mgr.release()
    holds_agree(mgr, {})


@pytest.mark.parametrize("hold_capacity", [16, 64, 512])
@pytest.mark.parametrize("seed", range(2))
def test_random_walks_over_loaded_prefixes_keep_every_hold_accounted_for(seg_name, seed,
                                                                        hold_capacity):
    # Scheduler-like walks over prefixes loaded before (relets reusing their hold entries,
    # reaching further ahead and less), lookups, loads, releases, another client's and our
    # own stores and owner failovers: after every call each hold entry is free, one lease or
    # one pin on a block that holds its key, and the lookup counts are what a model says.
    mgr = connect(seg_name, TEST_LAYOUT, num_blocks=300, ring_capacity=1 << 16,
                  hold_capacity=hold_capacity, grants=False)
    p, other = spawn(procs.store_on_demand, seg_name, False)
    try:
        assert procs.store(mgr, WALKED) == WALKED
        random_walks(mgr, random.Random(seed), other, 300)
        assert mgr.held_blocks() == 0
        fresh = [b"walk-after-%03d" % i for i in range(300)]
        other.send(fresh)
        assert other.recv() == fresh  # every block was evictable: no hold left behind
    finally:
        other.send(None)
        p.join()
        pid = mgr.segment.owner_record()[0]
        mgr.shutdown()
        stop_owner(pid)


def test_requests_sharing_the_head_of_a_long_prefix_soon_lease_only_what_they_ask(seg_name):
    """A prefix loaded whole is leased ahead as far as requests asked before; requests that
    ask for its first 40 keys only take, after one of them, those 40 and no more."""
    mgr = connect(seg_name, TEST_LAYOUT, num_blocks=1024, ring_capacity=8192,
                  hold_capacity=2048)
    try:
        prefix = [b"long-%04d" % i for i in range(512)]
        assert procs.store(mgr, prefix) == prefix
        assert all(mgr.key_status(k) == LookupResult.HIT for k in prefix)  # a long request
        load_and_check(mgr, prefix)
        mgr.release()
        held = []
        for _ in range(3):  # short ones
            assert all(mgr.key_status(k) == LookupResult.HIT for k in prefix[:40])
            held.append(mgr.held_blocks())
            load_and_check(mgr, prefix[:40])
            mgr.release()
        assert held[1:] == [40, 40]
    finally:
        pid = mgr.segment.owner_record()[0]
        mgr.shutdown()
        stop_owner(pid)


def test_one_request_asking_further_costs_later_requests_no_extra_relets(seg_name):
    """A request asking one key past the reach relets the rest from an offset; what it asked
    counts from the prefix's head, so the requests after it still lease in one relet."""
    mgr = connect(seg_name, TEST_LAYOUT, num_blocks=1024, ring_capacity=8192,
                  hold_capacity=2048)
    try:
        prefix = [b"long-%04d" % i for i in range(512)]
        assert procs.store(mgr, prefix) == prefix
        assert all(mgr.key_status(k) == LookupResult.HIT for k in prefix)
        load_and_check(mgr, prefix)
        mgr.release()
        runs, relets = mgr._h.runs, []
        real = runs.relet

        def counted(h, key):
            relets.append(key)
            return real(h, key)

        runs.relet = counted
        per_request = []
        for n in [64, 64, 65, 64, 64, 64, 65, 64, 65, 64, 40, 100, 100, 100]:
            relets.clear()
            assert all(mgr.key_status(k) == LookupResult.HIT for k in prefix[:n])
            load_and_check(mgr, prefix[:n])
            mgr.release()
            per_request.append(len(relets))
        assert max(per_request) <= 2, per_request
    finally:
        pid = mgr.segment.owner_record()[0]
        mgr.shutdown()
        stop_owner(pid)


@pytest.fixture
def roomy(seg_name):
    """A client of a 1,024-block segment, with room to lease long prefixes (and, with few
    clients, 64 blocks in its grant ring)."""
    mgr = connect(seg_name, TEST_LAYOUT, num_blocks=1024, ring_capacity=8192,
                  hold_capacity=2048, max_clients=4)
    yield mgr
    pid = mgr.segment.owner_record()[0]
    mgr.shutdown()
    stop_owner(pid)


def store_from_grants(mgr, keys: list[bytes]) -> None:
    """Store ``keys`` from the client's grant ring (waits until the owner stocked it: it
    stocks the rings of clients that store), and wait until the owner published them."""
    head, _ = slots.grants(mgr.segment, mgr.slot)
    if head["granted"] == 0:
        assert procs.store(mgr, [b"first-store"]) == [b"first-store"]
    wait_for(lambda: head["granted"] - mgr._own.taken >= len(keys), "the grant ring stocked")
    assert procs.store(mgr, keys) == keys
    wait_for(lambda: all(mgr.index.find(k)[1] == L.READY for k in keys), "the publish")


def test_the_first_lookup_of_a_prefix_we_stored_leases_all_of_it(roomy):
    prefix = [b"ours-%04d" % i for i in range(32)]
    store_from_grants(roomy, prefix)
    assert roomy.key_status(prefix[0]) == LookupResult.HIT
    assert roomy.held_blocks() == 32  # the rest leased ahead, by the same one handshake
    assert all(roomy.key_status(k) == LookupResult.HIT for k in prefix)
    load_and_check(roomy, prefix)
    roomy.release()
    assert roomy.held_blocks() == 0


def test_a_prefix_we_stored_and_whose_blocks_hold_other_keys_since_is_no_hit(roomy):
    prefix = [b"ours-%04d" % i for i in range(32)]
    store_from_grants(roomy, prefix)
    for i in range(0, 1024, 64):  # our own later stores evict it and reuse its blocks
        store_from_grants(roomy, [b"later-%04d" % j for j in range(i, i + 64)])
    assert all(roomy.index.find(k)[1] == -1 for k in prefix)
    assert roomy.key_status(prefix[0]) == LookupResult.MISS
    assert roomy.held_blocks() == 0


def test_a_relet_that_took_keys_nobody_asked_for_takes_only_what_was_asked_next(roomy):
    """A prefix leased ahead past what requests ask (ours, stored with the keys of our own
    request after it) is leased, after one such request, only as far as they ask."""
    prefix = [b"ours-%04d" % i for i in range(80)]
    assert procs.store(roomy, prefix) == prefix
    assert all(roomy.key_status(k) == LookupResult.HIT for k in prefix)
    load_and_check(roomy, prefix)
    roomy.release()
    held = []
    for _ in range(3):  # requests that share the first 64 keys
        assert all(roomy.key_status(k) == LookupResult.HIT for k in prefix[:64])
        held.append(roomy.held_blocks())
        load_and_check(roomy, prefix[:64])
        roomy.release()
    assert held[1:] == [64, 64]


def hold_mark(mgr) -> int:
    return int(slots.hold_mark(mgr.segment, mgr.slot)[0])


def test_a_client_that_holds_nothing_any_more_brings_its_hold_mark_down(roomy):
    """Claims and evictions read every slot's holds below its mark: once a client holds
    nothing, they read none of its entries, however many it used before."""
    prefix = [b"mark-%04d" % i for i in range(100)]
    assert procs.store(roomy, prefix) == prefix
    assert roomy.lookup(prefix) == 100
    assert hold_mark(roomy) >= 100
    roomy.release()
    assert hold_mark(roomy) == 0
    assert roomy.lookup(prefix) == 100
    load_and_check(roomy, prefix)  # the loads took every lease: nothing held after them
    assert hold_mark(roomy) == 0


def test_a_lease_taken_after_the_hold_mark_came_down_still_protects_its_block(cache, seg_name):
    assert cache.lookup(KEYS[:8]) == 8
    cache.release()
    assert hold_mark(cache) == 0
    assert cache.key_status(KEYS[3]) == LookupResult.HIT
    assert hold_mark(cache) > 0
    assert other_client_stores(seg_name, FRESH) == []  # all 8 blocks or none: one is held
    load_and_check(cache, [KEYS[3]])


def test_a_key_that_is_not_bytes_is_refused_by_the_first_lookup_of_a_prefix_we_stored(roomy):
    prefix = [b"typed-%04d" % i for i in range(16)]
    store_from_grants(roomy, prefix)
    with pytest.raises(InvalidArgumentError):
        roomy.key_status(memoryview(prefix[0]))  # equal to the key, but not bytes
    assert roomy.held_blocks() == 0 and not roomy._h.asks
    assert roomy.key_status(prefix[0]) == LookupResult.HIT
