"""Offers: when no block is free, the owner grants a client the victims it would evict, still
cached and readable, and the client claims them only when it takes them for a store.

Every test runs a real owner process (started by ``connect``) and real clients. What they pin
down: a full cache holds no grant empty; a claim never takes a block a reader holds (the
lease handshake, done by the claiming client), nor one a request used since it was offered
(that one goes back into the cache); nobody ever reads a claimed block's new bytes under its
old key; and whatever dies, a claim is freed and an offer that was never claimed stays
cached.
"""
from __future__ import annotations

import contextlib
import os
import signal
import struct

import procs
import pytest
from conftest import TEST_LAYOUT, stop_owner
from test_exactly_once import owner_proc
from test_shared import spawn, wait_for

from kvshm.client.connect import connect
from kvshm.errors import KvshmError
from kvshm.index import protocol as P
from kvshm.index.api import LookupResult
from kvshm.inspect.snapshot import verify
from kvshm.shm import layout as L
from kvshm.shm import offers, slots, writers
from kvshm.shm.entry import STATE_OFF, WRITER_OFF
from kvshm.shm.fence import full_fence
from kvshm.shm.records import ENTRY_DTYPE
from kvshm.shm.segment import Segment
from kvshm.shm.table import BlockTable

BLOCKS, CLIENTS = 64, 4  # a client is stocked with 4 blocks, up to 16 as its stores grow


@pytest.fixture
def pair(seg_name):
    """Two clients of one segment: ``a`` stores, ``b`` reads."""
    a = connect(seg_name, TEST_LAYOUT, num_blocks=BLOCKS, max_clients=CLIENTS,
                ring_capacity=8192, hold_capacity=64)
    b = connect(seg_name)
    yield a, b
    pid = next((m.segment.owner_record()[0] for m in (a, b) if m.segment is not None), 0)
    for m in (b, a):
        if m.segment is not None:
            m.shutdown()
    stop_owner(pid)


def keys(tag: str, n: int) -> list[bytes]:
    return [b"%s-%03d" % (tag.encode(), i) for i in range(n)]


def entries(seg) -> list:
    t = BlockTable(seg.buf, seg.geometry)
    try:
        return [t.read(b) for b in range(seg.geometry.num_blocks)]
    finally:
        t.close()


