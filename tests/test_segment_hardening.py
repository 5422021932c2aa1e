"""Data-plane hardening: attach checks fingerprinted, cross-checked fields only; a dead or
failing creator never blocks anyone; group mode reaches the named objects; bad manager input
gets a typed error. Creators run in real processes that SIGKILL/SIGSTOP themselves at named
crash points (``KVSHM_CRASH_AT``)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import posix_ipc
import pytest

from kvshm.shm import layout as L
from kvshm.errors import (InsufficientSpaceError, InvalidArgumentError, KvshmError,
                          NotAKvshmSegmentError, SegmentNotFoundError)
from kvshm.shm.layout import Layout
from kvshm.shm.names import shm_name
from kvshm.shm.segment import Segment

from conftest import SMALL_GEOMETRY, TEST_LAYOUT

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEADLINE_S = 60  # a guard against a hung process, never synchronisation
TWO_PAGES = Layout((4096, 8192), 16, "hardening")


def path(name: str) -> str:
    return "/dev/shm/kvshm-" + name


def creator(name: str, crash_at: str | None, num_blocks: int = 8, signal_: str = "KILL",
            exist_ok: bool = False) -> subprocess.Popen:
    """A process that creates ``name`` (stopping at ``crash_at``) and prints the outcome."""
    code = ("import sys, json; from kvshm.shm.segment import Segment; from kvshm.shm.layout import "
            "Layout\ntry:\n s = Segment.create(sys.argv[1], Layout((4096, 4096), 16, 'test'),"
            f" {num_blocks}, ring_capacity=8192, hold_capacity=64, exist_ok={exist_ok})\n"
            " print(json.dumps(['ok', s.geometry.total_bytes]))\n"
            "except Exception as e:\n print(json.dumps([type(e).__name__, str(e)]))\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    env.pop("KVSHM_CRASH_AT", None)
    if crash_at:
        env.update(KVSHM_CRASH_AT=crash_at, KVSHM_CRASH_SIGNAL=signal_)
    return subprocess.Popen([sys.executable, "-c", code, name], env=env,
                            stdout=subprocess.PIPE, text=True)


def attacher(name: str, create: bool) -> subprocess.Popen:
    return creator(name, None, exist_ok=True) if create else subprocess.Popen(
        [sys.executable, "-c", "import sys, json; from kvshm.shm.segment import Segment\ntry:\n"
         " s = Segment.attach(sys.argv[1]); print(json.dumps(['ok', 0]))\n"
         "except Exception as e:\n print(json.dumps([type(e).__name__, str(e)]))\n", name],
        env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.PIPE, text=True)


def outcome(p: subprocess.Popen) -> list:
    out, _ = p.communicate(timeout=DEADLINE_S)
    return json.loads(out)


def poll(cond, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def stopped(p: subprocess.Popen) -> bool:
    with open(f"/proc/{p.pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0] == "T"


def has_open(p: subprocess.Popen, file: str) -> bool:
    fds = f"/proc/{p.pid}/fd"
    try:
        return any(os.readlink(f"{fds}/{fd}").startswith(file) for fd in os.listdir(fds))
    except FileNotFoundError:
        return False


# --- 3: attach trusts only checked fields ------------------------------------------------------
def _dead_segment(name: str, layout: Layout = TWO_PAGES) -> None:
    """A segment whose creator process has exited."""
    code = ("import sys; from kvshm.shm.segment import Segment; from kvshm.shm.layout import Layout\n"
            f"Segment.create(sys.argv[1], Layout({layout.page_bytes!r}, 16, {layout.model!r}),"
            " 8, ring_capacity=8192, hold_capacity=64).close()")
    subprocess.run([sys.executable, "-c", code, name], check=True, timeout=DEADLINE_S,
                   env=dict(os.environ, PYTHONPATH=ROOT))


def _patch(name: str, offset: int, data: bytes) -> None:
    fd = os.open(path(name), os.O_RDWR)
    try:
        os.pwrite(fd, data, offset)
    finally:
        os.close(fd)


def test_attach_refuses_swapped_page_sizes_in_the_description(seg_name):
    _dead_segment(seg_name)
    desc = TWO_PAGES.describe().replace('"page_bytes":[4096,8192]', '"page_bytes":[8192,4096]')
    json.loads(desc)  # still valid JSON
    _patch(seg_name, L.OFF_LAYOUT_DESC, desc.encode().ljust(L.LAYOUT_DESC_BYTES, b"\0"))
    with pytest.raises(NotAKvshmSegmentError) as e:
        Segment.attach(seg_name)
    assert "fingerprint" in str(e.value) and f"kvshm-inspect rm {seg_name}" in str(e.value)


@pytest.mark.parametrize("field,value", [("max_clients", 31), ("ring_capacity", 16384),
                                         ("hold_capacity", 4096), ("num_blocks", 2**40),
                                         ("num_blocks", 0), ("index_slots", 4)])
def test_attach_refuses_a_header_field_that_disagrees_with_the_geometry(seg_name, field, value):
    _dead_segment(seg_name)
    dtype, off = L.HEADER_DTYPE.fields[field][:2]  # the header's one definition
    _patch(seg_name, off, dtype.type(value).tobytes())
    with pytest.raises(NotAKvshmSegmentError) as e:
        Segment.attach(seg_name)
    assert f"kvshm-inspect rm {seg_name}" in str(e.value)
    assert not isinstance(e.value, InvalidArgumentError)


# --- 4: creation races -------------------------------------------------------------------------
@pytest.mark.parametrize("point", ["segment.create.after_open", "segment.create.after_lock",
                                   "segment.create.after_reserve"])
def test_a_creator_killed_mid_creation_blocks_nobody(seg_name, point):
    p = creator(seg_name, point)
    p.wait(DEADLINE_S)
    assert p.returncode == -signal.SIGKILL and os.path.exists(path(seg_name))
    with pytest.raises(SegmentNotFoundError) as e:  # attach-only: the leftover is gone
        Segment.attach(seg_name)
    assert "died half-way" in str(e.value)
    seg = Segment.create(seg_name, TEST_LAYOUT, 8, exist_ok=True, **SMALL_GEOMETRY)
    seg.close()
    Segment.attach(seg_name).close()


def test_attacher_waits_for_a_stopped_creator_past_the_old_ten_second_bound(seg_name):
    p = creator(seg_name, "segment.create.after_reserve", signal_="STOP")
    try:
        poll(lambda: stopped(p), "the creator to stop")
        a = attacher(seg_name, create=False)
        poll(lambda: has_open(a, path(seg_name)), "the attacher to open the object")
        end = time.monotonic() + 12  # the behaviour under test: still waiting after 10 s
        while time.monotonic() < end:
            assert a.poll() is None, outcome(a)
            time.sleep(0.05)
    finally:
        os.kill(p.pid, signal.SIGCONT)
    assert outcome(p)[0] == "ok" and outcome(a) == ["ok", 0]


@pytest.mark.parametrize("create", [False, True], ids=["attach", "create"])
def test_racers_beside_a_failing_creator_see_no_segment_never_remove_it(seg_name, create):
    p = creator(seg_name, "segment.create.after_lock", num_blocks=2**31 - 1, signal_="STOP")
    poll(lambda: stopped(p), "the creator to stop")
    a = attacher(seg_name, create=create)
    try:
        poll(lambda: has_open(a, path(seg_name)), "the racer to open the object")
    finally:
        os.kill(p.pid, signal.SIGCONT)
    assert outcome(p)[0] == "InsufficientSpaceError"
    kind, msg = outcome(a)
    assert "remove it" not in str(msg)
    assert kind == ("ok" if create else "SegmentNotFoundError"), msg


def test_a_creator_stopped_before_its_lock_starts_over_when_removed(seg_name):
    p = creator(seg_name, "segment.create.after_open", signal_="STOP", exist_ok=True)
    poll(lambda: stopped(p), "the creator to stop")
    seg = Segment.create(seg_name, TEST_LAYOUT, 8, exist_ok=True, **SMALL_GEOMETRY)
    os.kill(p.pid, signal.SIGCONT)
    assert outcome(p) == ["ok", seg.geometry.total_bytes]
    seg.close()
    assert Segment.attach(seg_name).geometry.num_blocks == 8


# --- 5: group mode -----------------------------------------------------------------------------
def _as_nobody() -> None:
    """Become uid/gid 65534 (import what is needed first: the tree may be root's alone)."""
    os.setgid(65534)
    os.setuid(65534)


def _child_opens_the_tier_area_as_nobody(name: str) -> str:
    from kvshm.tier.area import TierArea
    _as_nobody()
    try:
        with Segment.attach(name) as seg:
            TierArea.create(seg).close()
    except KvshmError as e:
        return type(e).__name__
    return "ok"


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_a_creator_killed_while_making_a_named_object_blocks_no_other_user(make_segment):
    # Its umask would have left the object (the tier area) readable by its own user alone
    # until it set the segment's mode: killed in between, another user must still get it.
    seg = make_segment(mode=0o666)
    code = ("import os, sys; os.umask(0o077)\n"
            "from kvshm.shm.segment import Segment\nfrom kvshm.tier.area import TierArea\n"
            "TierArea.create(Segment.attach(sys.argv[1]))\n")
    creator = _armed(code, seg.name, at="object.before_link")
    try:
        poll(lambda: stopped(creator), "the creator to stop with its object half made")
    finally:
        creator.kill()
        creator.wait(timeout=DEADLINE_S)
    from multiprocessing import get_context
    with get_context("spawn").Pool(1) as pool:
        assert pool.apply(_child_opens_the_tier_area_as_nobody, (seg.name,)) == "ok"


def _owner_as_nobody(name: str, conn) -> None:
    from kvshm.owner.server import Owner
    _as_nobody()
    owner = Owner(name)
    conn.send("serving")
    owner.run()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_an_owner_of_another_user_serves_a_client_whatever_it_made_under_a_doorbells_name(
        make_segment):
    # A client made a semaphore readable by itself alone where its reply doorbell's was once
    # named; an owner of another user never opens it (a doorbell is a word of the segment):
    # every client is served.
    from multiprocessing import get_context
    from kvshm.client.connect import connect
    seg = make_segment(mode=0o666)
    posix_ipc.Semaphore(f"/kvshm-{seg.name}@{seg.tag}-c0-reply", posix_ipc.O_CREX,
                        mode=0o600).close()
    ctx = get_context("spawn")
    parent, child = ctx.Pipe()
    owner = ctx.Process(target=_owner_as_nobody, args=(seg.name, child), daemon=True)
    owner.start()
    child.close()
    try:
        assert parent.poll(DEADLINE_S) and parent.recv() == "serving"
        first = connect(seg.name, timeout=DEADLINE_S)
        good = connect(seg.name, timeout=DEADLINE_S)
        try:
            assert first.slot == 0
            for mgr, key in ((first, b"f" * 36), (good, b"k" * 36)):
                out = mgr.prepare_store([key])
                mgr.complete_store(out.keys_to_store)
                assert mgr.lookup([key]) == 1
            assert owner.is_alive()
        finally:
            first.shutdown()
            good.shutdown()
    finally:
        owner.kill()
        owner.join(DEADLINE_S)


def _open_object(seg: Segment, name: str):
    from kvshm.shm.objects import open_object
    return open_object(name, seg.fd, point="mover.area.after_open")


def _child_opens_an_object_after_the_removal(name: str, obj: str, conn) -> None:
    _as_nobody()
    with Segment.attach(name) as seg:
        conn.send("attached")
        conn.recv()  # the segment is removed now
        try:
            _open_object(seg, obj)
        except Exception as e:  # noqa: BLE001 - the parent checks which
            conn.send(type(e).__name__)
        else:
            conn.send("ok")


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process as another user")
def test_an_object_of_a_removed_segment_made_by_another_user_fails_typed(make_segment):
    # The remover is between removing the segment and its objects (the tier area); a process
    # of another user opens the root-made object then: the sticky /dev/shm refuses it the
    # removal, which is the remover's to do, and it hears that the segment is gone.
    from multiprocessing import get_context
    seg = make_segment(mode=0o666)
    obj = seg.object_name("tier")
    _open_object(seg, obj).close_fd()
    ctx = get_context("spawn")
    parent, child = ctx.Pipe()
    p = ctx.Process(target=_child_opens_an_object_after_the_removal, args=(seg.name, obj, child))
    p.start()
    child.close()  # a child that dies early ends our reads (EOFError), never hangs them
    try:
        assert parent.poll(DEADLINE_S) and parent.recv() == "attached"
        posix_ipc.unlink_shared_memory(shm_name(seg.name))
        parent.send("go")
        assert parent.poll(DEADLINE_S) and parent.recv() == "SegmentNotFoundError"
    finally:
        p.kill()
        p.join(DEADLINE_S)


# --- a removed segment leaves nothing behind ------------------------------------------------
def _armed(code: str, name: str, at: str) -> subprocess.Popen:
    """A process running ``code`` (with ``name`` in argv[1]) that freezes at crash point
    ``at``; it prints its outcome."""
    env = dict(os.environ, PYTHONPATH=ROOT, KVSHM_CRASH_AT=at, KVSHM_CRASH_SIGNAL="STOP")
    return subprocess.Popen([sys.executable, "-c", code, name], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)


def test_a_client_attaching_as_its_segment_is_removed_leaves_nothing_behind(seg_name):
    from test_exactly_once import owner_proc
    Segment.create(seg_name, TEST_LAYOUT, 8, **SMALL_GEOMETRY).close()
    owner = owner_proc(seg_name)
    client = _armed("import sys, json; from kvshm.client.connect import connect\ntry:\n"
                    " connect(sys.argv[1]); print(json.dumps(['ok', 0]))\n"
                    "except Exception as e:\n print(json.dumps([type(e).__name__, str(e)]))\n",
                    seg_name, at="client.connect.after_activate")
    poll(lambda: stopped(client), "the client to freeze with its slot activated")
    Segment.unlink(seg_name)
    assert owner.wait(timeout=DEADLINE_S) == 0  # an owner stops serving a removed segment
    os.kill(client.pid, signal.SIGCONT)
    kind, msg = outcome(client)
    assert kind == "OwnerUnavailableError" and "was removed" in msg, msg
    assert [e for e in os.listdir("/dev/shm") if seg_name in e] == []


def test_a_client_of_a_removed_segment_starts_no_owner_for_its_successor(seg_name):
    # Its owner stopped serving the removed segment; a call must fail as owner-unavailable,
    # not start an owner by name, which would attach the segment now under that name.
    from test_exactly_once import owner_proc
    from kvshm.errors import OwnerUnavailableError
    from kvshm.client.connect import connect
    Segment.create(seg_name, TEST_LAYOUT, 8, **SMALL_GEOMETRY).close()
    owner = owner_proc(seg_name)
    mgr = connect(seg_name, grants=False, timeout=2)
    try:
        Segment.unlink(seg_name)
        assert owner.wait(timeout=DEADLINE_S) == 0  # it stops serving a removed segment
        with Segment.create(seg_name, TEST_LAYOUT, 8, **SMALL_GEOMETRY) as successor:
            with pytest.raises(OwnerUnavailableError):
                mgr.prepare_store([b"k" * 36])
            assert successor.owner_record()[1] == 0  # no owner has ever run on it
    finally:
        mgr.shutdown()


@pytest.mark.unit
def test_liveness_through_a_closed_handle_is_refused(seg_name):
    # After close the descriptor's number may denote another file: asking through it would
    # answer for that file.
    seg = Segment.create(seg_name, TEST_LAYOUT, 8, **SMALL_GEOMETRY)
    seg.close()
    with open(os.devnull):  # perhaps takes the number the segment had
        with pytest.raises(InvalidArgumentError):
            seg.owner_alive()
        with pytest.raises(InvalidArgumentError):
            seg.removed()


def test_liveness_of_a_removed_segment_is_still_answered(seg_name):
    # Whoever attached a segment before it was removed asks who is alive (the owner, its
    # clients) through that same object, not through its name, which is gone.
    from test_exactly_once import owner_proc
    Segment.create(seg_name, TEST_LAYOUT, 8, **SMALL_GEOMETRY).close()
    owner = owner_proc(seg_name)
    os.kill(owner.pid, signal.SIGSTOP)  # it would stop serving once it saw the removal
    with Segment.attach(seg_name) as seg:
        Segment.unlink(seg_name)
        assert seg.owner_alive() and seg.clients_alive() == set()
        os.kill(owner.pid, signal.SIGCONT)
        assert owner.wait(timeout=DEADLINE_S) == 0
        assert not seg.owner_alive()


# --- 7: bad input ------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", ["abc", 5, None, b"k" * 36, bytearray(b"k" * 36)])
def test_lookup_of_a_non_sequence_raises_invalid_argument(manager, bad):
    with pytest.raises(InvalidArgumentError):
        manager.lookup(bad)


@pytest.mark.parametrize("bad", ["abc", 5, None, bytearray(b"k" * 36)])
def test_key_status_and_lookup_of_a_bad_key_raise_invalid_argument(manager, bad):
    with pytest.raises(InvalidArgumentError):
        manager.key_status(bad)
    with pytest.raises(InvalidArgumentError):
        manager.lookup([bad])


def test_bytearray_keys_are_refused_and_leave_the_cache_unchanged(manager):
    with pytest.raises(InvalidArgumentError) as e:
        manager.prepare_store([bytearray(b"k" * 36)])
    assert "bytes(key)" in str(e.value)
    assert manager.prepare_store([b"k" * 36]).keys_to_store == [b"k" * 36]


def test_prepare_store_of_a_generator_stores_every_key(manager):
    keys = [bytes([i]) * 36 for i in range(3)]
    out = manager.prepare_store(k for k in keys)
    assert out.keys_to_store == keys
    manager.complete_store(iter(keys))
    assert manager.lookup(iter(keys)) == 3


@pytest.mark.unit
@pytest.mark.parametrize("name", [".", "..", "...", "ok\n"])
def test_dot_names_and_trailing_newline_are_refused(name):
    with pytest.raises(InvalidArgumentError):
        shm_name(name)
