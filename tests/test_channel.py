"""The job channel with a real worker process: jobs, flushes, completions, and deaths.

The test process is the engine's scheduler (SharedManager + SchedulerConnector +
SchedulerChannel) and writes the "device" KV; a spawned process is its worker (WorkerChannel +
WorkerConnector + CPU handler) and copies between the same shared device tensors and the
segment. Deaths are real SIGKILLs; a worker "mid-job" is one blocked inside its handler after
telling the test which job it holds.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time

import numpy as np
import pytest
from lazy import torch  # imported at its first use, not when the suite is collected

from kvshm.engine import channel as ch
from kvshm.shm import layout as L
from kvshm.shm import slots
from kvshm.engine.channel import SchedulerChannel, WorkerChannel
from kvshm.client.connect import connect
from kvshm.engine.connector import SchedulerConnector
from kvshm.errors import InvalidArgumentError, ProtocolError, TransferError
from kvshm.engine.hashing import block_hashes, offload_key
from kvshm.shm.segment import Segment
from kvshm.shm.table import BlockTable
from kvshm.transfer.factory import make_handler
from kvshm.transfer.spec import TransferHandler
from kvshm.engine.worker import WorkerConnector

from conftest import SMALL_GEOMETRY
from test_connector import BT, PAGE, kv, layout, prompt
from torch_children import CTX  # the workers use torch



class _Stuck(TransferHandler):
    """A handler that tells the test which job it got, then never finishes it."""

    def __init__(self, conn):
        self.conn = conn

    def transfer_async(self, job_id, spec):
        self.conn.send(("stuck", job_id, spec.kind))
        self.conn.recv()  # the test SIGKILLs us while we hold the job
        return True

    def get_finished(self):
        return []

    def wait(self, job_ids):
        pass

    def shutdown(self):
        pass


def _serve(address: tuple, dev: list, conn, stuck: bool) -> None:
    """Worker process body: serve the channel until Stop or a dead scheduler."""
    wc = WorkerChannel(*address)
    handler = _Stuck(conn) if stuck else make_handler(dev, wc.segment.torch_planes())
    WorkerConnector(handler).serve(wc)
    handler.shutdown()
    wc.close()
    conn.send("exited")


def _receive_a_job(address: tuple, conn) -> None:
    """Worker process body: report the ids of the first job it receives."""
    wc = WorkerChannel(*address)
    got: list = []
    while not got and (frames := wc.recv(timeout=1.0)) is not None:
        got = [m for m in frames if isinstance(m, ch.JobFrame)]
    conn.send((got[0].device, got[0].segment) if got else None)
    wc.close()


def _channel_and_die(name: str, conn) -> None:
    sc = SchedulerChannel(name)
    conn.send(sc.address)
    conn.recv()  # SIGKILLed here


class Engine:
    """Scheduler side of one engine, with its worker in another process."""

    def __init__(self, name: str, stuck: bool = False, device_blocks: int = 24):
        self.mgr = connect(name, layout(1), num_blocks=8, **SMALL_GEOMETRY)
        self.owner = self.mgr.segment.owner_record()[0]
        self.conn = SchedulerConnector(self.mgr, device_block_tokens=BT)
        self.chan = SchedulerChannel(name)
        self.dev = [torch.zeros(device_blocks, PAGE, dtype=torch.uint8).share_memory_()
                    for _ in range(2)]
        self.pipe, child = CTX.Pipe()
        self.proc = CTX.Process(target=_serve, args=(self.chan.address, self.dev, child,
                                                     stuck), daemon=True)
        self.proc.start()
        self.chan.wait_worker(timeout=120)

    def compute(self, toks, blocks) -> None:
        for i in range(len(toks) // BT):
            for p, d in enumerate(self.dev):
                d[blocks[i]].numpy()[:] = kv(toks[i * BT:(i + 1) * BT], i * BT, p).ravel()

    def matches(self, toks, blocks) -> bool:
        return all(np.array_equal(d[blocks[i]].numpy(),
                                  kv(toks[i * BT:(i + 1) * BT], i * BT, p).ravel())
                   for i in range(len(toks) // BT) for p, d in enumerate(self.dev))

    def admit(self, req: str, toks, blocks) -> int:
        n = self.conn.get_num_new_matched_tokens(req, block_hashes(toks, BT), 0)
        return self.conn.update_state_after_alloc(req, blocks, n)

    def finish(self, jobs):
        """Send jobs, wait for all of them over the channel, complete them."""
        self.chan.flush(jobs.flush)
        self.chan.send(jobs.loads + jobs.stores)
        done = self.chan.wait([j.job_id for j in jobs.loads + jobs.stores], timeout=60)
        return self.conn.jobs_finished(done)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.chan.stop()
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.chan.close()
        self.mgr.shutdown()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.owner, signal.SIGKILL)


@pytest.fixture
def engine(seg_name):
    made = []

    def new(**kw) -> Engine:
        made.append(Engine(seg_name, **kw))
        return made[-1]

    yield new
    for e in made:
        e.close()


@pytest.fixture
def channel(seg_name):
    """A scheduler's job channel on a fresh segment no owner serves."""
    Segment.create(seg_name, layout(1), 8, **SMALL_GEOMETRY).close()
    sc = SchedulerChannel(seg_name)
    yield sc
    sc.close()


def _stuck_worker(sc: SchedulerChannel):
    """A worker process on ``sc`` that takes its first job and never finishes it; it says
    which job on the returned pipe."""
    parent, child = CTX.Pipe()
    dev = [torch.zeros(4, PAGE, dtype=torch.uint8).share_memory_()]
    p = CTX.Process(target=_serve, args=(sc.address, dev, child, True), daemon=True)
    p.start()
    return p, parent