def fill_until_offered(m, n: int = 1) -> dict[int, bytes]:
    """Store into ``m`` until the cache is full and its grant ring holds ``n`` offers."""
    for i in range(8):
        procs.store(m, keys(f"fill{i}", BLOCKS // 4))
    wait_for(lambda: len(procs.offered_to(m)) >= n, "the owner to offer victims to the client")
    return procs.offered_to(m)


def level(m) -> int:
    head, _ = slots.grants(m.segment, m.slot)
    return head["granted"] - m._own.taken


def test_a_full_cache_offers_its_victims_and_holds_no_grant_empty(pair):
    a, b = pair
    offered = fill_until_offered(a)
    states = [e.state for e in entries(a.segment)]
    assert L.FREE not in states and L.GRANTED not in states  # every block caches a key
    for block, key in offered.items():  # and an offered one is still a hit, right bytes
        assert b.lookup([key]) == 1
        assert procs.check(b.segment.planes(), b.prepare_load([key])[0], key)
        b.complete_load([key])
    b.release()
    assert a.segment.counter("offered_blocks") >= len(offered)


def test_a_claim_leaves_a_block_a_reader_holds_until_it_lets_go(pair):
    a, b = pair
    offered = fill_until_offered(a)
    block, key = next(iter(offered.items()))
    assert b.lookup([key]) == 1  # b's lease, before a claims
    procs.store(a, keys("more", level(a)))  # takes its whole ring: every offer in it
    assert a._own.declined == [block]  # handed back to READY, kept to claim later
    assert procs.check(b.segment.planes(), b.prepare_load([key])[0], key)
    b.complete_load([key])
    b.release()
    procs.store(a, keys("after", 1))  # claims it now that nobody holds it
    assert a.lookup([key]) == 0 and a._own.declined == []


def test_an_offer_a_request_used_is_returned_and_stays_cached(pair):
    a, b = pair
    offered = fill_until_offered(a)
    block, key = next(iter(offered.items()))
    b.prepare_load([key])
    b.touch([key])
    b.complete_load([key])
    b.release()
    t = BlockTable(a.segment.buf, a.segment.geometry)
    try:
        wait_for(lambda: offers.used_since_offer(t, [block])[0], "the owner to apply b's touch")
    finally:
        t.close()
    procs.store(a, keys("more", level(a)))
    wait_for(lambda: entries(a.segment)[block].writer == -1, "the owner to take it back")
    e = entries(a.segment)[block]
    assert (e.state, e.key) == (L.READY, key)
    assert b.lookup([key]) == 1
    b.release()


def test_nobody_reads_a_claimed_blocks_new_bytes_under_its_old_key(pair):
    a, b = pair
    offered = fill_until_offered(a)
    out = a.prepare_store(keys("new", level(a)))
    claimed = {blk: offered[blk] for blk in out.block_ids if blk in offered}
    assert claimed, "the store took no offer"
    planes = a.segment.planes()
    for k, blk in zip(out.keys_to_store, out.block_ids):
        procs.fill(planes, blk, k)
    for old in claimed.values():  # claimed, not yet published: no lookup finds it
        assert b.lookup([old]) == 0
    a.complete_store(out.keys_to_store)
    wait_for(lambda: all(b.lookup([k]) == 1 for k in out.keys_to_store), "the publish")
    for k, blk in zip(out.keys_to_store, out.block_ids):
        assert procs.check(planes, b.prepare_load([k])[0], k)
        b.complete_load([k])
    b.release()
    assert all(b.lookup([old]) == 0 for old in claimed.values())
    assert verify(a.segment) == []


def test_a_dead_clients_claims_are_freed_and_its_offers_stay_cached(pair, seg_name):
    a, b = pair
    p, conn = spawn(procs.claim_and_wait, seg_name)
    info = conn.recv()  # it holds claims (a store under way) and offers it never took
    os.kill(p.pid, signal.SIGKILL)
    p.join()
    wait_for(lambda: all(e.writer != info["slot"] or e.state == L.FREE
                         for e in entries(b.segment)), "the owner to reclaim the dead client")
    es = entries(b.segment)
    assert all(es[blk].state == L.FREE for blk in info["claimed"])
    for blk, key in info["offered"].items():
        assert (es[blk].state, es[blk].key) == (L.READY, key) and b.lookup([key]) == 1
    b.release()
    assert verify(b.segment) == []


def test_a_new_owner_keeps_a_live_clients_offers_and_claims(pair):
    a, b = pair
    fill_until_offered(a, 2)
    out = a.prepare_store(keys("new", 1))  # claims one offer; the others stay in the ring
    still = procs.offered_to(a)
    procs.fill_all(a.segment.planes(), out.block_ids, out.keys_to_store)
    pid = a.segment.owner_record()[0]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not a.segment.owner_alive(), "the owner to die")
    a.complete_store(out.keys_to_store)  # one-way: the next call's owner publishes it
    a.take_events()  # a call: it starts a successor
    assert a.segment.owner_record()[0] != pid
    wait_for(lambda: b.lookup(out.keys_to_store) == 1, "the successor to publish the claim")
    b.release()
    assert procs.offered_to(a) == still  # the offers it never took are still its, still cached
    assert all(b.lookup([k]) == 1 for k in still.values())
    b.release()
    assert verify(a.segment) == []


def test_a_takeover_leaves_the_claim_round_of_a_live_client_to_that_client(pair):
    """A client descheduled inside its claim of an offer (the entry's round open, its state
    not stored yet) while the owner dies and a successor takes over. Had the successor closed
    that round, the client's state store would land outside any round: a reader that proved
    the block READY meanwhile would go on trusting the proof (an unchanged sequence number)
    while the client claims the block and writes its own bytes into it."""
    a, b = pair
    blk, key = next(iter(fill_until_offered(a).items()))
    table, planes = a.table, a.segment.planes()
    seq = table._odd(blk)  # a's claim (offers.claim_one) opens its round and stops there
    pid = a.segment.owner_record()[0]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not a.segment.owner_alive(), "the owner to die")
    b.take_events()  # the reader's call starts a successor, which rebuilds from the table
    assert a.segment.owner_record()[0] not in (0, pid)
    during = b.key_status(key)
    b.release()
    # a goes on: its claim's state, its round closed, a fence, and nobody holds the block
    a.segment.buf[table.base + blk * L.ENTRY_BYTES + STATE_OFF] = L.EVICTING
    table._even(blk, seq)
    full_fence()
    assert not a._own._holds.held_one(blk)
    loaded = None  # the reader asks again, before a marks the block CLAIMED and writes it
    if b.key_status(key) == LookupResult.HIT:
        try:
            loaded = b.prepare_load([key])
        except KvshmError:
            loaded = None
    offers.finish_one(table, blk)
    procs.fill(planes, blk, b"the claimer's own key")
    assert loaded is None or procs.check(planes, loaded[0], key), "the reader loaded new bytes"
    assert during != LookupResult.HIT  # nobody leases a block while a claim round is open
    if loaded:
        b.complete_load([key])


