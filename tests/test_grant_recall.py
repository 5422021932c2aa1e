"""An idle client's grown grant ring comes back: the owner recalls the blocks a client has
not taken for a while, down to its share, once the budget they hold is what a busy client
lacks.

A client's ring grows beyond its share while the budget has room (a store twice its share
is then one take); a client that stored alone grows to the whole budget. Should it go idle
then, the blocks it holds are kept from everyone else, and every busy client's larger stores
go by round trip for as long as it idles. The recall takes them back with a handshake (the
owner lowers the count, the client announces the positions it is taking, each fenced
before it reads the other's word), so a block is never both taken by its client and ended
by the owner. Every test runs a real owner process.
"""
from __future__ import annotations

import os
import signal
from types import SimpleNamespace

import pytest

from kvshm.client.connect import connect
from kvshm.errors import ReplyTimeoutError
from kvshm.inspect.snapshot import verify
from kvshm.owner.stocking import IDLE_SECONDS, _idle, grant_budget, grant_target, recall
from kvshm.shm import layout as L
from kvshm.shm import slots
from kvshm.shm.segment import Segment
from kvshm.shm.table import BlockTable

from conftest import TEST_LAYOUT, stop_owner
import procs
from test_exactly_once import owner_proc
from test_grants import BLOCKS, CLIENTS, mgr, other  # noqa: F401 (fixtures: a share of 16
# blocks, a budget of 64)
from test_shared import spawn, wait_for

def _level(m) -> int:
    """Blocks in ``m``'s grant ring, not taken yet."""
    words, _ = slots.grants(m.segment, m.slot)
    return int(words["granted"]) - m._own.taken


class _Stores:
    """Stores of ``n`` fresh keys a time by one client, each telling whether it needed a
    round trip."""

    def __init__(self, m, n: int) -> None:
        self.m, self.n, self.done = m, n, 0

    def from_grants(self) -> bool:
        keys = [b"busy-%d-%d" % (self.m.slot, self.done + i) for i in range(self.n)]
        self.done += self.n
        req = self.m._link._req
        assert procs.store(self.m, keys) == keys
        return self.m._link._req == req


