"""A running request's provisional rank (vLLM 0.33's LRU), through the managers and the owner.

``Running`` names the request some keys belong to: its keys share one rank, taken when the
request first needs one, tails before heads; ``done`` ends it. Ordering is observed through
evictions, on the in-process manager and through a real owner process. The frames that carry
it must still work without the new fields, and a bad value must never crash or corrupt the
owner: a touch or a store naming one is refused, a publish is applied without ranks.
"""
from __future__ import annotations

import pytest

from kvshm.errors import InvalidArgumentError
from kvshm.owner import running as running_mod
from kvshm.index import protocol as P
from kvshm.index.api import LookupResult, Running
from kvshm.client.connect import connect
from kvshm.owner.manager import LocalManager
from kvshm.index.access import RANKED, SEEN

import procs
from conftest import KIND_PARAMS, TEST_LAYOUT, make_manager, stop_owner
from test_grants import BLOCKS, CLIENTS, _stocked
from test_shared import _raw_call, wait_for

X = [b"x%d" % i for i in range(4)]
R = [b"r%d" % i for i in range(2)]
Z = [b"z%d" % i for i in range(4)]


def _lru(kind: str, make_segment):
    seg = make_segment(num_blocks=8, policy="lru")
    m = make_manager(kind, seg, "lru", True)
    yield m
    pid = seg.owner_record()[0] if kind == "shared" else 0
    m.shutdown()
    if pid:
        stop_owner(pid)


@pytest.fixture(params=KIND_PARAMS)
def lru(request, make_segment):
    """An 8-block LRU manager of each kind (shared: a real owner process, no grants)."""
    yield from _lru(request.param, make_segment)


@pytest.fixture
def shared_x(make_segment):
    """A shared 8-block LRU manager (a real owner process, no grants) holding X."""
    for m in _lru("shared", make_segment):
        procs.store(m, X)
        yield m


def ranked(keys: list[bytes]) -> bytes:
    return bytes([RANKED]) * len(keys)


def _running_request_layout(m) -> None:
    """x0..x3 stored; request 1 reads x1 (pos 16) and x2 (pos 32); y stored by someone else;
    request 1 stores r0 (pos 48) and r1 (pos 64). Order: x0 x3 r1 r0 x2 x1 y."""
    procs.store(m, X)
    m.touch(X[1:3], ranked(X[1:3]), running=Running(1, {X[1]: 16, X[2]: 32}))
    procs.store(m, [b"y"])
    m.touch([b"y"], ranked([b"y"]), running=Running(1, {b"y": 8}))  # never made older
    out = m.prepare_store(R, running=Running(1, {R[0]: 48, R[1]: 64}))
    m.complete_store(out.keys_to_store)


def test_a_running_requests_keys_share_its_rank_tails_first(lru):
    _running_request_layout(lru)
    out = lru.prepare_store(Z)  # 1 block free: 3 victims
    assert out.evicted_keys == [X[0], X[3], R[1]]
    lru.complete_store(out.keys_to_store)
    assert lru.prepare_store([b"w0", b"w1", b"w2"]).evicted_keys == [R[0], X[2], X[1]]


def test_a_finished_request_is_forgotten_and_its_keys_are_most_recent(lru):
    _running_request_layout(lru)
    keys = [X[1], X[2], R[0], R[1]]  # head to tail
    lru.touch(keys, bytes([SEEN]) * 4, running=Running(1, done=True))
    # request 1 again: a new rank, after everything, so x0 (the oldest) is now the newest
    lru.touch([X[0]], ranked(X[:1]), running=Running(1, {X[0]: 8}))
    out = lru.prepare_store(Z + [b"w0", b"w1"])  # 1 block free: 5 victims
    assert out.evicted_keys == [X[3], b"y", R[1], R[0], X[2]]


