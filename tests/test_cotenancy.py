"""What a client of a shared segment can and cannot do to the others, tried with real
processes: whatever it does to what it owns or creates (its slot, its rings, its doorbell, the
files under its objects' names), the owner keeps serving everyone else, and counts or
quarantines it, never dies of it (``docs/cotenancy.md``).

Honest clients make a fixed number of calls that must all succeed; no timing thresholds.
"""
from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from kvshm.client.connect import connect
from kvshm.errors import ClientQuarantinedError
from kvshm.shm import layout as L
from kvshm.shm import slots
from kvshm.shm.table import BlockTable

import procs
from conftest import stop_owner
from procs import stopped
from test_shared import wait_for

CTX = mp.get_context("spawn")
HONEST_OPS = 40


def _honest_ops(mgr, n: int = HONEST_OPS) -> int:
    """``n`` store-then-lookup rounds of fresh keys; how many were served in full."""
    done = 0
    for i in range(n):
        keys = [b"honest-%d-%d" % (i, j) for j in range(2)]
        stored = procs.store(mgr, keys)
        done += stored == keys and mgr.lookup(keys) == 2
    return done


@pytest.mark.parametrize("how", ["truncate", "fifo"])
def test_a_client_spoiling_its_doorbell_takes_no_owner_down(seg, how):
    # A glibc semaphore is a file its users map unchecked: truncated, it was SIGBUS for every
    # owner that rang it; a FIFO in its place made every owner's start fail. Doorbells are
    # words of the segment now: nothing a client can truncate or replace.
    honest = connect(seg.name)
    parent, child = CTX.Pipe()
    bad = CTX.Process(target=procs.spoil_reply_bell, args=(seg.name, child, how, 20),
                      daemon=True)
    bad.start()
    child.close()
    try:
        assert parent.recv() == "spoiled"
        epoch = seg.owner_record().epoch
        stop_owner(seg.owner_record()[0])  # every owner from here on meets what it spoiled
        parent.send("go")  # its calls and ours at once
        assert _honest_ops(honest) == HONEST_OPS
        assert seg.owner_record().epoch == epoch + 1  # the successor we made, and no other
        assert parent.recv() == {"served": 20, "errors": []}  # nor did it hurt itself
        parent.send("stop")
    finally:
        bad.join(30)
        honest.shutdown()


def test_a_client_leaving_its_ring_positions_at_the_end_of_their_range_is_quarantined(seg):
    # Ring positions are u64 words its client writes: an owner that trusted them stored a
    # position past 2**64 - 1 (ValueError) and died, and so did every successor.
    honest = connect(seg.name)
    parent, child = CTX.Pipe()
    bad = CTX.Process(target=procs.scribble_ring_positions, args=(seg.name, child),
                      daemon=True)
    bad.start()
    child.close()
    try:
        parent.recv()  # its slot: connected
        epoch = seg.owner_record().epoch
        stop_owner(seg.owner_record()[0])  # the next owner adopts the ring as it is left
        parent.send("scribble")
        assert parent.recv() == "scribbled"
        assert _honest_ops(honest) == HONEST_OPS
        assert seg.owner_record().epoch == epoch + 1  # the successor we made, and no other
        parent.send("call")
        assert parent.recv() == "ClientQuarantinedError"
        parent.send("stop")
    finally:
        bad.join(30)
        honest.shutdown()


@pytest.mark.parametrize("word", ["newcomer", "head"])
def test_a_client_holding_a_word_raised_never_wakes_the_owner_for_nothing(seg, word):
    # A newcomer flag at 1, or a request ring head that differs from its tail, told the
    # owner that something waited: it woke, found nothing, and looked again at once, a busy
    # loop for as long as the client kept the word raised.
    honest = connect(seg.name)
    parent, child = CTX.Pipe()
    bad = CTX.Process(target=procs.hold_word_raised, args=(seg.name, child, word), daemon=True)
    bad.start()
    child.close()
    try:
        assert parent.recv() == "connected"
        before = seg.counter("idle_wakeups")
        parent.send("go")
        assert _honest_ops(honest) == HONEST_OPS  # while it holds the word raised
        parent.send("stop")
        assert parent.recv() > 0
        assert seg.counter("idle_wakeups") == before
    finally:
        bad.join(30)
        honest.shutdown()


@contextlib.contextmanager
def a_client_dead_in_a_slot_it_marked_free(seg, honest) -> Iterator[tuple[int, int]]:
    """A client that left FREE in its slot's state, killed while the owner is frozen (so the
    owner still serves it there): yields its slot and the frozen owner's pid, and thaws the
    owner on the way out."""
    parent, child = CTX.Pipe()
    bad = CTX.Process(target=procs.scribble_slot_state,
                      args=(seg.name, child, L.SlotState.FREE), daemon=True)
    bad.start()
    child.close()
    owner = seg.owner_record()[0]
    try:
        slot = parent.recv()["slot"]
        procs.store(honest, [b"before-0"])  # the owner has served the bad client by now
        os.kill(owner, signal.SIGSTOP)  # it notices nothing from here on
        os.kill(bad.pid, signal.SIGKILL)
        bad.join(30)
        yield slot, owner
    finally:
        os.kill(owner, signal.SIGCONT)
        if bad.is_alive():
            bad.kill()


