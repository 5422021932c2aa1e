"""The control plane under an adversary: exactly-once requests, an owner no client can stall,
slots that always come back.

Owners are started by the test (``owner_proc``) so that a crash point (``kvshm/crashpoints.py``)
can stop one at an exact step; successors are started by the clients, without crash points.
Child processes are spawned and driven through pipes; waiting polls a condition with a
deadline that bounds a hang (it is not what a test asserts).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys

import pytest

from kvshm.shm import layout as L
from kvshm.index import protocol as P
from kvshm.shm import slots
from kvshm.client.connect import connect
from kvshm.errors import ClientSlotsExhaustedError, ReplyTimeoutError
from kvshm.shm.segment import Segment
from kvshm.shm.table import BlockTable
from kvshm.owner.stocking import grant_target
from kvshm.inspect.snapshot import verify

import procs
from conftest import SMALL_GEOMETRY, TEST_LAYOUT, stop_owner
from test_shared import states, wait_for

CTX = mp.get_context("spawn")
KEYS = [b"once-key-%03d" % i for i in range(400)]


def owner_proc(name: str, crash_at: str | None = None, signal_name: str = "KILL"):
    """Start an owner for ``name``, optionally armed to stop at crash point ``crash_at``."""
    env = dict(os.environ)
    env.pop("KVSHM_CRASH_AT", None)
    if crash_at:
        env.update(KVSHM_CRASH_AT=crash_at, KVSHM_CRASH_SIGNAL=signal_name)
    p = subprocess.Popen([sys.executable, "-m", "kvshm.owner", name], env=env,
                         stdin=subprocess.DEVNULL)
    seg = Segment.attach(name)
    try:
        wait_for(lambda: seg.owner_record()[0] == p.pid, "the owner to start and rebuild")
    finally:
        seg.close()
    return p


def _writing_blocks(seg: Segment) -> int:
    return states(seg).count(L.WRITING)


# --- exactly-once --------------------------------------------------------------------------
def test_owner_dying_after_executing_a_store_grants_its_blocks_once(seg):
    first = owner_proc(seg.name, "owner.request.after_execute:2")  # hello is request 1
    mgr = connect(seg.name)
    out = mgr.prepare_store(KEYS[:4])  # executed by the first owner, answered by the next
    first.wait()
    assert first.returncode == -signal.SIGKILL
    assert sorted(out.keys_to_store) == sorted(KEYS[:4]) and len(set(out.block_ids)) == 4
    assert _writing_blocks(seg) == 4  # granted once: a second grant would show 8
    assert seg.counter("round_trip_stores") == 1  # and counted once: the replay adds none
    planes = seg.planes()
    for k, b in zip(out.keys_to_store, out.block_ids):
        procs.fill(planes, b, k)
    mgr.complete_store(out.keys_to_store)
    assert mgr.lookup(KEYS[:4]) == 4
    blocks = mgr.prepare_load(KEYS[:4])
    assert all(procs.check(planes, b, k) for b, k in zip(blocks, KEYS[:4]))
    mgr.complete_load(KEYS[:4])
    mgr.shutdown()


def test_a_slow_owner_is_waited_for_not_sent_the_request_again(seg):
    # A failover first, so the client has seen two epochs; then an owner that stalls right
    # after consuming a store. The client must wait, not resend: a resend was executed as
    # a second grant of the same blocks.
    mgr = connect(seg.name)
    procs.store(mgr, KEYS[:2])
    stop_owner(seg.owner_record()[0])
    slow = owner_proc(seg.name, "owner.request.after_consume", "STOP")
    assert mgr.lookup(KEYS[:2]) == 2
    waiter = CTX.Process(target=procs.cont_when_stopped, args=(slow.pid, 1.0), daemon=True)
    waiter.start()
    out = mgr.prepare_store(KEYS[2:6])
    waiter.join()
    assert len(set(out.block_ids)) == 4 and _writing_blocks(seg) == 4
    mgr.complete_store(out.keys_to_store)
    assert _writing_blocks(seg) == 0 and verify(seg) == []
    mgr.shutdown()
    slow.kill()
    slow.wait()


def test_owner_dying_after_its_reply_is_answered_once(seg):
    first = owner_proc(seg.name, "owner.request.after_reply:2")
    mgr = connect(seg.name)
    out = mgr.prepare_store(KEYS[:3])
    first.wait()
    # The successor replays the request whose reply was already out; its second reply is
    # dropped by the client, and no block is granted twice.
    mgr.complete_store(out.keys_to_store)
    assert mgr.lookup(KEYS[:3]) == 3
    assert _writing_blocks(seg) == 0 and verify(seg) == []
    mgr.shutdown()


def _poisoned(seg_name: str, poisoner, *args) -> dict:
    """Run ``poisoner`` (``procs``: it makes every owner die on its frame, then makes a call
    behind it) in a child process; what that call said."""
    parent, child = CTX.Pipe()
    p = CTX.Process(target=poisoner, args=(seg_name, child, *args), daemon=True)
    p.start()
    child.close()  # ours: a child that dies without a word ends recv
    result = parent.recv()
    p.join()
    return result


def _serves_on(seg_name: str) -> int:
    """Check that the owner that dropped a poisonous frame serves on, with nothing stuck once
    the poisoner went; its errors counter."""
    seg = Segment.attach(seg_name)
    try:
        assert seg.owner_alive()
        # What the dead owners granted stays the client's (it may have been told and be
        # copying) until it goes: then it is reclaimed like any dead client's stores.
        wait_for(lambda: not {L.WRITING, L.GRANTED} & set(states(seg)),
                 "the gone client's stores and grants")
        assert verify(seg) == []
        mgr = connect(seg_name)
        assert procs.store(mgr, KEYS[:2]) == KEYS[:2]
        mgr.shutdown()
        return seg.counter("errors")
    finally:
        stop_owner(seg.owner_record()[0])
        seg.close()


@pytest.mark.parametrize("point", ["owner.request.after_consume",
                                   "owner.request.after_execute"])
def test_a_request_that_kills_every_owner_fails_instead_of_looping(seg_name, point):
    Segment.create(seg_name, TEST_LAYOUT, 16, **SMALL_GEOMETRY).close()
    result = _poisoned(seg_name, procs.poison_request, point)
    assert result["error"] == "RequestDroppedError" and "owners died" in result["message"]
    _serves_on(seg_name)


def test_a_store_whose_round_trip_fails_can_be_asked_again_in_full(seg_name):
    # A store took blocks from its grant ring and asked the owner for the rest; the round
    # trip failed. The keys taken stayed in flight for the client's life: the same store
    # asked again left them out (never stored, shown pending), their blocks held granted.
    s = Segment.create(seg_name, TEST_LAYOUT, 16, max_clients=4, **SMALL_GEOMETRY)
    assert grant_target(s.geometry) == 1  # one block in the ring: three keys need the owner
    s.close()
    result = _poisoned(seg_name, procs.poison_part_granted_store, "owner.request.after_consume")
    keys = [b"mixed-0", b"mixed-1", b"mixed-2"]
    assert result == {"error": "RequestDroppedError", "stored": keys, "found": 3}
    _serves_on(seg_name)


@pytest.mark.parametrize("kind", ["touch", "publish"])
def test_a_one_way_frame_that_kills_every_owner_is_dropped_instead_of_looping(seg_name, kind):
    # A one-way frame has no request id, so no reply can fail it; what owners died beginning
    # it must still be counted, or each successor begins it again and dies, forever.
    s = Segment.create(seg_name, TEST_LAYOUT, 16, max_clients=4, **SMALL_GEOMETRY)
    assert grant_target(s.geometry) >= 1  # so that a store can take the one-way path
    s.close()
    result = _poisoned(seg_name, procs.poison_one_way, kind, "owner.one_way.after_begin")
    assert result == {"error": None, "message": ""}  # the call behind it was served
    assert _serves_on(seg_name) >= 1  # the dropped frame is counted, not silent


def test_a_dropped_publish_keeps_its_blocks_for_its_client_until_it_goes_and_says_so(seg_name):
    # Its blocks were written (the client published them), but a frame that killed three
    # owners is no list to trust: its blocks may be ones the client still writes. They
    # stay its own while it lives, shown as stranded, and come back when it goes.
    from kvshm.inspect.snapshot import snapshot
    s = Segment.create(seg_name, TEST_LAYOUT, 16, max_clients=4, **SMALL_GEOMETRY)
    parent, child = CTX.Pipe()
    p = CTX.Process(target=procs.poison_one_way, daemon=True,
                    args=(seg_name, child, "publish", "owner.one_way.after_begin", True))
    p.start()
    child.close()
    try:
        assert parent.recv() == {"error": None, "message": ""}
        mine = parent.recv()
        row = BlockTable(s.buf, s.geometry).read(mine["block"])
        assert row.state in (L.GRANTED, L.CLAIMED) and (row.writer, row.writer_gen) == (
            mine["slot"], mine["gen"])  # still the client's: never handed to anyone else
        c = next(c for c in snapshot(s)["clients"] if c["slot"] == mine["slot"])
        assert c["stranded"] == 1
        parent.send("go")
        p.join(30)
        wait_for(lambda: BlockTable(s.buf, s.geometry).read(mine["block"]).state == L.FREE,
                 "its stranded block to be freed once it went")
    finally:
        stop_owner(s.owner_record()[0])
        s.close()


def test_event_subscription_survives_an_owner_death(seg):
    mgr = connect(seg.name, events=True)
    procs.store(mgr, KEYS[:2])
    assert [e.keys for e in mgr.take_events()] == [KEYS[:2]]
    stop_owner(seg.owner_record()[0])
    procs.store(mgr, KEYS[2:4])  # the reply of a new owner: the client subscribes again
    procs.store(mgr, KEYS[4:6])
    assert KEYS[4:6] in [e.keys for e in mgr.take_events()]
    mgr.shutdown()


def test_an_events_client_sees_the_stores_made_between_a_takeover_and_its_next_call(seg):
    listener = connect(seg.name, events=True)
    quiet = connect(seg.name)
    procs.store(quiet, KEYS[:2])
    assert [e.keys for e in listener.take_events() if not e.removed] == [KEYS[:2]]
    stop_owner(seg.owner_record()[0])
    procs.store(quiet, KEYS[2:4])  # its call starts a successor; the listener says nothing
    assert [e.keys for e in listener.take_events() if not e.removed] == [KEYS[2:4]]
    listener.shutdown()
    quiet.shutdown()


def test_a_slot_an_events_client_gave_back_says_no_events(seg):
    listener = connect(seg.name, events=True)
    slot = listener.slot
    assert slots.record(seg, slot).events == 1
    listener.shutdown()
    wait_for(lambda: slots.record(seg, slot).state == L.SlotState.FREE, "the slot freed")
    assert slots.record(seg, slot).events == 0  # whoever claims it next, of any release


# A real owner that stops itself (SIGSTOP) right after it stores a slot's state FREE, as a
# descheduled owner would: whatever of the slot it clears after that, it clears late.
_OWNER_STOPPING_AT_FREE = """
import os, runpy, signal, sys
import kvshm.shm.slots as S
store, armed = S._store, [True]
def stopping(seg, slot, name, value):
    store(seg, slot, name, value)
    if armed and name == "state" and value == S.SlotState.FREE:
        armed.clear()
        os.kill(os.getpid(), signal.SIGSTOP)