def test_a_store_that_takes_its_requests_rank_ranks_its_keys_as_one_by_one_inserts(lru):
    """A running request's first store, whose first key has no position: that key is
    inserted (most recent, a fresh rank) before the request takes its rank for the next
    key, so it is the older of the two, as when each key was entered one by one (before
    the batch writers). Ranks computed for the whole batch first would give the request
    its rank before the first key's fresh one, and turn the order round."""
    out = lru.prepare_store(R, running=Running(1, {R[1]: 5}))  # r0: no position
    lru.complete_store(out.keys_to_store)
    procs.store(lru, Z + [b"w0", b"w1"])  # the cache is full
    assert lru.prepare_store([b"v"]).evicted_keys == [R[0]]


def test_a_publish_that_takes_its_requests_rank_ranks_its_keys_as_one_by_one_inserts(
        make_segment):
    """The same for a Publish of granted blocks (applied by the owner's ``Grants``)."""
    seg = make_segment(num_blocks=8, policy="lru")
    m = LocalManager(seg, "lru")
    try:
        blocks = m.grants.grant(3, 9, 2, 0)
        m.grants.publish(3, 9, R, blocks, True, 2, Running(1, {R[1]: 5}))
        procs.store(m, Z + [b"w0", b"w1"])  # the cache is full
        assert m.prepare_store([b"v"]).evicted_keys == [R[0]]
    finally:
        m.shutdown()


@pytest.mark.procs
def test_frames_without_the_running_fields_still_work(shared_x):
    m = shared_x
    old_touch = P.request_encoder.encode(["Touch", 0, [X[0]], None])  # 3 fields
    m._link.requests.put(old_touch, timeout=5)
    req = m._link.next_req()
    W = Z + [b"w0", b"w1"]
    reply = _raw_call(m, P.request_encoder.encode(["PrepareStore", req, W, False, 0]))
    assert isinstance(reply, P.Prepared) and reply.keys == W  # after the touch (FIFO)
    assert reply.evicted == [X[1], X[2]]  # x0 was touched: most recent
    m.complete_store(W)
    assert m.lookup([X[0]] + W) == 7


@pytest.mark.parametrize("running", [
    Running(0, {X[0]: 1}), Running(1 << 64, {}), Running(-3, {}),
    Running(1, {X[0]: -2}), Running(1, {X[0]: 1 << 64}), Running(1, {X[0]: "16"}),
], ids=["zero", "too-big", "negative", "negative-position", "position-too-big",
        "position-not-int"])
def test_the_in_process_manager_refuses_a_bad_running_request_and_changes_nothing(
        make_segment, running):
    seg = make_segment(num_blocks=8, policy="lru")
    m = LocalManager(seg, "lru")
    try:
        procs.store(m, X)
        before = (m.policy.order(), m.num_free)
        with pytest.raises(InvalidArgumentError):
            m.touch(X[:1], ranked(X[:1]), running=running)
        with pytest.raises(InvalidArgumentError):
            m.prepare_store(Z, running=running)
        assert (m.policy.order(), m.num_free) == before and m.running.ranks == {}
    finally:
        m.shutdown()


@pytest.mark.procs
def test_the_owner_refuses_bad_running_fields_and_keeps_serving(shared_x):
    m, seg = shared_x, shared_x.segment
    errors = seg.counter("errors")
    for fields in ({"request": -1, "positions": [5]}, {"request": 1, "positions": [5, 6]},
                   {"request": 1, "positions": [-7]}):
        m._link.send(P.Touch(0, [X[0]], ranked(X[:1]), **fields))  # one-way: dropped
        req = m._link.next_req()
        reply = _raw_call(m, P.request_encoder.encode(P.PrepareStore(req, Z, **fields)))
        assert isinstance(reply, P.Error) and reply.kind == "InvalidArgumentError"
    assert seg.counter("errors") == errors + 6
    out = m.prepare_store(Z)  # nothing was allocated or reordered by them
    assert out.evicted_keys == []
    m.complete_store(Z)
    assert m.prepare_store([b"w0", b"w1"]).evicted_keys == X[:2]


