"""A kernel job's compiled issue: what it writes, which driver calls it makes in which order,
and that it stops at the first refusal, never launching after one.

The driver here is a recording fake (C-callable Python functions handed in as ``Driver``):
these are unit tests of kvshm's own C logic. The same path on a real GPU is tested in
tests/test_transfer.py, which checks every byte a Triton-method job moves.
"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from kvshm.transfer import cuda_issue
from kvshm.transfer.cuda_issue import (
    STEP_ARGS,
    STEP_END,
    STEP_LAUNCH,
    STEP_ORDER,
    STEP_START,
    STEP_WAIT,
    Driver,
    Issue,
    KernelShape,
    failed_step,
)

needs_native = pytest.mark.skipif(not cuda_issue.LIBRARY.load(),
                                  reason="no C compiler on this host")

_RECORD = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
_WAIT = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_uint)
_LAUNCH = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, *[ctypes.c_uint] * 7,
                           ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)

SHAPE = KernelShape(function=0xF00, base=0xBA5E, table=0x7AB1E, n_pairs=3, n_pieces=2,
                    grid_y=6, block_x=128, shared=0)
CALLER, ORDER, STREAM, START, END = 0x11, 0x22, 0x33, 0x44, 0x55


class FakeDriver:
    """Records every call; ``fail`` names the call (by position, from 1) that returns 700."""

    def __init__(self, fail: int = 0) -> None:
        self.calls: list[tuple] = []
        self.fail = fail
        self.params: list[int] = []
        self.ids_at_launch: np.ndarray | None = None
        self.idx: np.ndarray | None = None
        # the callbacks must outlive every call: kept on self
        self._record, self._wait, self._launch = (_RECORD(self.record), _WAIT(self.wait),
                                                  _LAUNCH(self.launch))
        self.driver = Driver(*(ctypes.cast(f, ctypes.c_void_p).value or 0
                               for f in (self._record, self._wait, self._launch)))

    def _answer(self) -> int:
        return 700 if len(self.calls) == self.fail else 0

    def record(self, event, stream):
        self.calls.append(("record", event, stream or 0))
        return self._answer()

    def wait(self, stream, event, flags):
        self.calls.append(("wait", stream, event, flags))
        return self._answer()

    def launch(self, f, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        self.calls.append(("launch", f, gx, gy, gz, bx, by, bz, shared, stream, extra or 0))
        ptrs = [params[k] for k in range(8)]
        self.params = [ctypes.c_uint64.from_address(p).value for p in ptrs[:3]] + \
            [ctypes.c_int32.from_address(p).value for p in ptrs[3:6]] + \
            [ctypes.c_uint64.from_address(p).value for p in ptrs[6:]]
        assert self.idx is not None
        self.ids_at_launch = self.idx.copy()  # what the kernel would read
        return self._answer()


def issue(fake: FakeDriver, dev, rows, subs=None, has_sub=False, n=None, words=64):
    call = Issue.make(fake.driver, SHAPE, has_sub)
    assert call is not None
    dev, rows = np.asarray(dev, np.int64), np.asarray(rows, np.int64)
    subs_arr = None if subs is None else np.asarray(subs, np.int64)
    fake.idx = np.full(words, -9, np.int64)
    rc = call(dev.ctypes.data, rows.ctypes.data,
              None if subs_arr is None else subs_arr.ctypes.data,
              dev.size if n is None else n, fake.idx.ctypes.data, CALLER, ORDER, STREAM, START,
              END)
    return rc, fake.idx


@needs_native
def test_a_job_writes_its_ids_then_waits_records_launches_and_records_its_end():
    fake = FakeDriver()
    rc, idx = issue(fake, [5, 1, 4], [9, 2, 7])
    assert rc == 0
    assert fake.calls == [
        ("record", ORDER, CALLER),
        ("wait", STREAM, ORDER, 0),
        ("record", START, STREAM),
        ("launch", SHAPE.function, 3, SHAPE.grid_y, 1, SHAPE.block_x, 1, 1, SHAPE.shared,
         STREAM, 0),
        ("record", END, STREAM),
    ]
    assert list(idx[:6]) == [5, 1, 4, 9, 2, 7] and set(idx[6:]) == {-9}


@needs_native
def test_the_kernel_gets_its_pointers_then_three_int32_then_two_null_scratch_pointers():
    fake = FakeDriver()
    rc, idx = issue(fake, [5, 1, 4], [9, 2, 7])
    assert rc == 0
    assert fake.params == [SHAPE.base, idx.ctypes.data, SHAPE.table, 3, SHAPE.n_pairs,
                           SHAPE.n_pieces, 0, 0]


@needs_native
def test_the_ids_are_in_the_buffer_before_the_launch():
    fake = FakeDriver()
    issue(fake, [5, 1], [9, 2], [1, 0], has_sub=True)
    assert fake.ids_at_launch is not None
    assert list(fake.ids_at_launch[:6]) == [5, 1, 9, 2, 1, 0]


@needs_native
def test_without_sub_blocks_only_two_rows_of_ids_are_written():
    fake = FakeDriver()
    _, idx = issue(fake, [3, 8], [4, 6], [1, 1], has_sub=False)
    assert list(idx[:4]) == [3, 8, 4, 6] and set(idx[4:]) == {-9}


@needs_native
@pytest.mark.parametrize("step,calls", [(STEP_ORDER, 1), (STEP_WAIT, 2), (STEP_START, 3),
                                        (STEP_LAUNCH, 4), (STEP_END, 5)])
def test_a_refused_driver_call_is_the_last_one_made_and_names_its_step(step, calls):
    fake = FakeDriver(fail=calls)
    rc, _ = issue(fake, [5, 1, 4], [9, 2, 7])
    assert failed_step(rc) == (step, 700)
    assert len(fake.calls) == calls


@needs_native
@pytest.mark.parametrize("n", [0, -1, 1 << 31])
def test_a_job_of_no_or_too_many_blocks_makes_no_call_and_writes_nothing(n):
    fake = FakeDriver()
    rc, idx = issue(fake, [5], [9], n=n)
    assert failed_step(rc) == (STEP_ARGS, 0)
    assert fake.calls == [] and set(idx) == {-9}


@needs_native
def test_sub_blocks_promised_but_not_given_make_no_call():
    fake = FakeDriver()
    rc, idx = issue(fake, [5], [9], None, has_sub=True)
    assert failed_step(rc) == (STEP_ARGS, 0)
    assert fake.calls == [] and set(idx) == {-9}


def test_without_a_driver_or_a_kernel_shape_there_is_no_compiled_issue():
    fake = FakeDriver()
    assert Issue.make(None, SHAPE, False) is None
    assert Issue.make(fake.driver, None, False) is None
