"""Tests for kvshm.shm.segment: create/attach across processes, views, validation, space,
permissions, unlink. One behaviour per test; cross-process tests use real processes."""
from __future__ import annotations

import errno
import mmap
import multiprocessing as mp
import os
import stat
import struct
import traceback

import numpy as np
import posix_ipc
import pytest

import kvshm.shm.creation as creation_mod
import kvshm.shm.segment as segment_mod
from kvshm.shm import layout as L
from kvshm.errors import (FormatVersionError, InsufficientSpaceError, InvalidArgumentError,
                          KvshmError, LayoutMismatchError, NotAKvshmSegmentError,
                          SegmentExistsError, SegmentNotFoundError, SegmentPermissionError)
from kvshm.shm.layout import Layout
from kvshm.shm.names import list_segments, shm_name
from kvshm.shm.segment import Segment

LAYOUT = Layout((4096, 4096), 16, "test")
SMALL = dict(ring_capacity=8192, hold_capacity=64)
CTX = mp.get_context("spawn")
JOIN_S = 120  # a guard against a hung child, not synchronisation


def shm_path(name: str) -> str:
    return "/dev/shm/kvshm-" + name


def pattern(seed: int, n: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8)


def run_child(target, *args):
    """Run ``target(conn, *args)`` in a spawned process; return what it sent (re-raising
    its failure here)."""
    parent, child = CTX.Pipe()
    p = CTX.Process(target=_child_main, args=(target, child) + args)
    p.start()
    child.close()
    try:
        status, value = parent.recv()
    except EOFError:
        status, value = "error", "child exited without reporting"
    p.join(JOIN_S)
    assert p.exitcode == 0, f"child exit code {p.exitcode}: {value}"
    if status == "error":
        pytest.fail(f"child failed:\n{value}")
    return value


def _child_main(target, conn, *args):
    try:
        conn.send(("ok", target(*args)))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


# --- children (module level so that 'spawn' can import them) ------------------------------
def _child_read(name, layout, reads):
    with Segment.attach(name, layout) as seg:
        g = seg.geometry
        out = {
            "geometry": (g.num_blocks, g.page_bytes, g.max_clients, g.ring_capacity,
                         g.hold_capacity, g.total_bytes),
            "layout": seg.layout.describe(),
            "created_ns": seg.created_ns,
            "bytes": [bytes(seg.plane(p)[b]) for p, b in reads],
        }
        return out


def _child_write(name, layout, writes):
    with Segment.attach(name, layout) as seg:
        for (p, b), seed in writes:
            page = seg.plane(p)[b]
            page[:] = pattern(seed, page.size)
    return None


def _child_create_write_exit(name, layout, seed):
    seg = Segment.create(name, layout, 8, **SMALL)
    seg.plane(0)[3] = pattern(seed, layout.page_bytes[0])
    seg.close()  # and exit without unlinking
    return os.getpid()


def _child_attach_as_nobody(name):
    os.setgid(65534)
    os.setuid(65534)
    try:
        seg = Segment.attach(name)
    except KvshmError as e:
        return type(e).__name__, str(e)
    seg.close()
    return None, ""


# --- create and attach ---------------------------------------------------------------------
@pytest.mark.procs
def test_other_process_attaches_and_sees_geometry_layout_and_bytes(make_segment):
    seg = make_segment(layout=LAYOUT, num_blocks=12)
    seg.plane(0)[3] = pattern(1, 4096)
    seg.plane(1)[11] = pattern(2, 4096)
    got = run_child(_child_read, seg.name, LAYOUT, [(0, 3), (1, 11), (1, 0)])
    g = seg.geometry
    assert got["geometry"] == (12, (4096, 4096), g.max_clients, 8192, 64, g.total_bytes)
    assert got["layout"] == LAYOUT.describe()
    assert got["created_ns"] == seg.created_ns
    assert got["bytes"][0] == pattern(1, 4096).tobytes()
    assert got["bytes"][1] == pattern(2, 4096).tobytes()
    assert got["bytes"][2] == bytes(4096)  # fresh segment is zero-filled