@pytest.mark.procs
def test_the_owner_refuses_a_store_in_parts_with_a_part_of_bad_positions(shared_x):
    # In one frame a positions count unlike the keys' is refused; in parts it must be too,
    # not stored unranked (a part's miscount could even be made up by the next part's).
    m, seg = shared_x, shared_x.segment
    errors = seg.counter("errors")
    req = m._link.next_req()
    m._link.send(P.PrepareStore(req, Z[:2], more=True, part=0, request=1, positions=[5]))
    reply = _raw_call(m, P.request_encoder.encode(
        P.PrepareStore(req, Z[2:], part=1, request=1, positions=[7, 8, 9])))
    assert isinstance(reply, P.Error) and reply.kind == "InvalidArgumentError"
    assert seg.counter("errors") == errors + 1
    assert m.prepare_store(Z).evicted_keys == []  # nothing was allocated by it
    m.complete_store(Z)


@pytest.mark.procs
def test_a_publish_with_bad_running_fields_is_published_without_ranks(seg_name):
    m = connect(seg_name, TEST_LAYOUT, num_blocks=BLOCKS, max_clients=CLIENTS,
                ring_capacity=8192)
    try:
        _stocked(m, 2)
        keys = [b"g0", b"g1"]
        out = m.prepare_store(keys)  # from the grant ring: no frame
        blocks = [m._own.inflight.pop(k) for k in keys]
        errors = m.segment.counter("errors")
        m._link.push(P.Publish(0, keys, blocks, True, request=5, positions=[1]))
        assert out.block_ids == blocks
        wait_for(lambda: m.key_status(keys[1]) is LookupResult.HIT, "the publish")
        assert m.lookup(keys) == 2 and m.segment.counter("errors") == errors + 1
    finally:
        pid = m.segment.owner_record()[0]
        m.shutdown()
        stop_owner(pid)


def test_granted_stores_take_the_running_requests_rank_when_published(make_segment):
    m = LocalManager(make_segment(num_blocks=8, policy="lru"), "lru")
    try:
        procs.store(m, X[:2])
        m.touch([], b"", running=Running(7, {}), client=(3, 9))  # nothing: takes no rank
        m.touch(X[:1], ranked(X[:1]), running=Running(7, {X[0]: 1}), client=(3, 9))  # takes it
        procs.store(m, [b"y"])
        blocks = m.grants.grant(3, 9, 3, 0)
        m.grants.publish(3, 9, R, blocks[:2], True, 3, Running(7, {R[0]: 16, R[1]: 32}))
        m.grants.publish(3, 9, [b"late"], blocks[2:], True, 3)  # no request: most recent
        assert m.policy.order() == [X[1], R[1], R[0], X[0], b"y", b"late"]
    finally:
        m.shutdown()


def _frames_published(m: LocalManager, frames, together: bool) -> list[bytes]:
    """Publish ``frames`` ((running, keys) each) of client (3, 9) from its grants, one by one
    or taken together as the owner takes queued frames; returns the policy's order."""
    procs.store(m, X[:2])
    m.touch(X[:1], ranked(X[:1]), running=Running(8, {X[0]: 1}), client=(3, 9))
    keys = [k for _, ks in frames for k in ks]
    blocks = m.grants.grant(3, 9, len(keys), 0)
    spans, at = [], 0
    for running, ks in frames:
        spans.append((running, ks, blocks[at:at + len(ks)]))
        at += len(ks)
    if together:
        m.grants.publish(3, 9, keys, blocks, True, len(keys),
                         frames=[(r, len(ks)) for r, ks, _ in spans])
    else:
        for running, ks, bs in spans:
            m.grants.publish(3, 9, ks, bs, True, len(keys), running)
    return m.policy.order()