def test_a_takeover_leaves_the_claim_round_of_a_client_that_lowered_its_counts_to_it(pair):
    """The same claim round, of a client that also lowered its grant counts to the offer's
    position: to a successor the offer then looks like one its predecessor died writing
    and never handed over. Had it ended the offer (closed the round, cached the key again),
    the client would go on to claim it and write its bytes where another store gets it."""
    a, b = pair
    blk, key = next(iter(fill_until_offered(a).items()))
    table = a.table
    pos = table.read(blk).writer_req
    seq = table._odd(blk)  # a's claim (offers.claim_one) opens its round and stops there
    words, _ = slots.grants(a.segment, a.slot)
    words["granted"] = words["taken"] = pos  # possible counts that never reached it
    pid = a.segment.owner_record()[0]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not a.segment.owner_alive(), "the owner to die")
    b.take_events()  # the reader's call starts a successor, which rebuilds from the table
    assert a.segment.owner_record()[0] not in (0, pid)
    assert table.seq(blk) == seq  # its round is still a's to close
    e = table.read(blk)
    assert (e.writer, e.writer_gen, e.writer_req) == (a.slot, a.gen, pos)  # still a's offer
    a.segment.buf[table.base + blk * L.ENTRY_BYTES + STATE_OFF] = L.EVICTING
    table._even(blk, seq)
    full_fence()
    offers.finish_one(table, blk)  # a's claim ends: the block is a's to write
    stored = []
    for i in range(BLOCKS // 4):  # the cache turns over around it
        out = b.prepare_store(keys(f"b{i}", 4))
        if out is not None:
            stored += out.block_ids
            b.complete_store(out.keys_to_store)
    assert blk not in stored


class RacedClaim:
    """Client ``a``'s claim of a block offered to it, done step by step as
    ``OwnStores._claim_one`` does it, stalled (descheduled, SIGSTOPped) after its mark: a
    reader process leased the block in the instant between a's first reading of the holds
    and that mark. ``stall``: "marked" (the block EVICTING) or "mid-round" (a's round open,
    the state not stored yet: ``table.claim.odd``)."""

    def __init__(self, a, seg_name: str, stall: str):
        self.a, self.name, self.stall = a, seg_name, stall
        self.blk, self.key = next(iter(fill_until_offered(a).items()))
        assert not a._own._holds.held_one(self.blk)  # a's first reading: nobody holds it
        self.started: list = []
        self.seq = 0

    def reader(self, env: dict[str, str] | None = None, timeout: float = 30.0):
        """The reader process: leased, then told to load while a's claim is undecided."""
        p, conn = spawn(procs.lease_then_load, self.name, self.key, timeout, env=env)
        self.started.append((p, conn))
        assert conn.recv() == 1  # its lookup: a hit, leased
        a, blk = self.a, self.blk
        if self.stall == "marked":
            assert offers.claim_one(a.table, blk, a.slot, a.gen)  # EVICTING
        else:
            self.seq = a.table._odd(blk)
        conn.send("load")
        return p, conn

    def decide(self) -> None:
        """a goes on: its state stored and round closed, a fence, its reading of the holds,
        which finds the reader's lease: the block goes back, READY."""
        a, blk = self.a, self.blk
        if self.stall == "mid-round":
            a.segment.buf[a.table.base + blk * L.ENTRY_BYTES + STATE_OFF] = L.EVICTING
            a.table._even(blk, self.seq)
        full_fence()
        assert a._own._holds.held_one(blk)
        offers.unclaim_one(a.table, blk)

    def close(self) -> None:
        for p, conn in self.started:
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
                conn.send("go")
                p.join(10)


@pytest.fixture(params=["marked", "mid-round"])
def raced(pair, seg_name, request):
    r = RacedClaim(pair[0], seg_name, request.param)
    yield r
    r.close()


def test_a_lease_stays_loadable_while_a_claim_that_raced_it_is_undecided(raced):
    """A reader leased a block just before another client's claim marked it, and the
    claimer stalled before it read the holds. The reader's load must wait for the claim's
    decision (the claimer sees the lease and gives the block back), not give up on a
    lease that still holds: a hit stays loadable until it is pinned or released."""
    p, conn = raced.reader({"KVSHM_CRASH_AT": "client.load.wait_decision",
                            "KVSHM_CRASH_SIGNAL": "STOP"})
    wait_for(lambda: procs.stopped(p.pid) or conn.poll(), "the reader to wait, or to give up")
    gave_up = conn.recv() if conn.poll() else None
    assert gave_up is None, f"the reader gave up on its lease while the claim was undecided: " \
                            f"{gave_up}"
    raced.decide()
    os.kill(p.pid, signal.SIGCONT)
    assert conn.recv() == {"blocks": [raced.blk], "verified": True}


def test_a_lease_whose_claim_stays_undecided_past_the_timeout_is_refused_as_such(raced):
    """A claimer stalled for longer than the reader's timeout: the load is refused with
    BlockStateError (the block is neither evicted nor safe to read yet), never held forever
    and never reported as evicted."""
    _, conn = raced.reader(timeout=0.3)
    got = conn.recv()
    assert got["error"] == "BlockStateError" and "undecided" in got["message"], got


@pytest.mark.parametrize("takeover", [False, True])
def test_a_client_publishing_an_offer_it_never_claimed_frees_no_block_another_holds(
        pair, seg_name, takeover):
    """A client that misuses only words of its own (its grant ring's taken count) and
    publishes an offer it never claimed, while another client has that block pinned: the
    owner serves the offer's key no more, but must not free the block while it is pinned
    (nor must a successor, ``takeover``): an honest store would write into the block the
    load is reading."""
    a, b = pair
    blk, key = next(iter(fill_until_offered(a).items()))
    assert b.lookup([key]) == 1
    assert b.prepare_load([key]) == [blk]
    head, _ = slots.grants(a.segment, a.slot)
    head["taken"] = head["granted"]  # "taken", every grant, the offer among them
    assert a._link.wait_consumed(a._link.push(P.Publish(0, [b"unclaimed"], [blk], True)), 10)
    assert b.lookup([key]) == 0  # the offer's key is no longer served (its bytes may not be)
    if takeover:
        pid = a.segment.owner_record()[0]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not a.segment.owner_alive(), "the owner to die")
        b.take_events()  # the call starts a successor, which rebuilds from the table
    a.shutdown()  # its grants end: a block freed meanwhile went back to its ring
    c = connect(seg_name, grants=False)
    for i in range(BLOCKS // 4):  # an honest writer fills the cache again
        procs.store(c, keys(f"c{i}", 4))
    assert procs.check(b.segment.planes(), blk, key), "an honest store wrote a pinned block"
    b.complete_load([key])
    n = iter(range(1 << 20))  # let go of, the block comes back into use: it never leaks

    def reused() -> bool:
        procs.store(c, keys(f"again{next(n)}", 4))
        return entries(c.segment)[blk].state == L.READY
    wait_for(reused, "the parked block to be stored into again")
    c.shutdown()


def test_an_offer_whose_key_a_dead_owner_tore_is_freed_only_once_nobody_holds_it(pair,
                                                                                 seg_name):
    """An owner dies halfway through rewriting an offered block another client has pinned
    (its sequence number odd, its key checksum no longer the key's). The successor cannot
    trust the key, so it keeps the block as its client's, claimed and indexed nowhere; when
    that grant ends (the client leaves), the block, still READY in the table, must not go
    back to the free list while the load holds it: an honest store would write into it."""
    a, b = pair
    blk, key = next(iter(fill_until_offered(a).items()))
    assert b.lookup([key]) == 1 and b.prepare_load([key]) == [blk]
    pid = a.segment.owner_record()[0]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not a.segment.owner_alive(), "the owner to die")
    table = a.table
    table._odd(blk)  # the dead owner's round, its key checksum half rewritten
    at = table.base + blk * L.ENTRY_BYTES + ENTRY_DTYPE.fields["keysum"][1]
    struct.pack_into("<I", a.segment.buf, at, struct.unpack_from("<I", a.segment.buf, at)[0] ^ 1)
    b.take_events()  # the call starts a successor, which rebuilds from the table
    a.shutdown()  # its grants end, the torn offer among them
    c = connect(seg_name, grants=False)
    for i in range(BLOCKS // 4):  # an honest writer fills the cache again
        procs.store(c, keys(f"c{i}", 4))
    assert procs.check(b.segment.planes(), blk, key), "an honest store wrote a pinned block"
    b.complete_load([key])
    c.shutdown()


def publish_torn_over_a_claim(a, clear_writer: bool) -> tuple[int, bytes, list[bytes]]:
    """``a`` claims an offer and writes a new key's bytes into it; its owner dies as it
    begins the publish, its body copy stopped past the state byte (and the writer field,
    with ``clear_writer``): the entry odd, READY over the old key and its checksum. Returns
    the block, its old key and the keys ``a`` stores."""
    offered = fill_until_offered(a)
    out = a.prepare_store(keys("new", level(a)))
    blk, old = next((x, offered[x]) for x in out.block_ids if x in offered)
    procs.fill_all(a.segment.planes(), out.block_ids, out.keys_to_store)
    tear_a_publish(a, blk, clear_writer)
    return blk, old, out.keys_to_store


def tear_a_publish(m, blk: int, clear_writer: bool = False) -> None:
    """The owner dies as it begins publishing claimed block ``blk``, its body copy stopped
    past the state byte (and the writer field, with ``clear_writer``): the entry odd, READY
    over the old key and its checksum (``m``: any client of the segment)."""
    os.kill(m.segment.owner_record()[0], signal.SIGKILL)
    wait_for(lambda: not m.segment.owner_alive(), "the owner to die")
    at = m.table.base + blk * L.ENTRY_BYTES
    m.table._odd(blk)
    m.segment.buf[at + STATE_OFF] = L.READY
    if clear_writer:
        m.segment.buf[at + WRITER_OFF:at + WRITER_OFF + 2] = b"\xff\xff"


@pytest.mark.parametrize("ending", ["publishes", "leaves"])
@pytest.mark.parametrize("writer", ["kept", "cleared"])
def test_a_claimed_block_whose_publish_a_dead_owner_began_is_never_served_as_its_old_key(
        pair, writer, ending):
    """A claimed offer holds its old key in the table while its client writes the new
    key's bytes. An owner killed as it began the publish (its body copy, which may store
    any subset of its bytes) left the entry odd and READY, the old key and its checksum
    intact, the writer field changed or not. The successor trusted the key because its
    checksum verified, and served the old key from the new key's bytes."""
    a, b = pair
    _, old, stored = publish_torn_over_a_claim(a, writer == "cleared")
    b.take_events()  # the call starts a successor, which rebuilds from the table
    assert b.lookup([old]) == 0  # its bytes are the new key's
    if ending == "leaves":  # the offer's grant ends without the publish
        a.shutdown()
        assert b.lookup([old]) == 0
        assert verify(b.segment) == []
        return
    a.complete_store(stored)
    a.take_events()  # (after the Publish)
    for k in stored:
        if b.lookup([k]):
            assert procs.check(b.segment.planes(), b.prepare_load([k])[0], k)
            b.complete_load([k])
        b.release()
    assert verify(a.segment) == []


def test_a_successor_dying_as_it_frees_what_a_dead_owner_left_mid_rewrite_leaves_it_torn(pair):
    """A successor found the entry of a claimed block whose publish a dead owner began
    (READY over the old key and checksum, the new key's bytes in the block), closed its
    round, and died before it freed it: the next owner found an intact READY entry and
    served the old key from the new key's bytes. An entry stays odd until it is freed."""
    a, b = pair
    _, old, _ = publish_torn_over_a_claim(a, clear_writer=True)
    a_successor_dies_at(a.segment.name, "owner.rebuild.torn")
    b.take_events()  # the call starts the next owner, which rebuilds from the table
    assert b.lookup([old]) == 0  # its bytes are the new key's


@pytest.mark.parametrize("copy", ["ready", "offered"])
def test_an_offer_given_back_across_a_takeover_is_no_damage_once_its_key_is_stored_again(
        pair, copy):
    """A client inside the round that gives a claim back (a lease raced its claim) when
    the owner died: the successor, which trusts no open round, kept the block as that
    client's claim and indexed it nowhere. Given back, it is an offer again, its old key
    intact, and the key, a miss meanwhile, was stored again elsewhere. The next takeover
    took the two copies for a damaged table: it dropped the good one and counted it, and
    verify reported both. ``a``'s claim is driven step by step, as ``RacedClaim`` does."""
    a, b = pair
    blk, key = next(iter(fill_until_offered(a).items()))
    assert b.lookup([key]) == 1 and b.prepare_load([key]) == [blk]  # the racing lease
    assert offers.claim_one(a.table, blk, a.slot, a.gen)  # EVICTING; then a sees the pin
    seq = a.table._odd(blk)  # and gives the block back: READY stored, the round open
    a.segment.buf[a.table.base + blk * L.ENTRY_BYTES + STATE_OFF] = L.READY
    for takeover in range(2):  # one inside a's round, one after the key was stored again
        pid = b.segment.owner_record()[0]
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: not b.segment.owner_alive(), "the owner to die")
        b.take_events()  # the call starts a successor, which rebuilds from the table
        if takeover == 0:
            a.table._even(blk, seq)  # a's round closes: an offer again, indexed nowhere
            assert procs.check(b.segment.planes(), blk, key)
            b.complete_load([key])
            b.release()
            assert procs.store(b, [key]) == [key]  # a miss: stored again
            wait_for(lambda: b.lookup([key]) == 1, "the store to be published")
            b.release()
            for i in range(BLOCKS * 4 if copy == "offered" else 0):  # the cache turns over
                if key in procs.offered_to(b).values():  # until the new copy is offered
                    break
                procs.store(b, keys(f"turn{i}", 1))
                if not _held_elsewhere(b, key, blk):  # offered after the check above, and
                    assert procs.store(b, [key]) == [key]  # claimed by that very store:
                    wait_for(lambda: _held_elsewhere(b, key, blk), "the key to be stored")
            assert copy == "ready" or key in procs.offered_to(b).values()
    assert_served_to_a_newcomer(b, key)  # a client that never leased it asks
    assert b.segment.counter("duplicate_keys") == 0 and verify(b.segment) == []


