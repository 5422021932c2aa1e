"""A kernel job's whole issue in one compiled call: ids, ordering, timing events and launch.

This module owns the shortest path from a CUDA job's validated plan to its running kernel.
One C call writes the job's ids into the pinned index buffer and makes the five driver calls
that the handler otherwise makes one Python call at a time: record the caller's point on its
stream, make the lane's stream wait for it, record the start event, launch the copy kernel,
record the end event. Each Python-level call costs several microseconds when the host's caches
were evicted between an engine's steps, which is how jobs arrive; at 16 KiB pages a job's
whole copy takes ~330 us, so tens of microseconds of issue are most of what separates it from
one contiguous copy.

The driver's entry points are handed in (``Driver``), never looked up by the C code: the CPU
tests hand in recording fakes, and a process without libcuda never gets this far. The kernel
is described by a ``KernelShape`` that ``triton_copy`` fills in only when the compiled kernel's
parameters are exactly the ones this call passes (three pointers, three int32, Triton's two
scratch pointers unused); anything else keeps Triton's own launcher.

It must never launch after a failed step, never report a launch that did not happen, and never
choose an address: every id was validated by ``spec.plan_transfer``, and the buffer is one the
caller took from ``IndexBuffers`` for this job. It must never import torch or Triton.
"""
from __future__ import annotations

import ctypes
import logging
from dataclasses import dataclass
from typing import Any

from kvshm.shm.native import CLibrary

logger = logging.getLogger(__name__)

# The step a failed call stopped at (a result's upper half; the lower half is the CUresult).
# Before LAUNCH nothing was copied and the job may take another path; from END on the kernel
# is queued, only its end event is missing.
STEP_ARGS, STEP_ORDER, STEP_WAIT, STEP_START, STEP_LAUNCH, STEP_END = range(1, 7)

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
typedef int (*record_t)(void *event, void *stream);                    /* cuEventRecord */
typedef int (*wait_t)(void *stream, void *event, unsigned flags);      /* cuStreamWaitEvent */
typedef int (*launch_t)(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                        unsigned by, unsigned bz, unsigned shared, void *stream,
                        void **params, void **extra);                  /* cuLaunchKernel */

struct kvshm_launch {       /* filled once per compiled kernel by cuda_issue.Issue */
    record_t record;
    wait_t wait;
    launch_t launch;
    void *function;         /* the kernel (CUfunction) */
    uint64_t base, table;   /* its first and third arguments, fixed per handler */
    int32_t n_pairs, n_pieces;
    uint32_t grid_y, block_x, shared, has_sub;
};

#define FAIL(step, rc) (((int64_t)(step) << 32) | (uint32_t)(rc))

/* 0 when the kernel is queued between the start and end events; else FAIL(step, CUresult).
   idx: the pinned buffer the kernel reads through UVA (same address on both sides). */