@pytest.mark.procs
def test_bytes_written_by_other_process_are_visible_to_creator(make_segment):
    seg = make_segment(layout=LAYOUT, num_blocks=12)
    run_child(_child_write, seg.name, LAYOUT, [((0, 5), 7), ((1, 11), 8)])
    assert bytes(seg.plane(0)[5]) == pattern(7, 4096).tobytes()
    assert bytes(seg.plane(1)[11]) == pattern(8, 4096).tobytes()
    assert not seg.plane(0)[4].any() and not seg.plane(1)[10].any()


@pytest.mark.procs
def test_segment_outlives_its_creator_process(seg_name):
    pid = run_child(_child_create_write_exit, seg_name, LAYOUT, 42)
    assert pid != os.getpid()
    with Segment.attach(seg_name, LAYOUT) as seg:
        assert seg.geometry.num_blocks == 8
        assert bytes(seg.plane(0)[3]) == pattern(42, 4096).tobytes()


def test_attach_without_layout_adopts_the_stored_layout(make_segment):
    lay = Layout((1024, 2048, 512), 32, "m", {"tp": 2, "dtype": "bf16"})
    seg = make_segment(layout=lay, num_blocks=5)
    with Segment.attach(seg.name) as other:
        assert other.layout == lay
        assert other.geometry == seg.geometry


def test_create_records_geometry_in_the_header(make_segment):
    seg = make_segment(num_blocks=7)
    fields = L.HEADER.unpack_from(seg.buf, 0)
    assert fields[0] == L.MAGIC and fields[1] == L.FORMAT_VERSION
    assert fields[3] == seg.geometry.total_bytes == os.fstat(seg.fd).st_size
    assert fields[5] == 7 and fields[6] == 16 and fields[7] == 2
    assert fields[12] == LAYOUT.fingerprint()


def test_fresh_block_table_is_all_free(make_segment):
    from kvshm.shm.keyindex import KeyIndex
    from kvshm.shm.table import BlockTable
    seg = make_segment(num_blocks=6)
    table = BlockTable(seg.buf, seg.geometry)
    index = KeyIndex(seg.buf, seg.geometry, table)
    assert all(table.read(b).state == L.FREE for b in range(6))
    assert index.find(b"anything") == (-1, -1)


def test_list_segments_includes_created_segment(make_segment):
    seg = make_segment()
    assert seg.name in list_segments()


# --- views -----------------------------------------------------------------------------
def test_numpy_views_of_two_attachments_alias_the_same_memory(make_segment):
    seg = make_segment(num_blocks=4)
    with Segment.attach(seg.name, LAYOUT) as other:
        a, b = seg.plane(1), other.plane(1)
        assert a.shape == b.shape == (4, 4096) and a.dtype == np.uint8
        a[2, 100:108] = np.arange(1, 9, dtype=np.uint8)
        assert b[2, 100:108].tolist() == list(range(1, 9))
        b[3, -1] = 255
        assert a[3, -1] == 255
        del a, b


def test_planes_do_not_overlap(make_segment):
    seg = make_segment(num_blocks=4)
    p0, p1 = seg.planes()
    p0[:] = 1
    assert not p1.any()
    p1[:] = 2
    assert (p0 == 1).all()


def test_data_region_and_planes_are_2mib_aligned(make_segment):
    seg = make_segment(num_blocks=4)
    addr, length = seg.data_address()
    assert addr == seg.plane(0).ctypes.data
    assert seg.geometry.data_offset % L.DATA_ALIGN == 0
    assert all(off % L.DATA_ALIGN == 0 for off in seg.geometry.plane_offsets())
    assert length == seg.geometry.total_bytes - seg.geometry.data_offset


def test_torch_views_alias_the_segment_memory(make_segment):
    torch = pytest.importorskip("torch")
    seg = make_segment(num_blocks=4)
    with Segment.attach(seg.name, LAYOUT) as other:
        t0, t1 = seg.torch_planes()
        assert t0.dtype == torch.uint8 and tuple(t0.shape) == (4, 4096)
        t1[1].fill_(7)
        assert (other.plane(1)[1] == 7).all()
        other.plane(0)[2, :4] = [9, 8, 7, 6]
        assert t0[2, :4].tolist() == [9, 8, 7, 6]
        assert t0.data_ptr() == seg.plane(0).ctypes.data
        del t0, t1


