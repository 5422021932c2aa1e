"""CPU transfer handler: block copies between CPU "device" tensors and segment planes.

This module owns the handler used by CPU engines and by every test on a machine without a GPU:
one worker thread per lane (a direction, or expedited loads; jobs FIFO within a lane, lanes
overlap, so an expedited load never waits behind queued loads or stores), the
copy loop over coalesced byte runs, the optional split of a big job over helper threads, and
completion bookkeeping (results, per-job events for ``wait``).

It must never move a byte before the job has been validated (``plan_transfer`` runs in the
caller's thread and raises there), let a copy exception kill a worker thread (the job reports
``success=False`` instead), or report a job finished before its bytes are in place.

How bytes move: one ``ctypes.memmove`` per coalesced run. It releases the GIL while it copies;
measured on the 2-core dev box with 1,000 shuffled blocks it reaches 60-90% of one contiguous
copy from 64 KiB blocks up, while ``index_copy_`` scatters at 1.5-3 GB/s and a per-block torch
``copy_`` loop at 0.3-15 GB/s (it fans copies out to OpenMP threads and stalls when a core is
busy). Opt-in ``copier="vm"`` uses ``process_vm_readv`` on our own pid instead: 1,024 runs per
system call and kernel-checked addresses, but slower here (this VM hides ERMS from the kernel's
copy routine), so it is not the default; where the kernel refuses it, it falls back to memmove.
Every address comes from validated block ids and is bounds-checked in ``job_runs`` first.

Block checksums (``checksums=BlockSums(segment)``, for a ``Layout(checksums=True)`` segment):
after a store's bytes are in place, and before the job is reported done, the worker writes the
crc32 of every segment block page it wrote, for the planes this handler copies; after a load's
copy it recomputes them, and a mismatch fails the job with a ``TransferError`` naming the
corrupt blocks (``TransferResult.error``) and adds to the ``checksum_failures`` counter. See
``kvshm.shm.checksums``; the CUDA handler does neither.
"""
from __future__ import annotations

import collections
import ctypes
import errno
import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from kvshm import crashpoints
from kvshm.errors import InvalidArgumentError, TransferError
from kvshm.transfer import native_check
from kvshm.transfer.spec import (
    LANES,
    BlockPlan,
    Geometry,
    TransferHandler,
    TransferResult,
    TransferSpec,
    build_geometry,
    job_runs,
    plan_transfer,
)

if TYPE_CHECKING:
    import torch

    from kvshm.shm.checksums import BlockSums

logger = logging.getLogger(__name__)

_memmove = ctypes.memmove  # a CFUNCTYPE: releases the GIL while it copies
_libc = ctypes.CDLL(None, use_errno=True)
_vm_readv = _libc.process_vm_readv
_vm_readv.restype = ctypes.c_ssize_t
_vm_readv.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_ulong, ctypes.c_void_p,
                      ctypes.c_ulong, ctypes.c_ulong]
IOV_MAX = 1024           # iovecs per call (UIO_MAXIOV)
VM_MAX_BYTES = 1 << 30   # per call: the kernel silently truncates beyond ~2 GiB (MAX_RW_COUNT)
_vm_usable = True        # cleared once, process-wide, if the kernel refuses the call


@dataclass
class _Job:
    job_id: int
    plan: BlockPlan
    done: threading.Event


