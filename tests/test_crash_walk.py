"""Walk every named crash point: a process dies (or freezes) at that exact step, and the cache
still never serves wrong bytes, leaks no block or slot, and every survivor keeps working.

For an owner point, the first owner is started armed (``KVSHM_CRASH_AT``) and dies at that
step while three client processes run checksummed random traffic; the clients start its
successor. For a client point, one extra client process is armed and dies or freezes there
(SIGKILL or SIGSTOP) while the others run. Afterwards every READY block is checked byte for
byte against its key, ``verify`` must be clean, and once everyone left no block is WRITING
and every slot is FREE. A frozen owner is not walked: it holds the owner lock, so by design
everyone waits for it (``kvshm-inspect show`` names it) — it is a stall, not a crash.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import subprocess
import sys

import pytest

from kvshm.shm import layout as L
from kvshm.shm import slots
from kvshm.crashpoints import POINTS
from kvshm.shm.segment import Segment
from kvshm.inspect.snapshot import verify
from kvshm.shm.table import BlockTable

import procs
from conftest import SMALL_GEOMETRY, TEST_LAYOUT, stop_owner
from kvshm.owner.stocking import grant_target
from test_exactly_once import owner_proc
from test_shared import wait_for

CTX = mp.get_context("spawn")
NKEYS, OPS, SURVIVORS = 40, 120, 3

# Owner points and the hit at which the owner dies: late enough that the cache is full and
# evicting, early enough that every workload reaches it.
OWNER_POINTS = {
    "owner.request.after_consume": 30, "owner.request.after_execute": 30,
    "owner.request.after_reply": 30, "owner.evict.after_mark": 3,
    "owner.evict.after_drop": 3, "table.write.odd": 40, "owner.reclaim.mid": 1,
    "owner.goodbye.mid": 1, "owner.grant.before_count": 6, "owner.publish.mid": 5,
    "owner.one_way.after_begin": 10, "owner.offer.after_choose": 3, "table.offer.mid": 3, "table.offer.odd": 3,
    "owner.publish.after_forget": 2,
}
CLIENT_POINTS = {
    "client.connect.after_activate": 1, "client.store.after_prepare": 5,
    "client.store.after_copy": 5, "client.load.after_pin": 2,
    "client.shutdown.before_bye": 1, "client.store.after_take": 2,
    "table.claim.odd": 2, "client.claim.before_check": 2,
}
# Walked by the tests of their own module (copy workers, batch table writes, segment
# creation, named objects, the mover, offers: a load waiting on an undecided eviction,
# the freeing of an offer published without a claim, Publish frames applied together, a
# dead client's torn claim ended while its copier lives:
# test_an_owner_dying_as_it_ends_a_dead_clients_torn_claim_never_serves_its_old_key; a
# successor dying as it rewrites the key index:
# test_an_owner_dying_as_it_rewrites_the_index_leaves_a_clients_offers_cached; an idle
# client's grants recalled: test_grant_recall.py).
WALKED_ELSEWHERE = {"worker.store.mid_copy", "client.slot.after_lock", "owner.rebuild.torn", "client.load.wait_decision", "owner.publish.merged",
                    "owner.free.after_holds", "owner.launch.before_pid", "object.before_link", "mover.area.after_open",
                    "segment.create.after_open", "segment.create.after_lock", "segment.create.after_reserve",
                    "mover.fill.after_prepare", "mover.fill.after_get",
                    "mover.spill.after_pin", "owner.unclaimed.settled", "owner.rebuild.index",
                    "owner.recall.lowered", "owner.recall.mid", "client.take.after_intent"}


@pytest.fixture
def seg(seg_name):
    """Sixteen blocks over four client slots: one granted block per storing client, so a
    one-key store takes the grant path and larger ones the round trip."""
    s = Segment.create(seg_name, TEST_LAYOUT, 16, max_clients=4, **SMALL_GEOMETRY)
    yield s
    pid = s.owner_record()[0]
    s.close()
    if pid:
        stop_owner(pid)


@pytest.mark.unit
def test_the_walk_takes_both_store_paths(seg):
    assert grant_target(seg.geometry) == 1


@pytest.mark.unit
def test_every_crash_point_is_walked():
    walked = set(OWNER_POINTS) | set(CLIENT_POINTS) | {"owner.rebuild.mid", BATCH_POINT}
    assert set(POINTS) - WALKED_ELSEWHERE == walked


def _run_clients(name: str, n: int, seed: int) -> list[tuple]:
    kids = []
    for i in range(n):
        parent, child = CTX.Pipe()
        p = CTX.Process(target=procs.random_traffic,
                        args=(name, child, seed + i, OPS, NKEYS), daemon=True)
        p.start()
        kids.append((p, parent))
    return kids


def _collect(kids) -> list[dict]:
    out = [conn.recv() for _, conn in kids]
    for p, _ in kids:
        p.join()
    return out


def _armed_client(name: str, point: str, hit: int, sig: str) -> subprocess.Popen:
    env = dict(os.environ, KVSHM_CRASH_AT=f"{point}:{hit}", KVSHM_CRASH_SIGNAL=sig)
    code = ("import sys, multiprocessing as mp; sys.path.insert(0, sys.argv[2]); import procs; "
            "a, b = mp.Pipe(); procs.random_traffic(sys.argv[1], b, 99, 400, %d)" % NKEYS)
    return subprocess.Popen([sys.executable, "-c", code, name, os.path.dirname(__file__)],
                            env=env, stdout=subprocess.DEVNULL)


def _died(owner: subprocess.Popen, point: str) -> None:
    """The armed owner died at ``point`` (once the workload is over, it has no other way to
    end: an owner that never reached the point is stopped and the test fails)."""
    try:
        owner.wait(timeout=30)
    except subprocess.TimeoutExpired:
        owner.kill()
        owner.wait()
        pytest.fail(f"the owner never reached {point}")
    assert owner.returncode == -signal.SIGKILL, f"the owner never reached {point}"


def _check_cache(seg: Segment, stats: list[dict]) -> None:
    assert [s["errors"] for s in stats] == [[]] * len(stats), "a survivor saw an error"
    assert sum(s["corrupt"] for s in stats) == 0, "a load returned another key's bytes"
    assert sum(s["stores"] for s in stats) > 0 and sum(s["loads"] for s in stats) > 0
    if not seg.owner_alive():  # it died after the last call: the next client brings one
        from kvshm.client.connect import connect
        connect(seg.name).shutdown()
    t = BlockTable(seg.buf, seg.geometry)
    planes = seg.planes()
    try:
        wait_for(lambda: all(e.state not in (L.WRITING, L.GRANTED, L.CLAIMED) and
                             not (e.state == L.READY and e.writer >= 0)
                             for e in map(t.read, range(seg.geometry.num_blocks))),
                 "every unfinished store, grant, offer and claim to end", timeout=20)
        wait_for(lambda: all(slots.record(seg, s).state == L.SlotState.FREE
                             for s in range(seg.geometry.max_clients)),
                 "every slot to come back", timeout=20)
        for b in range(seg.geometry.num_blocks):
            e = t.read(b)
            if e.state == L.READY:
                assert procs.check(planes, b, e.key), f"READY block {b} holds wrong bytes"
        assert verify(seg) == []
    finally:
        t.close()


@pytest.mark.parametrize("point", sorted(OWNER_POINTS))
def test_owner_dying_at_the_point_loses_nothing(seg, point):
    owner = owner_proc(seg.name, f"{point}:{OWNER_POINTS[point]}")
    victim = None
    if point == "owner.reclaim.mid":  # needs a client death to reclaim
        victim = _armed_client(seg.name, "client.store.after_prepare", 3, "KILL")
    kids = _run_clients(seg.name, SURVIVORS, seed=len(point))
    if victim is not None:
        assert victim.wait() == -signal.SIGKILL
    stats = _collect(kids)
    _died(owner, point)
    _check_cache(seg, stats)


def test_owner_dying_mid_rebuild_loses_nothing(seg):
    owner = owner_proc(seg.name)
    stats = _collect(_run_clients(seg.name, SURVIVORS, seed=7))
    owner.kill()
    owner.wait()
    second = owner_proc_no_wait(seg.name, "owner.rebuild.mid")
    assert second.wait() == -signal.SIGKILL
    stats += _collect(_run_clients(seg.name, SURVIVORS, seed=8))
    _check_cache(seg, stats)


# The batch writers' own round (every entry odd, then all bodies, then all even) runs from
# ``VECTOR_MIN`` entries: stores of up to 32 keys over 64 blocks make stores, grants,
# publishes and evictions that large, so an owner dies inside one of them.
BATCH_POINT = "table.write_many.odd"


@pytest.mark.parametrize("hit", [1, 2, 3, 4])
def test_owner_dying_inside_a_batch_write_loses_nothing(seg_name, hit):
    seg = Segment.create(seg_name, TEST_LAYOUT, 64, max_clients=4, **SMALL_GEOMETRY)
    try:
        owner = owner_proc(seg.name, f"{BATCH_POINT}:{hit}")
        kids = []
        for i in range(SURVIVORS):
            parent, child = CTX.Pipe()
            p = CTX.Process(target=procs.random_traffic,
                            args=(seg.name, child, hit * 10 + i, 60, 160, 32), daemon=True)
            p.start()
            kids.append((p, parent))
        stats = _collect(kids)
        _died(owner, BATCH_POINT)
        _check_cache(seg, stats)
    finally:
        pid = seg.owner_record()[0]
        seg.close()
        if pid:
            stop_owner(pid)


def owner_proc_no_wait(name: str, crash_at: str) -> subprocess.Popen:
    env = dict(os.environ, KVSHM_CRASH_AT=crash_at)
    return subprocess.Popen([sys.executable, "-m", "kvshm.owner", name], env=env,
                            stdin=subprocess.DEVNULL)


@pytest.mark.parametrize("sig", ["KILL", "STOP"])
@pytest.mark.parametrize("point", sorted(CLIENT_POINTS))
def test_client_dying_or_freezing_at_the_point_disturbs_nobody(seg, point, sig):
    owner = owner_proc(seg.name)
    victim = _armed_client(seg.name, point, CLIENT_POINTS[point], sig)
    if sig == "STOP":
        wait_for(lambda: procs._proc_state(victim.pid) == "T", f"the victim to freeze at {point}")
    kids = _run_clients(seg.name, SURVIVORS, seed=len(point))
    stats = _collect(kids)  # the others finish while it is frozen or dead
    if sig == "STOP":
        os.kill(victim.pid, signal.SIGKILL)
    assert victim.wait() == -signal.SIGKILL
    _check_cache(seg, stats)
    assert owner.poll() is None  # the owner never died
