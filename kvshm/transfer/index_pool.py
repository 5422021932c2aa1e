"""Reusable host buffers for the block ids a copy kernel reads, and the per-job method choice.

This module owns two pieces of pure host logic of the CUDA handler, kept free of torch so
they are tested without a GPU:

* ``IndexBuffers``: pinned int64 buffers that a job's ids are written into and that the
  kernel reads through UVA. A buffer is handed out again only once the job that read it has
  finished (its ``done`` predicate, the job's end event), so a job never overwrites ids that
  an earlier, still queued kernel has yet to read; it grows by allocating, never by waiting.
  Allocating pinned memory per job (``pin_memory()``) cost more than the copy at 16 KiB blocks.
* ``choose_method``: which copy method a job gets, from the handler's method, what is
  available, and the job's page size against the measured thresholds.

It must never allocate device memory or import torch, and never hand out a buffer whose last
reader may still be queued.
"""
from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

METHODS = ("auto", "copy", "batch", "kernel", "triton")

# Pages below these sizes (bytes, per plane pair) go to the gather/scatter kernel under
# ``auto``; from them up, to DMA. Measured with tools/bench_transfer.py on an H200 (see
# docs/benchmarks.md): 1,000 DMA descriptors of 256 KiB reach 78% of one contiguous copy (the
# copy engine pays per descriptor) where the kernel reaches 84%; from 512 KiB DMA is at least
# as fast both ways. Stores keep DMA wherever it is as fast: the copy engines leave the SMs
# to the model.
KERNEL_BELOW = {"load": 512 << 10, "store": 512 << 10}


@dataclass
class IndexBuffer:
    """One pinned buffer: ``host`` (int64 numpy view) and ``device`` (what a kernel reads)."""
    host: np.ndarray
    device: Any
    owner: Any = None                       # keeps the allocation alive
    done: Callable[[], bool] | None = None  # None: free; else True once its reader finished


class IndexBuffers:
    """Pool of ``IndexBuffer``; ``alloc(words)`` makes a new one of at least ``words`` int64.

    Not thread-safe: the CUDA handler calls it under its own lock.
    """

    def __init__(self, alloc: Callable[[int], IndexBuffer], min_words: int = 4096):
        self._alloc = alloc
        self._min = min_words
        self._free: list[IndexBuffer] = []
        self._busy: list[IndexBuffer] = []
        self.allocated = 0  # buffers alive: held, free, or taken and not yet held

    def take(self, words: int) -> IndexBuffer:
        """A buffer of at least ``words`` int64 that no queued copy still reads."""
        still = []
        for b in self._busy:  # few: one per job in flight
            if b.done is not None and b.done():
                b.done = None
                self._free.append(b)
            else:
                still.append(b)
        self._busy = still
        while self._free:
            b = self._free.pop()  # most recently used first: its pages are warm
            if b.host.size >= words:
                return b
            self.allocated -= 1  # too small for this job: dropped, a bigger one replaces it
        size = self._min
        while size < words:
            size *= 2
        buf = self._alloc(size)
        self.allocated += 1
        return buf

    def hold(self, buf: IndexBuffer, done: Callable[[], bool]) -> None:
        """``buf`` is being read by a queued copy until ``done()`` returns True."""
        buf.done = done
        self._busy.append(buf)

    def give_back(self, buf: IndexBuffer) -> None:
        """``buf`` was taken but nothing was queued to read it (e.g. the launch failed)."""
        buf.done = None
        self._free.append(buf)


def choose_method(method: str, kind: str, page_bytes: float, n_blocks: int, *, pinned: bool,
                  uva: bool, triton: bool, batch: bool,
                  kernel_below: Mapping[str, int] = KERNEL_BELOW) -> str:
    """The copy method for one job: ``copy``, ``batch``, ``dma`` (batch, or one copy when the
    job is one run), ``kernel`` (torch indexing) or ``triton``.

    ``page_bytes``: the job's bytes per block per plane pair (the size of a DMA descriptor
    when nothing coalesces); ``pinned``/``uva``/``triton``/``batch``: what is usable now.
    An explicitly named method that is not usable falls back to DMA (never to an error: the
    handler checked at construction what can be checked then).
    """
    if method == "copy" or n_blocks == 0 or not pinned:
        return "copy"
    if method == "triton" and triton and uva:
        return "triton"
    if method == "kernel" and uva:
        return "kernel"
    if method == "auto" and uva and page_bytes < kernel_below.get(kind, 0):
        return "triton" if triton else "kernel"
    if method == "batch" and batch:
        return "batch"
    return "dma" if batch else "copy"
