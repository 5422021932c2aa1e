"""Publish frames queued behind each other are applied as one, and exactly as one by one.

A decode step stores one block per request, each a one-way Publish frame of one key; the
frames that queue while the owner is busy are taken together (``kvshm/owner/coalesce.py``).
Here they queue while no owner runs at all: the client kills its owner, completes one-key
stores from its grant ring, and an owner started afterwards finds them all waiting.

What the tests pin down: every key of the queued frames is published once, with its own
bytes, and in ring order for a successor's rebuild; a frame that may not join the others (a
failed store) is still served, alone; a client taking events gets every key, however many
frames were taken together; and an owner that dies after applying merged frames, before
releasing them from the ring, leaves a successor that publishes each key once and loses no
block.
"""
from __future__ import annotations

import os
import signal
from collections import Counter

import procs
import pytest
from conftest import TEST_LAYOUT, stop_owner
from test_exactly_once import owner_proc
from procs import stopped
from test_shared import wait_for

from kvshm.client.connect import connect
from kvshm.index import protocol as P
from kvshm.index.api import Running
from kvshm.inspect.snapshot import verify
from kvshm.shm import layout as L
from kvshm.shm import slots
from kvshm.shm.segment import Segment
from kvshm.shm.table import BlockTable

BLOCKS, CLIENTS = 128, 2  # a storing client is kept stocked with 16 blocks
QUEUED = 6  # one-key Publish frames queued for the next owner


@pytest.fixture
def pair(seg_name):
    """Two clients of one segment, ``a`` stores and ``b`` reads, and the segment itself (for
    looking at its table once they left)."""
    a = connect(seg_name, TEST_LAYOUT, num_blocks=BLOCKS, max_clients=CLIENTS,
                ring_capacity=8192, hold_capacity=64)
    b = connect(seg_name)
    seg = Segment.attach(seg_name)
    yield a, b, seg
    for m in (b, a):
        if m.segment is not None:
            m.shutdown()
    stop_owner(seg.owner_record()[0] if seg.owner_alive() else 0)
    seg.close()


def queue_one_key_stores(a, tag: str, outcomes: list[bool]) -> list[bytes]:
    """One one-key store per outcome, each from ``a``'s grant ring, written, then completed
    (a one-way Publish frame) while no owner runs: the frames wait in ``a``'s ring."""
    keys = [b"%s-%d" % (tag.encode(), i) for i in range(len(outcomes))]
    queue_stores(a, tag, [[k] for k in keys], outcomes)
    return keys


def queue_stores(a, tag: str, frames: list[list[bytes]], outcomes: list[bool],
                 reverse: bool = False, first: P.Publish | None = None,
                 running: list[Running] | None = None) -> dict[bytes, int]:
    """Stores of ``frames`` (their keys), all from ``a``'s grant ring and written, each then
    completed with its outcome (last frame first if ``reverse``; naming its ``running``
    request, if given) while no owner runs: one Publish frame each waits in ``a``'s ring,
    behind ``first`` if given. Returns each key's block."""
    procs.store(a, [b"%s-warm-%d" % (tag.encode(), i) for i in range(8)])  # stock deeper
    # Its Publish taken off the ring before the owner is killed: one applied but not yet
    # released would be replayed by the next owner and counted twice (counters are not
    # exactly-once across an owner's death), which the counting tests would read as ours.
    wait_for(lambda: not a._link.requests.pending(), "the owner to take the warm Publish")
    head, _ = slots.grants(a.segment, a.slot)
    need = sum(map(len, frames))
    wait_for(lambda: head["granted"] - a._own.taken >= need, "the owner to stock the ring")
    planes, blocks = a.segment.planes(), {}
    for keys in frames:
        out = a.prepare_store(keys)
        assert all(k in a._own.inflight for k in keys)  # from the grant ring: one-way
        procs.fill_all(planes, out.block_ids, out.keys_to_store)
        blocks.update(zip(out.keys_to_store, out.block_ids))
    os.kill(a.segment.owner_record()[0], signal.SIGKILL)
    wait_for(lambda: not a.segment.owner_alive(), "the owner to die")
    if first is not None:
        a._link.push(first)
    order = list(zip(frames, outcomes, running or [None] * len(frames)))
    for keys, ok, run in order[::-1] if reverse else order:
        a.complete_store(keys, success=ok, running=run)
    return blocks


