"""Late writers: a process still copying for a dead scheduler never writes into reused blocks.

The test process is another client of the cache (and watches the segment). A spawned
scheduler process (SharedManager + SchedulerConnector + SchedulerChannel) sends store jobs to
a spawned worker process (WorkerChannel + WorkerConnector + CPU handler). The worker is frozen
half-way through a store by the ``worker.store.mid_copy`` crash point with SIGSTOP; then the
scheduler is SIGKILLed. While the worker lives, the dead scheduler's WRITING blocks must not
be handed to anyone (they are quarantined, across an owner failover too); its queued jobs
must be refused; once the worker is gone, the blocks come back. Contents are checksummed per
key (``procs.fill``/``check``): no READY block may hold another key's bytes.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time

import pytest
from lazy import torch  # imported at its first use, not when the suite is collected

import procs
from test_shared import spawn
from torch_children import CTX  # the scheduler and the worker use torch
from kvshm.shm import layout as L
from kvshm.shm import slots
from kvshm.shm import locks, writers
from kvshm.engine.channel import SchedulerChannel, WorkerChannel
from kvshm.client.connect import connect
from kvshm.engine.connector import SchedulerConnector
from kvshm.engine.hashing import block_hashes, offload_key
from kvshm.shm.segment import Segment
from kvshm.shm.table import BlockTable
from kvshm.transfer.factory import make_handler
from kvshm.engine.worker import WorkerConnector

from conftest import SMALL_GEOMETRY
from test_connector import BT, PAGE, layout, prompt

NUM_BLOCKS = 12
JOB_BLOCKS = 4


# --- child processes ---------------------------------------------------------------------
def _scheduler(name: str, conn, dev: list) -> None:
    """Scheduler: one store job of JOB_BLOCKS blocks per "store" command, then report."""
    mgr = connect(name)
    sched = SchedulerConnector(mgr, device_block_tokens=BT)
    chan = SchedulerChannel(name)
    conn.send(chan.address)
    chan.wait_worker(timeout=120)
    n = 0
    while conn.recv() == "store":  # the test SIGKILLs us while we wait here
        req, toks = f"r{n}", prompt(500 + n, JOB_BLOCKS * BT)
        blocks = list(range(n * JOB_BLOCKS, (n + 1) * JOB_BLOCKS))
        hashes = block_hashes(toks, BT)
        sched.get_num_new_matched_tokens(req, hashes, 0)
        sched.update_state_after_alloc(req, blocks, 0)
        keys = [offload_key(h) for h in hashes]
        planes = [d.numpy() for d in dev]
        for b, k in zip(blocks, keys):  # device KV = the key's checksummed content
            procs.fill(planes, b, k)
        jobs = sched.build_jobs({req: (JOB_BLOCKS * BT, blocks)})
        chan.send(jobs.stores)
        conn.send({"slot": mgr.slot, "gen": mgr.gen, "keys": keys,
                   "blocks": list(jobs.stores[0].spec.segment_block_ids)})
        n += 1


def _worker(name: str, conn, address: tuple, dev: list) -> None:
    """Worker: serve the channel until its scheduler is gone, then say so."""
    # A group of its own: when the test's process group counts as orphaned, a dying member
    # makes the kernel SIGCONT the group's stopped members, and this one must stay frozen.
    os.setsid()
    wc = WorkerChannel(*address)
    handler = make_handler(dev, wc.segment.torch_planes())
    WorkerConnector(handler).serve(wc)
    handler.shutdown()
    wc.close()
    conn.send("exited")
    conn.recv()


# --- helpers -----------------------------------------------------------------------------
def wait_for(cond, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)  # polling a state; the assertion is on the state


def table(seg: Segment) -> list:
    t = BlockTable(seg.buf, seg.geometry)
    out = [t.read(b) for b in range(seg.geometry.num_blocks)]
    t.close()
    return out


def wrong_ready_blocks(seg: Segment) -> list[int]:
    """READY blocks whose bytes are not their own key's."""
    planes = seg.planes()
    return [b for b, e in enumerate(table(seg))
            if e.state == L.READY and not procs.check(planes, b, e.key)]