S._store = stopping
sys.argv = ["kvshm.owner"] + sys.argv[1:]
runpy.run_module("kvshm.owner", run_name="__main__")
"""


def test_a_slot_freed_late_never_clears_what_its_next_client_stored(seg_name):
    """The owner frees a departed client's slot, then lets go of it (its served lock): only
    then may a newcomer claim it. An owner stalled right after it stored FREE keeps the slot
    unclaimable, and has nothing of it left to clear when it goes on."""
    seg = Segment.create(seg_name, TEST_LAYOUT, 8, max_clients=1)
    owner = subprocess.Popen([sys.executable, "-c", _OWNER_STOPPING_AT_FREE, seg_name],
                             stdin=subprocess.DEVNULL)
    try:
        wait_for(lambda: seg.owner_record()[0] == owner.pid, "the owner")
        connect(seg_name).shutdown()  # its goodbye: the owner frees the slot, then stops
        wait_for(lambda: procs._proc_state(owner.pid) == "T", "the owner stopped")
        assert slots.record(seg, 0).state == L.SlotState.FREE
        with pytest.raises(ClientSlotsExhaustedError):
            slots.claim(seg)  # FREE, but the owner has not let go of it yet
        os.kill(owner.pid, signal.SIGCONT)  # the owner goes on with the goodbye
        newcomer = connect(seg_name, events=True)
        rec = slots.record(seg, 0)
        assert (rec.pid, rec.events) == (os.getpid(), 1)
        newcomer.shutdown()
    finally:
        os.kill(owner.pid, signal.SIGCONT)
        stop_owner(owner.pid)
        seg.close()


def test_a_client_that_asks_for_events_sees_the_stores_of_clients_that_did_not(seg):
    quiet = connect(seg.name)  # the owner records no events while nobody asked for them
    procs.store(quiet, KEYS[:2])
    listener = connect(seg.name, events=True)
    procs.store(quiet, KEYS[2:4])
    assert [e.keys for e in listener.take_events() if not e.removed] == [KEYS[2:4]]
    assert quiet.take_events() == []  # never asked
    listener.shutdown()
    quiet.shutdown()


def test_request_ids_past_32_bits_work(seg):
    mgr = connect(seg.name)
    mgr._link._req = 2**32 - 2
    out = mgr.prepare_store(KEYS[:3])
    mgr.complete_store(out.keys_to_store)
    assert mgr.lookup(KEYS[:3]) == 3 and verify(seg) == []
    mgr.shutdown()


def test_a_prepare_store_larger_than_a_frame_is_one_atomic_operation(seg_name):
    # 300 keys do not fit one frame of this ring. Keys offered in one call are never chosen
    # as victims of that call; when the parts ran separately, the part with the new keys
    # evicted the cached keys an earlier part had offered.
    # 64 client slots over 200 blocks: no grants (stocking.grant_target), stores round-trip.
    mgr = connect(seg_name, TEST_LAYOUT, num_blocks=200, ring_capacity=8192, max_clients=64)
    try:
        cached = [b"cached-%054d" % i for i in range(200)]
        fresh = [b"fresh--%054d" % i for i in range(150)]
        assert procs.store(mgr, cached) == cached  # the cache is full
        assert mgr.prepare_store(cached[:150] + fresh) is None  # 50 evictable, 150 needed
        assert mgr.lookup(cached) == 200
        mgr.release()
        out = mgr.prepare_store(cached[:50] + fresh)  # 150 evictable: all of them go
        assert sorted(out.keys_to_store) == sorted(fresh) and len(set(out.block_ids)) == 150
        assert sorted(out.evicted_keys) == sorted(cached[50:])
        mgr.complete_store(out.keys_to_store)
        assert mgr.lookup(cached[:50]) == 50 and mgr.lookup(fresh) == 150
    finally:
        pid = mgr.segment.owner_record()[0]
        mgr.shutdown()
        stop_owner(pid)


def test_a_store_without_a_request_id_is_refused_not_granted(seg):
    mgr = connect(seg.name)
    mgr._link.requests.put(P.request_encoder.encode(P.PrepareStore(0, KEYS[:3])), timeout=5)
    mgr._link.owner_bell.ring()
    assert mgr._link.reply_bell.wait(10, mgr._link.replies.pending, 0.001)
    reply = P.reply_decoder.decode(mgr._link.replies.try_get())
    assert isinstance(reply, P.Error) and reply.kind == "ProtocolError"
    assert _writing_blocks(seg) == 0  # a grant nobody hears of would leak until we exit
    assert procs.store(mgr, KEYS[:3]) == KEYS[:3]
    mgr.shutdown()


# --- an owner no client can stall ------------------------------------------------------------
def test_a_client_that_never_reads_its_replies_does_not_slow_the_others(seg):
    mute = connect(seg.name)
    other = connect(seg.name, timeout=5.0)
    for _ in range(5000):  # far more replies than its rings hold, none of them read
        if not mute._link.requests.try_put(P.request_encoder.encode(
                P.TakeEvents(mute._link.next_req()))):
            break
        mute._link.owner_bell.ring()
    for i in range(20):  # each would have waited 5 s behind a blocked reply
        assert procs.store(other, KEYS[2 * i:2 * i + 2]) == KEYS[2 * i:2 * i + 2]
    other.shutdown()
    mute.shutdown()


def test_a_client_with_a_scribbled_ring_is_quarantined_and_keeps_its_leases(seg):
    writer = connect(seg.name)
    procs.store(writer, KEYS[:16])  # the cache is full
    bad = connect(seg.name)
    assert bad.lookup(KEYS[:2]) == 2  # leased: nobody else may evict these two
    from kvshm.shm.ring import _TAIL
    bad._link.requests._w[_TAIL] = 1 << 62  # its request ring's tail word now lies
    bad._link.owner_bell.ring()
    out = writer.prepare_store(KEYS[16:30])  # the owner keeps serving, and spares the leases
    assert out is not None and not set(out.evicted_keys) & set(KEYS[:2])
    assert writer.prepare_store(KEYS[30:32]) is None  # only the leased blocks are left
    # The owner may answer the writer's requests before, in the same pass, it reaches the
    # scribbled ring (it serves the clients in turn): the error is counted then, not before.
    wait_for(lambda: seg.counter("errors") >= 1, "the owner to quarantine the scribbler")
    writer.shutdown()
    bad._link.close()  # it cannot say goodbye on a broken ring: it just goes
    slots.unlock(bad.segment, bad.slot, bad.gen)
    wait_for(lambda: slots.record(seg, bad.slot).state == L.SlotState.FREE,
             "its slot to be reclaimed")


def test_reconnecting_in_a_loop_never_wedges_the_owner(seg):
    kids = [CTX.Process(target=procs.reconnect_loop, args=(seg.name, 100), daemon=True)
            for _ in range(2)]
    for k in kids:
        k.start()
    procs.reconnect_loop(seg.name, 100)
    for k in kids:
        k.join()
        assert k.exitcode == 0
    mgr = connect(seg.name, timeout=5.0)
    assert procs.store(mgr, KEYS[:4]) == KEYS[:4]
    assert seg.counter("errors") == 0
    mgr.shutdown()


# --- slots always come back ------------------------------------------------------------------
def test_a_client_killed_before_its_owner_adopted_it_gets_its_slot_back(seg):
    mgr = connect(seg.name)  # an owner runs
    env = dict(os.environ, KVSHM_CRASH_AT="client.connect.after_activate")
    p = subprocess.Popen([sys.executable, "-c", "import kvshm, sys; kvshm.connect(sys.argv[1])",
                          seg.name], env=env)
    assert p.wait() == -signal.SIGKILL
    wait_for(lambda: all(slots.record(seg, s).state == L.SlotState.FREE
                         for s in range(seg.geometry.max_clients) if s != mgr.slot),
             "the owner to reclaim the slot of the dead newcomer")
    mgr.shutdown()


def time_out_connects(seg, n: int = 10) -> None:
    """``n`` connects that time out: the owner is stopped (SIGSTOP) meanwhile."""
    owner = seg.owner_record()[0]
    os.kill(owner, signal.SIGSTOP)
    try:
        for _ in range(n):
            with pytest.raises(ReplyTimeoutError):
                connect(seg.name, timeout=0.3)
    finally:
        os.kill(owner, signal.SIGCONT)


def test_timed_out_connects_leave_no_slot_behind(seg):
    mgr = connect(seg.name)
    time_out_connects(seg)
    wait_for(lambda: sum(slots.record(seg, s).state != L.SlotState.FREE
                         for s in range(seg.geometry.max_clients)) == 1,
             "the owner to reclaim the slots of timed-out connects")
    mgr.shutdown()


def test_gc_with_a_live_owner_says_the_owner_reclaims(seg):
    mgr = connect(seg.name)
    r = subprocess.run([sys.executable, "-m", "kvshm.inspect.cli", "gc", seg.name],
                       capture_output=True, text=True)
    assert r.returncode == 0 and "owner" in r.stdout + r.stderr
    mgr.shutdown()


def _shm_mappings() -> int:
    """How many of this process's mappings are segments (or, of older formats, glibc
    semaphores: "sem.XXXXXX (deleted)") in /dev/shm."""
    with open("/proc/self/maps") as f:
        return sum("/dev/shm/kvshm-" in line or "/dev/shm/sem." in line for line in f)


def test_failed_connects_leave_no_mapping_behind(seg):
    import gc
    mgr = connect(seg.name)
    gc.collect()
    before = _shm_mappings()
    time_out_connects(seg)
    gc.collect()
    assert _shm_mappings() == before
    mgr.shutdown()


# --- counters at their limits ----------------------------------------------------------------
def test_an_owner_epoch_at_its_maximum_wraps_and_successors_take_over(seg):
    seg.write_owner_record(0, 2**32 - 1, 0, 0)  # the last epoch the record can hold
    mgr = connect(seg.name)
    assert seg.owner_record().epoch == mgr._link.epoch == 1  # 0 means "no owner yet"
    stop_owner(seg.owner_record()[0])
    assert procs.store(mgr, KEYS[:2]) == KEYS[:2]  # a successor serves: a failover seen
    assert seg.owner_record().epoch == mgr._link.epoch == 2
    mgr.shutdown()


def test_a_slot_generation_at_its_maximum_wraps_and_its_next_client_stores(seg):
    for s in range(seg.geometry.max_clients):  # as a departed client may leave its slot
        slots._store(seg, s, "gen", 2**64 - 1)
    mgr = connect(seg.name)
    assert 1 <= mgr.gen < 2**32  # what a block table entry's writer field holds
    assert procs.store(mgr, KEYS[:4]) == KEYS[:4]
    assert mgr.lookup(KEYS[:4]) == 4 and verify(seg) == []
    mgr.shutdown()


def test_request_ids_at_their_limit_raise_a_typed_error(seg):
    from kvshm.errors import CounterLimitError
    mgr = connect(seg.name)
    mgr._link._req = 2**64 - 2
    mgr.take_events()  # request id 2**64 - 1, the last one
    with pytest.raises(CounterLimitError, match="connect again"):
        mgr.take_events()
    mgr.shutdown()  # its goodbye has no id left either: the owner reclaims the slot
    wait_for(lambda: slots.record(seg, mgr.slot).state == L.SlotState.FREE,
             "the owner to reclaim the slot")