def assert_served_to_a_newcomer(mgr, key: bytes) -> None:
    """A client connecting now finds ``key`` and loads its own bytes (a call that may start
    the next owner, which rebuilds)."""
    c = connect(mgr.segment.name)
    try:
        assert c.lookup([key]) == 1
        assert procs.check(c.segment.planes(), c.prepare_load([key])[0], key)
        c.complete_load([key])
    finally:
        c.shutdown()


def assert_each_served(mgr, keys: list[bytes]) -> None:
    """``mgr`` finds every key and loads its own bytes, then lets its leases go."""
    for key in keys:
        assert mgr.lookup([key]) == 1
        assert procs.check(mgr.segment.planes(), mgr.prepare_load([key])[0], key)
        mgr.complete_load([key])
    mgr.release()


def a_successor_dies_at(name: str, point: str) -> None:
    """A successor owner armed at crash point ``point`` starts, takes over, and dies there."""
    from test_crash_walk import owner_proc_no_wait
    assert owner_proc_no_wait(name, point).wait(timeout=60) == -signal.SIGKILL


def _held_elsewhere(mgr, key: bytes, blk: int) -> bool:
    """Whether a READY block other than ``blk`` holds ``key`` (read from the table: a lookup
    would make the key recent, and the cache would never offer it)."""
    t = mgr.table
    return any(x != blk and (e := t.read(x)).state == L.READY and e.key == key
               for x in range(t.num_blocks))