def test_a_client_that_marks_its_slot_free_and_dies_costs_its_slots_next_client_nothing(seg):
    # A client that left FREE in its slot's state lets the next client claim the slot the
    # moment it dies, before the owner noticed the death: the newcomer activates the slot
    # (fresh rings, a cleared served record) while the owner still serves the dead client
    # there. The owner read the newcomer's fresh ring at the dead client's positions, found
    # it "corrupt" and quarantined the newcomer, which could never be served. A slot is now
    # claimed only once no owner serves it (its served lock).
    honest = connect(seg.name)
    newcomer = None
    try:
        with a_client_dead_in_a_slot_it_marked_free(seg, honest) as (_, owner):
            told, tell = CTX.Pipe()
            newcomer = CTX.Process(target=procs.connect_and_store,
                                   args=(seg.name, tell, 10), daemon=True)
            newcomer.start()
            tell.close()
            wait_for(lambda: any(slots.record(seg, s).pid == newcomer.pid
                                 for s in range(seg.geometry.max_clients)),
                     "the newcomer to take a slot (the dead client's is the first FREE one)")
            os.kill(owner, signal.SIGCONT)
            got = told.recv()
        assert got.get("error") is None and got.get("done") == 10, got
        assert _honest_ops(honest) == HONEST_OPS
    finally:
        if newcomer is not None and newcomer.is_alive():
            newcomer.kill()
        honest.shutdown()


def test_a_job_channel_never_takes_a_slot_the_owner_still_serves(seg):
    # The same race with a scheduler's job channel as the newcomer: it took the dead
    # client's slot, and the owner, still serving the dead client there, read the channel's
    # fresh rings as that client's and quarantined the slot (an error counted for nothing).
    from kvshm.engine.channel import SchedulerChannel
    honest = connect(seg.name)
    chan = None
    try:
        errors, reclaimed = seg.counter("errors"), seg.counter("reclaimed_clients")
        with a_client_dead_in_a_slot_it_marked_free(seg, honest) as (slot, owner):
            chan = SchedulerChannel(seg.name)
            os.kill(owner, signal.SIGCONT)
            wait_for(lambda: seg.counter("reclaimed_clients") > reclaimed,
                     "the owner to reclaim the dead client")
        assert _honest_ops(honest) == HONEST_OPS
        assert (chan.slot == slot, seg.counter("errors")) == (False, errors)
    finally:
        if chan is not None:
            chan.close()
        honest.shutdown()


@pytest.mark.parametrize("newcomer", ["client", "channel"])
def test_a_newcomer_looking_past_a_dead_clients_slot_is_never_taken_for_a_scribbler(
        seg, newcomer):
    # A newcomer looking for a FREE slot locked each slot in turn to read it, a dead
    # client's too. An owner that looked at that moment saw a live holder whose record names
    # a generation nobody holds (a client that rewrote its record), counted an error, marked
    # the slot quarantined and left the dead client's slot unreclaimed. A newcomer locks
    # FREE slots only.
    code = ("import sys; from kvshm.shm.segment import Segment; from kvshm.shm import slots\n"
            "s = Segment.attach(sys.argv[1]); slot, gen = slots.claim(s)\n")
    dead = subprocess.run([sys.executable, "-c", code + "slots.activate(s, slot, gen)\n"
                           "print(slot)", seg.name], capture_output=True, text=True, check=True)
    dead_slot = int(dead.stdout)  # activated, never adopted (no owner ran), its holder gone
    env = dict(os.environ, KVSHM_CRASH_AT="client.slot.after_lock", KVSHM_CRASH_SIGNAL="STOP")
    take = code + "print(slot)" if newcomer == "client" else (  # a scheduler's job channel
        "import sys; from kvshm.engine.channel import SchedulerChannel\n"
        "print(SchedulerChannel(sys.argv[1]).slot)")
    newcomer = subprocess.Popen([sys.executable, "-c", take, seg.name],
                                env=env, stdout=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: stopped(newcomer.pid), "the newcomer to stop with a slot locked")
        parent, child = CTX.Pipe()
        owner = CTX.Process(target=procs.take_over_and_report, args=(seg.name, child))
        owner.start()
        child.close()
        got = parent.recv()
        owner.join(30)
        assert got["errors"] == 0 and dead_slot in got["free"], got
        assert slots.served(seg, dead_slot)["quarantined"] == 0
    finally:
        newcomer.send_signal(signal.SIGCONT)
        out, _ = newcomer.communicate(timeout=30)
    assert newcomer.returncode == 0 and out.strip().isdigit()


_FORGED_PARTS = """
import sys
from kvshm.client.connect import connect
from kvshm.errors import KvshmError
from kvshm.index import protocol as P
mgr = connect(sys.argv[1], timeout=2.0)
try:  # the last part of a request whose first never came: the owner asks for it again
    mgr._link.call([P.PrepareStore(mgr._link.next_req(), [b"forged-0"], False, 5)])
except KvshmError as e:
    print(type(e).__name__)
mgr.shutdown()
"""