def _shut_down_with_owner(mgr) -> None:
    """Shut ``mgr`` down, and the owner it started."""
    owner = mgr.segment.owner_record()[0]
    mgr.shutdown()
    with contextlib.suppress(ProcessLookupError):
        os.kill(owner, signal.SIGKILL)


def states(seg) -> list[int]:
    t = BlockTable(seg.buf, seg.geometry)
    out = [t.read(b).state for b in range(seg.geometry.num_blocks)]
    t.close()
    return out


def test_jobs_run_in_the_worker_process_and_loads_verify(engine, monkeypatch):
    e = engine()
    toks = prompt(30, 5 * BT)
    assert e.admit("a", toks, [0, 1, 2, 3, 4]) == 0
    e.compute(toks, [0, 1, 2, 3, 4])
    done = e.finish(e.conn.build_jobs({"a": (5 * BT, [0, 1, 2, 3, 4])}))
    assert [(d.kind, d.success) for d in done.done] == [("store", True)]
    assert e.mgr.lookup([offload_key(h) for h in block_hashes(toks, BT)]) == 5
    monkeypatch.setattr(ch, "MAX_IDS_PER_FRAME", 2)  # the load travels as 3 frames
    blocks = [10, 12, 14, 16, 18]
    assert e.admit("b", toks, blocks) == 5 * BT
    done = e.finish(e.conn.build_jobs({}))
    assert [(d.kind, d.success) for d in done.done] == [("load", True)]
    assert e.matches(toks, blocks)


def test_flush_over_the_channel_orders_the_store_before_block_reuse(engine):
    e = engine()
    toks = prompt(31, 6 * BT)
    blocks = list(range(6))
    e.admit("a", toks, blocks)
    e.compute(toks, blocks)
    jobs = e.conn.build_jobs({"a": (6 * BT, blocks)})
    e.chan.send(jobs.stores)
    nxt = e.conn.build_jobs({}, preempted=["a"])
    assert nxt.flush == {jobs.stores[0].job_id}
    e.chan.flush(nxt.flush)
    done = e.chan.wait(nxt.flush, timeout=60)  # the engine waits before reusing the blocks
    for d in e.dev:
        d[blocks] = 0x5A
    assert [d.success for d in e.conn.jobs_finished(done).done] == [True]
    other = list(range(10, 16))
    e.admit("b", toks, other)
    e.finish(e.conn.build_jobs({}))
    assert e.matches(toks, other)


def test_worker_killed_mid_job_fails_the_job_and_frees_its_blocks(engine):
    e = engine(stuck=True)
    toks = prompt(32, 4 * BT)
    e.admit("a", toks, [0, 1, 2, 3])
    jobs = e.conn.build_jobs({"a": (4 * BT, [0, 1, 2, 3])})
    writing = jobs.stores[0].spec.segment_block_ids
    assert [states(e.mgr.segment)[b] for b in writing] == [L.WRITING] * 4
    e.chan.send(jobs.stores)
    assert e.pipe.recv() == ("stuck", jobs.stores[0].job_id, "store")
    e.proc.kill()
    e.proc.join()
    done = e.conn.jobs_finished(e.chan.wait([jobs.stores[0].job_id], timeout=60))
    assert [(d.kind, d.success) for d in done.done] == [("store", False)]
    assert states(e.mgr.segment) == [L.FREE] * 8
    assert e.conn.request_finished("a") is False
    # Later jobs on the dead channel fail at once instead of hanging.
    e.admit("b", toks, [4, 5, 6, 7])
    later = e.conn.build_jobs({"b": (4 * BT, [4, 5, 6, 7])})
    e.chan.send(later.stores)
    assert [d.success for d in e.chan.poll()] == [False]
    e.conn.jobs_finished([(later.stores[0].job_id, False)])
    assert e.mgr.prepare_store([b"k%d" % i for i in range(8)]).evicted_keys == []


def test_worker_killed_mid_load_releases_the_pins(engine, seg_name):
    e = engine(stuck=True)
    toks = prompt(33, 8 * BT)
    keys = [offload_key(h) for h in block_hashes(toks, BT)]
    out = e.mgr.prepare_store(keys)
    e.mgr.complete_store(out.keys_to_store)
    assert e.admit("a", toks, list(range(8))) == 8 * BT
    jobs = e.conn.build_jobs({})
    e.chan.send(jobs.loads)
    assert e.pipe.recv()[0] == "stuck"
    assert e.mgr.prepare_store([b"new"]) is None  # all 8 blocks pinned by the load
    e.proc.kill()
    e.proc.join()
    done = e.conn.jobs_finished(e.chan.wait([jobs.loads[0].job_id], timeout=60))
    assert [(d.kind, d.success) for d in done.done] == [("load", False)]
    e.mgr.release()
    assert e.mgr.prepare_store([b"new"]) is not None


def test_stop_drains_and_the_worker_exits(engine):
    e = engine()
    toks = prompt(34, 2 * BT)
    e.admit("a", toks, [0, 1])
    e.compute(toks, [0, 1])
    jobs = e.conn.build_jobs({"a": (2 * BT, [0, 1])})
    e.chan.send(jobs.stores)
    e.chan.stop()
    assert e.pipe.recv() == "exited"
    done = e.chan.wait([jobs.stores[0].job_id], timeout=60)
    assert [d.success for d in done] == [True]


def test_worker_exits_when_its_scheduler_closes_the_channel(engine):
    e = engine()
    e.chan.close()
    assert e.pipe.recv() == "exited"
    e.proc.join()


