"""A job's id checks in one compiled call, built on first use by the host's C compiler.

This module owns the one piece of compiled code on a transfer's path: a C loop that checks,
in a single pass over a job's ids, that every device and segment id is in range and that no
destination is named twice. numpy needs five or six calls for the same checks, and on a host
whose caches were evicted between an engine's steps each costs tens of microseconds: a cold
plan of 1,000 ids took 147-195 us with numpy and 95-124 with this call on a 2-core VM, and
on an H200's host a 16 KiB-block store issued after a 2 ms pause in 86 us instead of 140.

The C source below is compiled once per host with ``cc`` (``$CC`` if set) into the user's
cache directory, named by a hash of the source, the machine and the flags, and loaded with
ctypes (``PyDLL``: the GIL is held through the loop, a few microseconds). A library is loaded
only if it and its directory are this user's alone, and used only if it passes a self-test.
Where none of that works, every caller falls back to numpy: the answer is the same, slower.

It must never refuse a job by itself or accept one numpy would refuse: ``check`` answers
"valid" only when it is sure; anything else (a bad id, a repeat, a mark left by another
thread, ids it cannot read in place) sends the caller to the numpy checks, which decide and
word the error. It must never build at import (``import kvshm`` stays light): ``load``
builds, at handler construction.
"""
from __future__ import annotations

import contextlib
import ctypes
import itertools
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np

logger = logging.getLogger(__name__)

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

_BUILD_PREFIX = "build-"  # temporary build directories beside the library
_BUILD_SECONDS = 15       # a build takes ~0.1 s; a compiler that hangs costs no more than this
_FLAGS = ("-O2", "-shared", "-fPIC")  # no -march: a home directory may serve several CPUs
_I64 = np.dtype(np.int64)
_fn: Any = None           # the loaded function, once load() succeeded
_tried = False            # load() ran (and failed, if _fn is still None): never retried
_lock = threading.Lock()  # one build per process at a time
_mark: tuple[np.ndarray, int] = (np.zeros(0, np.uint32), 0)  # (marks, their address)
_gen = itertools.count(1)


def _after_fork_in_child() -> None:
    # A fork while another thread held the lock (building) would leave the child's copy held
    # for good; the child builds or loads for itself.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)


def _library_path() -> Path:
    import hashlib
    import platform
    what = "\0".join((_SOURCE, platform.machine(), *_FLAGS))
    digest = hashlib.sha256(what.encode()).hexdigest()[:16]
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    cache = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"  # XDG: relative is void
    return cache / "kvshm" / f"ids-{digest}.so"


def _build(path: Path) -> None:
    """Compile the source into ``path``; another process building the same file at the same
    time is harmless (each writes its own temporary file, then renames it into place)."""
    import shlex
    import shutil
    import subprocess
    import tempfile
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    for old in path.parent.glob(_BUILD_PREFIX + "*"):  # left by builds killed midway
        with contextlib.suppress(OSError):
            if time.time() - old.stat().st_mtime > 10 * _BUILD_SECONDS:
                shutil.rmtree(old)
    cc = shlex.split(os.environ.get("CC") or "cc")
    with tempfile.TemporaryDirectory(prefix=_BUILD_PREFIX, dir=path.parent) as tmp:
        src, out = Path(tmp) / "ids.c", Path(tmp) / "ids.so"
        src.write_text(_SOURCE)
        subprocess.run([*cc, *_FLAGS, "-o", str(out), str(src)], check=True,
                       capture_output=True, timeout=_BUILD_SECONDS)
        os.chmod(out, 0o755)
        os.replace(out, path)


def _open_trusted(path: Path) -> int:
    """A descriptor of the library, opened through a descriptor of its directory, both
    checked to be this user's and writable by nobody else: code another user could have
    written is never loaded, even if the path is swapped between the check and the load."""
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW, dir_fd=dfd)
        for f, what in ((dfd, path.parent), (fd, path)):
            st = os.fstat(f)
            if st.st_uid != os.getuid() or st.st_mode & 0o022:
                os.close(fd)
                raise PermissionError(f"{what} is not this user's alone (owner {st.st_uid}, "
                                      f"mode {st.st_mode & 0o777:o})")
        return fd
    finally:
        os.close(dfd)


def _dlopen(path: Path) -> Any:
    fd = _open_trusted(path)
    try:  # what the descriptor holds, not whatever the path names by now
        return ctypes.PyDLL(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def _self_test(fn: Any) -> bool:
    """The loaded function answers known cases rightly: a stale or foreign library must not
    be the one that says "valid"."""
    ids, dup = np.arange(2, dtype=np.int64), np.ones(2, np.int64)
    mark = np.zeros(2, np.uint32)
    a, d, m = ids.ctypes.data, dup.ctypes.data, mark.ctypes.data
    return (fn(a, 2, a, 2, 2, 2, 0, m, 1) == 1 and fn(a, 2, a, 2, 1, 2, 0, m, 2) == 0
            and fn(a, 2, a, 2, 2, 1, 1, m, 3) == 0 and fn(a, 2, d, 2, 2, 2, 0, m, 4) == 0)


def _load() -> Any:
    if not getattr(sys, "_is_gil_enabled", lambda: True)():
        logger.debug("kvshm: compiled id checks share marks under the GIL; none here: numpy")
        return None
    try:
        path = _library_path()
        if not path.exists():
            _build(path)
        try:
            lib = _dlopen(path)
        except PermissionError:
            raise
        except OSError:  # torn (a failed load leaves nothing loaded): build it again
            _build(path)
            lib = _dlopen(path)
        fn = lib.kvshm_ids_ok
        fn.restype = ctypes.c_int64
        fn.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                       ctypes.c_uint64, ctypes.c_uint64, ctypes.c_int64, ctypes.c_void_p,
                       ctypes.c_uint32]
    except Exception as e:  # no compiler, no usable cache: numpy does the checks, slower
        logger.debug("kvshm: compiled id checks unavailable (%s); using numpy", e)
        return None
    if not _self_test(fn):
        logger.warning("kvshm: %s answers its self-test wrongly; id checks use numpy (remove "
                       "the file to rebuild it)", path)
        return None
    return fn


def load() -> bool:
    """Build (once per host) and load the checker; True when ``check`` can answer."""
    global _fn, _tried
    if _tried:
        return _fn is not None
    with _lock:
        if not _tried:
            _fn = _load()
            _tried = True
    return _fn is not None


def check(dev: np.ndarray, seg: np.ndarray, n_dev: int, n_seg: int, dst_is_dev: bool) -> bool:
    """True only when every id is in range and no destination repeats; False when unsure.

    ``dev``, ``seg``: flat int64 arrays, read in place; read-only, strided or empty ones
    answer False (the numpy checks take them).
    """
    global _mark
    fn = _fn
    if fn is None or dev.dtype is not _I64 or seg.dtype is not _I64 or dev.ndim != 1 \
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
    return bool(fn(dev_ptr, dev.size, seg_ptr, seg.size, n_dev, n_seg, dst_is_dev, mark_ptr,
                   gen))


_at: Any = ctypes.c_char.from_buffer  # needs a writable, contiguous, non-empty buffer
_address = ctypes.addressof
