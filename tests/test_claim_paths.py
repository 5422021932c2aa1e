"""A one-key store claims its one offered block without numpy (``OwnStores._claim_one``);
whatever the block's entry, the holds on it and the client's recent loads, that must do
exactly what the claim of several blocks (``_claim_many``) does for it: the same entry
afterwards, sequence number included, and the block in the same list (spare, declined,
returned) or in none."""
from __future__ import annotations

import random
from unittest import mock

import numpy as np
import pytest

from kvshm.client import own_stores
from kvshm.client.own_stores import OwnStores
from kvshm.shm import layout as L
from kvshm.shm import offers, slots
from kvshm.shm.table import BlockTable

ME, OTHER = (1, 3), (2, 5)  # the claiming client's (slot, gen), and another's
BLOCKS = 16


@pytest.fixture
def twins(make_segment):
    """Two identical segments, each with the claiming client's OwnStores."""
    out = []
    for _ in range(2):
        seg = make_segment(num_blocks=BLOCKS, max_clients=4)
        table = BlockTable(seg.buf, seg.geometry)
        out.append((seg, table, OwnStores(seg, *ME, None, table)))  # (no owner link needed)
    yield out
    for _, table, stores in out:
        stores.close()
        table.close()


def arrange(seg, table: BlockTable, rnd: random.Random, b: int) -> set[int]:
    """Block ``b`` in a random state a claim may meet; holds on it or not. Returns the
    client's recent loads."""
    kind = rnd.choice(["offer", "offer", "offer", "other_offer", "ready", "granted",
                       "claimed", "free"])
    tick, used = 100, rnd.random() < 0.3
    state = {"granted": L.GRANTED, "claimed": L.CLAIMED, "free": L.FREE}.get(kind, L.READY)
    table.write(b, state, b"" if kind == "free" else b"key-%d" % b, -1, 0, 0,
                tick + 1 if used else tick - 1)
    if kind in ("offer", "other_offer", "claimed"):
        who = OTHER if kind == "other_offer" else ME
        offers.offer(table, [b], *who, [7], tick)
    if rnd.random() < 0.1:
        table._odd(b)  # an owner caught mid-rewrite (settling it, say)
    holder = rnd.randrange(4) if rnd.random() < 0.4 else None  # (ourselves, too)
    for s in range(4):
        h = slots.holds(seg, s)
        h[:] = -1
        n = rnd.choice([1, 3]) if s == holder else 0
        for i in range(n):
            h[i] = rnd.choice([b, L.lease_code(b), (b + 1) % BLOCKS])
        slots.hold_mark(seg, s)[0] = n
    return {b} if rnd.random() < 0.2 else set()


def lease_races_the_claim(seg, b: int):
    """A crash_point stand-in: at the claim's check, another slot leases ``b`` (a lookup
    that raced the claim; the claim's fence and second reading of the holds catch it)."""
    def point(name: str) -> None:
        if name == "client.claim.before_check":
            slots.holds(seg, 3)[0] = L.lease_code(b)
            slots.hold_mark(seg, 3)[0] = 1
    return point


def test_claiming_one_block_does_what_claiming_several_does_for_it(twins):
    (seg1, t1, one), (seg2, t2, many) = twins
    rnd = random.Random(1)
    for case in range(2000):
        b = rnd.randrange(BLOCKS)
        state = rnd.getstate()
        one.recent = arrange(seg1, t1, rnd, b)
        rnd.setstate(state)
        many.recent = arrange(seg2, t2, rnd, b)
        for s in (one, many):
            s.spare, s.declined, s.returned = [], [], []
        race = rnd.random() < 0.2
        with mock.patch.object(own_stores, "crash_point",
                               lease_races_the_claim(seg1, b) if race else lambda _: None):
            one._claim_one(b)
        with mock.patch.object(own_stores, "crash_point",
                               lease_races_the_claim(seg2, b) if race else lambda _: None):
            many._claim_many([b])
        assert t1.read(b) == t2.read(b), f"case {case}"
        assert (one.spare, one.declined, one.returned) == \
            (many.spare, many.declined, many.returned), f"case {case}"


class LeaseToPin(np.ndarray):
    """A slot's hold array whose holder turns its lease on ``BLOCK`` into a pin (the same
    entry: a load of a key it had looked up) just after a comparison reads it: held all
    along, first as a lease, then as a pin."""
    live: np.ndarray  # the segment's hold array it stands for
    armed = False
    BLOCK = 5

    def __eq__(self, other):
        out = np.asarray(super().__eq__(other))
        if LeaseToPin.armed:
            LeaseToPin.live[0] = LeaseToPin.BLOCK
        return out


@pytest.mark.parametrize("path", ["one", "many"])
def test_a_lease_turning_into_a_pin_during_the_check_keeps_the_block(make_segment, path):
    b, reader = LeaseToPin.BLOCK, 2
    seg = make_segment(num_blocks=BLOCKS, max_clients=4)
    table = BlockTable(seg.buf, seg.geometry)
    stores = OwnStores(seg, *ME, None, table)
    try:
        table.write(b, L.READY, b"key-5", -1, 0, 0, 99)
        offers.offer(table, [b], *ME, [7], 100)  # offered to us, unused since
        live = slots.holds(seg, reader)
        live[:] = -1
        slots.hold_mark(seg, reader)[0] = 1  # the only slot with holds
        LeaseToPin.live, LeaseToPin.armed = live, False
        stores._holds._holds[reader] = live.view(LeaseToPin)

        def point(name: str) -> None:  # a lookup's lease races the claim, then is loaded
            if name == "client.claim.before_check":
                live[0] = L.lease_code(b)
                LeaseToPin.armed = True

        with mock.patch.object(own_stores, "crash_point", point):
            if path == "one":
                stores._claim_one(b)
            else:
                stores._claim_many([b, b + 1])  # (b + 1: not an offer, left alone)
        assert b not in stores.spare and stores.declined == [b]
        assert table.read(b).state == L.READY
    finally:
        stores.close()
        table.close()


@pytest.mark.parametrize("ids", [[-1, 15], [16, 15], [-1], [16]])
def test_a_block_id_outside_the_table_taken_from_the_ring_is_never_written(twins, ids):
    """Only the owner writes the grant ring, but the slot is the client's memory: an id
    outside the table (a scribble) is never used for a store, nor read past the table."""
    (seg, table, stores), _ = twins
    table.write(15, L.GRANTED, b"", *ME, 0)  # a real grant beside it
    head, ring = slots.grants(seg, ME[0])
    ring[:len(ids)] = ids
    head["granted"] = len(ids)
    taken = stores.take([b"k%d" % i for i in range(len(ids))])
    head.release()
    assert all(0 <= b < BLOCKS for b in taken)
    assert taken == ([15] if 15 in ids else [])