class CpuTransferHandler(TransferHandler):
    """Copies on background threads; the same semantics as the CUDA handler.

    ``threads``: copy threads per job (the direction's worker plus helpers); a job of at least
    ``split_min_bytes`` whose runs average ``split_min_run`` bytes or more is cut into that many
    byte-balanced parts. Why: one big copy uses non-temporal stores (glibc switches above
    ~192 MiB here) and per-block copies do not, so one thread tops out near 70% of it; a second
    thread closes the gap when a core is free. Small jobs and small runs stay on one thread:
    waking a helper costs more than it saves, and the GIL serialises per-run Python cost.
    ``copier``: ``memmove`` (default) or ``vm`` (process_vm_readv, memmove where refused).
    ``inline``: the kinds (``"load"``, ``"store"``) copied in the caller's thread, inside
    ``transfer_async``, instead of on a lane's thread. For an engine whose KV cache is on the
    CPU: its compute threads hold every core, so a copy thread only takes a core from them
    (and its hand-offs cost a wake-up each way), while the copy itself is no shorter there.
    """

    def __init__(self, device_tensors: Sequence[torch.Tensor], planes: Sequence[torch.Tensor],
                 *, block_size_factor: int = 1,
                 kv_dim_before_num_blocks: Sequence[bool] | None = None,
                 threads: int | None = None, split_min_bytes: int = 8 << 20,
                 split_min_run: int = 64 << 10, copier: str = "memmove",
                 checksums: BlockSums | None = None, inline: Iterable[str] = ()) -> None:
        self._geo: Geometry = build_geometry(device_tensors, planes, block_size_factor,
                                             kv_dim_before_num_blocks)
        native_check.load()  # a job's id checks in one call (built once per host)
        if any(p.device.device.type != "cpu" for p in self._geo.pairs):
            raise InvalidArgumentError("CpuTransferHandler needs CPU device tensors; use "
                                       "make_handler to get the CUDA handler for CUDA tensors")
        if copier not in ("memmove", "vm"):
            raise InvalidArgumentError(f"copier must be 'memmove' or 'vm', got {copier!r}")
        self._copy_runs = _memmove_runs if copier == "memmove" else _vm_or_memmove_runs
        self._sums = checksums
        self._sum_planes = sorted({checksums.plane_of(p.plane_ptr) for p in self._geo.pairs}) \
            if checksums is not None else []
        self._inline = frozenset(inline)
        if not self._inline <= {"load", "store"}:
            raise InvalidArgumentError(f"inline takes 'load' and 'store', got {sorted(inline)}")
        self._threads = max(1, threads if threads is not None else min(2, os.cpu_count() or 1))
        self._split_min, self._split_min_run = split_min_bytes, split_min_run
        self._helpers = ThreadPoolExecutor(2 * (self._threads - 1), "kvshm-copy-helper") \
            if self._threads > 1 else None
        self._lock = threading.Lock()
        self._pending: dict[int, _Job] = {}
        self._finished: list[TransferResult] = []
        self._closed = False
        self._queues: dict[str, queue.SimpleQueue] = {}
        self._workers: list[threading.Thread] = []
        for lane in LANES:
            q: queue.SimpleQueue = queue.SimpleQueue()
            t = threading.Thread(target=self._lane, args=(q,), name=f"kvshm-{lane}", daemon=True)
            self._queues[lane] = q
            self._workers.append(t)
            t.start()

    # --- interface -----------------------------------------------------------------------
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        plan = plan_transfer(spec, self._geo)  # raises before anything is queued
        job = _Job(job_id, plan, threading.Event())
        with self._lock:  # check-and-queue atomically: shutdown cannot slip in between
            if self._closed:
                raise TransferError("transfer handler is shut down; create a new one")
            if job_id in self._pending:
                raise InvalidArgumentError(f"job {job_id} is still in flight; job ids must be "
                                           f"unique among unfinished jobs")
            self._pending[job_id] = job
            if spec.kind not in self._inline:
                self._queues[spec.lane].put(job)
                return True
        self._run(job)  # (inline) done before we return; wait() finds nothing to wait for
        return True

    def get_finished(self) -> list[TransferResult]:
        with self._lock:
            out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: Iterable[int]) -> None:
        with self._lock:
            events = [self._pending[j].done for j in job_ids if j in self._pending]
        for ev in events:
            ev.wait()

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for q in self._queues.values():
                q.put(None)  # after every queued job: shutdown drains
        for t in self._workers:
            t.join()
        if self._helpers is not None:
            self._helpers.shutdown(wait=True)

    # --- worker side ---------------------------------------------------------------------
    def _lane(self, q: queue.SimpleQueue) -> None:
        while (job := q.get()) is not None:
            self._run(job)

    def _run(self, job: _Job) -> None:
        """Copy ``job``, then make its result visible and set its event."""
        t0 = time.perf_counter()
        error: Exception | None = None
        try:
            nbytes, ok = self._copy(job), True
            if self._sums is not None:
                self._check_sums(job)
        except Exception as e:  # the job fails, the thread lives on
            logger.exception("kvshm: %s job %d failed", job.plan.kind, job.job_id)
            nbytes, ok, error = 0, False, e
        result = TransferResult(job.job_id, ok, nbytes, time.perf_counter() - t0,
                                job.plan.kind, error)
        with self._lock:  # result is visible before wait() returns
            self._finished.append(result)
            del self._pending[job.job_id]
        job.done.set()

    def _check_sums(self, job: _Job) -> None:
        """After the copy: a store records its pages' sums, a load verifies them."""
        sums = self._sums
        assert sums is not None  # called only when the handler was given checksums
        blocks = np.unique(job.plan.segment_rows)
        if job.plan.kind == "store":
            sums.store(blocks, self._sum_planes)
            return
        bad = sums.bad(blocks, self._sum_planes)
        if bad:
            sums.count_failure(len({b for b, _ in bad}))
            raise TransferError(
                f"load job {job.job_id}: block(s) {sorted({b for b, _ in bad})} are corrupt "
                f"(plane page checksum mismatch at (block, plane) {bad[:8]}); recompute them")

    def _copy(self, job: _Job) -> int:
        """Copy every run of ``job``; returns the bytes moved."""
        runs = job_runs(job.plan, self._geo)
        if not runs or runs[0].nbytes.size == 0:
            return 0
        dev = np.concatenate([r.pair.device_ptr + r.device_off for r in runs])
        seg = np.concatenate([r.pair.plane_ptr + r.plane_off for r in runs])
        nb = np.concatenate([r.nbytes for r in runs])
        dst, src = (seg, dev) if job.plan.kind == "store" else (dev, seg)
        total = int(nb.sum())
        # Split only big jobs of big runs: small runs are bound by per-run Python cost, which
        # a second thread cannot share (the GIL) — measured: 16 KiB runs got slower split.
        big = total >= self._split_min and total >= self._split_min_run * nb.size
        parts = self._threads if self._helpers is not None and big else 1
        if crashpoints.ARMED and job.plan.kind == "store":  # tests: freeze a store half-done
            half = nb // 2
            self._copy_runs(dst, src, half)
            crashpoints.crash_point("worker.store.mid_copy")
            self._copy_runs(dst + half, src + half, nb - half)
            return total
        if parts == 1 or nb.size < 2:
            self._copy_runs(dst, src, nb)
            return total
        # byte-balanced cut points, so each thread copies about total / parts
        cuts = np.searchsorted(np.cumsum(nb), total * np.arange(1, parts) / parts)
        bounds = [0, *np.unique(np.clip(cuts, 1, nb.size - 1)).tolist(), nb.size]
        pieces = [slice(a, b) for a, b in itertools.pairwise(bounds) if b > a]
        helpers = self._helpers
        assert helpers is not None  # parts > 1 only with helper threads
        futures = [helpers.submit(self._copy_runs, dst[s], src[s], nb[s])
                   for s in pieces[1:]]
        try:
            self._copy_runs(dst[pieces[0]], src[pieces[0]], nb[pieces[0]])
        finally:
            for f in futures:  # never report before every part landed, even on error
                f.result()
        return total


