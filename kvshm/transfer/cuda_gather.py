"""Gather/scatter copies that reach the pinned segment planes through UVA, for small pages.

This module owns the two kernel methods of the CUDA handler and what they share:

  triton  ONE Triton kernel per job over all its blocks and plane pairs (``triton_copy``),
          16-byte accesses where the layout allows; its launch skips Triton's argument
          binding after the first call (a few us instead of tens at 1,000 blocks of 16 KiB).
  kernel  torch indexing (``index_select``/``index_copy_`` per pair), for CUDA builds of torch
          without Triton.

Both read the job's ids from a reusable pinned buffer (``IndexBuffers``) through UVA: no
pinned allocation and no upload per job. Before either is used, the driver must confirm that
every plane's host address is also its device address (``cuPointerGetAttribute``), else they
stay off and DMA is used.

It must never run on planes that are not pinned (a kernel would fault; the handler checks),
write ids into a buffer a queued kernel may still read, or import Triton before a job needs it.
"""
from __future__ import annotations

import ctypes
import logging
from typing import Any

import numpy as np
import torch

from kvshm.errors import TransferError
from kvshm.transfer.index_pool import IndexBuffer, IndexBuffers
from kvshm.transfer.spec import BlockPlan, Geometry

logger = logging.getLogger(__name__)

CU_POINTER_ATTRIBUTE_DEVICE_POINTER = 3
_WORDS = {4: torch.int32, 2: torch.int16, 1: torch.uint8}


