"""A job's id checks in one compiled call, built on first use by the host's C compiler.

This module owns the compiled code on a transfer's path: a C loop that checks,
in a single pass over a job's ids, that every device and segment id is in range and that no
destination is named twice. numpy needs five or six calls for the same checks, and on a host
whose caches were evicted between an engine's steps each costs tens of microseconds: a cold
plan of 1,000 ids took 147-195 us with numpy and 95-124 with this call on a 2-core VM, and
on an H200's host a 16 KiB-block store issued after a 2 ms pause in 86 us instead of 140.

The C source below is built once per host and loaded as ``shm/native.py`` says (its own
user's, self-tested, the GIL held through the loop). Where that does not work, every caller
falls back to numpy: the answer is the same, slower.

It must never refuse a job by itself or accept one numpy would refuse: ``check`` answers
"valid" only when it is sure; anything else (a bad id, a repeat, a mark left by another
thread, ids it cannot read in place) sends the caller to the numpy checks, which decide and
word the error. It must never build at import (``import kvshm`` stays light): ``load``
builds, at handler construction.
"""
from __future__ import annotations

import ctypes
import itertools
from typing import Any

import numpy as np

from kvshm.shm.native import CLibrary

_SOURCE = r"""
#include <stdint.h>
/* 1 when every dev[i] < n_dev and seg[i] < n_seg (compared unsigned: a negative id is huge)
   and no id of the destinations (dev when dst_is_dev, else seg) repeats; else 0.
   mark: one word per possible destination id; a word equal to gen marks an id seen in this
   call (no clearing between calls: gen changes instead). Every id is read once: the caller's
   memory may change under us, and a mark must never be written outside the array, so a
   destination id is checked against its range in the same read that marks it. */
int64_t kvshm_ids_ok(const int64_t *dev, int64_t nd, const int64_t *seg, int64_t ns,
                     uint64_t n_dev, uint64_t n_seg, int64_t dst_is_dev, uint32_t *mark,
                     uint32_t gen) {
    const int64_t *src = dst_is_dev ? seg : dev, *dst = dst_is_dev ? dev : seg;
    int64_t n_src = dst_is_dev ? ns : nd, n_dst = dst_is_dev ? nd : ns;
    uint64_t lim_src = dst_is_dev ? n_seg : n_dev, lim_dst = dst_is_dev ? n_dev : n_seg;
    for (int64_t i = 0; i < n_src; i++)
        if ((uint64_t)src[i] >= lim_src) return 0;
    for (int64_t i = 0; i < n_dst; i++) {
        uint64_t d = (uint64_t)*(const volatile int64_t *)&dst[i];  /* one load, kept */
        if (d >= lim_dst || mark[d] == gen) return 0;
        mark[d] = gen;
    }
    return 1;
}
"""

_I64 = np.dtype(np.int64)
_mark: tuple[np.ndarray, int] = (np.zeros(0, np.uint32), 0)  # (marks, their address)
_gen = itertools.count(1)


def _self_test(fns: dict[str, Any]) -> bool:
    """The loaded function answers known cases rightly: a stale or foreign library must not
    be the one that says "valid"."""
    fn = fns["kvshm_ids_ok"]
    ids, dup = np.arange(2, dtype=np.int64), np.ones(2, np.int64)
    mark = np.zeros(2, np.uint32)
    a, d, m = ids.ctypes.data, dup.ctypes.data, mark.ctypes.data
    return (fn(a, 2, a, 2, 2, 2, 0, m, 1) == 1 and fn(a, 2, a, 2, 1, 2, 0, m, 2) == 0
            and fn(a, 2, a, 2, 2, 1, 1, m, 3) == 0 and fn(a, 2, d, 2, 2, 2, 0, m, 4) == 0)


LIBRARY = CLibrary("ids", "id checks", _SOURCE, {"kvshm_ids_ok": (ctypes.c_int64, [
    ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64, ctypes.c_uint64,
    ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_uint32])}, _self_test,
    needs_gil=True)  # the marks are shared by every thread's calls


def load() -> bool:
    """Build (once per host) and load the checker; True when ``check`` can answer."""
    return LIBRARY.load()


def check(dev: np.ndarray, seg: np.ndarray, n_dev: int, n_seg: int, dst_is_dev: bool) -> bool:
    """True only when every id is in range and no destination repeats; False when unsure.

    ``dev``, ``seg``: flat int64 arrays, read in place; read-only, strided or empty ones
    answer False (the numpy checks take them).
    """
    global _mark
    fns = LIBRARY.fns
    if fns is None or dev.dtype is not _I64 or seg.dtype is not _I64 or dev.ndim != 1 \
            or seg.ndim != 1:
        return False
    try:  # the addresses through the buffer protocol: a third of what ndarray.ctypes costs
        dev_ptr, seg_ptr = _address(_at(dev)), _address(_at(seg))
    except (TypeError, ValueError, BufferError):
        return False
    mark, mark_ptr = _mark
    limit = n_dev if dst_is_dev else n_seg
    gen = next(_gen) & 0xFFFFFFFF
    # Wrapped (gen 0): marks of 2**32 calls ago could look current. Fresh marks, never
    # fill(0): numpy fills without the GIL, and another thread's call may be using these
    # marks meanwhile (its first mark of an id wiped, it would miss the repeat).
    if mark.size < limit or gen == 0:
        mark = np.zeros(max(limit, mark.size), np.uint32)
        mark_ptr = mark.ctypes.data
        _mark = (mark, mark_ptr)
        gen = gen or next(_gen) & 0xFFFFFFFF
    # The GIL is held through the call (PyDLL), so no other thread's call interleaves; one that
    # ran between our taking gen and calling can only leave false alarms, which the numpy
    # checks then clear, and never hide a duplicate: an id's second occurrence sees its first.
    return bool(fns["kvshm_ids_ok"](dev_ptr, dev.size, seg_ptr, seg.size, n_dev, n_seg,
                                    dst_is_dev, mark_ptr, gen))


_at: Any = ctypes.c_char.from_buffer  # needs a writable, contiguous, non-empty buffer
_address = ctypes.addressof