def loads_its_own_bytes(b, keys: list[bytes]) -> bool:
    """Whether ``b`` finds every one of ``keys`` cached with the bytes stored under it."""
    if b.lookup(keys) != len(keys):
        b.release()
        return False
    blocks = b.prepare_load(keys)
    planes = b.segment.planes()
    try:
        return all(procs.check(planes, blk, k) for blk, k in zip(blocks, keys))
    finally:
        b.complete_load(keys)
        b.release()


def settled(a, b, seg) -> None:
    """Once both clients left: no block is left mid-store, granted or claimed, no key is
    cached twice, and the segment verifies."""
    a.shutdown()
    b.shutdown()
    wait_for(lambda: all(slots.record(seg, s).state == L.SlotState.FREE
                         for s in range(CLIENTS)), "both clients to be gone")
    t = BlockTable(seg.buf, seg.geometry)
    try:
        rows = [t.read(blk) for blk in range(seg.geometry.num_blocks)]
    finally:
        t.close()
    assert not [r for r in rows if r.state in (L.WRITING, L.GRANTED, L.CLAIMED)]
    twice = [k for k, n in Counter(r.key for r in rows if r.state == L.READY).items() if n > 1]
    assert not twice, f"keys cached in two blocks: {twice}"
    assert verify(seg) == []


def test_publish_frames_queued_while_no_owner_ran_are_all_published(pair):
    a, b, seg = pair
    keys = queue_one_key_stores(a, "queued", [True] * QUEUED)
    owner_proc(seg.name)
    wait_for(lambda: loads_its_own_bytes(b, keys), "every queued key to be published")
    settled(a, b, seg)



def test_keys_of_frames_taken_together_keep_their_ring_order_for_a_successor(pair):
    # A successor rebuilds the eviction order from the table: (last use, block). The keys
    # of frames taken together must come back in ring order, as one frame at a time gives
    # (here against the blocks' order: the last block taken is published first).
    a, b, seg = pair
    frames = [[b"order-%d" % i] for i in range(QUEUED)]
    blocks = queue_stores(a, "order", frames, [True] * QUEUED, reverse=True)
    owner_proc(seg.name)
    ring = [f[0] for f in frames][::-1]
    wait_for(lambda: loads_its_own_bytes(b, ring), "every queued key to be published")
    t = BlockTable(seg.buf, seg.geometry)
    try:
        rows = {k: t.read(blocks[k]) for k in ring}
    finally:
        t.close()
    assert sorted(ring, key=lambda k: (rows[k].last_use, blocks[k])) == ring


def test_each_frame_taken_together_counts_as_a_completed_store(pair):
    a, b, seg = pair
    keys = queue_one_key_stores(a, "counted", [True] * QUEUED)
    before = seg.counter("stores"), seg.counter("store_blocks")
    first = owner_proc(seg.name, "owner.publish.merged", "STOP")  # frozen once merged
    wait_for(lambda: stopped(first.pid), "the owner to merge the frames")
    os.kill(first.pid, signal.SIGCONT)
    wait_for(lambda: loads_its_own_bytes(b, keys), "every queued key to be published")
    assert (seg.counter("stores") - before[0], seg.counter("store_blocks") - before[1]) == \
        (QUEUED, QUEUED)

def test_frames_naming_running_requests_are_taken_together_and_all_published(pair):
    # vLLM 0.33 names the running request of every store: a decode step's frames each carry
    # one, and they still queue behind a busy owner. (Their ranks, frame by frame, are
    # pinned down in test_running_ranks.py.)
    a, b, seg = pair
    keys = [b"running-%d" % i for i in range(QUEUED)]
    queue_stores(a, "running", [[k] for k in keys], [True] * QUEUED,
                 running=[Running(1 + i % 3, {k: 16 * (1 + i)}) for i, k in enumerate(keys)])
    first = owner_proc(seg.name, "owner.publish.merged", "STOP")  # frozen once merged
    wait_for(lambda: stopped(first.pid), "the owner to merge the frames")
    os.kill(first.pid, signal.SIGCONT)
    wait_for(lambda: loads_its_own_bytes(b, keys), "every queued key to be published")
    settled(a, b, seg)