def test_dead_scheduler_channel_slot_is_reclaimed_by_the_owner(seg_name):
    mgr = connect(seg_name, layout(1), num_blocks=8, **SMALL_GEOMETRY)
    try:
        parent, child = CTX.Pipe()
        p = CTX.Process(target=_channel_and_die, args=(seg_name, child), daemon=True)
        p.start()
        slot = parent.recv()[1]
        assert slots.record(mgr.segment, slot).state == L.SlotState.CHANNEL
        p.kill()
        p.join()
        deadline = time.monotonic() + 30
        while slots.record(mgr.segment, slot).state != L.SlotState.FREE:
            assert time.monotonic() < deadline, "the owner never reclaimed the channel slot"
            time.sleep(0.01)  # polling the owner's scan; the assertion is on the state
    finally:
        _shut_down_with_owner(mgr)


def test_a_worker_for_a_dead_scheduler_never_attaches_to_the_next_channel_of_its_slot(
        seg_name):
    # A channel's address named its segment and slot. A worker slow to start for a
    # scheduler that died meanwhile attached to the channel the next scheduler opened in
    # the same slot: that scheduler's store jobs were copied from the wrong engine's device
    # memory and published under its keys, and its own worker was refused.
    mgr = connect(seg_name, layout(1), num_blocks=8, **SMALL_GEOMETRY)
    nxt = None
    try:
        parent, child = CTX.Pipe()
        p = CTX.Process(target=_channel_and_die, args=(seg_name, child), daemon=True)
        p.start()
        stale = parent.recv()
        p.kill()
        p.join()
        deadline = time.monotonic() + 30
        while slots.record(mgr.segment, stale[1]).state != L.SlotState.FREE:
            assert time.monotonic() < deadline, "the owner never reclaimed the channel slot"
            time.sleep(0.01)  # polling the owner's scan; the assertion is on the state
        nxt = SchedulerChannel(seg_name)
        assert nxt.slot == stale[1]  # the first FREE slot: the dead scheduler's
        with pytest.raises(InvalidArgumentError, match="gone"):
            WorkerChannel(*stale)
        assert not nxt.worker_alive()
        w = WorkerChannel(*nxt.address)
        assert nxt.worker_alive() and w.scheduler_alive()
        w.close()
    finally:
        if nxt is not None:
            nxt.close()
        _shut_down_with_owner(mgr)


def test_a_worker_that_dies_before_its_scheduler_looked_fails_the_jobs_it_took(channel):
    # A scheduler that sent jobs without waiting for its worker saw it alive only if it
    # happened to look while it lived: one that attached, took a job and died between two
    # looks left the job outstanding for good (its store WRITING, its load pinned).
    from kvshm.engine.connector import Job
    from kvshm.transfer.spec import TransferSpec
    channel.send([Job(7, "r", TransferSpec("store", [1], [2]))])  # no worker yet: it waits
    p, told = _stuck_worker(channel)
    assert told.recv() == ("stuck", 7, "store")  # it took the job; we never looked
    p.kill()
    p.join()
    assert [(d.job_id, d.success) for d in channel.wait([7], timeout=60)] == [(7, False)]


def test_a_channel_whose_worker_died_takes_no_other_worker(channel):
    # The jobs a dead worker held, and those it never read, are failed at its death: their
    # stores freed, their loads' device blocks reused. A second worker attaching to the same
    # channel read those frames and ran them: a store copied its device memory into a block
    # another client had been granted since, and published.
    from kvshm.engine.connector import Job
    from kvshm.transfer.spec import TransferSpec
    p, told = _stuck_worker(channel)
    channel.send([Job(1, "r", TransferSpec("store", [1], [2]))])
    assert told.recv() == ("stuck", 1, "store")
    channel.send([Job(2, "r", TransferSpec("store", [2], [3]))])  # never read
    p.kill()
    p.join()
    assert sorted((d.job_id, d.success) for d in channel.wait([1, 2], timeout=60)) == [
        (1, False), (2, False)]
    with pytest.raises(InvalidArgumentError, match="had a worker"):
        WorkerChannel(*channel.address)
    assert not channel.worker_alive()


def test_waiting_for_the_worker_of_a_channel_that_lost_it_fails_at_once(channel):
    # A channel takes one worker, ever: once it was lost, waiting for one waited out the
    # whole timeout and then said none had attached.
    WorkerChannel(*channel.address).close()  # attached, then gone
    with pytest.raises(TransferError, match="lost"):
        channel.wait_worker(timeout=600)


def test_a_channel_has_one_worker_and_only_channel_slots_attach(seg_name):
    mgr = connect(seg_name, layout(1), num_blocks=8, **SMALL_GEOMETRY)
    sc = SchedulerChannel(seg_name)
    try:
        w = WorkerChannel(*sc.address)
        with pytest.raises(InvalidArgumentError, match="already has a worker"):
            WorkerChannel(*sc.address)
        with pytest.raises(InvalidArgumentError, match="not a job channel"):
            WorkerChannel(seg_name, mgr.slot, mgr.gen)
        assert sc.worker_alive() and w.scheduler_alive()
        first = sc.slot
        sc.close()
        assert not w.scheduler_alive()
        # Its worker still holds on: a new channel must not reformat the rings it writes to.
        sc = SchedulerChannel(seg_name)
        assert sc.slot != first
        w.close()
        assert not sc.worker_alive()
    finally:
        sc.close()
        _shut_down_with_owner(mgr)


