"""A job's id checks in one compiled call, built on first use by the host's C compiler.

This module owns the one piece of compiled code on a transfer's path: a C loop that checks,
in a single pass over a job's ids, that every device and segment id is in range and that no
destination is named twice. numpy needs five or six calls for the same checks, and on a host
whose caches were evicted between an engine's steps each of them costs tens of microseconds:
a cold job of 1,000 blocks spent 150-180 us validating (numpy) against 60-90 (this call),
which is a third of a 16 KiB-block job's whole time on CUDA.

The C source below is compiled once per host with ``cc`` (``$CC`` if set) into the user's
cache directory, named by a hash of the source, and loaded with ctypes (``PyDLL``: the GIL is
held; the loop takes a few microseconds). Where no compiler works the loader says so once at
debug level and every caller falls back to numpy: the answer is the same, only slower.

It must never be the only check that refuses a job: ``check`` answers "valid" only when it is
sure; anything else (a bad id, a duplicate, a mark left by another thread, ids it cannot read
in place) sends the caller to the numpy checks, which find the reason and word the error.
It must never build at import (``import kvshm`` stays light): ``load`` builds, at handler
construction.
"""
from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import os
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

_SOURCE = r"""
#include <stdint.h>
/* 1 when every dev[i] < n_dev and seg[i] < n_seg (compared unsigned: a negative id is huge)
   and no id of the destinations (dev when dst_is_dev, else seg) repeats; else 0.
   mark: one word per possible destination id; a word equal to gen marks an id seen in this
   call (no clearing between calls: gen changes instead). */
int64_t kvshm_ids_ok(const int64_t *dev, int64_t nd, const int64_t *seg, int64_t ns,
                     uint64_t n_dev, uint64_t n_seg, int64_t dst_is_dev, uint32_t *mark,
                     uint32_t gen) {
    for (int64_t i = 0; i < nd; i++)
        if ((uint64_t)dev[i] >= n_dev) return 0;
    for (int64_t i = 0; i < ns; i++)
        if ((uint64_t)seg[i] >= n_seg) return 0;
    const int64_t *dst = dst_is_dev ? dev : seg;
    int64_t m = dst_is_dev ? nd : ns;
    for (int64_t i = 0; i < m; i++) {
        if (mark[dst[i]] == gen) return 0;
        mark[dst[i]] = gen;
    }
    return 1;
}
"""

_I64 = np.dtype(np.int64)
_fn: Any = None           # the loaded function, once load() succeeded
_tried = False            # load() ran (and failed, if _fn is still None): never retried
_lock = threading.Lock()  # one build per process at a time
_mark: tuple[np.ndarray, int] = (np.zeros(0, np.uint32), 0)  # (marks, their address)
_gen = itertools.count(1)


def _library_path() -> Path:
    digest = hashlib.sha256(_SOURCE.encode()).hexdigest()[:16]
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "kvshm" / f"ids-{digest}.so"


def _build(path: Path) -> None:
    """Compile the source into ``path``; another process building the same file at the same
    time is harmless (each writes its own temporary file, then renames it into place)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    cc = os.environ.get("CC") or "cc"
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        src, out = Path(tmp) / "ids.c", Path(tmp) / "ids.so"
        src.write_text(_SOURCE)
        subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(out), str(src)],
                       check=True, capture_output=True, timeout=60)
        os.replace(out, path)


def load() -> bool:
    """Build (once per host) and load the checker; True when ``check`` can answer."""
    global _fn, _tried
    if _tried:
        return _fn is not None
    with _lock:
        if not _tried:
            try:
                path = _library_path()
                if not path.exists():
                    _build(path)
                fn = ctypes.PyDLL(str(path)).kvshm_ids_ok
                fn.restype = ctypes.c_int64
                fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                               ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p,
                               ctypes.c_uint32]
                _fn = fn
            except Exception as e:  # no compiler, no writable cache: numpy does the checks
                logger.debug("kvshm: compiled id checks unavailable (%s); using numpy", e)
            _tried = True
    return _fn is not None


def check(dev: np.ndarray, seg: np.ndarray, n_dev: int, n_seg: int, dst_is_dev: bool) -> bool:
    """True only when every id is in range and no destination repeats; False when unsure.

    ``dev``, ``seg``: flat int64 arrays, read in place; read-only, strided or empty ones
    answer False (the numpy checks take them).
    """
    global _mark
    fn = _fn
    if fn is None or dev.dtype is not _I64 or seg.dtype is not _I64:
        return False
    try:  # the addresses through the buffer protocol: a third of what ndarray.ctypes costs
        dev_ptr, seg_ptr = _address(_at(dev)), _address(_at(seg))
    except (TypeError, ValueError, BufferError):
        return False
    mark, mark_ptr = _mark
    limit = n_dev if dst_is_dev else n_seg
    if mark.size < limit:
        mark = np.zeros(limit, np.uint32)
        mark_ptr = mark.ctypes.data
        _mark = (mark, mark_ptr)
    gen = next(_gen) & 0xFFFFFFFF
    if gen == 0:  # wrapped: marks of 2**32 calls ago could look current
        mark.fill(0)
        gen = next(_gen) & 0xFFFFFFFF
    # The GIL is held through the call (PyDLL), so no other thread's call interleaves; one that
    # ran between our taking gen and calling can only leave false alarms, which the numpy
    # checks then clear, and never hide a duplicate: an id's second occurrence sees its first.
    return bool(fn(dev_ptr, dev.size, seg_ptr, seg.size, n_dev, n_seg, dst_is_dev, mark_ptr,
                   gen))


_at: Any = ctypes.c_char.from_buffer  # needs a writable, contiguous, non-empty buffer
_address = ctypes.addressof