class Rig:
    """This process as a client, a scheduler process and its worker frozen mid-store."""

    def __init__(self, name: str):
        self.name = name
        self.client = connect(name, layout(1), num_blocks=NUM_BLOCKS, **SMALL_GEOMETRY)
        self.seg = self.client.segment
        self.dev = [torch.zeros(NUM_BLOCKS, PAGE, dtype=torch.uint8).share_memory_()
                    for _ in range(2)]
        self.sched, self.sched_pipe = spawn(_scheduler, name, self.dev, ctx=CTX)
        address = self.sched_pipe.recv()
        self.worker, self.worker_pipe = spawn(
            _worker, name, address, self.dev,
            env={"KVSHM_CRASH_AT": "worker.store.mid_copy", "KVSHM_CRASH_SIGNAL": "STOP"}, ctx=CTX)

    def store_job(self) -> dict:
        self.sched_pipe.send("store")
        return self.sched_pipe.recv()

    def freeze_worker_mid_store(self) -> dict:
        job = self.store_job()
        wait_for(lambda: procs.stopped(self.worker.pid), "the worker to freeze mid-copy")
        return job

    def kill_scheduler(self, slot: int) -> None:
        self.sched.kill()
        self.sched.join()
        wait_for(lambda: slots.record(self.seg, slot).state == L.SlotState.FREE,
                 "the owner to reclaim the dead scheduler's slot")

    def resume_worker(self) -> None:
        """Let the worker run until it exits (re-continued if it freezes again)."""
        deadline = time.monotonic() + 60
        while not self.worker_pipe.poll(0.01):
            assert time.monotonic() < deadline, "the worker never exited"
            if procs.stopped(self.worker.pid):
                os.kill(self.worker.pid, signal.SIGCONT)
        assert self.worker_pipe.recv() == "exited"
        self.worker_pipe.send("bye")
        self.worker.join(30)

    def blocks_in(self, state: int) -> set[int]:
        return {b for b, e in enumerate(table(self.seg)) if e.state == state}

    def close(self) -> None:
        for p in (self.sched, self.worker):
            if p.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
                    os.kill(p.pid, signal.SIGCONT)
                p.join()
        owner = self.seg.owner_record()[0]
        self.client.shutdown()
        with contextlib.suppress(ProcessLookupError):
            if owner:
                os.kill(owner, signal.SIGKILL)


@pytest.fixture
def rig(seg_name):
    r = Rig(seg_name)
    yield r
    r.close()


def store_keys(mgr, keys: list[bytes]) -> list[int]:
    """Store ``keys`` (checksummed), return the blocks they got."""
    out = mgr.prepare_store(keys)
    assert out is not None
    planes = mgr.segment.planes()
    for k, b in zip(out.keys_to_store, out.block_ids):
        procs.fill(planes, b, k)
    mgr.complete_store(out.keys_to_store)
    return list(out.block_ids)


# --- tests -------------------------------------------------------------------------------
def test_a_dead_schedulers_blocks_are_not_reused_while_its_worker_still_copies(rig):
    job = rig.freeze_worker_mid_store()
    rig.kill_scheduler(job["slot"])
    assert set(job["blocks"]) <= rig.blocks_in(L.WRITING)  # quarantined, not freed
    granted = []
    for i in range(3):  # more than the free blocks: the rest evicts our own stores
        granted += store_keys(rig.client, [b"other-%d-%d" % (i, j) for j in range(4)])
    assert not set(granted) & set(job["blocks"])
    rig.resume_worker()
    assert wrong_ready_blocks(rig.seg) == []
    # The worker is gone: the quarantined blocks come back, nothing leaks.
    wait_for(lambda: not rig.blocks_in(L.WRITING), "the quarantined blocks to be freed")
    assert rig.seg.counters()["quarantined_blocks"] == JOB_BLOCKS
    assert len(store_keys(rig.client, [b"after-%d" % i for i in range(NUM_BLOCKS)])) \
        == NUM_BLOCKS
    assert wrong_ready_blocks(rig.seg) == []