def test_a_ready_row_damaged_into_a_served_offers_key_is_trusted_no_more_than_the_offer(
        pair):
    """Damage (a row rewritten from another's key, length and checksum, all of which
    verify) makes two entries hold a key, and either may be the damaged one. A live
    client's offer the owner served is one of them here: the successor trusts neither,
    counts the key and serves it from no block."""
    a, b = pair
    blk, key = next(iter(fill_until_offered(a).items()))
    t = a.table
    other = next(x for x in range(BLOCKS) if x != blk and t.read(x).state == L.READY
                 and t.read(x).writer == -1)
    pid = a.segment.owner_record()[0]
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not a.segment.owner_alive(), "the owner to die")
    src, dst = t.base + blk * L.ENTRY_BYTES, t.base + other * L.ENTRY_BYTES
    seq = t._odd(other)
    for field in ("keylen", "keysum", "key"):
        off, size = ENTRY_DTYPE.fields[field][1], ENTRY_DTYPE.fields[field][0].itemsize
        a.segment.buf[dst + off:dst + off + size] = a.segment.buf[src + off:src + off + size]
    t._even(other, seq)
    b.take_events()  # the call starts a successor, which rebuilds from the table
    assert b.segment.counter("duplicate_keys") == 1
    assert b.lookup([key]) == 0