def _descriptors_of(name: str) -> list[str]:
    """This process's descriptors of segment ``name`` (removed or not)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").split()[0] == f"/dev/shm/kvshm-{name}":
                out.append(fd)
    return out


def _fail_as_the_rings_open(monkeypatch) -> None:
    """The next job channel this process opens finds its slot's rings are no rings (a
    scribbled region)."""
    from kvshm.engine import channel

    def no_ring(view):
        raise ProtocolError("buffer does not hold a kvshm ring")
    monkeypatch.setattr(channel, "Ring", no_ring)


def test_a_scheduler_channel_that_fails_as_it_opens_keeps_no_descriptor(seg_name, monkeypatch):
    Segment.create(seg_name, layout(1), 8, **SMALL_GEOMETRY).close()
    _fail_as_the_rings_open(monkeypatch)
    with pytest.raises(ProtocolError):
        SchedulerChannel(seg_name)
    assert _descriptors_of(seg_name) == []


def test_a_worker_channel_that_fails_as_it_opens_keeps_no_descriptor_or_lock(
        seg_name, monkeypatch):
    Segment.create(seg_name, layout(1), 8, **SMALL_GEOMETRY).close()
    sc = SchedulerChannel(seg_name)
    try:
        before = _descriptors_of(seg_name)
        _fail_as_the_rings_open(monkeypatch)
        with pytest.raises(ProtocolError):
            WorkerChannel(*sc.address)
        assert _descriptors_of(seg_name) == before
        assert not sc.worker_alive()  # its lock went with its descriptor
    finally:
        sc.close()


def test_frames_carry_the_whole_spec_across_several_frames(seg_name, monkeypatch):
    from kvshm.engine.connector import Job
    from kvshm.transfer.spec import TransferSpec
    mgr = connect(seg_name, layout(1), num_blocks=8, **SMALL_GEOMETRY)
    sc = SchedulerChannel(seg_name)
    w = WorkerChannel(*sc.address)
    try:
        monkeypatch.setattr(ch, "MAX_IDS_PER_FRAME", 2)
        spec = TransferSpec("load", [5, 6, 7], [1, 2, 3], skip=1)
        sc.send([Job(9, "r", spec), Job(10, "r", TransferSpec("store", [1], [4]))])
        sc.flush([9])
        got = w.recv(timeout=10)
        assert [type(m).__name__ for m in got] == ["JobFrame", "JobFrame", "Flush"]
        assert got[0].to_job().spec == spec and got[1].to_job().spec.skip is None
        assert sc.outstanding() == {9: "load", 10: "store"}
    finally:
        w.close()
        sc.close()
        _shut_down_with_owner(mgr)


def test_a_flush_of_many_jobs_travels_over_the_smallest_rings(seg_name):
    from kvshm.engine.connector import Job
    from kvshm.transfer.spec import TransferSpec
    Segment.create(seg_name, layout(1), 8, ring_capacity=4096, hold_capacity=64).close()
    sc = SchedulerChannel(seg_name)
    w = WorkerChannel(*sc.address)
    try:
        ids = list(range(100_000, 100_500))
        sc._outstanding.update((j, "store") for j in ids)  # as if sent and not yet done
        sc.flush(ids)
        got: list = []
        while (frames := w.recv(timeout=1.0)):
            got += [j for m in frames if isinstance(m, ch.Flush) for j in m.job_ids]
        assert got == ids
    finally:
        w.close()
        sc.close()


def test_a_job_of_many_blocks_travels_over_the_smallest_rings(seg_name):
    # A frame carried up to 2,048 ids whatever the ring: over the smallest rings a segment
    # may have (4,096 bytes), a job of a few hundred blocks could not be sent at all.
    from kvshm.engine.connector import Job
    from kvshm.transfer.spec import TransferSpec
    Segment.create(seg_name, layout(1), 8, ring_capacity=4096, hold_capacity=64).close()
    sc = SchedulerChannel(seg_name)
    try:
        parent, child = CTX.Pipe()
        p = CTX.Process(target=_receive_a_job, args=(sc.address, child), daemon=True)
        p.start()
        sc.wait_worker(timeout=120, starting=p.is_alive)
        ids = list(range(1000, 1600))
        sc.send([Job(1, "r", TransferSpec("store", ids, ids[::-1]))])
        assert parent.recv() == (ids, ids[::-1])
        p.join(30)
    finally:
        sc.close()


@contextlib.contextmanager
def _worker(channel, target, *args):
    """A spawned process running ``target(channel.address, *args)``, the channel's worker,
    told to stop on the way out (and killed if it does not)."""
    p = CTX.Process(target=target, args=(channel.address, *args), daemon=True)
    p.start()
    try:
        channel.wait_worker(timeout=120, starting=p.is_alive)
        yield p
    finally:
        with contextlib.suppress(Exception):
            channel.stop()
        p.join(30)
        if p.is_alive():
            p.kill()
            p.join()


@contextlib.contextmanager
def _a_worker_serving(channel, dev):
    """A worker process serving ``channel`` with a CPU handler over ``dev``."""
    parent, child = CTX.Pipe()
    with _worker(channel, _serve, dev, child, False) as p:
        yield p


def _filled_device() -> list:
    return [torch.full((4, PAGE), 7, dtype=torch.uint8).share_memory_() for _ in range(2)]


@contextlib.contextmanager
def _stopped(p):
    """Worker ``p`` stopped (it drains nothing: its ring stays full whatever the wait), and
    resumed on the way out unless it died (its failure shows)."""
    os.kill(p.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(p.pid, signal.SIGCONT)


def test_a_job_frame_of_an_unknown_kind_fails_that_job_and_the_worker_serves_on(channel):
    # The worker built the job (TransferSpec) outside the guard that turns a refused job into
    # a failed one: a frame whose kind is neither store nor load raised out of its serve
    # loop, the worker process died, and every other job on the channel failed with it.
    from kvshm.engine.connector import Job
    from kvshm.transfer.spec import TransferSpec
    with _a_worker_serving(channel, _filled_device()):
        channel._outstanding[5] = "store"
        assert channel._send(ch.JobFrame(5, "copy", [1], [2]))
        channel.send([Job(6, "r", TransferSpec("store", [1], [2]))])
        assert sorted((d.job_id, d.success) for d in channel.wait([5, 6], timeout=60)) == [
            (5, False), (6, True)]
        assert channel.worker_alive()


def test_an_undecodable_job_frame_fails_that_job_and_the_worker_serves_on(channel):
    # The worker decoded its ring's frames outside any guard: one it could not decode (here
    # a device list that is no list) raised out of its serve loop and the worker died, taking
    # every other job of the channel with it. The frame still names its job: that job fails.
    import msgspec
    from kvshm.engine.connector import Job
    from kvshm.transfer.spec import TransferSpec
    with _a_worker_serving(channel, _filled_device()):
        channel._outstanding[5] = "store"
        ch._put(channel._ends.jobs, msgspec.msgpack.encode(
            ["Job", 5, "store", "not a list", [2], True, None, -1, 0]), channel._check_worker)
        channel.send([Job(6, "r", TransferSpec("store", [1], [3]))])
        assert sorted((d.job_id, d.success) for d in channel.wait([5, 6], timeout=60)) == [
            (5, False), (6, True)]
        assert channel.worker_alive()


@pytest.mark.parametrize("lost", [1, 2], ids=["middle", "last"])
def test_a_job_with_a_part_lost_fails_and_copies_none_of_its_parts(channel, monkeypatch, lost):
    # A job of many ids travels in several frames, which the worker joins. With the middle
    # frame lost (undecodable, naming nothing), the last frame completed the job from the
    # parts it had: a job with blocks missing that would copy the rest and report success.
    # With the last frame lost, the job neither ran nor failed: its scheduler waited forever.
    from kvshm.engine.connector import Job
    from kvshm.transfer.spec import TransferSpec
    monkeypatch.setattr(ch, "MAX_IDS_PER_FRAME", 1)
    send, frames = channel._send, []

    def lose_a_part(frame):
        frames.append(frame)
        if isinstance(frame, ch.JobFrame) and frame.job_id == 7 and len(frames) == lost + 1:
            ok = ch._put(channel._ends.jobs, b"\xc1", channel._check_worker)
            channel._ends.jobs_bell.ring()
            return ok
        return send(frame)
    seg = channel.seg
    with _a_worker_serving(channel, _filled_device()):
        monkeypatch.setattr(channel, "_send", lose_a_part)
        channel.send([Job(7, "r", TransferSpec("store", [0, 1, 2], [2, 3, 4]))])
        monkeypatch.setattr(channel, "_send", send)
        channel.send([Job(8, "r", TransferSpec("store", [3], [5]))])
        assert sorted((d.job_id, d.success) for d in channel.wait([7, 8], timeout=60)) == [
            (7, False), (8, True)]
        planes = seg.torch_planes()
        assert all(not bool(p[b].any()) for p in planes for b in (2, 3, 4))
        assert all(bool((p[5] == 7).all()) for p in planes)
        assert channel.worker_alive()


class _Held(TransferHandler):
    """Takes jobs (telling the test) and finishes them once the test sets ``go``; refuses an
    id it holds, as kvshm's handlers do."""

    def __init__(self, conn, go):
        self.conn, self.go = conn, go
        self.held: dict[int, str] = {}
        self.done: list = []
        self.lock = __import__("threading").Lock()

    def transfer_async(self, job_id, spec):
        with self.lock:
            if job_id in self.held:
                raise InvalidArgumentError(f"job {job_id} is still in flight")
            self.held[job_id] = spec.kind
        self.conn.send(("took", job_id))
        return True

    def wait(self, job_ids):
        self.go.wait()
        from kvshm.transfer.spec import TransferResult
        with self.lock:
            self.done += [TransferResult(j, True, 0, 0.0, k) for j, k in self.held.items()]
            self.held.clear()

    def get_finished(self):
        with self.lock:
            out, self.done = self.done, []
        return out

    def shutdown(self):
        pass