def test_a_dead_schedulers_queued_jobs_are_refused_by_its_worker(rig):
    first = rig.freeze_worker_mid_store()
    queued = rig.store_job()  # sits in the channel while the worker is frozen
    rig.kill_scheduler(first["slot"])
    rig.resume_worker()
    planes = rig.seg.planes()
    copied = [b for b, k in zip(queued["blocks"], queued["keys"]) if procs.check(planes, b, k)]
    assert copied == []
    wait_for(lambda: not rig.blocks_in(L.WRITING), "the quarantined blocks to be freed")
    assert rig.blocks_in(L.FREE) == set(range(NUM_BLOCKS))


def test_an_owner_failover_keeps_quarantined_blocks_quarantined(rig):
    job = rig.freeze_worker_mid_store()
    rig.kill_scheduler(job["slot"])
    owner = rig.seg.owner_record()[0]
    os.kill(owner, signal.SIGKILL)
    wait_for(lambda: not rig.seg.owner_alive(), "the owner to die")
    granted = []
    for i in range(3):  # the first one starts a new owner, which rebuilds the index
        granted += store_keys(rig.client, [b"other-%d-%d" % (i, j) for j in range(4)])
    assert rig.seg.owner_record()[0] != owner
    assert not set(granted) & set(job["blocks"])
    assert set(job["blocks"]) <= rig.blocks_in(L.WRITING)
    rig.resume_worker()
    assert wrong_ready_blocks(rig.seg) == []
    wait_for(lambda: not rig.blocks_in(L.WRITING), "the new owner to free the blocks")


def test_a_killed_worker_releases_the_quarantined_blocks(rig):
    job = rig.freeze_worker_mid_store()
    rig.kill_scheduler(job["slot"])
    assert set(job["blocks"]) <= rig.blocks_in(L.WRITING)
    rig.worker.kill()  # its registration goes with its kernel lock
    rig.worker.join()
    wait_for(lambda: not rig.blocks_in(L.WRITING), "the quarantined blocks to be freed")


def test_quarantined_blocks_come_back_when_the_worker_dies_though_a_newcomer_took_the_slot(
        rig):
    # A slot's kernel lock alone says whether its client lives (its generation word is the
    # client's to write): the dead scheduler's quarantined stores must not wait for the
    # next client of its slot to go as well.
    job = rig.freeze_worker_mid_store()
    rig.kill_scheduler(job["slot"])
    newcomer = connect(rig.name)
    try:
        assert newcomer.slot == job["slot"]  # the first FREE slot: the dead scheduler's
        assert set(job["blocks"]) <= rig.blocks_in(L.WRITING)
        rig.worker.kill()
        rig.worker.join()
        wait_for(lambda: not rig.blocks_in(L.WRITING), "the quarantined blocks to be freed")
    finally:
        newcomer.shutdown()


def test_quarantined_blocks_come_back_when_the_worker_dies_though_a_newcomer_took_the_slot_and_an_owner_took_over(rig):  # noqa: E501
    # A successor owner knows a dead generation from the slot's next one by their own
    # kernel locks: the dead scheduler's quarantined stores must not wait for the newcomer.
    job = rig.freeze_worker_mid_store()
    rig.kill_scheduler(job["slot"])
    newcomer = connect(rig.name)
    try:
        assert newcomer.slot == job["slot"]
        owner = rig.seg.owner_record()[0]
        os.kill(owner, signal.SIGKILL)
        wait_for(lambda: not rig.seg.owner_alive(), "the owner to die")
        newcomer.take_events()  # a successor takes over
        assert set(job["blocks"]) <= rig.blocks_in(L.WRITING)  # the worker still copies
        rig.worker.kill()
        rig.worker.join()
        wait_for(lambda: not rig.blocks_in(L.WRITING), "the quarantined blocks to be freed")
    finally:
        newcomer.shutdown()