int64_t kvshm_issue(const struct kvshm_launch *L, const int64_t *dev, const int64_t *rows,
                    const int64_t *subs, int64_t n, int64_t *idx, void *caller, void *order,
                    void *stream, void *start, void *end) {
    int rc;
    if (n <= 0 || n > 0x7fffffff || (L->has_sub && !subs)) return FAIL(1, 0);
    memcpy(idx, dev, (size_t)n * 8);
    memcpy(idx + n, rows, (size_t)n * 8);
    if (L->has_sub) memcpy(idx + 2 * n, subs, (size_t)n * 8);
    __atomic_thread_fence(__ATOMIC_SEQ_CST);   /* the ids before anything the GPU may run */
    if ((rc = L->record(order, caller))) return FAIL(2, rc);
    if ((rc = L->wait(stream, order, 0))) return FAIL(3, rc);
    if ((rc = L->record(start, stream))) return FAIL(4, rc);
    uint64_t idx_dev = (uint64_t)(uintptr_t)idx;
    int32_t n32 = (int32_t)n, pairs = L->n_pairs, pieces = L->n_pieces;
    uint64_t scratch = 0, profile = 0;  /* Triton's global and profile scratch: unused */
    void *params[] = {(void *)&L->base, &idx_dev, (void *)&L->table, &n32, &pairs, &pieces,
                      &scratch, &profile};
    if ((rc = L->launch(L->function, (unsigned)n, L->grid_y, 1, L->block_x, 1, 1, L->shared,
                        stream, params, 0))) return FAIL(5, rc);
    if ((rc = L->record(end, stream))) return FAIL(6, rc);
    return 0;
}
"""


class _Launch(ctypes.Structure):
    _fields_ = [("record", ctypes.c_void_p), ("wait", ctypes.c_void_p),
                ("launch", ctypes.c_void_p), ("function", ctypes.c_void_p),
                ("base", ctypes.c_uint64), ("table", ctypes.c_uint64),
                ("n_pairs", ctypes.c_int32), ("n_pieces", ctypes.c_int32),
                ("grid_y", ctypes.c_uint32), ("block_x", ctypes.c_uint32),
                ("shared", ctypes.c_uint32), ("has_sub", ctypes.c_uint32)]


@dataclass(frozen=True)
class Driver:
    """Addresses of ``cuEventRecord``, ``cuStreamWaitEvent`` and ``cuLaunchKernel``."""
    record: int
    wait: int
    launch: int

    @classmethod
    def load(cls) -> Driver | None:
        """The process's CUDA driver's entry points; None without one."""
        try:
            cuda = ctypes.CDLL("libcuda.so.1")
            return cls(*(ctypes.cast(getattr(cuda, name), ctypes.c_void_p).value or 0
                         for name in ("cuEventRecord", "cuStreamWaitEvent", "cuLaunchKernel")))
        except (OSError, AttributeError):
            return None


@dataclass(frozen=True)
class KernelShape:
    """What a direct launch of the copy kernel needs (``triton_copy.compiled_shape``)."""
    function: int   # CUfunction
    base: int       # the kernel's word base pointer
    table: int      # its per-pair table (device memory)
    n_pairs: int
    n_pieces: int
    grid_y: int     # n_pairs * n_pieces
    block_x: int    # 32 * num_warps
    shared: int     # dynamic shared memory, bytes


def _self_test(fns: dict[str, Any]) -> bool:
    """Refuses a bad job before any driver call, writing nothing: a library that launched or
    wrote here would be the wrong one."""
    launch = _Launch(has_sub=1)
    idx = (ctypes.c_int64 * 2)(7, 7)
    return bool(fns["kvshm_issue"](ctypes.byref(launch), None, None, None, 0, idx, None, None,
                                   None, None, None) == STEP_ARGS << 32
                and fns["kvshm_issue"](ctypes.byref(launch), idx, idx, None, 1, idx, None,
                                       None, None, None, None) == STEP_ARGS << 32
                and list(idx) == [7, 7])


LIBRARY = CLibrary("issue", "kernel issue", _SOURCE, {"kvshm_issue": (ctypes.c_int64, [
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
    ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
    ctypes.c_void_p])}, _self_test)


class Issue:
    """One compiled kernel's issue path; ``Issue.make`` returns None where it cannot run.

    The GIL is held through each call (a few us of memcpy and driver calls), as
    ``CLibrary`` loads every library.
    """

    def __init__(self, fn: Any, driver: Driver, shape: KernelShape, has_sub: bool) -> None:
        self._fn = fn
        self._launch = _Launch(driver.record, driver.wait, driver.launch, shape.function,
                               shape.base, shape.table, shape.n_pairs, shape.n_pieces,
                               shape.grid_y, shape.block_x, shape.shared, int(has_sub))
        self._ref = ctypes.byref(self._launch)

    @classmethod
    def make(cls, driver: Driver | None, shape: KernelShape | None,
             has_sub: bool) -> Issue | None:
        if driver is None or shape is None or not LIBRARY.load():
            return None
        assert LIBRARY.fns is not None
        return cls(LIBRARY.fns["kvshm_issue"], driver, shape, has_sub)

    def __call__(self, dev: int, rows: int, subs: int | None, n: int, idx: int, caller: int,
                 order: int, stream: int, start: int, end: int) -> int:
        """Issue one job (addresses and handles as ints); 0, or ``step << 32 | CUresult``."""
        return int(self._fn(self._ref, dev, rows, subs, n, idx, caller, order, stream, start,
                            end))


def failed_step(result: int) -> tuple[int, int]:
    """(step, CUresult) of a nonzero ``Issue`` result."""
    return result >> 32, result & 0xFFFFFFFF