# --- validation on attach ----------------------------------------------------------------
@pytest.mark.parametrize("other", [
    Layout((4096, 2048), 16, "test"),
    Layout((4096, 4096), 32, "test"),
    Layout((4096, 4096), 16, "other-model"),
    Layout((4096,), 16, "test"),
    Layout((4096, 4096), 16, "test", {"tp": 2}),
], ids=["page-bytes", "tokens-per-block", "model", "planes", "extra"])
def test_attach_with_different_layout_raises_mismatch_showing_both(make_segment, other):
    seg = make_segment()
    with pytest.raises(LayoutMismatchError) as e:
        Segment.attach(seg.name, other)
    msg = str(e.value)
    assert LAYOUT.describe() in msg and other.describe() in msg
    assert seg.name in msg


def test_create_exist_ok_with_different_layout_raises_mismatch(make_segment):
    seg = make_segment()
    with pytest.raises(LayoutMismatchError):
        Segment.create(seg.name, Layout((8192,), 16, "test"), 4, exist_ok=True, **SMALL)


def test_format_version_mismatch_raises_format_version_error(make_segment):
    seg = make_segment()
    raw = posix_ipc.SharedMemory(shm_name(seg.name))
    try:
        with mmap.mmap(raw.fd, L.HEADER_BYTES) as mm:
            struct.pack_into("<I", mm, 8, L.FORMAT_VERSION + 98)  # version follows the magic
    finally:
        raw.close_fd()
    with pytest.raises(FormatVersionError) as e:
        Segment.attach(seg.name, LAYOUT)
    msg = str(e.value)
    assert str(L.FORMAT_VERSION + 98) in msg and f"version {L.FORMAT_VERSION}" in msg


def _foreign_object(name: str, data: bytes) -> None:
    shm = posix_ipc.SharedMemory(shm_name(name), posix_ipc.O_CREX, mode=0o600, size=len(data))
    try:
        if data:
            with mmap.mmap(shm.fd, len(data)) as mm:
                mm[:] = data
    finally:
        shm.close_fd()


# An *empty* object is what a creator killed right after its exclusive open leaves behind:
# test_segment_hardening.py proves it is removed, not refused.
@pytest.mark.parametrize("size", [100, L.HEADER_BYTES, 64 << 10],
                         ids=["tiny", "header-sized", "large"])
def test_foreign_shm_object_raises_not_a_kvshm_segment(seg_name, size):
    _foreign_object(seg_name, os.urandom(size))
    with pytest.raises(NotAKvshmSegmentError) as e:
        Segment.attach(seg_name, LAYOUT)
    assert "not a kvshm segment" in str(e.value)
    assert os.path.exists(shm_path(seg_name))  # somebody else's object: left alone
    assert os.stat(shm_path(seg_name)).st_size == size


def test_create_exist_ok_over_foreign_object_raises_not_a_kvshm_segment(seg_name):
    _foreign_object(seg_name, os.urandom(8192))
    with pytest.raises(NotAKvshmSegmentError):
        Segment.create(seg_name, LAYOUT, 4, exist_ok=True, **SMALL)
    assert os.stat(shm_path(seg_name)).st_size == 8192


def test_segment_whose_size_disagrees_with_header_is_damaged(make_segment):
    seg = make_segment(num_blocks=4)
    os.ftruncate(seg.fd, seg.geometry.total_bytes + 4096)
    with pytest.raises(NotAKvshmSegmentError) as e:
        Segment.attach(seg.name, LAYOUT)
    assert str(seg.geometry.total_bytes) in str(e.value)


@pytest.mark.parametrize("damage", [b"\xff\xfe", b"{not json", b'{"model": "x"}'],
                         ids=["not-utf8", "not-json", "missing-fields"])
def test_damaged_layout_description_raises_not_a_kvshm_segment(make_segment, damage):
    seg = make_segment()
    seg.buf[L.OFF_LAYOUT_DESC:L.OFF_LAYOUT_DESC + L.LAYOUT_DESC_BYTES] = \
        damage.ljust(L.LAYOUT_DESC_BYTES, b"\0")
    for layout in (None, LAYOUT):
        with pytest.raises(NotAKvshmSegmentError) as e:
            Segment.attach(seg.name, layout)
        assert "damaged" in str(e.value) and seg.name in str(e.value)