def _serve_held(address: tuple, conn, go) -> None:
    wc = WorkerChannel(*address)
    WorkerConnector(_Held(conn, go)).serve(wc)
    wc.close()


def test_a_job_id_sent_again_while_its_job_runs_leaves_that_jobs_report_alone(channel):
    # The handler refuses a second job under an id it runs; the worker reported that
    # refusal as the id's failure, ahead of the running job's own report: the scheduler
    # took a store still copying for a failed one (and would free its blocks).
    from kvshm.engine.connector import Job
    from kvshm.transfer.spec import TransferSpec
    parent, child = CTX.Pipe()
    go = CTX.Event()
    with _worker(channel, _serve_held, child, go):
        try:
            channel.send([Job(5, "r", TransferSpec("store", [1], [2]))])
            assert parent.recv() == ("took", 5)
            assert channel._send(ch.JobFrame(5, "store", [1], [3]))
            channel.send([Job(6, "r", TransferSpec("store", [2], [4]))])
            assert parent.recv() == ("took", 6)  # the worker has read the second job 5
            go.set()
            assert sorted((d.job_id, d.success) for d in channel.wait([5, 6], timeout=60)) \
                == [(5, True), (6, True)]
        finally:
            go.set()  # (its copies end: it can stop)


class _Lines:
    """A channel stand-in for ``WorkerConnector.serve``: hands out the given batches."""

    def __init__(self, *batches):
        self.batches = list(batches)
        self.done: list = []
        self.segment = None

    def recv(self, timeout):
        return self.batches.pop(0) if self.batches else None

    def send_done(self, results):
        self.done += results
        return True


def test_a_frame_that_names_no_job_makes_the_worker_finish_running_copies_first():
    # An undecodable frame may have been a Flush: the worker cannot know which jobs it
    # named, so every running copy finishes before the worker takes the next job.
    import threading
    from kvshm.engine.frames import Broken
    calls: list = []

    class Recorder(TransferHandler):
        def transfer_async(self, job_id, spec):
            calls.append(("copy", job_id))
            return True

        def wait(self, job_ids):
            if threading.current_thread() is threading.main_thread():
                calls.append(("wait", sorted(job_ids)))

        def get_finished(self):
            return []

        def shutdown(self):
            pass
    w = WorkerConnector(Recorder())
    w._writers = type("NoWriters", (), {"retire": lambda s, x: None,
                                        "close": lambda s: None})()
    w.serve(_Lines([ch.JobFrame(5, "store", [1], [2])],
                   [Broken(None, "unknown", "test"), ch.JobFrame(6, "store", [2], [3])],
                   [ch.Stop()]))
    assert calls[:3] == [("copy", 5), ("wait", [5]), ("copy", 6)]


