"""CUDA transfer handler: block copies between GPU KV tensors and the segment's planes.

This module owns one CUDA stream per lane (loads and expedited loads at the highest priority,
each on its own stream, stores at the default one), ordering (every job first waits for the
caller's current stream: a store must not read KV the compute stream is still writing, a load
must not land under pending writes; jobs are FIFO within a lane because they share a stream), completion by timed CUDA events, and
the copy method of each job:

  copy    one cudaMemcpyAsync (torch ``copy_``) per coalesced run. Always available; the only
          method on memory that is not pinned (then slower, and synchronous for the caller).
  batch   every run in ONE ``cuMemcpyBatchAsync`` call (driver >= 12.8, via ctypes): the driver
          call is ~0.5 us per run instead of ~5 us per torch ``copy_``. Pinned memory only.
  kernel  a gather/scatter kernel (torch indexing) that reaches the pinned plane through UVA, for
          small pages where DMA descriptors are slow (vLLM measured 5-7 GB/s below 28 KiB).
          ``auto`` uses it for loads only, like vLLM (stores: the copy engine spares the SMs).

It must never run ``batch`` or ``kernel`` on memory that is not pinned (a kernel would fault),
report a job before its end event fired, or release the pinned region while a copy may still
read it (shutdown drains first). It cannot be tested without a GPU: tests/test_transfer.py runs
every method on CUDA when one is present.
"""
from __future__ import annotations

import ctypes
import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import numpy as np
import torch

from kvshm.errors import InvalidArgumentError, TransferError
from kvshm.transfer.spec import (LANES, BlockPlan, PairRuns, TransferHandler, TransferResult,
                       TransferSpec, build_geometry, job_runs, plan_transfer)

logger = logging.getLogger(__name__)

METHODS = ("auto", "copy", "batch", "kernel")
SRC_ORDER_STREAM, SRC_ORDER_ANY = 1, 3  # CUmemcpySrcAccessOrder


class _CUmemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _CUmemcpyAttributes(ctypes.Structure):
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _CUmemLocation),
                ("dstLocHint", _CUmemLocation), ("flags", ctypes.c_uint)]


# CUDA 12.8 ABI (with failIdx; 13.0 dropped it), pinned by asking cuGetProcAddress for 12080.
_BATCH_FN = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                             ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t,
                             ctypes.c_void_p, ctypes.c_void_p)


class DriverBatch:
    """cuMemcpyBatchAsync, or None from ``load`` when the driver lacks it."""

    def __init__(self, fn: Any):
        self._fn = fn

    @classmethod
    def load(cls) -> "DriverBatch | None":
        try:
            get = ctypes.CDLL("libcuda.so.1").cuGetProcAddress_v2
        except (OSError, AttributeError):
            return None
        get.restype = ctypes.c_int
        get.argtypes = [ctypes.c_char_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_int,
                        ctypes.c_uint64, ctypes.POINTER(ctypes.c_int)]
        ptr, status = ctypes.c_void_p(), ctypes.c_int(-1)
        rc = get(b"cuMemcpyBatchAsync", ctypes.byref(ptr), 12080, 0, ctypes.byref(status))
        if rc != 0 or status.value != 0 or not ptr.value:
            return None
        return cls(_BATCH_FN(ptr.value))

    def copy(self, dst: np.ndarray, src: np.ndarray, sizes: np.ndarray, stream: int,
             order: int) -> None:
        attrs = _CUmemcpyAttributes(srcAccessOrder=order)
        idx, fail = ctypes.c_size_t(0), ctypes.c_size_t(0)
        rc = self._fn(dst.ctypes.data, src.ctypes.data, sizes.ctypes.data, dst.size,
                      ctypes.byref(attrs), ctypes.byref(idx), 1, ctypes.byref(fail), stream)
        if rc != 0:
            raise TransferError(f"cuMemcpyBatchAsync failed: CUresult {rc} at copy {fail.value}")

    def works(self, device: torch.device) -> bool:
        """Self-test: two scattered copies each way through pinned memory, compared."""
        try:
            g = torch.arange(8192, device=device, dtype=torch.int32).view(torch.uint8)
            h = torch.zeros(g.numel(), dtype=torch.uint8, pin_memory=True)
            s = torch.cuda.Stream(device)
            n = np.array([4096, 8192], np.uint64)
            self.copy(np.array([h.data_ptr() + 24576, h.data_ptr()], np.uint64),
                      np.array([g.data_ptr(), g.data_ptr() + 8192], np.uint64), n,
                      s.cuda_stream, SRC_ORDER_STREAM)
            s.synchronize()
            return bool(torch.equal(h[24576:28672], g[:4096].cpu())
                        and torch.equal(h[:8192], g[8192:16384].cpu()))
        except Exception as e:  # noqa: BLE001 — any failure means "do not use it"
            logger.warning("kvshm: cuMemcpyBatchAsync self-test failed (%s); using copy_", e)
            return False