def test_attach_missing_segment_raises_not_found(seg_name):
    with pytest.raises(SegmentNotFoundError) as e:
        Segment.attach(seg_name, LAYOUT)
    assert seg_name in str(e.value)
    assert not os.path.exists(shm_path(seg_name))


def test_create_existing_name_raises_segment_exists(make_segment):
    seg = make_segment()
    with pytest.raises(SegmentExistsError) as e:
        Segment.create(seg.name, LAYOUT, 4, **SMALL)
    assert seg.name in str(e.value)
    assert Segment.attach(seg.name, LAYOUT).geometry == seg.geometry  # untouched


def test_create_exist_ok_attaches_the_existing_segment(make_segment):
    seg = make_segment(num_blocks=6)
    seg.plane(0)[1, :3] = [1, 2, 3]
    with Segment.create(seg.name, LAYOUT, 99, exist_ok=True, **SMALL) as again:
        assert again.geometry.num_blocks == 6  # the existing geometry wins
        assert again.plane(0)[1, :3].tolist() == [1, 2, 3]


# --- space ---------------------------------------------------------------------------------
def test_insufficient_space_names_needed_and_free_bytes_and_leaves_nothing(
        seg_name, monkeypatch):
    monkeypatch.setattr(creation_mod, "free_bytes", lambda: 12345)
    with pytest.raises(InsufficientSpaceError) as e:
        Segment.create(seg_name, LAYOUT, 8, **SMALL)
    need = L.Geometry(8, LAYOUT.page_bytes, 32, 8192, 64).total_bytes
    msg = str(e.value)
    assert str(need) in msg and "12345" in msg
    assert not os.path.exists(shm_path(seg_name))
    with pytest.raises(SegmentNotFoundError):
        Segment.attach(seg_name)


def test_huge_segment_raises_insufficient_space_and_leaves_nothing(seg_name):
    with pytest.raises(InsufficientSpaceError) as e:
        Segment.create(seg_name, Layout((1 << 20,), 16, "huge"), 2**30, **SMALL)
    assert "bytes" in str(e.value)
    assert not os.path.exists(shm_path(seg_name))