@pytest.mark.parametrize("together", [False, True])
def test_frames_taken_together_rank_each_key_at_its_own_frames_request(make_segment, together):
    # Decode-phase frames of two running requests (7, and 8 which already has a rank),
    # interleaved with a frame of no request: each key at its request's rank, tails first;
    # the same order whether the frames come one by one or taken together.
    m = LocalManager(make_segment(num_blocks=16, policy="lru"), "lru")
    try:
        frames = [(Running(7, {b"a0": 16}), [b"a0"]), (Running(8, {b"b0": 32}), [b"b0"]),
                  (None, [b"n0"]), (Running(7, {b"a1": 32}), [b"a1"]),
                  (Running(8, {b"b1": 48}), [b"b1"])]
        assert _frames_published(m, frames, together) == \
            [X[1], b"b1", b"b0", X[0], b"a1", b"a0", b"n0"]
    finally:
        m.shutdown()


@pytest.mark.parametrize("together", [False, True])
def test_a_key_taken_together_is_ranked_by_the_frame_that_publishes_it(make_segment, together):
    # The first frame naming k gives a block never granted to the client: ignored, so the
    # next frame publishes k, and only its request (9) takes a rank, as one by one.
    m = LocalManager(make_segment(num_blocks=16, policy="lru"), "lru")
    try:
        blocks = m.grants.grant(3, 9, 2, 0)
        frames = [([b"k"], [15], Running(7, {b"k": 16})),
                  ([b"k"], blocks[:1], Running(9, {b"k": 32})),
                  ([b"j"], blocks[1:], Running(9, {b"j": 48}))]
        if together:
            m.grants.publish(3, 9, [b"k", b"k", b"j"], [15, *blocks], True, 2,
                             frames=[(r, 1) for _, _, r in frames])
        else:
            for keys, bs, r in frames:
                m.grants.publish(3, 9, keys, bs, True, 2, r)
        assert m.policy.order() == [b"j", b"k"]
        assert list(m.running.ranks) == [(3, 9, 9)]
    finally:
        m.shutdown()


def test_a_bad_request_among_frames_taken_together_costs_only_its_frames_ranks(make_segment):
    m = LocalManager(make_segment(num_blocks=16, policy="lru"), "lru")
    try:
        errors = m.segment.counter("errors")
        frames = [(Running(7, {b"a0": 16}), [b"a0"]), (Running(0, {b"z0": 1}), [b"z0"]),
                  (Running(7, {b"a1": 32}), [b"a1"])]
        assert _frames_published(m, frames, True) == \
            [X[1], X[0], b"a1", b"a0", b"z0"]  # request 0 is no request: z0 fresh
        assert m.segment.counter("errors") == errors + 1
    finally:
        m.shutdown()


def test_the_ranks_kept_are_bounded_and_go_with_their_client(make_segment, monkeypatch):
    monkeypatch.setattr(running_mod, "MAX_RUNNING", 4)
    m = LocalManager(make_segment(num_blocks=8, policy="lru"), "lru")
    try:
        procs.store(m, X[:1])
        for req in range(1, 11):
            m.touch(X[:1], ranked(X[:1]), running=Running(req, {X[0]: 1}), client=(3, 9))
        assert len(m.running.ranks) == 4
        m.reclaim_writer(3, 9)
        assert m.running.ranks == {}
    finally:
        m.shutdown()


@pytest.mark.parametrize("call", ["prepare_store", "complete_store"])
def test_a_store_refuses_to_end_a_running_request_on_both_managers(lru, call):
    """``done`` ends a request on touch only: a store's frame cannot carry it with its keys'
    positions, so neither manager may take it (they would rank the keys differently)."""
    out = lru.prepare_store(R)
    done = Running(1, {R[0]: 48, R[1]: 64}, done=True)
    with pytest.raises(InvalidArgumentError):
        if call == "prepare_store":
            lru.prepare_store(Z, running=done)
        else:
            lru.complete_store(out.keys_to_store, running=done)
    lru.complete_store(out.keys_to_store)
    assert lru.lookup(R) == 2 and lru.lookup(Z) == 0