def test_a_load_racing_the_freeing_of_an_unclaimed_publish_never_reads_a_reused_block(
        seg_name):
    """As above, but the reader remembers the block's entry (it loaded it before) and
    leases and pins it without the index while the owner frees it, the owner stopped right
    after it read the holds. The owner's FREE must come before that reading, as an
    eviction's mark does: then a reader either sees FREE or is seen (its pin parks the
    block), and no honest store writes into a block a load reads."""
    seg = Segment.create(seg_name, TEST_LAYOUT, BLOCKS, max_clients=CLIENTS,
                         ring_capacity=8192, hold_capacity=64)
    owner = owner_proc(seg_name, "owner.free.after_holds", "STOP")
    a, b, c = connect(seg_name), connect(seg_name), None
    try:
        blk, key = next(iter(fill_until_offered(a).items()))
        assert b.lookup([key]) == 1 and b.prepare_load([key]) == [blk]
        b.complete_load([key])
        b.release()  # b holds nothing, and remembers the block's entry
        head, _ = slots.grants(a.segment, a.slot)
        head["taken"] = head["granted"]
        a._link.push(P.Publish(0, [b"unclaimed"], [blk], True))
        wait_for(lambda: procs.stopped(owner.pid), "the owner to stop after reading the holds")
        pinned = b.lookup([key]) == 1 and b.prepare_load([key]) == [blk]
        os.kill(owner.pid, signal.SIGCONT)
        a.shutdown()  # its grants end: a block freed meanwhile went back to its ring
        c = connect(seg_name, grants=False)
        for i in range(BLOCKS // 4):
            procs.store(c, keys(f"c{i}", 4))
        assert not pinned or procs.check(b.segment.planes(), blk, key), \
            "an honest store wrote into the block a load was reading"
    finally:
        os.kill(owner.pid, signal.SIGCONT)
        for m in (c, b, a):
            if m is not None and m.segment is not None:
                m.shutdown()
        seg.close()
        stop_owner(owner.pid)


@contextlib.contextmanager
def claimer_killed_at_its_claim(seg_name: str, *, finishing: bool = False, lease: bool = False,
                                timeout: float = 30.0):
    """A claimer process killed with its claim of an offer marked (EVICTING; ``finishing``:
    the round that finishes it open, CLAIMED stored) while this process, registered to copy
    for it, lives; ``lease``: a reader leased the block before the mark. Yields (the
    reader, the block, its key) once the owner has reclaimed the claimer."""
    p, conn = spawn(procs.claim_marked_and_wait, seg_name, TEST_LAYOUT, BLOCKS, finishing)
    blk, key, slot, gen = conn.recv()
    b = connect(seg_name, timeout=timeout)
    reg = writers.Registrations(b.segment)
    try:
        assert reg.admit(slot, gen)  # this process copies for the claimer's generation
        if lease:
            assert b.lookup([key]) == 1
        conn.send("claim")
        assert conn.recv() == "marked"
        before = b.segment.counter("reclaimed_clients")
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        wait_for(lambda: b.segment.counter("reclaimed_clients") > before,
                 "the owner to reclaim the dead claimer")
        yield b, blk, key
    finally:
        reg.close()
        pid = b.segment.owner_record()[0]
        b.shutdown()
        stop_owner(pid)


def test_a_claim_its_dead_claimer_left_marked_is_settled_though_a_copier_of_it_lives(
        seg_name):
    """A claimer dies with its claim marked (EVICTING, the holds not read) while a process
    registered to copy for it lives. The owner keeps the blocks that may still be written
    into (quarantine), but nothing is ever written into an offer before its claim ends: it
    is settled, so a reader that leased the block before the mark loads it at once rather
    than waiting its whole timeout for a decision nobody would make."""
    with claimer_killed_at_its_claim(seg_name, lease=True, timeout=3.0) as (b, blk, key):
        assert b.prepare_load([key]) == [blk]
        assert procs.check(b.segment.planes(), blk, key)
        b.complete_load([key])


def test_a_claim_round_a_dead_claimer_left_open_is_closed_though_its_copier_lives(seg_name):
    """A claimer dies inside the round that finishes its claim (CLAIMED stored, the round
    open) while a process registered to copy for it lives. The block may be written into
    now, so it stays the dead claimer's until its copier goes; but its round is closed at
    the reclaim, or every reader of the entry (a lookup of its old key) spins on it and
    every look the owner takes costs it as much, until the copier goes."""
    with claimer_killed_at_its_claim(seg_name, finishing=True) as (b, blk, key):
        assert b.table.seq(blk) % 2 == 0, "the dead claimer's round is still open"
        assert entries(b.segment)[blk].state == L.CLAIMED  # still its copier's to write
        assert b.lookup([key]) == 0


def test_an_owner_dying_as_it_ends_a_dead_clients_torn_claim_never_serves_its_old_key(
        seg_name):
    """A claimed offer whose publish a dead owner began (odd, READY over the old key and its
    checksum, the new key's bytes in the block) is kept by the successor as its live
    client's claim, indexed nowhere. The client dies while a process registered to copy for
    it lives, and the owner ends its unclaimed offers: had it closed that entry's round
    before its FREE write, an owner dying in between (and the copier going) would leave an
    intact READY entry, and the next owner would serve the old key from the new key's
    bytes."""
    p, conn = spawn(procs.claim_written_and_wait, seg_name, TEST_LAYOUT, BLOCKS)
    blk, old, slot, gen = conn.recv()  # its claim written, never completed
    b = connect(seg_name)
    reg = writers.Registrations(b.segment)
    successor = None
    try:
        assert reg.admit(slot, gen)  # this process copies for the claimer's generation
        tear_a_publish(b, blk)  # the claim's publish
        successor = owner_proc(seg_name, "owner.unclaimed.settled")
        assert b.table.seq(blk) % 2 == 1  # kept as the claimer's, indexed nowhere
        os.kill(p.pid, signal.SIGKILL)
        p.join()
        assert successor.wait(timeout=30) == -signal.SIGKILL  # dead ending the claimer's offers
        reg.close()  # and the copier goes
        b.take_events()  # the call starts the next owner, which rebuilds from the table
        assert b.lookup([old]) == 0  # its bytes are the new key's
        b.release()
        assert verify(b.segment) == []
    finally:
        if p.is_alive():
            os.kill(p.pid, signal.SIGKILL)
        reg.close()
        pid = b.segment.owner_record()[0]
        b.shutdown()
        stop_owner(pid)
        if successor is not None and successor.poll() is None:
            successor.kill()
            successor.wait()


def test_the_dead_are_reclaimed_while_others_keep_the_owner_busy(seg_name):
    """An owner that always finds frames waiting still reclaims a dead client (and so gets
    back what it held, parked blocks too): its housekeeping does not wait for a quiet
    moment that a busy cache may never have."""
    first = connect(seg_name, TEST_LAYOUT, num_blocks=BLOCKS, max_clients=CLIENTS,
                    ring_capacity=8192, hold_capacity=64)
    busy, bconn = spawn(procs.touch_until_told, seg_name)
    doomed, dconn = spawn(procs.connect_and_report, seg_name)
    try:
        assert bconn.recv() == "busy"
        dconn.recv()
        before = first.segment.counter("reclaimed_clients")
        os.kill(doomed.pid, signal.SIGKILL)
        doomed.join()
        wait_for(lambda: first.segment.counter("reclaimed_clients") > before,
                 "the owner to reclaim the dead client while busy")
    finally:
        bconn.send("stop")
        busy.join(30)
        pid = first.segment.owner_record()[0]
        first.shutdown()
        stop_owner(pid)


@pytest.mark.parametrize("point", ["table.offer.mid", "table.offer.odd"])
def test_an_owner_dying_halfway_through_an_offer_leaves_no_entry_mid_rewrite(seg_name, point):
    """An offer's fields are stored one after another, its round open. An owner that dies
    between them leaves an entry that names no live client (the successor settles it) or,
    once the fields that name the client are stored, an offer to a live client with its
    round open: the successor hands it over (it cannot tell that round from the client's
    own claim round, so it never closes it) and the client's claim closes it. Either way
    no entry stays mid-rewrite once the clients took what they were handed."""
    seg = Segment.create(seg_name, TEST_LAYOUT, BLOCKS, max_clients=CLIENTS,
                         ring_capacity=8192, hold_capacity=64)
    first = owner_proc(seg_name, f"{point}:4")  # a few refills in, with old positions
    a, b = connect(seg_name), connect(seg_name)
    try:
        for i in range(8):
            procs.store(b, keys(f"fill{i}", BLOCKS // 8))  # a full cache: grants are offers
        for i in range(100):  # each store's refill offers victims: the owner dies in one
            procs.store(a, keys(f"a{i}", 1))
            procs.store(b, keys(f"b{i}", 1))
            if first.poll() is not None:
                break
        assert first.wait(10) == -signal.SIGKILL  # died inside an offer
        b.take_events()  # a successor rebuilds, and hands over what was never handed over
        for i in range(2 * 16):  # past all each client was handed (its ring holds <= 16)
            procs.store(a, keys(f"a-after{i}", 1))
            procs.store(b, keys(f"b-after{i}", 1))
        assert verify(seg) == []  # no entry left mid-rewrite while the clients live
    finally:
        pid = seg.owner_record()[0]
        for m in (b, a):
            m.shutdown()
        seg.close()
        stop_owner(pid)


def test_a_block_written_without_a_claim_is_never_published(pair, monkeypatch):
    a, b = pair
    offered = fill_until_offered(a)
    # A client that skips the claim: it takes offers as if they were its to write.
    monkeypatch.setattr(type(a._own), "_claim", lambda self, blocks: self.spare.extend(blocks))
    errors = a.segment.counter("errors")
    out = a.prepare_store(keys("rogue", level(a)))
    rogue = [(k, blk) for k, blk in zip(out.keys_to_store, out.block_ids) if blk in offered]
    assert rogue
    procs.fill_all(a.segment.planes(), out.block_ids, out.keys_to_store)
    a.complete_store(out.keys_to_store)
    wait_for(lambda: a.segment.counter("errors") >= errors + len(rogue), "the owner to refuse")
    for k, blk in rogue:
        assert b.lookup([k]) == 0 and b.lookup([offered[blk]]) == 0  # neither key is served
        e = entries(a.segment)[blk]  # freed (and perhaps granted again since): no key of its
        assert e.state != L.READY or e.key not in (k, offered[blk])
    b.release()


def test_a_claim_never_touches_a_block_held_before_it(pair):
    """A reader that leased (or pinned) a block before its claimer looked keeps an entry that
    no claim ever rewrote: not even for a moment, which would fail its load."""
    a, b = pair
    offered = fill_until_offered(a)
    block, key = next(iter(offered.items()))
    assert b.lookup([key]) == 1  # leased before the claim
    before = entries(a.segment)[block].seq
    procs.store(a, keys("more", level(a)))
    assert entries(a.segment)[block].seq == before  # never rewritten
    assert procs.check(b.segment.planes(), b.prepare_load([key])[0], key)
    b.complete_load([key])
    b.release()


def test_a_takeover_survives_an_index_slot_naming_a_block_out_of_range(pair):
    """The successor reads its predecessor's key index to tell which offers it served. A
    slot damaged to name a block past the table made that read fail, and every owner after
    it (and gc) died starting: the segment was wedged. Such a slot names nothing."""
    import zlib
    a, b = pair
    blk, key = next(iter(fill_until_offered(a).items()))
    os.kill(a.segment.owner_record()[0], signal.SIGKILL)
    wait_for(lambda: not a.segment.owner_alive(), "the owner to die")
    idx = a.index
    i = zlib.crc32(key) & idx.mask
    while idx._words[2 * i + 1] != blk:  # the offer's slot
        i = (i + 1) & idx.mask
    idx._words[2 * i + 1] = a.table.num_blocks + 10_000_000
    b.take_events()  # the call starts a successor, which rebuilds from the table
    assert b.lookup([key]) == 0  # named by no slot now: a miss, never a failure
    b.release()
    assert verify(b.segment) == []


def test_a_lookup_misses_a_key_whose_index_slot_names_a_block_out_of_range(pair):
    """A reader's first candidate for a key is the block of the first slot carrying its
    tag. A slot damaged to name a block past the table is no candidate: the lookup is a
    miss, never a failure, and the owner goes on serving."""
    import zlib
    a, b = pair
    stored = keys("damaged", 2)
    procs.store(a, stored)
    key = stored[0]
    idx = a.index
    i = zlib.crc32(key) & idx.mask
    while idx._uwords[2 * i] != zlib.crc32(key):  # the key's slot
        i = (i + 1) & idx.mask
    idx._words[2 * i + 1] = a.table.num_blocks + 10_000_000
    assert b.lookup([key]) == 0
    assert b.lookup([stored[1]]) == 1  # the others are served as before
    b.release()
    assert a.segment.owner_alive()


def test_an_owner_dying_mid_rebuild_leaves_a_live_clients_offers_cached(pair):
    """A successor that died halfway through adopting the ready blocks had cleared the key
    index and not yet indexed again the offers of a live client. The owner after it took
    the index as the record of which offers were served: none were, so it kept every offer
    as a claim, indexed nowhere, and their keys, still cached, were misses."""
    a, b = pair
    offered = fill_until_offered(a)
    os.kill(a.segment.owner_record()[0], signal.SIGKILL)
    wait_for(lambda: not a.segment.owner_alive(), "the owner to die")
    a_successor_dies_at(a.segment.name, "owner.rebuild.mid")
    b.take_events()  # the call starts the next owner, which rebuilds from the table
    assert_each_served(b, list(offered.values()))
    assert verify(b.segment) == []


@pytest.mark.parametrize("client", ["lives", "dies"])
def test_an_owner_dying_as_it_rewrites_the_index_leaves_a_clients_offers_cached(
        pair, seg_name, client):
    """The key index is the record of which offers of a client its owner served. A
    successor that cleared it and died before it indexed those offers again (killed
    anywhere in between: it counts duplicate keys over the whole table there) left them
    named by no slot: the owner after it kept each one as a claim, indexed nowhere, and
    their keys, still cached, were misses; and had their client died meanwhile, freed
    them."""
    _, b = pair
    p, conn = spawn(procs.claim_and_wait, seg_name)
    try:
        offered = conn.recv()["offered"]  # offers it never took, still cached
        assert offered
        _kill_owner(b)
        a_successor_dies_at(seg_name, "owner.rebuild.index")
        if client == "dies":
            p.kill()
            p.join()
        b.take_events()  # the call starts the next owner, which rebuilds from the table
        assert_each_served(b, list(offered.values()))
        assert verify(b.segment) == []
    finally:
        p.kill()
        p.join()


def test_an_offer_given_back_by_a_client_that_died_in_a_takeover_is_no_damage(pair, seg_name):
    """A client gave a claim back inside a takeover (its round open when the owner died),
    so the successor kept the block as its claim, indexed nowhere; the key, a miss, was
    stored again elsewhere. The client and the owner then died together: the next owner
    took the given-back block for a dead client's offer, still cached, and with the key's
    new copy for a damaged table. It dropped both copies and counted the damage."""
    _, b = pair
    p, conn = spawn(procs.claim_marked_and_wait, seg_name, TEST_LAYOUT, BLOCKS)
    blk, key, _slot, _gen = conn.recv()
    conn.send("go")
    assert conn.recv() == "marked"  # EVICTING: the client's claim
    seq = b.table._odd(blk)  # its give-back (a lease raced it): READY stored, round open
    b.segment.buf[b.table.base + blk * L.ENTRY_BYTES + STATE_OFF] = L.READY
    _kill_owner(b)
    b.take_events()  # the successor keeps the block as the live client's claim
    b.table._even(blk, seq)  # the give-back ends: its old key intact, indexed nowhere
    assert b.lookup([key]) == 0
    assert procs.store(b, [key]) == [key]
    wait_for(lambda: _held_elsewhere(b, key, blk), "the key to be stored again")
    _kill_owner(b)
    p.kill()
    p.join()
    assert_served_to_a_newcomer(b, key)  # its calls start the next owner, which rebuilds
    assert b.segment.counter("duplicate_keys") == 0 and verify(b.segment) == []


def _kill_owner(mgr) -> None:
    os.kill(mgr.segment.owner_record()[0], signal.SIGKILL)
    wait_for(lambda: not mgr.segment.owner_alive(), "the owner to die")