def test_failed_reservation_raises_insufficient_space_and_leaves_nothing(
        seg_name, monkeypatch):
    def no_space(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(segment_mod.os, "posix_fallocate", no_space)
    with pytest.raises(InsufficientSpaceError) as e:
        Segment.create(seg_name, LAYOUT, 4, **SMALL)
    assert "No space left" in str(e.value)
    assert not os.path.exists(shm_path(seg_name))


def test_space_is_reserved_at_creation(make_segment):
    seg = make_segment(num_blocks=4)
    st = os.fstat(seg.fd)
    assert st.st_size == seg.geometry.total_bytes
    assert st.st_blocks * 512 >= seg.geometry.total_bytes  # fallocated, not sparse


# --- permissions ---------------------------------------------------------------------------
def test_default_mode_is_0600(make_segment):
    seg = make_segment()
    assert stat.S_IMODE(os.stat(shm_path(seg.name)).st_mode) == 0o600


def test_requested_mode_is_honoured_despite_umask(make_segment):
    old = os.umask(0o077)
    try:
        seg = make_segment(mode=0o660)
    finally:
        os.umask(old)
    assert stat.S_IMODE(os.stat(shm_path(seg.name)).st_mode) == 0o660


def _can_switch_user() -> bool:
    return os.geteuid() == 0


@pytest.mark.procs
@pytest.mark.skipif(not _can_switch_user(), reason="needs root to become another user")
def test_other_user_cannot_attach_a_0600_segment(make_segment):
    seg = make_segment(mode=0o600)
    kind, msg = run_child(_child_attach_as_nobody, seg.name)
    assert kind == SegmentPermissionError.__name__, msg
    assert seg.name in msg and "0o660" in msg


@pytest.mark.procs
@pytest.mark.skipif(not _can_switch_user(), reason="needs root to become another user")
def test_other_user_can_attach_a_world_readable_segment(make_segment):
    seg = make_segment(mode=0o666)
    kind, msg = run_child(_child_attach_as_nobody, seg.name)
    assert kind is None, msg


# --- unlink --------------------------------------------------------------------------------
def test_unlink_removes_segment_and_its_semaphores(make_segment):
    seg = make_segment()
    for what in ("owner", "c0-reply"):
        posix_ipc.Semaphore(seg.object_name(what), posix_ipc.O_CREX).close()
    entries = [f"sem.kvshm-{seg.name}@{seg.tag}-owner", f"sem.kvshm-{seg.name}@{seg.tag}-c0-reply"]
    assert all(os.path.exists("/dev/shm/" + e) for e in entries)
    assert Segment.unlink(seg.name) is True
    assert not os.path.exists(shm_path(seg.name))
    assert not any(os.path.exists("/dev/shm/" + e) for e in entries)
    with pytest.raises(SegmentNotFoundError):
        Segment.attach(seg.name)


def test_unlink_removes_what_a_segment_removed_before_under_the_name_left(make_segment):
    # A process of a removed segment made a doorbell after the removal and died before it
    # could remove it: the next removal of the name takes it.
    old = make_segment()
    posix_ipc.unlink_shared_memory(shm_name(old.name))  # removed, its cleanup never ran
    new = make_segment(old.name)
    for seg in (old, new):
        posix_ipc.Semaphore(seg.object_name("owner"), posix_ipc.O_CREX).close()
    Segment.unlink(new.name)
    assert [e for e in os.listdir("/dev/shm") if e.startswith(f"sem.kvshm-{old.name}@")] == []


def test_unlink_missing_segment_returns_false(seg_name):
    assert Segment.unlink(seg_name) is False


def test_unlink_leaves_other_segments_alone(make_segment):
    a, b = make_segment(), make_segment()
    Segment.unlink(a.name)
    assert os.path.exists(shm_path(b.name))
    with Segment.attach(b.name, LAYOUT):
        pass


def test_unlink_leaves_semaphores_of_a_segment_whose_name_extends_its_name(make_segment):
    a = make_segment()
    b = make_segment(name=a.name + "-2")  # "x" and "x-2"
    posix_ipc.Semaphore(a.object_name("owner"), posix_ipc.O_CREX).close()
    posix_ipc.Semaphore(b.object_name("owner"), posix_ipc.O_CREX).close()
    Segment.unlink(a.name)
    assert not os.path.exists(f"/dev/shm/sem.kvshm-{a.name}@{a.tag}-owner")
    assert os.path.exists(f"/dev/shm/sem.kvshm-{b.name}@{b.tag}-owner")
    assert os.path.exists(shm_path(b.name))


def test_unlink_removes_the_objects_that_format_4_named_for_the_name_alone(make_segment):
    seg = make_segment()
    longer = make_segment(seg.name + "-2")  # its objects are not seg's
    old = [f"/kvshm-{seg.name}-owner", f"/kvshm-{seg.name}-c0-reply",
           f"/kvshm-{seg.name}-c12-peer_in", f"/kvshmtier-{seg.name}-bell"]
    kept = [f"/kvshm-{longer.name}-owner", f"/kvshm-{longer.name}-c0-reply"]
    for sem in old + kept:
        posix_ipc.Semaphore(sem, posix_ipc.O_CREX).close()
    posix_ipc.SharedMemory(f"/kvshmtier-{seg.name}", posix_ipc.O_CREX, size=4096).close_fd()
    Segment.unlink(seg.name)
    assert not any(os.path.exists("/dev/shm/sem." + s[1:]) for s in old)
    assert not os.path.exists(f"/dev/shm/kvshmtier-{seg.name}")
    assert all(os.path.exists("/dev/shm/sem." + s[1:]) for s in kept)
    for sem in kept:
        posix_ipc.unlink_semaphore(sem)


def test_objects_of_a_segment_are_not_listed_as_segments(make_segment):
    seg = make_segment()
    posix_ipc.SharedMemory(seg.object_name("tier"), posix_ipc.O_CREX, size=4096).close_fd()
    assert [n for n in list_segments() if n.startswith(seg.name)] == [seg.name]


def test_mapping_survives_unlink(make_segment):
    seg = make_segment(num_blocks=4)
    seg.plane(0)[0, 0] = 77
    Segment.unlink(seg.name)
    assert seg.plane(0)[0, 0] == 77  # processes that map it keep their mapping


def test_close_is_idempotent_and_keeps_the_segment(make_segment):
    seg = make_segment()
    other = Segment.attach(seg.name, LAYOUT)
    other.close()
    other.close()
    assert os.path.exists(shm_path(seg.name))


def test_close_with_live_numpy_view_does_not_raise(make_segment):
    seg = make_segment()
    other = Segment.attach(seg.name, LAYOUT)
    view = other.plane(0)
    other.close()
    del view


# --- invalid arguments ---------------------------------------------------------------------
@pytest.mark.parametrize("name", ["", "a/b", "has space", "x" * 129, "../etc", "ü", None])
def test_invalid_segment_name_raises_invalid_argument(name):
    with pytest.raises(InvalidArgumentError) as e:
        Segment.create(name, LAYOUT, 4, **SMALL)
    assert "segment names" in str(e.value) and repr(name) in str(e.value)
    with pytest.raises(InvalidArgumentError):
        Segment.attach(name)
    with pytest.raises(InvalidArgumentError):
        Segment.unlink(name)


@pytest.mark.parametrize("num_blocks", [0, -1, 2**31, 2**40])
def test_invalid_num_blocks_raises_invalid_argument_and_leaves_nothing(seg_name, num_blocks):
    with pytest.raises(InvalidArgumentError) as e:
        Segment.create(seg_name, LAYOUT, num_blocks, **SMALL)
    assert "num_blocks" in str(e.value) and str(num_blocks) in str(e.value)
    assert not os.path.exists(shm_path(seg_name))


@pytest.mark.parametrize("pages", [(), (0,), (-4096,), (4096, -1), (1,) * (L.MAX_PLANES + 1)],
                         ids=["no-planes", "zero", "negative", "one-negative", "too-many"])
def test_invalid_plane_sizes_raise_invalid_argument(pages):
    with pytest.raises(InvalidArgumentError):
        Layout(pages, 16, "test")


@pytest.mark.parametrize("tokens", [0, -16])
def test_invalid_tokens_per_block_raises_invalid_argument(tokens):
    with pytest.raises(InvalidArgumentError) as e:
        Layout((4096,), tokens, "test")
    assert "tokens_per_block" in str(e.value)


@pytest.mark.parametrize("kw", [dict(ring_capacity=100), dict(ring_capacity=4100),
                                dict(hold_capacity=1), dict(max_clients=0),
                                dict(max_clients=5000)])
def test_invalid_geometry_raises_invalid_argument_and_leaves_nothing(seg_name, kw):
    args = dict(SMALL, **kw)
    with pytest.raises(InvalidArgumentError):
        Segment.create(seg_name, LAYOUT, 4, **args)
    assert not os.path.exists(shm_path(seg_name))


def test_invalid_policy_raises_invalid_argument_and_leaves_nothing(seg_name):
    with pytest.raises(InvalidArgumentError) as e:
        Segment.create(seg_name, LAYOUT, 4, policy="fifo", **SMALL)
    assert "fifo" in str(e.value)
    assert not os.path.exists(shm_path(seg_name))


def test_invalid_argument_error_is_a_value_error():
    with pytest.raises(ValueError):
        Layout((), 16)


# --- header records ------------------------------------------------------------------------
def test_counters_start_at_zero_and_are_shared(make_segment):
    seg = make_segment()
    assert set(seg.counters().values()) == {0}
    seg.counter_add("stores", 3)
    with Segment.attach(seg.name, LAYOUT) as other:
        assert other.counter("stores") == 3


def test_owner_record_is_shared(make_segment):
    seg = make_segment()
    seg.write_owner_record(1234, 5, 6, 7)
    with Segment.attach(seg.name, LAYOUT) as other:
        assert other.owner_record() == (1234, 5, 6, 7)


def test_owner_record_is_named_and_stored_word_by_word(make_segment):
    seg = make_segment()
    seg.write_owner_record(7, 3, 11, 13)
    rec = seg.owner_record()
    assert (rec.pid, rec.epoch, rec.since_ns, rec.tick) == (7, 3, 11, 13) == tuple(rec)
    assert rec[:2] == (7, 3)
    off = L.OFF_OWNER + L.OWNER_DTYPE.fields["epoch"][1]
    assert int.from_bytes(seg.buf[off:off + 4], "little") == 3


@pytest.mark.procs  # runs a child process
# --- sizes as people write them ---------------------------------------------------------
def test_connect_takes_nbytes_with_units(seg_name):
    """``nbytes="1M"`` sizes the cache like the tools' size options (it was a TypeError)."""
    from kvshm.client.connect import connect
    from conftest import stop_owner
    mgr = connect(seg_name, LAYOUT, nbytes="1M")
    try:
        assert mgr.segment.geometry.num_blocks == (1 << 20) // LAYOUT.block_bytes
    finally:
        pid = mgr.segment.owner_record()[0]
        mgr.shutdown()
        stop_owner(pid)


@pytest.mark.parametrize("nbytes,says", [
    (1 << 50, "at most"), ("1P", "not a size"), ("lots", "not a size"), (-1, "cannot hold"),
    (1.5e6, "a number of bytes"), (True, "a number of bytes"), ("1K", "cannot hold")])
def test_a_bad_nbytes_is_refused_in_its_own_terms(seg_name, nbytes, says):
    """Every message names nbytes, the parameter the caller passed, and says what to give:
    1 PiB was refused as "num_blocks must be in 1..2**31-1"."""
    from kvshm.client.connect import connect
    with pytest.raises(InvalidArgumentError) as e:
        connect(seg_name, LAYOUT, nbytes=nbytes)
    assert "nbytes" in str(e.value) and says in str(e.value), str(e.value)
    assert "num_blocks" not in str(e.value)
    assert not os.path.exists(f"/dev/shm/kvshm-{seg_name}")


def test_segment_create_refuses_a_size_for_a_block_count(seg_name):
    with pytest.raises(InvalidArgumentError, match="count of blocks.*nbytes"):
        Segment.create(seg_name, LAYOUT, "64M")
    assert not os.path.exists(shm_path(seg_name))


def test_a_hold_scan_finds_every_pin_and_lease_below_each_slots_mark(make_segment):
    """Few blocks are compared with every hold, many are looked up after a sort: both find
    exactly the blocks some slot pins or leases below its mark."""
    from kvshm.shm import slots
    seg = make_segment(num_blocks=64, max_clients=4)
    rng = np.random.default_rng(7)
    cap = seg.geometry.hold_capacity
    scan = slots.HoldScan(seg)
    for _ in range(200):
        want: set[int] = set()
        for s in range(4):
            h = slots.holds(seg, s)
            h[:] = rng.choice([-1, *range(64), *(L.lease_code(b) for b in range(64))], cap)
            mark = int(rng.integers(0, cap + 1))
            slots.hold_mark(seg, s)[0] = mark
            want |= {int(L.held_block(c)) for c in h[:mark] if c != -1}
        for n in (0, 1, 3, 8, 9, 40):
            blocks = rng.choice(64, n, replace=False)
            got = scan.held(blocks)
            assert got.tolist() == [int(b) in want for b in blocks]
            assert [scan.held_one(int(b)) for b in blocks] == [int(b) in want for b in blocks]
    scan.close()


def test_a_hold_scan_never_reads_a_code_across_two_entries(make_segment):
    from kvshm.shm import slots
    seg = make_segment(num_blocks=64, max_clients=4)
    scan = slots.HoldScan(seg)
    h = slots.holds(seg, 2)
    h[:2] = [0x05000000, 0]  # bytes 00 00 00 05 00 00 00 00: block 5's pin code at offset 3
    slots.hold_mark(seg, 2)[0] = 2
    assert (scan.held_one(5), scan.held_one(0)) == (False, True)
    assert scan.held(np.array([5, 0])).tolist() == [False, True]
    scan.close()
