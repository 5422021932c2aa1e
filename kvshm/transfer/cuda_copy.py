"""CUDA transfer handler: block copies between GPU KV tensors and the segment's planes.

This module owns one CUDA stream per lane (loads and expedited loads at the highest priority,
each on its own stream, stores at the default one), ordering (every job first waits for the
caller's current stream: a store must not read KV the compute stream is still writing, a load
must not land under pending writes; jobs are FIFO within a lane because they share a stream),
completion by timed CUDA events, and the choice of each job's copy method by its page size
(``index_pool.choose_method``):

  triton  ONE gather/scatter kernel over all the job's blocks, reading the pinned planes
          through UVA (``cuda_gather``, ``triton_copy``): small and mid-sized pages, where DMA
          descriptors are slow. Triton is imported only when a job uses it.
  kernel  the same through torch indexing, where Triton is missing.
  batch   every coalesced run in one ``cuMemcpyBatchAsync`` call (``cuda_dma``): large pages,
          where the copy engines are as fast and leave the SMs to the model.
  copy    one ``copy_`` per run: always available; the only method on unpinned memory.

``auto`` (the default) takes a kernel for pages under ``kernel_below[kind]`` bytes and DMA
from there up; naming a method forces it wherever it can run.

It must never run a kernel or ``batch`` on memory that is not pinned (a kernel would fault),
report a job before its end event fired, reuse an index buffer a queued kernel may still
read, or release the pinned region while a copy may still read it (shutdown drains first).
It cannot be tested without a GPU: tests/test_transfer.py runs every method on CUDA when one
is present; the host-side pieces are tested on the CPU (``index_pool``, ``triton_copy``).
"""
from __future__ import annotations

import contextlib
import importlib.util
import inspect
import logging
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvshm.errors import InvalidArgumentError, TransferError
from kvshm.transfer import native_check
from kvshm.transfer.cuda_dma import DriverBatch, copy_batch, copy_each
from kvshm.transfer.cuda_gather import Gather
from kvshm.transfer.index_pool import KERNEL_BELOW, METHODS, IndexBuffer, choose_method
from kvshm.transfer.spec import (
    LANES,
    BlockPlan,
    TransferHandler,
    TransferResult,
    TransferSpec,
    build_geometry,
    job_runs,
    plan_transfer,
)

logger = logging.getLogger(__name__)


def _event_calls(cls: type) -> tuple[Any, Any, Any, Any]:
    """(record, wait, synchronize, elapsed_time) of ``cls`` as functions of the event: the C
    methods of torch's event base class, which skip ``torch.cuda.Event``'s Python wrappers (a
    frame each; a job makes six such calls, and each costs several us when the host's caches
    are cold, as they are between an engine's steps). ``cls``'s own methods otherwise."""
    names = ("record", "wait", "synchronize", "elapsed_time")
    for base in cls.__mro__[1:-1]:
        found = [getattr(base, n, None) for n in names]
        if all(f is not None and not inspect.isfunction(f) for f in found):
            return found[0], found[1], found[2], found[3]
    own = [getattr(cls, n) for n in names]
    return own[0], own[1], own[2], own[3]


@dataclass
class _Job:
    job_id: int
    kind: str
    nbytes: int
    start: Any = None
    end: Any = None
    failed: bool = False
    keep: Any = None  # whatever the GPU may still read (index buffer, descriptors)
    reported: bool = False  # get_finished saw it done (its events may serve another job now)
    synced: bool = False  # wait() saw its end event fire: no need to query it again

    def done(self) -> bool:
        return self.reported or self.synced or self.end is None or bool(self.end.query())

    def result(self, elapsed: Any) -> TransferResult:
        secs = 0.0
        if not self.failed:
            try:
                secs = elapsed(self.start, self.end) / 1e3
            except Exception:  # timing is informative only
                pass
        return TransferResult(self.job_id, not self.failed, 0 if self.failed else self.nbytes,
                              secs, self.kind)