def test_a_failed_store_queued_among_others_is_served_alone_and_frees_its_block(pair):
    a, b, seg = pair
    outcomes = [True, True, False, True, True, True]
    keys = queue_one_key_stores(a, "mixed", outcomes)
    owner_proc(seg.name)
    good = [k for k, ok in zip(keys, outcomes) if ok]
    wait_for(lambda: loads_its_own_bytes(b, good), "the successful stores to be published")
    assert b.lookup([keys[outcomes.index(False)]]) == 0  # never published
    settled(a, b, seg)



def test_a_refused_publish_at_the_head_of_queued_frames_takes_none_of_them_along(pair):
    # A frame whose key the owner refuses (a client bypassing its own checks) heads the
    # queue: it is refused alone, and the frames behind it are published.
    a, b, seg = pair
    frames = [[b"behind-%d" % i] for i in range(QUEUED)]
    queue_stores(a, "behind", frames, [True] * QUEUED,
                 first=P.Publish(0, [b""], [0]))
    owner_proc(seg.name)
    keys = [f[0] for f in frames]
    wait_for(lambda: loads_its_own_bytes(b, keys), "the frames behind it to be published")

@pytest.mark.parametrize("running", [False, True], ids=["plain", "running"])
def test_an_owner_dying_after_applying_merged_frames_leaves_each_key_published_once(pair,
                                                                                     running):
    a, b, seg = pair
    keys = [b"merged-%d" % i for i in range(QUEUED)]
    queue_stores(a, "merged", [[k] for k in keys], [True] * QUEUED,
                 running=[Running(1 + i % 2, {k: 16 * (1 + i)}) for i, k in enumerate(keys)]
                 if running else None)
    first = owner_proc(seg.name, "owner.publish.merged")
    first.wait(timeout=30)
    assert first.returncode == -signal.SIGKILL  # it took the queued frames together
    a.take_events()  # a round trip: a's call starts a successor, which replays the frames
    wait_for(lambda: loads_its_own_bytes(b, keys), "every queued key to be published")
    settled(a, b, seg)



def test_a_client_taking_events_gets_every_key_of_frames_taken_together(seg_name):
    # Four frames of four 64-byte keys taken together make one stored event of 16 keys,
    # more than half of a 4 KiB ring's reply frame: it is handed out in parts, and the
    # events after it follow.
    a = connect(seg_name, TEST_LAYOUT, num_blocks=BLOCKS, max_clients=CLIENTS,
                ring_capacity=4096, hold_capacity=64)
    b = connect(seg_name, events=True)
    seg = Segment.attach(seg_name)
    try:
        b.take_events()
        keys = [(b"event-%02d-" % i).ljust(64, b"x") for i in range(16)]
        queue_stores(a, "ev", [keys[i:i + 4] for i in range(0, 16, 4)], [True] * 4)
        owner_proc(seg_name)
        wait_for(lambda: loads_its_own_bytes(b, keys), "every queued key to be published")
        procs.store(a, [b"after-0", b"after-1"])
        got: set[bytes] = set()
        for _ in range(20):  # each call hands out what fits one reply
            got.update(k for e in b.take_events() if not e.removed for k in e.keys)
        assert got >= {*keys, b"after-0", b"after-1"}, f"{len(got & set(keys))} of 16"
    finally:
        for m in (b, a):
            m.shutdown()
        stop_owner(seg.owner_record()[0] if seg.owner_alive() else 0)
        seg.close()


@pytest.mark.unit
def test_frames_taken_together_stay_within_what_the_pass_grants_the_client():
    # A client that floods one-key Publish frames gets no more of a pass than its share:
    # the merge takes at most ``most`` frames (the owner passes what the pass has left).
    import mmap

    from kvshm.owner import coalesce
    from kvshm.shm.ring import Ring
    mm = mmap.mmap(-1, Ring.region_size(1 << 16))
    Ring.format(memoryview(mm), 1 << 16)
    ring = Ring(memoryview(mm))
    for i in range(100):
        assert ring.try_put(P.request_encoder.encode(P.Publish(0, [b"flood-%d" % i], [i])))
    head = P.request_decoder.decode(ring.peek())
    merged, frames = coalesce.merge(ring, head, 64)
    assert (frames, merged.keys) == (64, [b"flood-%d" % i for i in range(64)])
    ring.advance()
    assert P.request_decoder.decode(ring.peek()).keys == [b"flood-64"]  # the rest wait
    del ring
    mm.close()
