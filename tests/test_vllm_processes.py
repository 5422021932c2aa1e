"""kvshm's vLLM integration across processes: engines and workers that die or live apart.

* the owner that an engine auto-starts outlives a SIGKILL of that engine's whole process
  group (vLLM's EngineCore and its workers);
* a vLLM worker process apart from its scheduler (tensor parallelism) copies a store only
  while registered under the scheduler's kvshm client (slot, generation), so the owner keeps
  a dead scheduler's blocks from reuse while its workers may still write them;
* real vLLM engines with ``tensor_parallel_size=2`` (scheduler and two worker processes):
  hits across engines, and a SIGKILL of the EngineCore while both workers are mid-copy.

The end-to-end tests use the vLLM venv (see ``test_vllm``) and skip without it.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from kvshm.index.api import LookupResult
from kvshm.index.client import connect
from kvshm.integrations.vllm.jobs import WorkerCore
from kvshm.shm import slots, writers
from kvshm.shm.layout import Layout
from kvshm.shm.segment import Segment
from kvshm.transfer.spec import make_handler

from conftest import unique_name
from test_vllm import REPO, VLLM_PY, E, _alive, needs_vllm, remove_segment, tiny_model  # noqa: F401


# --- the auto-started owner outlives the process group that started it ---------------------
_GROUP_CHILD = """
import os, subprocess, sys
from kvshm.index.client import connect
from kvshm.shm.layout import Layout
mgr = connect(sys.argv[1], Layout((4096,), 16, "t"), num_blocks=8)  # starts the owner
out = mgr.prepare_store([b"k" * 36]); mgr.complete_store(out.keys_to_store)
# a second member of the group, as vLLM's workers are of the EngineCore's
mate = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                        stdin=subprocess.PIPE)
print(mgr.segment.owner_record()[0], mgr.segment.counter("failovers"), os.getpgid(0),
      mate.pid, flush=True)
sys.stdin.read()  # until the test kills the whole group
"""


def test_the_owner_survives_a_sigkill_of_the_starting_engines_process_group():
    """vLLM's EngineCore (here a plain client in a process group of its own, with a second
    member) auto-starts the owner; ``killpg(SIGKILL)`` of that group leaves the owner
    serving: another client finds the same owner pid, no failover, the stored block."""
    name = unique_name()
    child = subprocess.Popen([sys.executable, "-c", _GROUP_CHILD, name], cwd=REPO,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             start_new_session=True,
                             env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        owner, failovers, pgid, mate = map(int, child.stdout.readline().split())
        assert pgid == child.pid and os.getpgid(mate) == pgid
        assert owner not in (child.pid, mate) and os.getpgid(owner) != pgid  # detached
        os.killpg(pgid, signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while _alive(mate):  # the group's other member dies too (a zombie: reparented)
            assert time.monotonic() < deadline, "the group's second member outlived SIGKILL"
            time.sleep(0.005)  # polling a state; the assertions are on states
        assert _alive(owner)
        mgr = connect(name)
        try:
            assert mgr.key_status(b"k" * 36) is LookupResult.HIT
            out = mgr.prepare_store([b"n" * 36])  # a round trip the same owner answers
            mgr.complete_store(out.keys_to_store)
            assert mgr.segment.owner_record()[0] == owner and _alive(owner)
            assert mgr.segment.counter("failovers") == failovers
        finally:
            mgr.shutdown()
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        remove_segment(name)


_SCHEDULER_CHILD = """
import sys
from kvshm.index.client import connect
mgr = connect(sys.argv[1])
out = mgr.prepare_store([bytes([i]) * 36 for i in range(3)])
print(mgr.slot, mgr.gen, *out.block_ids, flush=True)
sys.stdin.read()  # until the test SIGKILLs it
"""


def test_a_vllm_worker_copies_only_while_registered_under_its_live_scheduler(seg_name):
    """A vLLM worker process apart from its scheduler (TP > 1): a store job names the
    scheduler's (slot, generation), and the worker registers under it before copying, so
    when the scheduler is SIGKILLed with the copy in flight the owner quarantines its WRITING
    blocks until the worker retires; a store job of the dead generation is skipped."""
    seg = Segment.create(seg_name, Layout((4096,), 16, "t"), 8)
    mgr = connect(seg_name)  # starts the owner; stays to see what the owner does
    child = subprocess.Popen([sys.executable, "-c", _SCHEDULER_CHILD, seg_name], cwd=REPO,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=str(REPO)))
    dev = [torch.randint(-128, 127, (8, 4096), dtype=torch.int8)]
    core = WorkerCore(dev, [[0]], seg.torch_planes()[0], 1, make_handler=make_handler,
                      writers=writers.Registrations(seg))
    try:
        slot, gen, *blocks = map(int, child.stdout.readline().split())
        assert core.submit(0, "store", [1, 2, 3], [3], [0], blocks, writer=(slot, gen))
        assert (slot, gen, os.getpid()) in {(r["slot"], r["gen"], r["pid"])
                                            for r in writers.registrations(seg)}
        child.kill()  # the scheduler dies; job 0 is not yet reported: still "in flight"
        child.wait()
        reclaimed = seg.counter("reclaimed_clients")
        mgr.prepare_store([b"x" * 36])  # a round trip: the owner runs its liveness checks
        deadline = time.monotonic() + 30
        while seg.counter("quarantined_blocks") < 3:
            assert time.monotonic() < deadline, (seg.counters(), reclaimed)
            time.sleep(0.005)  # polling the owner's state; the assertions are on states
        out = mgr.prepare_store([bytes([0x80 + i]) * 36 for i in range(4)])  # the rest
        assert out is not None and not set(out.block_ids) & set(blocks)  # never handed out
        assert mgr.prepare_store([b"y" * 36]) is None  # full: the quarantined are not free
        assert core.get_finished()[0][:2] == (0, True)  # copied, then retired: gen is dead
        assert not writers.registrations(seg)
        before = seg.planes()[0].copy()
        assert core.submit(1, "store", [4, 5, 6], [3], [0], blocks, writer=(slot, gen))
        core.wait({1})
        assert core.get_finished() == [(1, True, 0, 0.0)]  # skipped: nobody completes it
        assert (seg.planes()[0] == before).all() and not writers.registrations(seg)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
        core.shutdown()
        mgr.shutdown()
        seg.close()