def _memmove_runs(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> None:
    # map() keeps the per-run Python cost to the ctypes call itself (~0.4 us)
    collections.deque(map(_memmove, dst.tolist(), src.tolist(), nbytes.tolist()), maxlen=0)


class VmUnsupported(OSError):
    """process_vm_readv is not permitted here; nothing was copied."""


def _vm_runs(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray,
             max_bytes: int = VM_MAX_BYTES) -> None:
    """Copy runs with process_vm_readv on our own pid: <= IOV_MAX runs, <= max_bytes a call."""
    if nbytes.size and int(nbytes.max()) > max_bytes:  # cut long (coalesced) runs into pieces
        reps = -(-nbytes // max_bytes)
        idx = np.repeat(np.arange(nbytes.size), reps)
        off = (np.arange(idx.size) - np.repeat(np.cumsum(reps) - reps, reps)) * max_bytes
        dst, src, nbytes = dst[idx] + off, src[idx] + off, np.minimum(nbytes[idx] - off, max_bytes)
    local = np.empty((nbytes.size, 2), np.uint64)   # struct iovec {base, len}: destinations
    remote = np.empty((nbytes.size, 2), np.uint64)  # sources, in the same (our own) process
    local[:, 0], remote[:, 0] = dst, src
    local[:, 1] = remote[:, 1] = nbytes
    cum = np.concatenate(([0], np.cumsum(nbytes)))
    pid, i, n = os.getpid(), 0, nbytes.size
    while i < n:
        fit = int(np.searchsorted(cum, cum[i] + max_bytes, "right")) - 1
        j = min(n, i + IOV_MAX, max(i + 1, fit))
        got = _vm_readv(pid, local[i:j].ctypes.data, j - i, remote[i:j].ctypes.data, j - i, 0)
        if got != cum[j] - cum[i]:
            err = ctypes.get_errno() if got < 0 else errno.EIO
            if i == 0 and err in (errno.ENOSYS, errno.EPERM, errno.EACCES):
                raise VmUnsupported(err, os.strerror(err))
            raise TransferError(f"process_vm_readv copied {got} of {cum[j] - cum[i]} bytes: "
                                f"{os.strerror(err)}")
        i = j


def _vm_or_memmove_runs(dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray) -> None:
    global _vm_usable
    if _vm_usable:
        try:
            return _vm_runs(dst, src, nbytes)
        except VmUnsupported as e:
            _vm_usable = False
            logger.info("kvshm: process_vm_readv unavailable (%s); copying with memmove", e)
    _memmove_runs(dst, src, nbytes)