def test_the_worker_reads_any_bytes_without_raising():
    import random

    from kvshm.engine.frames import JobReader
    rng = random.Random(7)
    reader = JobReader()
    frames = [rng.randbytes(rng.randint(0, 48)) for _ in range(20_000)]
    frames += [b"\x92\xa3Job" + rng.randbytes(rng.randint(0, 24)) for _ in range(20_000)]
    frames.append(b"\x91" * 100_000 + b"\xc0")  # nested past any decoder's depth
    for frame in frames:
        reader.read(frame)


def test_an_undecodable_completion_fails_the_job_it_names_and_the_scheduler_reads_on(channel):
    # The scheduler decoded completions outside any guard: one it could not decode raised
    # out of poll() into the engine.
    import msgspec
    channel._outstanding.update({5: "store", 6: "load"})
    for frame in (b"\xc1", msgspec.msgpack.encode(["Done", 5, "yes"]),
                  msgspec.msgpack.encode(ch.Done(6, True))):
        assert ch._put(channel._ends.done, frame, lambda: True)
    assert sorted((d.job_id, d.success) for d in channel.poll()) == [(5, False), (6, True)]


def test_a_job_id_sent_again_after_its_job_was_refused_reports_once_and_copies_nothing(
        channel):
    # A job the handler refused waits in the worker's failures until the reporter takes
    # them; a second job under its id, arriving meanwhile, was not taken for a duplicate and
    # ran: the worker reported the id failed (the scheduler frees the blocks) while the
    # second copy went on writing them, then reported it done as well.
    seg = channel.seg
    with _a_worker_serving(channel, _filled_device()):
        assert channel._send(ch.JobFrame(5, "store", [99], [2]))  # no device block 99
        assert channel._send(ch.JobFrame(5, "store", [1], [2]))
        assert channel._send(ch.JobFrame(9, "store", [3], [5]))  # the end of the reports
        assert _completions_on_the_wire(channel, 9) == [(5, False), (9, True)]
        assert all(not bool(p[2].any()) for p in seg.torch_planes())


def _completions_on_the_wire(channel, last: int) -> list:
    """Every (job id, success) the worker publishes up to job ``last``'s, duplicates kept (the
    scheduler's own reading keeps a job's first report only). The worker reports jobs in the
    order it took them, so a job sent last marks the end of what came before it."""
    from kvshm.engine.frames import Done, to_scheduler
    got: list = []
    deadline = time.monotonic() + 60
    while not got or got[-1][0] != last:
        assert time.monotonic() < deadline, f"no report of job {last}; got {got}"
        if (frame := channel._ends.done.try_get()) is None:
            time.sleep(0.01)  # (polling the ring: the test's own end of it)
        elif isinstance(d := to_scheduler.decode(frame), Done):
            got.append((d.job_id, d.success))
    return got


def test_a_job_with_two_parts_lost_is_reported_failed_once(channel, monkeypatch):
    # Every undecodable frame naming a job broke it again, even a job already broken (and
    # reported): two lost parts of one job, two failures reported for it.
    import msgspec

    from kvshm.engine.connector import Job
    from kvshm.transfer.spec import TransferSpec
    monkeypatch.setattr(ch, "MAX_IDS_PER_FRAME", 1)
    send = channel._send

    def lose_the_later_parts(frame):
        if isinstance(frame, ch.JobFrame) and frame.job_id == 7 and frame.part > 0:
            ok = ch._put(channel._ends.jobs, msgspec.msgpack.encode(
                ["Job", 7, "store", "not a list", [2], frame.last, None, -1, 0, frame.part]),
                channel._check_worker)
            channel._ends.jobs_bell.ring()
            return ok
        return send(frame)
    with _a_worker_serving(channel, _filled_device()):
        monkeypatch.setattr(channel, "_send", lose_the_later_parts)
        channel.send([Job(7, "r", TransferSpec("store", [0, 1, 2], [2, 3, 4]))])
        monkeypatch.setattr(channel, "_send", send)
        channel.send([Job(8, "r", TransferSpec("store", [3], [5]))])  # the end of the reports
        assert _completions_on_the_wire(channel, 8) == [(7, False), (8, True)]


def _a_channel_of_one_id_frames(seg_name, monkeypatch, timeout=0.2):
    """A channel whose frames carry one id each, on a ring of 4096 bytes (far fewer frames
    than a job of 1024 blocks takes), over a segment of 1024 blocks."""
    monkeypatch.setattr(ch, "MAX_IDS_PER_FRAME", 1)
    Segment.create(seg_name, layout(1), 1024, ring_capacity=4096, hold_capacity=64).close()
    return SchedulerChannel(seg_name, timeout=timeout)


