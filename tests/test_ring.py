"""Tests for kvshm.shm.ring: frame ring semantics, wrap-around, backpressure, cross-process
delivery, and the Doorbell's wake-up. No sleeps as synchronisation, no timing thresholds."""
from __future__ import annotations

import contextlib

import mmap
import multiprocessing as mp
import struct
import uuid
import zlib
from collections import deque

import posix_ipc
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshm.shm import ring as ring_mod
from kvshm.errors import FrameTooLargeError, InvalidArgumentError, ProtocolError, RingFullError
from kvshm.shm.doorbell import AWAKE, SLEEPING
from kvshm.shm.ring import Doorbell, Ring

SPAWN = mp.get_context("spawn")  # children attach by name, like a real engine process
XCAP = 4096  # cross-process ring: small, so 100k frames wrap and fill it many times


def make_ring(capacity: int) -> tuple[Ring, mmap.mmap]:
    mm = mmap.mmap(-1, Ring.region_size(capacity))
    Ring.format(memoryview(mm), capacity)
    return Ring(memoryview(mm)), mm


def frame(seq: int, n: int) -> bytes:
    """Deterministic payload: both sides can rebuild it from (seq, n)."""
    return (seq.to_bytes(8, "little") * (n // 8 + 1))[:n]


# --- single process ------------------------------------------------------------------------
def test_frames_come_out_in_fifo_order() -> None:
    r, _ = make_ring(1024)
    sent = [frame(i, i * 3) for i in range(20)]
    for p in sent:
        assert r.try_put(p)
    assert [r.try_get() for _ in sent] == sent
    assert r.try_get() is None


def test_zero_length_frame_round_trips() -> None:
    r, _ = make_ring(64)
    assert r.try_put(b"")
    assert r.pending()
    assert r.try_get() == b""
    assert not r.pending() and r.depth() == 0


@settings(max_examples=300, deadline=None)
@given(cap=st.sampled_from([64, 72, 136, 200, 512]),
       ops=st.lists(st.one_of(st.integers(0, 300), st.none()), max_size=200))
def test_wraparound_with_odd_sizes_keeps_every_frame_exact_and_ordered(cap, ops) -> None:
    r, _ = make_ring(cap)
    model: deque[bytes] = deque()
    seq = 0
    for op in ops:
        if op is None:  # get
            assert r.try_get() == (model.popleft() if model else None)
        else:
            p = frame(seq, op % (Ring.max_payload(cap) + 1))
            seq += 1
            if r.try_put(p):
                model.append(p)
            else:
                assert model, "an empty ring must accept any frame up to max_payload"
        assert r.pending() == bool(model)
    while model:
        assert r.try_get() == model.popleft()
    assert r.try_get() is None and r.depth() == 0


def test_try_put_is_false_when_full_and_true_after_a_get() -> None:
    r, _ = make_ring(256)
    p = b"z" * 20  # 24-byte frames
    while r.try_put(p):
        pass
    assert not r.try_put(p)
    assert r.try_get() == p
    assert r.try_put(p)


def test_put_on_a_full_ring_raises_ring_full_after_timeout() -> None:
    r, _ = make_ring(64)
    while r.try_put(b"x" * 12):
        pass
    with pytest.raises(RingFullError, match="consumer is not draining"):
        r.put(b"x" * 12, timeout=0.001)
    with pytest.raises(TimeoutError):  # RingFullError is also a TimeoutError
        r.put(b"x" * 12, timeout=0)


def test_oversized_frame_raises_frame_too_large_at_once() -> None:
    r, _ = make_ring(128)
    limit = Ring.max_payload(128)
    assert r.try_put(b"a" * limit)
    with pytest.raises(FrameTooLargeError):
        r.try_put(b"a" * (limit + 1))
    with pytest.raises(FrameTooLargeError):  # even when blocking: never waits for room
        r.put(b"a" * 10_000, timeout=3600)


def test_peek_returns_a_zero_copy_view_until_advance() -> None:
    r, _ = make_ring(256)
    r.try_put(b"first")
    r.try_put(b"second")
    v = r.peek()
    assert bytes(v) == b"first" and bytes(r.peek()) == b"first"
    v.release()
    r.advance()
    assert r.try_get() == b"second"


def test_frames_looked_ahead_at_are_released_by_one_advance_only_once_included() -> None:
    r, _ = make_ring(128)
    for p in (b"one", b"two", b"three"):
        r.try_put(p)
    assert bytes(r.peek()) == b"one"
    view, end = r.peek_after()
    assert bytes(view) == b"two"
    r.include(end)
    view, _ = r.peek_after()
    assert bytes(view) == b"three"  # looked at, not included: it stays
    head = r.head()
    r.advance()
    assert r.head() > head and r.try_get() == b"three" and r.try_get() is None


def test_looking_ahead_wraps_and_stops_at_the_published_tail() -> None:
    r, _ = make_ring(64)  # 64 bytes: the third 20-byte frame wraps to offset 0
    for i in range(2):
        r.try_put(frame(i, 20))
    assert r.try_get() == frame(0, 20)
    r.try_put(frame(2, 20))
    assert bytes(r.peek()) == frame(1, 20)
    view, end = r.peek_after()
    assert bytes(view) == frame(2, 20)
    r.include(end)
    assert r.peek_after() is None  # nothing published past it yet
    r.advance()
    assert r.depth() == 0 and r.try_put(frame(3, 20))


def test_memoryview_payload_is_counted_in_bytes() -> None:
    r, _ = make_ring(256)
    words = memoryview(struct.pack("<4Q", 1, 2, 3, 4)).cast("Q")
    assert r.try_put(words)
    assert r.try_get() == struct.pack("<4Q", 1, 2, 3, 4)


def test_weakly_ordered_cpu_path_with_fences_delivers_in_order(monkeypatch) -> None:
    monkeypatch.setattr(ring_mod, "_WEAK_ORDER", True)
    r, _ = make_ring(128)
    for i in range(100):
        assert r.try_put(frame(i, i % 50))
        assert r.try_get() == frame(i, i % 50)


@pytest.mark.parametrize("capacity", [0, 56, 100, 65.0])
def test_region_size_rejects_bad_capacity(capacity) -> None:
    with pytest.raises(InvalidArgumentError):
        Ring.region_size(capacity)


def test_attach_rejects_a_buffer_that_is_not_a_formatted_ring() -> None:
    mm = mmap.mmap(-1, Ring.region_size(256))
    with pytest.raises(ProtocolError, match="Ring.format"):
        Ring(memoryview(mm))


def test_attach_rejects_a_ring_truncated_by_its_buffer() -> None:
    mm = mmap.mmap(-1, Ring.region_size(256))
    Ring.format(memoryview(mm), 256)
    with pytest.raises(ProtocolError):
        Ring(memoryview(mm)[:Ring.region_size(64)])


def test_attach_rejects_counters_near_the_end_of_their_range() -> None:
    # Counters a peer left there would overflow their u64 words as frames pass.
    mm = mmap.mmap(-1, Ring.region_size(256))
    Ring.format(memoryview(mm), 256)
    w = memoryview(mm)[:192].cast("Q")
    w[ring_mod._HEAD] = w[ring_mod._TAIL] = ring_mod.POS_LIMIT
    with pytest.raises(ProtocolError, match="inconsistent"):
        Ring(memoryview(mm))
    w[ring_mod._HEAD] = w[ring_mod._TAIL] = ring_mod.POS_LIMIT - 8
    r = Ring(memoryview(mm))  # just below: legal, and far from any overflow
    assert r.try_put(b"x") and r.try_get() == b"x"


def test_a_frame_that_ends_past_the_published_tail_is_refused() -> None:
    r, mm = make_ring(256)
    assert r.try_put(b"12345678")  # 8 bytes published: the frame claims more
    struct.pack_into("<I", mm, 192, 100)
    with pytest.raises(ProtocolError, match="published"):
        r.peek()


def test_format_rejects_a_misaligned_or_too_small_buffer() -> None:
    mm = mmap.mmap(-1, 2 * Ring.region_size(256))
    with pytest.raises(InvalidArgumentError, match="aligned"):
        Ring.format(memoryview(mm)[4:], 256)
    with pytest.raises(InvalidArgumentError):
        Ring.format(memoryview(mm)[:100], 256)


# --- cross process -------------------------------------------------------------------------
@pytest.fixture
def shm():
    """A fresh named segment (two rings + a doorbell word) and a semaphore name (the test's
    own "go" signal); all unlinked."""
    tag = uuid.uuid4().hex[:12]
    names = {"shm": f"/kvshm-test-ring-{tag}", "go": f"/kvshm-test-go-{tag}"}
    size = 2 * Ring.region_size(XCAP) + 64
    seg = posix_ipc.SharedMemory(names["shm"], posix_ipc.O_CREX, size=size)
    mm = mmap.mmap(seg.fd, size)
    seg.close_fd()
    Ring.format(memoryview(mm)[:Ring.region_size(XCAP)], XCAP)
    Ring.format(memoryview(mm)[Ring.region_size(XCAP):], XCAP)
    try:
        yield names, mm
    finally:
        posix_ipc.unlink_shared_memory(names["shm"])
        with contextlib.suppress(posix_ipc.ExistentialError):
            posix_ipc.unlink_semaphore(names["go"])


def attach(name: str) -> mmap.mmap:
    seg = posix_ipc.SharedMemory(name)
    mm = mmap.mmap(seg.fd, seg.size)
    seg.close_fd()
    return mm


def regions(mm: mmap.mmap) -> tuple[memoryview, memoryview, memoryview]:
    """(ring A, ring B, doorbell flag) views of the test segment."""
    mv, rs = memoryview(mm), Ring.region_size(XCAP)
    return mv[:rs], mv[rs:2 * rs], mv[2 * rs:2 * rs + Doorbell.flag_size()]


def _produce(names: dict, count: int) -> None:
    mm = attach(names["shm"])
    ring_a, _, flag = regions(mm)
    r, bell = Ring(ring_a), Doorbell(flag)
    for seq in range(count):
        body = frame(seq, (seq * 7919) % 300)
        r.put(struct.pack("<QI", seq, zlib.crc32(body)) + body, timeout=60)
        bell.ring()
    r.close()
    bell.close()


@pytest.mark.procs
def test_cross_process_100k_frames_arrive_in_order_and_intact(shm) -> None:
    names, mm = shm
    count = 100_000
    ring_a, _, flag = regions(mm)
    r, bell = Ring(ring_a), Doorbell(flag)
    proc = SPAWN.Process(target=_produce, args=(names, count))
    proc.start()
    try:
        for seq in range(count):
            got = r.try_get()
            while got is None:
                assert bell.wait(60, r.pending, spin_s=1e-4), f"producer stalled at frame {seq}"
                got = r.try_get()
            got_seq, crc = struct.unpack_from("<QI", got)
            body = got[12:]
            assert got_seq == seq and zlib.crc32(body) == crc
            assert body == frame(seq, (seq * 7919) % 300)
        proc.join(60)
        assert proc.exitcode == 0
        assert r.try_get() is None
    finally:
        if proc.is_alive():
            proc.kill()
        bell.close()


def _ring_after_go(names: dict) -> None:
    mm = attach(names["shm"])
    ring_a, _, flag = regions(mm)
    r, bell = Ring(ring_a), Doorbell(flag)
    posix_ipc.Semaphore(names["go"]).acquire(60)
    r.put(b"wake up", timeout=60)
    raise SystemExit(0 if bell.ring() else 3)  # 3: ring() saw no sleeper and did not wake


@pytest.mark.procs
def test_doorbell_wakes_a_consumer_blocked_in_wait(shm) -> None:
    names, mm = shm
    ring_a, _, flag = regions(mm)
    r, bell = Ring(ring_a), Doorbell(flag)
    go = posix_ipc.Semaphore(names["go"], posix_ipc.O_CREAT, initial_value=0)
    proc = SPAWN.Process(target=_ring_after_go, args=(names,))
    proc.start()

    def ready() -> bool:  # the re-check after raising the flag lets the producer go
        if r.pending():
            return True
        if struct.unpack_from("I", flag)[0] == SLEEPING and go.value == 0:
            go.release()
        return False

    try:
        assert bell.wait(60, ready, spin_s=0)
        proc.join(60)
        assert proc.exitcode == 0  # the producer found the flag raised and woke us
        assert struct.unpack_from("I", flag)[0] == AWAKE
        assert r.try_get() == b"wake up"
    finally:
        if proc.is_alive():
            proc.kill()
        go.close()
        bell.close()


# --- doorbell, single process --------------------------------------------------------------
def test_doorbell_wait_returns_false_after_timeout_with_nothing_ready(shm) -> None:
    names, mm = shm
    bell = Doorbell(regions(mm)[2])
    assert bell.wait(0.01, lambda: False, spin_s=0.001) is False
    assert struct.unpack_from("I", regions(mm)[2])[0] == AWAKE  # flag lowered again
    bell.close()


def test_doorbell_flag_left_raised_by_a_dead_sleeper_is_harmless_and_reset(shm) -> None:
    names, mm = shm
    flag = regions(mm)[2]
    struct.pack_into("I", flag, 0, SLEEPING)  # a consumer that died asleep
    bell = Doorbell(flag)
    assert bell.wait(0.01, lambda: False, spin_s=0) is False
    struct.pack_into("I", flag, 0, SLEEPING)
    bell.reset()  # a consumer taking over: producers stop calling the kernel for nobody
    assert bell.ring() is False
    bell.close()


def test_doorbell_ring_does_not_wake_while_consumer_is_awake(shm) -> None:
    names, mm = shm
    bell = Doorbell(regions(mm)[2])
    assert bell.ring() is False
    bell.close()


def test_a_scribbled_doorbell_word_costs_a_wake_and_nothing_else(shm) -> None:
    # The word is memory its consumer's peers can write: any value is a raised flag to a
    # producer (one harmless wake), and a consumer raises it itself before it sleeps.
    names, mm = shm
    ring_a, _, flag = regions(mm)
    r, bell = Ring(ring_a), Doorbell(flag)
    for junk in (0xFFFFFFFF, 2, 0x80000000):
        struct.pack_into("I", flag, 0, junk)
        assert bell.ring() is True and struct.unpack_from("I", flag)[0] == AWAKE
        struct.pack_into("I", flag, 0, junk)
        assert bell.wait(0.01, lambda: False, spin_s=0) is False
        r.try_put(b"x")
        assert bell.wait(1, r.pending, spin_s=0) and r.try_get() == b"x"
    bell.close()


def test_one_doorbell_serves_many_rings(shm) -> None:
    names, mm = shm
    ring_a, ring_b, flag = regions(mm)
    rings, bell = [Ring(ring_a), Ring(ring_b)], Doorbell(flag)
    rings[1].try_put(b"from client b")
    assert bell.wait(0, lambda: any(r.pending() for r in rings), spin_s=0)
    assert [r.try_get() for r in rings] == [None, b"from client b"]
    bell.close()


def test_doorbell_wait_sees_a_frame_already_published_without_blocking(shm) -> None:
    names, mm = shm
    ring_a, _, flag = regions(mm)
    r, bell = Ring(ring_a), Doorbell(flag)
    r.try_put(b"ready")
    assert bell.wait(0, r.pending, spin_s=0)
    bell.close()