# --- the registry on its own -------------------------------------------------------------
def test_a_registration_is_alive_only_for_its_generation_and_while_its_lock_is_held(
        make_segment):
    seg = make_segment()
    other = Segment.attach(seg.name)  # a second open file description: another "process"
    try:
        reg = writers.Registrations(other)
        assert not writers.alive(seg, 3, 7)
        assert reg.register(3, 7)
        assert writers.alive(seg, 3, 7)
        assert not writers.alive(seg, 3, 8) and not writers.alive(seg, 4, 7)
        assert reg.register(3, 8)  # the slot's next client: a record of its own
        reg.unregister(3, 7)
        assert not writers.alive(seg, 3, 7) and writers.alive(seg, 3, 8)
        reg.close()
        assert not writers.alive(seg, 3, 8)
    finally:
        other.close()


def test_a_generation_lives_exactly_while_its_client_holds_its_lock(seg_name):
    from conftest import stop_owner
    m = connect(seg_name, layout(1), num_blocks=NUM_BLOCKS, **SMALL_GEOMETRY)
    seg = Segment.attach(seg_name)  # another open file description: another "process"
    try:
        slot, gen = m.slot, m.gen
        assert slots.generation_held(seg, slot, gen)
        slots._store(seg, slot, "gen", gen + 1)  # its word is the client's to write
        assert slots.generation_held(seg, slot, gen)
        assert not slots.generation_held(seg, slot, gen + 1)
        slots._store(seg, slot, "gen", gen)
        m.shutdown()
        assert not slots.generation_held(seg, slot, gen)
        wait_for(lambda: slots.record(seg, slot).state == L.SlotState.FREE, "its slot back")
        nxt = connect(seg_name)  # the first FREE slot: its
        try:
            assert nxt.slot == slot and nxt.gen != gen
            assert slots.generation_held(seg, slot, nxt.gen)
            assert not slots.generation_held(seg, slot, gen)  # the slot's, not the generation's
        finally:
            nxt.shutdown()
    finally:
        m.shutdown()
        stop_owner(seg.owner_record()[0])
        seg.close()


def test_a_copier_sees_a_generation_dead_once_its_lock_falls_though_its_slot_is_held(
        seg_name):
    # A client lets go of its generation's lock first, then of its slot's (a shutdown whose
    # goodbye went unanswered). In between, an owner sees the generation dead and frees its
    # stores without a copier registered: a copier must not be admitted for it then.
    from conftest import stop_owner
    m = connect(seg_name, layout(1), num_blocks=NUM_BLOCKS, **SMALL_GEOMETRY)
    seg = Segment.attach(seg_name)
    reg = writers.Registrations(seg)
    try:
        assert reg.admit(m.slot, m.gen)
        reg.unregister(m.slot, m.gen)
        locks.unlock(m.segment.fd, slots.gen_lock(m.slot, m.gen))  # the first of the two
        assert locks.is_held(seg.fd, L.LOCK_CLIENT_BASE + m.slot)
        assert not writers.generation_alive(seg, m.slot, m.gen)
        assert not reg.admit(m.slot, m.gen)
    finally:
        reg.close()
        m.shutdown()
        stop_owner(seg.owner_record()[0])
        seg.close()


def test_writer_lock_bytes_overlap_no_client_or_channel_lock():
    from kvshm.engine.channel import WORKER_LOCK_BASE
    last_client_byte = max(L.LOCK_CLIENT_BASE, WORKER_LOCK_BASE) + 1024
    assert L.LOCK_WRITER_BASE >= last_client_byte
    assert L.LOCK_GEN_BASE >= L.LOCK_SERVED_BASE + 1024  # past every per-slot byte


# --- kvshm-inspect gc: a temporary owner honours the registry as an owner does -------------
_GC_SCHED = """
import sys
from kvshm.client.connect import connect
m = connect(sys.argv[1])
out = m.prepare_store([b"victim-%d" % i for i in range(4)])  # a round trip: WRITING
print(m.slot, m.gen, *out.block_ids, flush=True)
sys.stdin.read()
"""