def test_a_send_the_ring_took_only_part_of_fails_that_job_and_the_ones_after_it(
        seg_name, monkeypatch):
    # A job of several frames whose worker stops draining (stopped, not dead) fills the ring
    # partway: send raised after the channel's timeout with part of job 7 in the ring, and
    # job 7 stayed outstanding for good, neither run (its last frame never came) nor failed:
    # a wait for it never returned, its blocks stayed WRITING; the worker, resumed, kept
    # the parts it had joined forever. The jobs after it in the same call were neither
    # sent, nor outstanding, nor ever reported: the connector kept them for good too.
    from kvshm.engine.connector import Job
    from kvshm.transfer.spec import TransferSpec
    ids = list(range(1024))
    with _a_channel_of_one_id_frames(seg_name, monkeypatch) as channel, \
            _a_worker_serving(channel, _filled_device()) as p:
        with _stopped(p), pytest.raises(TransferError, match="stayed full"):
            channel.send([Job(7, "r", TransferSpec("store", [i % 4 for i in ids], ids)),
                          Job(9, "r", TransferSpec("store", [1], [6]))])
        assert sorted((d.job_id, d.success) for d in channel.poll()) == [(7, False), (9, False)]
        channel.send([Job(8, "r", TransferSpec("store", [3], [5]))])  # the end of the reports
        # job 7 is reported once, by the scheduler: the worker drops its parts, unreported
        assert _completions_on_the_wire(channel, 8) == [(8, True)]
        planes = channel.seg.torch_planes()
        assert [b for b in ids if any(bool(p[b].any()) for p in planes)] == [5]


class _Interrupted(BaseException):
    """What a signal handler raises into a scheduler (KeyboardInterrupt, a timeout's)."""


def test_a_job_a_signal_interrupted_the_sending_of_fails_at_the_scheduler(seg_name, monkeypatch):
    # Only TransferError failed a job sent in part: a KeyboardInterrupt (any exception) while
    # send waited for room left the job outstanding with its last frame never sent. Nothing
    # else sent after, a wait for it never returned, even once the worker drained its ring.
    from kvshm.engine.connector import Job
    from kvshm.transfer.spec import TransferSpec
    ids = list(range(1024))

    def interrupt(*_):
        raise _Interrupted

    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        with _a_channel_of_one_id_frames(seg_name, monkeypatch, timeout=60) as channel, \
                _a_worker_serving(channel, _filled_device()) as p:
            with _stopped(p):
                try:
                    signal.setitimer(signal.ITIMER_REAL, 1.0)
                    with pytest.raises(_Interrupted):
                        channel.send([
                            Job(7, "r", TransferSpec("store", [i % 4 for i in ids], ids)),
                            Job(9, "r", TransferSpec("store", [1], [6]))])
                finally:
                    signal.setitimer(signal.ITIMER_REAL, 0)
            assert channel._ends.jobs.tail > 0  # (part of job 7 is in the ring)
            assert sorted((d.job_id, d.success) for d in channel.wait([7, 9], timeout=10)) \
                == [(7, False), (9, False)]
            channel.send([Job(8, "r", TransferSpec("store", [3], [5]))])
            # job 7 is reported once, by the scheduler: the worker drops its parts, unreported
            assert _completions_on_the_wire(channel, 8) == [(8, True)]
            planes = channel.seg.torch_planes()
            assert [b for b in ids if any(bool(p[b].any()) for p in planes)] == [5]
    finally:
        signal.signal(signal.SIGALRM, old)


def test_an_interrupt_after_a_jobs_last_frame_entered_the_ring_leaves_it_to_run(
        channel, monkeypatch):
    # The job is whole in the ring: the worker runs it, so the scheduler must not fail it
    # (its blocks would go back while the copy writes them); its report comes from the worker.
    from kvshm.engine.connector import Job
    from kvshm.transfer.spec import TransferSpec
    monkeypatch.setattr(ch, "MAX_IDS_PER_FRAME", 1)

    class Bell:
        def __init__(self, bell):
            self.bell, self.rung = bell, 0

        def ring(self):
            self.rung += 1
            if self.rung == 2:  # after job 7's last frame
                raise _Interrupted
            return self.bell.ring()

    with _a_worker_serving(channel, _filled_device()):
        bell = channel._ends.jobs_bell
        channel._ends.jobs_bell = Bell(bell)
        try:
            with pytest.raises(_Interrupted):
                channel.send([Job(7, "r", TransferSpec("store", [1, 2], [3, 4])),
                              Job(9, "r", TransferSpec("store", [1], [6]))])
        finally:
            channel._ends.jobs_bell = bell
        assert 7 in channel.outstanding()
        assert sorted((d.job_id, d.success) for d in channel.wait([7, 9], timeout=30)) \
            == [(7, True), (9, False)]
        planes = channel.seg.torch_planes()
        assert [b for b in range(8) if any(bool(p[b].any()) for p in planes)] == [3, 4]


def test_a_job_id_sent_again_while_its_job_runs_and_refused_by_the_ring_leaves_it_alone(
        seg_name, monkeypatch):
    # A second job under the id of a job the worker still runs, whose sending the full ring
    # refused, was failed at the scheduler under that id: the scheduler took the running
    # job for failed and freed its blocks while its copy still wrote them.
    from kvshm.engine.connector import Job
    from kvshm.transfer.spec import TransferSpec
    ids = list(range(1024))
    parent, child = CTX.Pipe()
    go = CTX.Event()
    with _a_channel_of_one_id_frames(seg_name, monkeypatch) as channel, \
            _worker(channel, _serve_held, child, go) as p:
        try:
            channel.send([Job(5, "r", TransferSpec("store", [1], [2]))])
            assert parent.recv() == ("took", 5)
            with _stopped(p), pytest.raises(TransferError, match="stayed full"):
                channel.send([Job(5, "r", TransferSpec("store", [i % 4 for i in ids], ids))])
            assert channel.poll() == []
            assert 5 in channel.outstanding()
            go.set()
            assert [(d.job_id, d.success) for d in channel.wait([5], timeout=60)] == [(5, True)]
        finally:
            go.set()


