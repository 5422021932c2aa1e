"""DMA copies for the CUDA handler: the copy engines move every coalesced run.

This module owns the two DMA methods:

  copy    one cudaMemcpyAsync (torch ``copy_``) per coalesced run. Always available; the only
          method on memory that is not pinned (then slower, and synchronous for the caller).
  batch   every run in ONE ``cuMemcpyBatchAsync`` call (driver >= 12.8, via ctypes): the driver
          call is ~0.5 us per run instead of ~5 us per torch ``copy_``. Pinned memory only.

DMA leaves the SMs to the model, and from ~1 MiB per run it is as fast as a kernel; below
that the copy engine's per-descriptor cost shows (see ``index_pool.KERNEL_BELOW``).
It must never issue ``batch`` on memory that is not pinned, or compute an address itself:
runs come bounds-checked from ``spec.job_runs``.
"""
from __future__ import annotations

import ctypes
import logging
from typing import Any

import numpy as np
import torch

from kvshm.errors import TransferError
from kvshm.transfer.spec import PairRuns

logger = logging.getLogger(__name__)

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
    def load(cls) -> DriverBatch | None:
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
        except Exception as e:  # any failure means "do not use it"
            logger.warning("kvshm: cuMemcpyBatchAsync self-test failed (%s); using copy_", e)
            return False


def copy_batch(batch: DriverBatch, kind: str, runs: list[PairRuns],
               stream: torch.cuda.Stream) -> Any:
    """All runs of every pair in one driver call; returns what the driver may still read."""
    dev = np.concatenate([r.pair.device_ptr + r.device_off for r in runs]).astype(np.uint64)
    seg = np.concatenate([r.pair.plane_ptr + r.plane_off for r in runs]).astype(np.uint64)
    nb = np.concatenate([r.nbytes for r in runs]).astype(np.uint64)
    dst, src = (seg, dev) if kind == "store" else (dev, seg)
    # A load's source (a ready segment block) is stable, so the driver may read it early.
    batch.copy(dst, src, nb, stream.cuda_stream,
               SRC_ORDER_ANY if kind == "load" else SRC_ORDER_STREAM)
    return dst, src, nb


def copy_each(kind: str, runs: list[PairRuns],
              flat: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """One torch ``copy_`` per run, on torch's current stream (the caller sets it)."""
    for (dflat, pflat), r in zip(flat, runs):
        for d, s, n in zip(r.device_off.tolist(), r.plane_off.tolist(), r.nbytes.tolist()):
            if kind == "store":
                pflat[s:s + n].copy_(dflat[d:d + n], non_blocking=True)
            else:
                dflat[d:d + n].copy_(pflat[s:s + n], non_blocking=True)