class _CudaArray:
    """Presents a pinned host range as CUDA memory (UVA) to torch.as_tensor."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3, "strides": None}


@dataclass
class _Job:
    job_id: int
    kind: str
    nbytes: int
    start: Any = None
    end: Any = None
    failed: bool = False
    keep: Any = None  # whatever the GPU may still read (index tensors, descriptors)

    def done(self) -> bool:
        return self.end is None or bool(self.end.query())

    def result(self) -> TransferResult:
        secs = 0.0
        if not self.failed:
            try:
                secs = self.start.elapsed_time(self.end) / 1e3
            except Exception:  # noqa: BLE001 — timing is informative only
                pass
        return TransferResult(self.job_id, not self.failed, 0 if self.failed else self.nbytes,
                              secs, self.kind)


class CudaTransferHandler(TransferHandler):
    """Stream-ordered block copies; call it from the engine thread that owns the compute stream.

    ``pin``: a PinnedRegion or BackgroundPin covering the planes. The handler reads its
    ``pinned`` flag before choosing a method and unregisters it at shutdown, after draining.
    Without one it probes the planes' first and last bytes with ``is_pinned``.
    """

    def __init__(self, device_tensors: Sequence[torch.Tensor], planes: Sequence[torch.Tensor], *,
                 block_size_factor: int = 1,
                 kv_dim_before_num_blocks: Sequence[bool] | None = None, pin: Any = None,
                 method: str = "auto", kernel_max_run_bytes: int = 28 << 10,
                 kernel_kinds: Iterable[str] = ("load",)) -> None:
        if method not in METHODS:
            raise InvalidArgumentError(f"method must be one of {METHODS}, got {method!r}")
        self._geo = build_geometry(device_tensors, planes, block_size_factor,
                                   kv_dim_before_num_blocks)
        self._dev = self._geo.pairs[0].device.device
        if self._dev.type != "cuda":
            raise InvalidArgumentError("CudaTransferHandler needs CUDA device tensors")
        self._pin, self._method = pin, method
        self._kernel_max, self._kernel_kinds = kernel_max_run_bytes, set(kernel_kinds)
        self._streams = {"load": torch.cuda.Stream(self._dev, priority=-100),  # clamped: highest
                         "store": torch.cuda.Stream(self._dev, priority=0),
                         # own stream: an expedited load does not queue behind regular loads
                         "expedited": torch.cuda.Stream(self._dev, priority=-100)}
        self._inflight: dict[str, deque[_Job]] = {k: deque() for k in LANES}
        self._jobs: dict[int, _Job] = {}
        self._lock = threading.Lock()
        self._closed = False
        f = self._geo.factor
        self._flat = [(torch.as_strided(p.device, (p.device_span(),), (1,)),
                       torch.as_strided(p.plane, (p.plane_span(f),), (1,))) for p in self._geo.pairs]
        self._batch = DriverBatch.load() if method in ("auto", "batch") else None
        if self._batch is not None and not self._batch.works(self._dev):
            self._batch = None
        if method == "batch" and self._batch is None:
            raise TransferError("method='batch' needs cuMemcpyBatchAsync (NVIDIA driver >= 12.8)")
        self._uva: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self._uva_failed = method not in ("auto", "kernel")
        self._seen_pinned = False
        self._warned = False

    # --- interface -----------------------------------------------------------------------
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        plan = plan_transfer(spec, self._geo)  # raises before anything is issued
        runs = job_runs(plan, self._geo)
        with self._lock:
            if self._closed:
                raise TransferError("transfer handler is shut down; create a new one")
            if job_id in self._jobs:
                raise InvalidArgumentError(f"job {job_id} is still in flight; job ids must be "
                                           f"unique among unfinished jobs")
            job = _Job(job_id, spec.kind, int(sum(int(r.nbytes.sum()) for r in runs)))
            stream = self._streams[spec.lane]
            try:
                job.start = torch.cuda.Event(enable_timing=True, blocking=True)
                job.end = torch.cuda.Event(enable_timing=True, blocking=True)
                stream.wait_stream(torch.cuda.current_stream(self._dev))
                job.start.record(stream)
                with torch.cuda.device(self._dev), torch.cuda.stream(stream):
                    job.keep = self._copy(plan, runs, stream)
            except Exception:  # reported as success=False, in FIFO order
                logger.exception("kvshm: %s job %d failed", spec.kind, job_id)
                job.failed = True
            try:
                job.end.record(stream)  # also after a failure: the result keeps its place
            except Exception:  # noqa: BLE001
                job.end = None
            self._inflight[spec.lane].append(job)
            self._jobs[job_id] = job
        return True

    def get_finished(self) -> list[TransferResult]:
        out = []
        with self._lock:
            for lane in LANES:
                q = self._inflight[lane]
                while q and q[0].done():  # in order: a later job never overtakes
                    job = q.popleft()
                    del self._jobs[job.job_id]
                    out.append(job.result())
        return out

    def wait(self, job_ids: Iterable[int]) -> None:
        with self._lock:
            ends = [self._jobs[j].end for j in job_ids if j in self._jobs]
        for e in ends:
            if e is not None:
                e.synchronize()  # blocking event: the thread sleeps instead of spinning

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for s in self._streams.values():
            s.synchronize()  # drain: nothing may still read the region we may unregister
        self._uva = None
        if self._pin is not None:
            self._pin.unregister()

    # --- copy methods --------------------------------------------------------------------
    def _pinned(self) -> bool:
        if self._pin is not None:
            return bool(getattr(self._pin, "pinned", False))
        if not self._seen_pinned:  # registration only ever goes false -> true under us
            self._seen_pinned = all(bool(pf[:1].is_pinned() and pf[-1:].is_pinned())
                                    for _, pf in self._flat)
        return self._seen_pinned

    def _choose(self, kind: str, runs: list[PairRuns]) -> str:
        n_runs = sum(r.nbytes.size for r in runs)
        if self._method == "copy" or n_runs == 0:
            return "copy"
        if not self._pinned():
            if not self._warned:
                self._warned = True
                logger.warning("kvshm: segment planes are not pinned (yet); copies run from "
                               "pageable memory: slower, and they block the calling thread")
            return "copy"
        total = sum(int(r.nbytes.sum()) for r in runs)
        small = kind in self._kernel_kinds and total < self._kernel_max * n_runs
        if (self._method == "kernel" or (self._method == "auto" and small)) and self._uva_views():
            return "kernel"
        if self._batch is not None and (self._method == "batch" or n_runs > 1):
            return "batch"
        return "copy"

    def _copy(self, plan: BlockPlan, runs: list[PairRuns], stream: torch.cuda.Stream) -> Any:
        method = self._choose(plan.kind, runs)
        if method == "kernel":
            return self._copy_kernel(plan)
        if method == "batch":
            return self._copy_batch(plan.kind, runs, stream)
        for (dflat, pflat), r in zip(self._flat, runs):
            for d, s, n in zip(r.device_off.tolist(), r.plane_off.tolist(), r.nbytes.tolist()):
                if plan.kind == "store":
                    pflat[s:s + n].copy_(dflat[d:d + n], non_blocking=True)
                else:
                    dflat[d:d + n].copy_(pflat[s:s + n], non_blocking=True)
        return None

    def _copy_batch(self, kind: str, runs: list[PairRuns], stream: torch.cuda.Stream) -> Any:
        dev = np.concatenate([r.pair.device_ptr + r.device_off for r in runs]).astype(np.uint64)
        seg = np.concatenate([r.pair.plane_ptr + r.plane_off for r in runs]).astype(np.uint64)
        nb = np.concatenate([r.nbytes for r in runs]).astype(np.uint64)
        dst, src = (seg, dev) if kind == "store" else (dev, seg)
        # A load's source (a ready segment block) is stable, so the driver may read it early.
        self._batch.copy(dst, src, nb, stream.cuda_stream,
                         SRC_ORDER_ANY if kind == "load" else SRC_ORDER_STREAM)
        return dst, src, nb

    def _copy_kernel(self, plan: BlockPlan) -> Any:
        def idx(a: np.ndarray) -> torch.Tensor:
            # From pinned memory: an upload from pageable memory would first synchronise the
            # stream, i.e. block this (engine) thread until the compute stream is done.
            return torch.from_numpy(np.ascontiguousarray(a)).pin_memory().to(
                self._dev, non_blocking=True)
        d, rows, subs = idx(plan.device_ids), idx(plan.segment_rows), idx(plan.segment_subs)
        for dev_w, host_w in self._uva or ():
            if plan.kind == "load":
                dev_w.index_copy_(0, d, host_w[rows, subs])
            else:
                host_w[rows, subs] = dev_w.index_select(0, d)
        return d, rows, subs

    def _uva_views(self) -> list[tuple[torch.Tensor, torch.Tensor]] | None:
        """Per pair: (device words (Nd, W), plane words (Ns, factor, W)) aliasing the memory."""
        if self._uva is None and not self._uva_failed:
            try:
                f, views = self._geo.factor, []
                for p in self._geo.pairs:
                    # widest word dividing every size, stride and address: fewer, wider accesses
                    g = np.gcd.reduce([p.page_bytes, p.device_stride, p.plane_stride,
                                       p.device_ptr, p.plane_ptr, 8])
                    word = {8: torch.int64, 4: torch.int32, 2: torch.int16}.get(int(g), torch.uint8)
                    host = torch.as_tensor(_CudaArray(p.plane_ptr, p.plane_span(f)), device=self._dev)
                    if host.data_ptr() != p.plane_ptr or host.device != self._dev:
                        raise TransferError("torch copied the plane instead of aliasing it")
                    host = torch.as_strided(host, (p.plane.shape[0], f, p.page_bytes),
                                            (p.plane_stride, p.page_bytes, 1))
                    views.append((p.device.view(word), host.view(word)))
                self._uva = views
            except Exception as e:  # noqa: BLE001 — fall back to DMA for good
                self._uva_failed = True
                logger.warning("kvshm: UVA access to the pinned planes failed (%s); the kernel "
                               "method is off, DMA is used", e)
        return self._uva