def test_a_call_the_owner_always_asks_to_resend_ends_at_its_timeout(seg):
    # The owner answers Retry to a request whose first parts it never saw (they died with
    # an owner), and the client resends it under a new id, the deadline never checked: a
    # client that forged such parts spun for good, the owner answering it all along.
    out = subprocess.run([sys.executable, "-c", _FORGED_PARTS, seg.name], timeout=120,
                         capture_output=True, text=True)
    assert out.stdout.split() == ["ReplyTimeoutError"], out.stderr


@pytest.mark.parametrize("state", [0xFFFFFFFF, 7, 1])
def test_a_dead_clients_slot_comes_back_whatever_state_it_left_in_it(seg, state):
    # The slot state is a word its client writes: a client that left garbage there and died
    # while no owner ran kept its slot (and its unfinished stores) for as long as the
    # segment lived, since the next owner reclaimed only slots in states it knew.
    honest = connect(seg.name)
    parent, child = CTX.Pipe()
    bad = CTX.Process(target=procs.scribble_slot_state, args=(seg.name, child, state),
                      daemon=True)
    bad.start()
    child.close()
    try:
        told = parent.recv()
        stop_owner(seg.owner_record()[0])
        os.kill(bad.pid, signal.SIGKILL)
        bad.join(30)
        honest.take_events()  # a round trip: starts the next owner, which meets the slot
        slot, table = told["slot"], BlockTable(seg.buf, seg.geometry)
        wait_for(lambda: slots.record(seg, slot).state == L.SlotState.FREE,
                 "the dead client's slot to be reclaimed")
        assert all(table.read(b).state == L.FREE for b in told["blocks"])  # and its stores
        assert _honest_ops(honest) == HONEST_OPS
    finally:
        if bad.is_alive():
            bad.kill()
        honest.shutdown()


def test_a_live_client_that_scribbles_its_slot_generation_keeps_its_stores(seg):
    # A slot's generation word is its client's to write; the kernel lock of its generation
    # is not, and says whether the stores of that generation have a living writer. The owner
    # took a new word for a death and freed the live client's unfinished stores, which it
    # then wrote into while others stored and read there.
    a = connect(seg.name)
    honest = connect(seg.name)
    parent, child = CTX.Pipe()
    other = CTX.Process(target=procs.connect_and_report, args=(seg.name, child), daemon=True)
    table = BlockTable(seg.buf, seg.geometry)
    try:
        keys = [b"scribbler-0", b"scribbler-1"]
        out = a.prepare_store(keys)
        assert all(table.read(b).state == L.WRITING for b in out.block_ids)
        rec = slots.record(seg, a.slot)
        slots._store(seg, a.slot, "gen", rec.gen + 1)
        other.start()
        child.close()
        gone = parent.recv()["slot"]
        os.kill(other.pid, signal.SIGKILL)  # a death the owner must tell apart from a's word
        other.join(30)
        wait_for(lambda: slots.record(seg, gone).state == L.SlotState.FREE,
                 "the dead client's slot to be reclaimed")
        assert all(table.read(b).state == L.WRITING for b in out.block_ids)
        procs.fill_all(a.segment.planes(), out.block_ids, out.keys_to_store)
        a.complete_store(out.keys_to_store)
        assert honest.lookup(keys) == 2
        blocks = honest.prepare_load(keys)
        assert all(procs.check(honest.segment.planes(), b, k) for b, k in zip(blocks, keys))
        honest.complete_load(keys)
    finally:
        if other.is_alive():
            other.kill()
        table.close()
        honest.shutdown()
        slots._store(seg, a.slot, "gen", rec.gen)
        a.shutdown()


def test_a_live_client_that_scribbles_its_slot_generation_keeps_its_stores_at_a_takeover(seg):
    # The same while no owner runs: the next owner finds a live client whose record shows
    # another generation than its unfinished stores. Their generation's lock is held: they
    # are kept (never handed to anyone) until it goes. The owner serves no client under a
    # word whose generation nobody holds: it tells it so (quarantined), so that its calls
    # fail at once instead of waiting out their timeout.
    a = connect(seg.name, timeout=5.0)
    honest = connect(seg.name)
    table = BlockTable(seg.buf, seg.geometry)
    try:
        out = a.prepare_store([b"scribbler-0", b"scribbler-1"])
        stop_owner(seg.owner_record()[0])
        slots._store(seg, a.slot, "gen", slots.record(seg, a.slot).gen + 1)
        honest.take_events()  # a round trip: starts the next owner, which meets the slot
        assert all(table.read(b).state == L.WRITING for b in out.block_ids)
        assert _honest_ops(honest) == HONEST_OPS  # the cache turns over around them
        assert all(table.read(b).state == L.WRITING for b in out.block_ids)
        with pytest.raises(ClientQuarantinedError, match="quarantined"):
            a.take_events()
        a.shutdown()
        wait_for(lambda: all(table.read(b).state == L.FREE for b in out.block_ids),
                 "its stores to come back once it went")
    finally:
        table.close()
        honest.shutdown()
        a.shutdown()