def _grown_to_the_budget(m) -> None:
    """``m`` stores alone, stores of half the budget, until its ring holds the whole budget
    (each store grows it: twice the largest store, within the budget's room)."""
    budget = grant_budget(m.segment.geometry)
    stores = _Stores(m, budget // 2)

    def grown() -> bool:  # looked at before the next store, not right after one (which
        if _level(m) >= budget:  # the owner may not have refilled yet on a loaded host)
            return True
        stores.from_grants()
        return False

    wait_for(grown, "the ring to grow to the budget")


def test_a_busy_client_is_granted_what_an_idle_one_held(mgr, other):
    g = mgr.segment.geometry
    share = grant_target(g)
    _grown_to_the_budget(mgr)
    stores = _Stores(other, share + 4)  # more than a share: a round trip while mgr holds all
    assert not stores.from_grants()
    wait_for(stores.from_grants, "a store larger than a share without a round trip",
             timeout=30)


def test_an_idle_client_keeps_its_share(mgr, other):
    share = grant_target(mgr.segment.geometry)
    _grown_to_the_budget(mgr)
    stores = _Stores(other, share + 4)
    wait_for(stores.from_grants, "the idle client's grants to come back", timeout=30)
    assert _level(mgr) == share
    keys = [b"back-%d" % i for i in range(share)]
    req = mgr._link._req
    assert procs.store(mgr, keys) == keys  # back to work: a share's store needs no frame
    assert mgr._link._req == req
    assert mgr.lookup(keys) == len(keys)


def _let_go(p, conn) -> None:
    """Let the spawned client go on (it may be stopped), then leave."""
    os.kill(p.pid, signal.SIGCONT)
    conn.send("bye")
    p.join(30)


def _intact(seg) -> None:
    """No block holds another key's bytes, and the table and index agree."""
    _ready_bytes_are_their_keys(seg)
    assert verify(seg) == []


def _ready_bytes_are_their_keys(seg) -> None:
    """Every READY block holds its own key's bytes (none was written by two stores)."""
    t = BlockTable(seg.buf, seg.geometry)
    planes = seg.planes()
    try:
        for b in range(seg.geometry.num_blocks):
            e = t.read(b)
            if e.state == L.READY and e.key.startswith((b"busy-", b"last-", b"grow-")):
                assert procs.check(planes, b, e.key), f"block {b} holds other bytes"
    finally:
        t.close()


@pytest.mark.parametrize("point", ["client.take.after_intent", "client.store.after_take"])
def test_a_client_taking_the_blocks_being_recalled_keeps_them(mgr, seg_name, point):
    # The idle client is frozen inside its take of more than its share (announced, its ids
    # perhaps read, its count not stored): the owner's recalls of those positions back off
    # until it goes on, and its store lands whole, in blocks nobody else was granted.
    share = grant_target(mgr.segment.geometry)
    levels = [share, 3 * share, grant_budget(mgr.segment.geometry)]
    p, conn = spawn(procs.grow_then_store, seg_name, levels, share + 4,
                    env={"KVSHM_CRASH_AT": f"{point}:3", "KVSHM_CRASH_SIGNAL": "STOP"})
    try:
        assert conn.recv()[0] == levels[-1]
        wait_for(lambda: procs.stopped(p.pid), "the client to stop inside its take")
        stores = _Stores(mgr, share + 4)
        wait_for(lambda: stores.from_grants() is not None and
                 mgr.segment.counter("recalls_refused") > 0, "a recall to back off")
        assert mgr.segment.counter("recalled_blocks") == 0
        os.kill(p.pid, signal.SIGCONT)
        assert conn.recv() == (True, True)
        wait_for(lambda: stores.from_grants() is not None and
                 mgr.segment.counter("recalled_blocks") > 0,
                 "the recall once the client is idle again", timeout=30)
        _intact(mgr.segment)
    finally:
        _let_go(p, conn)


def _marked_for(seg, slot: int) -> int:
    """Blocks the table marks as granted or offered to ``slot`` (not taken by it)."""
    t = BlockTable(seg.buf, seg.geometry)
    try:
        return sum(e.writer == slot and e.state in (L.GRANTED, L.READY)
                   for e in map(t.read, range(seg.geometry.num_blocks)))
    finally:
        t.close()


@pytest.mark.parametrize("point", ["owner.recall.lowered", "owner.recall.mid"])
def test_an_owner_dying_as_it_recalls_grants_leaks_none(seg_name, point):
    # Its successor hands the ones still granted over again, and recalls them in turn.
    Segment.create(seg_name, TEST_LAYOUT, BLOCKS, max_clients=CLIENTS,
                   ring_capacity=8192).close()
    first = owner_proc(seg_name, f"{point}:1")
    idle, busy = connect(seg_name), connect(seg_name)
    try:
        _grown_to_the_budget(idle)
        stores = _Stores(busy, grant_target(idle.segment.geometry) + 4)
        wait_for(lambda: stores.from_grants() is not None and first.poll() is not None,
                 "the owner to die recalling", timeout=30)
        assert first.returncode == -signal.SIGKILL
        wait_for(lambda: stores.from_grants() is not None and
                 idle.segment.counter("recalled_blocks") > 0 and
                 _level(idle) == grant_target(idle.segment.geometry),
                 "a successor to recall them", timeout=30)
        assert _marked_for(idle.segment, idle.slot) == _level(idle)  # nothing stranded
        _intact(idle.segment)
    finally:
        pid = idle.segment.owner_record()[0]
        busy.shutdown()
        idle.shutdown()
        stop_owner(pid)


def test_an_owner_dying_as_it_lowers_the_count_of_a_client_taking_keeps_the_client(seg_name):
    # The client read the count before it was lowered and takes past it; the owner dies
    # before it reads the client's intent. Its successor finds the client's taken count above
    # the granted one: a recall cut short, whose blocks it hands over again, not a client
    # that scribbled its words (quarantined).
    Segment.create(seg_name, TEST_LAYOUT, BLOCKS, max_clients=CLIENTS,
                   ring_capacity=8192).close()
    first = owner_proc(seg_name, "owner.recall.lowered:1", "STOP")
    busy = connect(seg_name, timeout=1.0)
    share = grant_target(busy.segment.geometry)
    levels = [share, 3 * share, grant_budget(busy.segment.geometry)]
    p, conn = spawn(procs.grow_then_store, seg_name, levels, share + 4,
                    env={"KVSHM_CRASH_AT": "client.store.after_take:3",
                         "KVSHM_CRASH_SIGNAL": "STOP"})
    try:
        slot = conn.recv()[1]
        wait_for(lambda: procs.stopped(p.pid), "the client to stop inside its take")
        stores = _Stores(busy, share + 4)

        def owner_stopped() -> bool:
            if not procs.stopped(first.pid):
                try:
                    stores.from_grants()
                except ReplyTimeoutError:  # it met the owner stopped: what we wait for
                    pass
            return procs.stopped(first.pid)
        wait_for(owner_stopped, "the owner to stop as it recalls", timeout=30)
        words, _ = slots.grants(busy.segment, slot)
        os.kill(p.pid, signal.SIGCONT)
        wait_for(lambda: words["taken"] > words["granted"], "the client to take past the count")
        first.kill()
        first.wait()
        assert conn.recv() == (True, True)  # a successor served it, from what it took
        stores.from_grants()
        assert not slots.served(busy.segment, slot)["quarantined"]
        assert words["granted"] >= words["taken"]
        _intact(busy.segment)
    finally:
        _let_go(p, conn)
        pid = busy.segment.owner_record()[0]
        busy.shutdown()
        stop_owner(pid)


def _client(granted: int, taken: int, intent: int, seen: int):
    """A refill's view of one client, its slot words in a dict."""
    head = {"granted": granted, "taken": taken, "intent": intent, "refused": 0}
    return SimpleNamespace(grant_head=head, taken_seen=seen, taken_at=0.0, slot=1, gen=1)


class _NoGrants:
    """Grants that must not be ended."""
    segment = SimpleNamespace(counter_add=lambda *a: None)

    def take_back(self, writer, first):
        raise AssertionError("blocks were taken back")


@pytest.mark.unit
def test_a_refused_recall_is_not_tried_again_until_the_client_idles_anew():
    c = _client(granted=64, taken=10, intent=30, seen=10)  # taking up to 30: past 10 + 16
    assert recall(_NoGrants(), c, 16, now=5.0) == 0
    assert c.grant_head["granted"] == 64  # the count it lowered is back
    assert not _idle(c, 5.0 + IDLE_SECONDS / 2)
    assert _idle(c, 5.0 + IDLE_SECONDS)


@pytest.mark.unit
@pytest.mark.parametrize("taken,intent", [(8, 8), (10, 9)])
def test_nothing_is_recalled_from_a_client_whose_words_contradict_its_takes(taken, intent):
    # taken below a count seen before, or above the intent: what it took is unknown
    c = _client(granted=64, taken=taken, intent=intent, seen=10)
    assert recall(_NoGrants(), c, 16, now=5.0) == 0
    assert c.grant_head["granted"] == 64