class _CudaArray:
    """Presents a pinned host range as CUDA memory (UVA) to ``torch.as_tensor``."""

    def __init__(self, ptr: int, nbytes: int, typestr: str = "|u1"):
        size = int(typestr[-1])
        self.__cuda_array_interface__ = {"shape": (nbytes // size,), "typestr": typestr,
                                         "data": (ptr, False), "version": 3, "strides": None}


def device_address(ptr: int) -> int | None:
    """The device address the driver gives a pinned host address; None if it gives none."""
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    out = ctypes.c_uint64(0)
    rc = cuda.cuPointerGetAttribute(ctypes.byref(out), CU_POINTER_ATTRIBUTE_DEVICE_POINTER,
                                    ctypes.c_uint64(ptr))
    return int(out.value) if rc == 0 else None


def alias(ptr: int, nbytes: int, device: torch.device, typestr: str = "|u1") -> torch.Tensor:
    """A CUDA tensor over pinned host memory at the same address (UVA), never a copy."""
    t = torch.as_tensor(_CudaArray(ptr, nbytes, typestr), device=device)
    if t.data_ptr() != ptr or t.device.type != "cuda":
        raise TransferError("torch copied pinned host memory instead of aliasing it")
    return t


def word_layout(geo: Geometry) -> tuple[int, int]:
    """(word bytes, alignment in words) for a kernel over ``geo``: the widest word dividing
    every page size, stride and address, and how many of them make 16 bytes (4 x int32 =
    16-byte accesses). Fewer, wider accesses are what make a gather reach the PCIe limit."""
    g = int(np.gcd.reduce([16] + [v for p in geo.pairs for v in (
        p.page_bytes, p.device_stride, p.plane_stride, p.device_ptr, p.plane_ptr)]))
    elem = 4 if g % 4 == 0 else 2 if g % 2 == 0 else 1
    return elem, g // elem


def pair_table(geo: Geometry, base_ptr: int, elem: int) -> np.ndarray:
    """The kernel's per-pair table (``triton_copy.T_*`` rows, flattened), in words of ``elem``
    bytes from ``base_ptr``; ``word_layout`` guarantees every entry divides exactly."""
    pairs = geo.pairs
    return np.array([
        [(p.device_ptr - base_ptr) // elem for p in pairs],
        [p.device_stride // elem for p in pairs],
        [(p.plane_ptr - base_ptr) // elem for p in pairs],
        [p.plane_stride // elem for p in pairs],
        [p.page_bytes // elem for p in pairs]], np.int64).ravel()


def write_ids(host: np.ndarray, plan: BlockPlan, with_subs: bool) -> None:
    """The kernel's ids: ``[device ids (n), segment rows (n), sub-blocks (n) if with_subs]``."""
    n = plan.n
    host[:n] = plan.device_ids
    host[n:2 * n] = plan.segment_rows
    if with_subs:
        host[2 * n:3 * n] = plan.segment_subs


class Gather:
    """Kernel copies for one handler's geometry; ``ready()`` says whether they may run."""

    def __init__(self, geo: Geometry, device: torch.device):
        self._geo, self._dev = geo, device
        self._failed = False
        self._checked = False
        self._pool = IndexBuffers(self._alloc)
        self._elem, self._align = word_layout(geo)
        self._base = torch.empty(64, dtype=_WORDS[self._elem], device=device)  # 256 B aligned
        self._table = torch.from_numpy(pair_table(geo, self._base.data_ptr(), self._elem)).to(
            device)
        self._max_page = max(p.page_bytes for p in geo.pairs) // self._elem
        self._fast: dict[tuple, Any] = {}
        self._views: list[tuple[torch.Tensor, torch.Tensor]] | None = None

    # --- readiness ---------------------------------------------------------------------
    def ready(self) -> bool:
        """True once the planes (already pinned) are confirmed mapped at their own address."""
        if not self._checked and not self._failed:
            self._checked = True
            with torch.cuda.device(self._dev):  # the driver call needs a current context
                bad = [hex(p.plane_ptr) for p in self._geo.pairs
                       if device_address(p.plane_ptr) != p.plane_ptr]
            if bad:
                self._failed = True
                logger.warning("kvshm: pinned planes at %s have no device address equal to "
                               "their host address (no UVA); kernel copies are off, DMA is "
                               "used", ", ".join(bad[:3]))
        return not self._failed

    # --- index buffers -----------------------------------------------------------------
    def _alloc(self, words: int) -> IndexBuffer:
        host = torch.empty(words, dtype=torch.int64, pin_memory=True)
        if host.data_ptr() % 16:  # the kernel is compiled for 16-byte aligned pointers
            raise TransferError("a pinned index buffer is not 16-byte aligned")
        dev = alias(host.data_ptr(), words * 8, self._dev, "<i8")
        return IndexBuffer(host.numpy(), dev, owner=host)

    def _ids(self, plan: BlockPlan, with_subs: bool) -> tuple[IndexBuffer, int]:
        buf = self._pool.take(3 * plan.n if with_subs else 2 * plan.n)
        write_ids(buf.host, plan, with_subs)
        return buf, plan.n

    def hold(self, buf: IndexBuffer, done: Any) -> None:
        self._pool.hold(buf, done)

    def give_back(self, buf: IndexBuffer) -> None:
        self._pool.give_back(buf)

    # --- triton ------------------------------------------------------------------------
    def copy_triton(self, plan: BlockPlan, stream: torch.cuda.Stream) -> IndexBuffer:
        """Queue the job's ONE kernel on ``stream``; returns the buffer it reads.

        This is on the path from a job's submission to its copy's start, so it makes only
        the calls it needs (each costs several us when the host's caches are cold)."""
        has_sub = self._geo.factor > 1
        buf, n = self._ids(plan, has_sub)
        try:
            fast = self._fast.get((plan.kind == "store", has_sub))
            if fast is not None:
                fast(n, buf.device, stream.cuda_stream)
            else:  # first launch: Triton binds, specialises and compiles
                self._first_launch(buf, n, plan.kind == "store", has_sub, stream)
        except BaseException:
            self._pool.give_back(buf)
            raise
        return buf

    def _first_launch(self, buf: IndexBuffer, n: int, store: bool, has_sub: bool,
                      stream: torch.cuda.Stream) -> None:
        from kvshm.transfer import triton_copy as tc
        with torch.cuda.stream(stream):
            self._fast[(store, has_sub)] = tc.launch(
                self._base, buf.device, self._table, n, len(self._geo.pairs), self._max_page,
                store=store, has_sub=has_sub, align=self._align)

    # --- torch indexing ------------------------------------------------------------------
    def copy_torch(self, plan: BlockPlan, stream: torch.cuda.Stream) -> IndexBuffer:
        """Per pair, one ``index_select`` and one ``index_copy_`` (or index_put_) through UVA."""
        buf, n = self._ids(plan, True)
        try:
            d, rows, subs = (buf.device[k * n:(k + 1) * n] for k in range(3))
            with torch.cuda.stream(stream):
                for dev_w, host_w in self._torch_views():
                    if plan.kind == "load":
                        dev_w.index_copy_(0, d, host_w[rows, subs])
                    else:
                        host_w[rows, subs] = dev_w.index_select(0, d)
        except BaseException:
            self._pool.give_back(buf)
            raise
        return buf

    def _torch_views(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per pair: (device words (Nd, W), plane words (Ns, factor, W)) aliasing the memory."""
        if self._views is None:
            f, word, views = self._geo.factor, _WORDS[self._elem], []
            for p in self._geo.pairs:
                host = alias(p.plane_ptr, p.plane_span(f), self._dev)
                host = torch.as_strided(host, (p.plane.shape[0], f, p.page_bytes),
                                        (p.plane_stride, p.page_bytes, 1))
                views.append((p.device.view(word), host.view(word)))
            self._views = views
        return self._views