class CudaTransferHandler(TransferHandler):
    """Stream-ordered block copies; call it from the engine thread that owns the compute stream.

    ``pin``: a PinnedRegion or BackgroundPin covering the planes. The handler reads its
    ``pinned`` flag before choosing a method and unregisters it at shutdown, after draining.
    Without one it probes the planes' first and last bytes with ``is_pinned``.
    ``kernel_below``: per direction, the page size (bytes per pair) from which ``auto`` uses
    DMA instead of a kernel. ``blocking_wait``: ``wait`` sleeps on the job's event instead of
    waiting as torch's ``synchronize`` does (a spin, with the GIL released, when the process
    has a core per GPU): it frees the core, but a woken thread comes back late, by up to
    hundreds of us on a VM, which is most of a 16 KiB-block job.
    """

    def __init__(self, device_tensors: Sequence[torch.Tensor], planes: Sequence[torch.Tensor], *,
                 block_size_factor: int = 1,
                 kv_dim_before_num_blocks: Sequence[bool] | None = None, pin: Any = None,
                 method: str = "auto", kernel_below: Mapping[str, int] | None = None,
                 blocking_wait: bool = False) -> None:
        if method not in METHODS:
            raise InvalidArgumentError(f"method must be one of {METHODS}, got {method!r}")
        self._geo = build_geometry(device_tensors, planes, block_size_factor,
                                   kv_dim_before_num_blocks)
        native_check.load()  # a job's id checks in one call (built once per host)
        self._dev = self._geo.pairs[0].device.device
        if self._dev.type != "cuda":
            raise InvalidArgumentError("CudaTransferHandler needs CUDA device tensors")
        if self._dev.index is None:
            self._dev = torch.device("cuda", torch.cuda.current_device())
        self._pin, self._method = pin, method
        self._kernel_below = dict(KERNEL_BELOW if kernel_below is None else kernel_below)
        self._blocking = bool(blocking_wait)
        self._block_bytes = sum(p.page_bytes for p in self._geo.pairs)
        self._page = self._block_bytes / len(self._geo.pairs)
        self._streams = {"load": torch.cuda.Stream(self._dev, priority=-100),  # clamped: highest
                         "store": torch.cuda.Stream(self._dev, priority=0),
                         # own stream: an expedited load does not queue behind regular loads
                         "expedited": torch.cuda.Stream(self._dev, priority=-100)}
        # one reusable event per lane to order it after the caller's stream (no new event per job)
        self._order = {k: torch.cuda.Event() for k in LANES}
        self._record, self._wait_on, self._sync, self._elapsed = _event_calls(torch.cuda.Event)
        self._inflight: dict[str, deque[_Job]] = {k: deque() for k in LANES}
        self._jobs: dict[int, _Job] = {}
        self._lock = threading.Lock()
        self._closed = False
        f = self._geo.factor
        self._flat = [(torch.as_strided(p.device, (p.device_span(),), (1,)),
                       torch.as_strided(p.plane, (p.plane_span(f),), (1,)))
                      for p in self._geo.pairs]
        self._batch = DriverBatch.load() if method in ("auto", "batch") else None
        if self._batch is not None and not self._batch.works(self._dev):
            self._batch = None
        if method == "batch" and self._batch is None:
            raise TransferError("method='batch' needs cuMemcpyBatchAsync "
                                "(NVIDIA driver >= 12.8)")
        self._triton = method in ("auto", "triton") \
            and importlib.util.find_spec("triton") is not None
        if method == "triton" and not self._triton:
            raise TransferError("method='triton' needs Triton (it ships with PyTorch's CUDA "
                                "builds); pip install triton, or use method='auto'")
        self._gather = Gather(self._geo, self._dev) if method in ("auto", "kernel", "triton") \
            else None
        self._seen_pinned = False
        self._warned = False
        self._one_gpu = torch.cuda.device_count() == 1
        self._events: list[tuple[Any, Any]] = []  # (start, end) of reported jobs, for reuse
        self._memo: dict[str, str] = {}  # method per kind, once nothing can change it
        # the caller's current stream, rebuilt only when its handle changes (building the torch
        # object costs ~15 us per job on a slow host; the raw handle, ~1 us)
        self._raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        self._cur: tuple[int, Any] = (-1, None)

    # --- interface -----------------------------------------------------------------------
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        plan = plan_transfer(spec, self._geo)  # raises before anything is issued
        method = self._memo.get(plan.kind) if plan.n else None
        if method is None:
            method = self._choose(plan)
        # DMA needs coalesced byte runs; a kernel copies page by page and needs none
        runs = job_runs(plan, self._geo) if method in ("copy", "batch", "dma") else None
        # Everything up to the copy's launch delays the copy; the bookkeeping after it runs
        # while the copy does. So the path to the launch is kept to the calls it needs.
        with self._lock:
            if self._closed:
                raise TransferError("transfer handler is shut down; create a new one")
            if job_id in self._jobs:
                raise InvalidArgumentError(f"job {job_id} is still in flight; job ids must be "
                                           f"unique among unfinished jobs")
            lane = "expedited" if spec.expedited else plan.kind
            stream = self._streams[lane]
            keep, failed, start, end = None, False, None, None
            try:
                start, end = self._events.pop() if self._events else (
                    torch.cuda.Event(enable_timing=True),
                    torch.cuda.Event(enable_timing=True, blocking=self._blocking))
                order = self._order[lane]
                self._record(order, self._caller_stream())
                self._wait_on(order, stream)
                self._record(start, stream)
                if self._one_gpu:  # the usual process: no device switch to enter and leave
                    keep = self._copy(plan, method, runs, stream)
                else:
                    with self._on_device():
                        keep = self._copy(plan, method, runs, stream)
            except Exception:  # reported as success=False, in FIFO order
                logger.exception("kvshm: %s job %d failed", spec.kind, job_id)
                failed = True
            job = _Job(job_id, plan.kind, plan.n * self._block_bytes, start, end, failed, keep)
            try:
                self._record(end, stream)  # also after a failure: the result keeps its place
            except Exception:
                job.end = None
                stream.synchronize()  # nothing may still read what the job keeps
            if isinstance(keep, IndexBuffer) and self._gather is not None:
                self._gather.hold(keep, job.done)
            self._inflight[lane].append(job)
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
                    out.append(job.result(self._elapsed))
                    job.reported = True
                    if job.end is not None and len(self._events) < 64:
                        self._events.append((job.start, job.end))  # creating them costs more
        return out

    def wait(self, job_ids: Iterable[int]) -> None:
        with self._lock:
            jobs = [job for j in job_ids if (job := self._jobs.get(j)) is not None]
        for job in jobs:
            # once reported, a job's events may already time a later job: never wait on them
            if not job.reported and job.end is not None:
                self._sync(job.end)  # releases the GIL
                job.synced = True  # get_finished need not ask the driver again

    def shutdown(self) -> None:
        with self._lock:
            if self._closed:
                return
            self._closed = True
        for s in self._streams.values():
            s.synchronize()  # drain: nothing may still read the region we may unregister
        self._gather = None
        if self._pin is not None:
            self._pin.unregister()

    # --- copy methods --------------------------------------------------------------------
    def _on_device(self) -> contextlib.AbstractContextManager:
        """Our device current (kernels load per device); a no-op in the usual one-GPU process."""
        if self._one_gpu or torch.cuda.current_device() == self._dev.index:
            return contextlib.nullcontext()
        return torch.cuda.device(self._dev)

    def _caller_stream(self) -> Any:
        if self._raw_stream is None:
            return torch.cuda.current_stream(self._dev)
        raw = self._raw_stream(self._dev.index)
        if raw != self._cur[0]:
            self._cur = (raw, torch.cuda.current_stream(self._dev))
        return self._cur[1]

    def _pinned(self) -> bool:
        if self._pin is not None:
            return bool(getattr(self._pin, "pinned", False))
        if not self._seen_pinned:  # registration only ever goes false -> true under us
            self._seen_pinned = all(bool(pf[:1].is_pinned() and pf[-1:].is_pinned())
                                    for _, pf in self._flat)
        return self._seen_pinned

    def _choose(self, plan: BlockPlan) -> str:
        """The job's method when none is memoised for its kind (``transfer_async`` looks)."""
        pinned = self._method != "copy" and plan.n > 0 and self._pinned()
        # A pin still in progress (an engine's first steps) is no news; one that ended
        # unpinned, or memory nobody pins, is: copies stay slow for good.
        settled = self._pin is None or getattr(self._pin, "done", True)
        if self._method != "copy" and plan.n > 0 and not pinned and settled \
                and not self._warned:
            self._warned = True
            logger.warning("kvshm: segment planes are not pinned; copies run from pageable "
                           "memory: slower, and they block the calling thread")
        uva = pinned and self._gather is not None and self._gather.ready()
        method = choose_method(self._method, plan.kind, self._page, plan.n, pinned=pinned,
                               uva=uva, triton=self._triton, batch=self._batch is not None,
                               kernel_below=self._kernel_below)
        if pinned:  # pinning only goes false -> true; the UVA check ran once
            self._memo[plan.kind] = method
        return method

    def _copy(self, plan: BlockPlan, method: str, runs: Any, stream: torch.cuda.Stream) -> Any:
        if method == "triton" and self._gather is not None:
            try:
                return self._gather.copy_triton(plan, stream)
            except Exception as e:  # nothing was queued: DMA takes this job
                self._triton = False  # and later ones go to the next method auto knows
                self._memo.clear()
                logger.warning("kvshm: the Triton copy kernel failed (%s); it is off", e)
                method, runs = "dma", job_runs(plan, self._geo)
        if method == "kernel" and self._gather is not None:
            return self._gather.copy_torch(plan, stream)
        if runs is None:
            runs = job_runs(plan, self._geo)
        n_runs = sum(r.nbytes.size for r in runs)
        if self._batch is not None and (method == "batch" or (method == "dma" and n_runs > 1)):
            return copy_batch(self._batch, plan.kind, runs, stream)
        with torch.cuda.stream(stream):
            copy_each(plan.kind, runs, self._flat)
        return None