def test_a_job_id_sent_again_after_its_sending_failed_runs_and_reports_once(
        seg_name, monkeypatch):
    # Job 7's sending failed partway and the scheduler reported it failed: its id is free
    # again (ids are unique among unfinished jobs). The worker had kept 7 as broken for
    # good, so a later job 7 was dropped, never run nor reported: its wait never returned.
    from kvshm.engine.connector import Job
    from kvshm.transfer.spec import TransferSpec
    ids = list(range(1024))
    with _a_channel_of_one_id_frames(seg_name, monkeypatch, timeout=0.5) as channel, \
            _a_worker_serving(channel, _filled_device()) as p:
        with _stopped(p), pytest.raises(TransferError, match="stayed full"):  # partway
            channel.send([Job(7, "r", TransferSpec("store", [i % 4 for i in ids], ids))])
        assert [(d.job_id, d.success) for d in channel.poll()] == [(7, False)]
        channel.send([Job(8, "r", TransferSpec("store", [3], [5]))])
        assert _completions_on_the_wire(channel, 8) == [(8, True)]  # none of the first 7
        channel.send([Job(7, "r", TransferSpec("store", [1], [6]))])  # the id again
        assert _completions_on_the_wire(channel, 7) == [(7, True)]
        planes = channel.seg.torch_planes()
        assert [b for b in ids if any(bool(p[b].any()) for p in planes)] == [5, 6]


def _signal_at(line_text: str, hit: int):
    """A trace function that sends this process SIGALRM when ``SchedulerChannel.send``
    reaches, for the ``hit``-th time, the line of its source holding ``line_text``."""
    import inspect
    import sys
    src, first = inspect.getsourcelines(ch.SchedulerChannel.send)
    target = first + next(i for i, s in enumerate(src) if line_text in s)
    seen = [0]

    def local(frame, event, arg):
        if event == "line" and frame.f_lineno == target:
            seen[0] += 1
            if seen[0] == hit:
                os.kill(os.getpid(), signal.SIGALRM)
        return local

    def traced(frame, event, arg):
        return local if frame.f_code is ch.SchedulerChannel.send.__code__ else None
    sys.settrace(traced)


@pytest.mark.parametrize("line", ["spec: TransferSpec = job.spec", "wslot, wgen = getattr",
                                  "= self._ends.jobs.tail"], ids=["spec", "writer", "tail"])
def test_a_signal_at_any_step_of_a_send_fails_every_job_it_did_not_send_whole(channel, line):
    # Only an exception out of putting a frame failed the unsent jobs: a signal handler's
    # raised at another step of the loop (here job 9's own lines, after it was outstanding,
    # before its frame went out) left job 9 outstanding for good, never sent nor failed, and
    # job 10 after it neither outstanding nor reported.
    import sys
    from kvshm.engine.connector import Job
    from kvshm.transfer.spec import TransferSpec

    def interrupt(*_):
        raise _Interrupted
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        with _a_worker_serving(channel, _filled_device()):
            _signal_at(line, 2)  # at job 9's pass over that line
            try:
                with pytest.raises(_Interrupted):
                    channel.send([Job(7, "r", TransferSpec("store", [1], [3])),
                                  Job(9, "r", TransferSpec("store", [2], [4])),
                                  Job(10, "r", TransferSpec("store", [3], [5]))])
            finally:
                sys.settrace(None)
            assert sorted((d.job_id, d.success) for d in channel.wait([7, 9, 10], timeout=60)) \
                == [(7, True), (9, False), (10, False)]
            planes = channel.seg.torch_planes()
            assert [b for b in range(8) if any(bool(p[b].any()) for p in planes)] == [3]
    finally:
        signal.signal(signal.SIGALRM, old)


@pytest.mark.parametrize("line,hit", [("break  # the worker", 1), ("whole = k + 1", 1),
                                      ("whole = k + 1", 2)], ids=["break", "end-7", "end-9"])
def test_a_signal_after_a_lost_worker_failed_the_job_under_way_reports_it_once(
        channel, line, hit):
    # A lost worker's jobs fail as send finds it gone, the job under way among them; a
    # signal's exception right after that (the job not yet counted as done) failed that job
    # again: two reports, and a connector counting reports would take the second for
    # another worker's, ending a job whose copy may still write its blocks.
    import sys
    from kvshm.engine.connector import Job
    from kvshm.transfer.spec import TransferSpec

    def interrupt(*_):
        raise _Interrupted
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        with _a_worker_serving(channel, _filled_device()) as p:
            p.kill()
            p.join()
            _signal_at(line, hit)
            try:
                with pytest.raises(_Interrupted):
                    channel.send([Job(7, "r", TransferSpec("store", [1], [3])),
                                  Job(9, "r", TransferSpec("store", [2], [4]))])
            finally:
                sys.settrace(None)
            assert sorted((d.job_id, d.success) for d in channel.poll()) == [
                (7, False), (9, False)]
    finally:
        signal.signal(signal.SIGALRM, old)


def test_a_signal_after_a_lost_worker_failed_an_id_sent_again_in_flight_reports_it_once(
        channel):
    # Job 5 was in flight when a job 5 was sent again (its report is the running job's).
    # send found the worker gone, which failed the running 5; a signal's exception then
    # found 5 no longer outstanding and failed it a second time.
    import sys
    from kvshm.engine.connector import Job
    from kvshm.transfer.spec import TransferSpec

    def interrupt(*_):
        raise _Interrupted
    old = signal.signal(signal.SIGALRM, interrupt)
    try:
        with _a_worker_serving(channel, _filled_device()) as p:
            channel._outstanding[5] = "store"  # in flight, as if sent before
            p.kill()
            p.join()
            _signal_at("break  # the worker", 1)
            try:
                with pytest.raises(_Interrupted):
                    channel.send([Job(5, "r", TransferSpec("store", [1], [3]))])
            finally:
                sys.settrace(None)
            assert [(d.job_id, d.success) for d in channel.poll()] == [(5, False)]
    finally:
        signal.signal(signal.SIGALRM, old)