_GC_COPIER = """
import sys
import numpy as np
from kvshm.shm import writers
from kvshm.shm.segment import Segment
seg = Segment.attach(sys.argv[1])
print(int(writers.Registrations(seg).admit(int(sys.argv[2]), int(sys.argv[3]))), flush=True)
sys.stdin.readline()  # still copying for the scheduler: the late copy lands when told
for b in map(int, sys.argv[4:]):
    for plane in seg.planes():
        plane[b] = 0xAB
print("copied", flush=True)
"""


def _popen(code: str, *args: object) -> "subprocess.Popen[str]":
    import subprocess
    import sys
    return subprocess.Popen([sys.executable, "-c", code, *map(str, args)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_gc_keeps_the_stores_a_live_copier_may_still_write(seg_name):
    """The owner and the scheduler die, the scheduler's copier lives on, an operator runs
    gc: the blocks it may still write into are kept, so its late copy lands in no key that
    the next owner handed out."""
    from kvshm.inspect.cleanup import reclaim
    from conftest import TEST_LAYOUT, stop_owner
    from test_shared import wait_for
    Segment.create(seg_name, TEST_LAYOUT, 32, max_clients=4, ring_capacity=8192).close()
    seg = Segment.attach(seg_name)
    sched = _popen(_GC_SCHED, seg_name)
    slot, gen, *blocks = map(int, sched.stdout.readline().split())
    copier = _popen(_GC_COPIER, seg_name, slot, gen, *blocks)
    m = None
    try:
        assert copier.stdout.readline().strip() == "1"  # admitted: it may copy now
        stop_owner(seg.owner_record()[0])
        wait_for(lambda: not seg.owner_alive(), "the owner to die")
        sched.kill()
        sched.wait()
        assert reclaim(seg)["acted"]
        m = connect(seg_name)  # a new engine and owner fill the cache
        stored = procs.store(m, [b"innocent-%d" % i for i in range(24)])
        copier.stdin.write("go\n")
        copier.stdin.flush()
        assert copier.stdout.readline().strip() == "copied"
        hits = m.lookup(stored)
        got = m.prepare_load(stored[:hits])
        assert all(procs.check(m.segment.planes(), b, k) for b, k in zip(got, stored))
        m.complete_load(stored[:hits])
    finally:
        for p in (sched, copier):
            p.kill()
            p.wait()
        if m is not None:
            pid = m.segment.owner_record()[0]
            m.shutdown()
            stop_owner(pid)
        seg.close()


# --- kvshm-inspect verify: a quarantine is no leak ----------------------------------------
def test_verify_reports_no_leak_while_a_live_copier_keeps_a_dead_schedulers_store(seg_name):
    """The scheduler dies mid-store, its copier lives on: the owner keeps the store's blocks
    WRITING on purpose (quarantined), and kvshm-inspect verify must not call them leaked."""
    import subprocess
    import sys
    from pathlib import Path
    from conftest import TEST_LAYOUT, stop_owner
    Segment.create(seg_name, TEST_LAYOUT, 32, max_clients=4, ring_capacity=8192).close()
    seg = Segment.attach(seg_name)
    sched = _popen(_GC_SCHED, seg_name)
    slot, gen, *blocks = map(int, sched.stdout.readline().split())
    copier = _popen(_GC_COPIER, seg_name, slot, gen, *blocks)
    try:
        assert copier.stdout.readline().strip() == "1"  # registered under (slot, gen)
        sched.kill()
        sched.wait()
        wait_for(lambda: slots.record(seg, slot).state == L.SlotState.FREE,
                 "the owner to reclaim the dead scheduler's slot")
        assert all(table(seg)[b].state == L.WRITING for b in blocks)  # quarantined
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        p = subprocess.run([sys.executable, "-m", "kvshm.inspect.cli", "verify", seg_name],
                           capture_output=True, text=True, timeout=60, env=env)
        assert (p.returncode, p.stdout, p.stderr) == (0, f"{seg_name}: ok, no violations\n", ""), \
            p.stdout
        assert copier.poll() is None
        assert all(table(seg)[b].state == L.WRITING for b in blocks)  # still quarantined
    finally:
        for p in (sched, copier):
            p.kill()
            p.wait()
        stop_owner(seg.owner_record()[0])
        seg.close()
