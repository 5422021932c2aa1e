"""Pinning: chunking, rollback, progress, turns, background pinning, balance, pre-faulting.

A fake backend stands in for cudaHostRegister so every behaviour is tested without a GPU; the
last tests pin real memory and run only when CUDA is present.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import threading

import pytest
from lazy import torch  # imported at its first use, not when the suite is collected

from kvshm.transfer import pinning
from kvshm.errors import InvalidArgumentError, PinningError
from kvshm.transfer.pinning import PAGE, pin_in_background, pin_region, plan_chunks, prefault

BASE = 1 << 40  # a page-aligned fake address: the fake backend never touches memory


class FakeBackend:
    """Records calls; fails register call number ``fail_at``; ``on_register(k)`` hooks call k."""

    def __init__(self, fail_at: int | None = None, on_register=None, bad_unregister=()):
        self.calls: list[tuple] = []
        self.registered: dict[int, int] = {}
        self.fail_at, self.on_register, self.bad_unregister = fail_at, on_register, bad_unregister
        self.n_register = 0

    def register(self, addr: int, nbytes: int) -> None:
        k, self.n_register = self.n_register, self.n_register + 1
        self.calls.append(("register", addr, nbytes))
        if self.on_register:
            self.on_register(k)
        if k == self.fail_at:
            raise PinningError("fake: out of memory")
        self.registered[addr] = nbytes

    def unregister(self, addr: int) -> None:
        self.calls.append(("unregister", addr))
        del self.registered[addr]  # KeyError = unbalanced
        if addr in self.bad_unregister:
            raise PinningError("fake: unregister failed")

    def clear_error(self) -> None:
        self.calls.append(("clear",))

    def sizes(self) -> list[int]:
        return [c[2] for c in self.calls if c[0] == "register"]


def pin(backend, nbytes=10 * PAGE, **kw):
    kw.setdefault("prefault_first", False)
    return pin_region(BASE, nbytes, backend=backend, **kw)


# --- chunking ------------------------------------------------------------------------------
def test_registers_in_consecutive_calls_of_at_most_chunk_bytes():
    b = FakeBackend()
    region = pin(b, 10 * PAGE, chunk_bytes=3 * PAGE)
    assert b.sizes() == [3 * PAGE, 3 * PAGE, 3 * PAGE, PAGE]
    assert [c[1] for c in b.calls] == [BASE + i * 3 * PAGE for i in range(4)]
    assert region.chunks == tuple((c[1], c[2]) for c in b.calls)


def test_chunks_end_on_row_boundaries():
    b = FakeBackend()
    pin(b, 20 * PAGE, chunk_bytes=8 * PAGE, align=3 * PAGE)
    assert b.sizes() == [6 * PAGE, 6 * PAGE, 6 * PAGE, 2 * PAGE]


def test_an_unaligned_start_still_cuts_on_page_boundaries():
    chunks = plan_chunks(BASE + 100, 5 * PAGE, 2 * PAGE)
    assert chunks[0] == (BASE + 100, 2 * PAGE - 100)
    assert all(a % PAGE == 0 for a, _ in chunks[1:])
    assert sum(n for _, n in chunks) == 5 * PAGE


def test_the_default_chunk_is_64_gib():
    b = FakeBackend()
    pin(b, 150 << 30)
    assert b.sizes() == [64 << 30, 64 << 30, 22 << 30]


# --- rollback ------------------------------------------------------------------------------
@pytest.mark.parametrize("k", [0, 1, 3])
def test_a_failure_at_chunk_k_unregisters_every_earlier_chunk_last_first(k):
    b = FakeBackend(fail_at=k)
    with pytest.warns(RuntimeWarning, match="continue unpinned"):
        assert pin(b, 10 * PAGE, chunk_bytes=2 * PAGE) is None
    unregistered = [c[1] for c in b.calls if c[0] == "unregister"]
    assert unregistered == [BASE + i * 2 * PAGE for i in reversed(range(k))]
    assert b.registered == {}
    assert b.calls[-1] == ("clear",)  # the sticky CUDA error is drained


def test_a_failing_unregister_does_not_stop_the_rollback():
    b = FakeBackend(fail_at=3, bad_unregister={BASE + 2 * PAGE})
    with pytest.warns(RuntimeWarning):
        assert pin(b, 10 * PAGE, chunk_bytes=2 * PAGE) is None
    assert b.registered == {}


def test_progress_reports_every_chunk():
    b, seen = FakeBackend(), []
    pin(b, 10 * PAGE, chunk_bytes=4 * PAGE, progress=lambda d, t: seen.append((d, t)))
    assert seen == [(0, 10 * PAGE), (4 * PAGE, 10 * PAGE), (8 * PAGE, 10 * PAGE),
                    (10 * PAGE, 10 * PAGE)]


def test_progress_returns_to_zero_after_a_rollback():
    b, seen = FakeBackend(fail_at=2), []
    with pytest.warns(RuntimeWarning):
        pin(b, 10 * PAGE, chunk_bytes=4 * PAGE, progress=lambda d, t: seen.append(d))
    assert seen == [0, 4 * PAGE, 8 * PAGE, 0]


def test_unregister_is_balanced_and_idempotent():
    b = FakeBackend()
    region = pin(b, 10 * PAGE, chunk_bytes=3 * PAGE)
    assert region.pinned
    region.unregister()
    region.unregister()
    assert b.registered == {} and not region.pinned
    assert sum(c[0] == "unregister" for c in b.calls) == 4


# --- turns ---------------------------------------------------------------------------------
class Turn:
    def __init__(self):
        self.held = False
        self.entries = 0

    def __enter__(self):
        self.held, self.entries = True, self.entries + 1

    def __exit__(self, *exc):
        self.held = False


@pytest.mark.parametrize("as_factory", [False, True])
def test_every_registration_happens_inside_one_turn(as_factory):
    turn = Turn()
    inside = []
    b = FakeBackend(on_register=lambda k: inside.append(turn.held))
    pin(b, 10 * PAGE, chunk_bytes=3 * PAGE, turn=(lambda: turn) if as_factory else turn)
    assert inside == [True] * 4 and turn.entries == 1 and not turn.held


def test_pre_faulting_runs_before_the_turn_is_taken(monkeypatch):
    log = []
    monkeypatch.setattr(pinning, "prefault", lambda a, n: log.append("prefault"))

    @contextlib.contextmanager
    def turn():
        log.append("turn")
        yield

    pin(FakeBackend(), 4 * PAGE, chunk_bytes=2 * PAGE, turn=turn(), prefault_first=True)
    assert log == ["prefault", "prefault", "turn"]


# --- no CUDA, bad arguments ----------------------------------------------------------------
# (Conditions as strings: evaluated when the test runs, so collecting this file imports no torch.)
@pytest.mark.skipif("torch.cuda.is_available()", reason="checks the no-GPU path")
def test_without_cuda_pin_region_warns_and_returns_none():
    with pytest.warns(RuntimeWarning, match="CUDA is not available"):
        assert pin_region(BASE, PAGE, prefault_first=False) is None


@pytest.mark.parametrize("addr,nbytes,kw", [
    (BASE, 0, {}), (0, PAGE, {}), (BASE, PAGE, {"align": 100}),
    (BASE, PAGE, {"chunk_bytes": PAGE, "align": 2 * PAGE})])
def test_invalid_arguments_are_refused(addr, nbytes, kw):
    with pytest.raises(InvalidArgumentError):
        pin_region(addr, nbytes, backend=FakeBackend(), **kw)


# --- background ----------------------------------------------------------------------------
def test_pin_in_background_returns_before_registration_finishes():
    gate = threading.Event()
    b = FakeBackend(on_register=lambda k: gate.wait())
    bg = pin_in_background(BASE, 4 * PAGE, chunk_bytes=2 * PAGE, backend=b, prefault_first=False)
    assert not bg.done and not bg.pinned
    gate.set()
    assert bg.wait()
    assert bg.pinned and bg.region.chunks == ((BASE, 2 * PAGE), (BASE + 2 * PAGE, 2 * PAGE))
    bg.unregister()
    assert b.registered == {} and not bg.pinned


def test_unregister_cancels_a_pin_in_progress_and_leaves_nothing_registered():
    entered, gate = threading.Event(), threading.Event()

    def hook(k):
        if k == 1:
            entered.set()
            gate.wait()

    b = FakeBackend(on_register=hook)
    bg = pin_in_background(BASE, 8 * PAGE, chunk_bytes=2 * PAGE, backend=b, prefault_first=False)
    entered.wait()
    bg.unregister(timeout=0)  # the pin is mid-chunk: it must undo itself
    gate.set()
    bg.wait()
    assert b.sizes() == [2 * PAGE, 2 * PAGE] and b.registered == {} and not bg.pinned


def test_a_background_failure_leaves_nothing_pinned():
    b = FakeBackend(fail_at=1)
    with pytest.warns(RuntimeWarning, match="continue unpinned"):
        bg = pin_in_background(BASE, 6 * PAGE, chunk_bytes=2 * PAGE, backend=b,
                               prefault_first=False)
        bg.wait()
    assert bg.done and not bg.pinned and b.registered == {}


# --- pre-faulting --------------------------------------------------------------------------
def _mapping(pages: int) -> tuple[mmap.mmap, int]:
    mm = mmap.mmap(-1, pages * PAGE)
    mm[:] = bytes(range(256)) * (pages * PAGE // 256)
    return mm, ctypes.addressof(ctypes.c_char.from_buffer(mm))


def test_prefault_uses_madvise_and_keeps_the_contents():
    mm, addr = _mapping(16)
    before = mm[:]
    assert prefault(addr + 10, 16 * PAGE - 10) == "madvise"
    assert mm[:] == before


def test_prefault_reads_each_page_when_madvise_is_unsupported(monkeypatch):
    monkeypatch.setattr(pinning, "_madvise", lambda *a: errno.EINVAL)
    mm, addr = _mapping(8)
    before = mm[:]
    assert prefault(addr, 8 * PAGE) == "touched"
    assert mm[:] == before


# --- real CUDA -----------------------------------------------------------------------------
@pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA GPU")
def test_a_real_region_is_pinned_then_released():
    mm, addr = _mapping(64)
    t = torch.frombuffer(mm, dtype=torch.uint8)
    region = pin_region(addr, 64 * PAGE, chunk_bytes=16 * PAGE)
    assert region is not None and len(region.chunks) == 4 and t.is_pinned()
    region.unregister()
    assert not t.is_pinned()
