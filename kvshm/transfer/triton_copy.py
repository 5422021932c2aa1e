"""One Triton gather/scatter kernel that copies every page of a job, for every plane pair.

This module owns the kernel and its launch. A job is a list of block ids; the kernel reads
them (through UVA, from a pinned host buffer: no upload) and a small per-pair table of bases,
strides and page sizes (uploaded once per handler), and each program copies one piece of one
page of one pair with 16-byte accesses where the layout allows. Coalescing is unnecessary
here: adjacent pages are copied at the same rate as scattered ones.

It is imported only by ``cuda_gather`` and only when a CUDA job picks the ``triton`` method, so
a CPU-only install never needs Triton. It must never choose addresses itself: every offset it
uses comes from the validated ids and the geometry checked in ``spec.build_geometry``, and the
caller guarantees that the host side is pinned and mapped at the same address (UVA).
It also runs under ``TRITON_INTERPRET=1`` on CPU tensors, which is how it is tested without
a GPU.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import triton
import triton.language as tl

# Table rows (int64, in words of the launch's element size), one column per plane pair.
T_DEV_BASE, T_DEV_STRIDE, T_PLANE_BASE, T_PLANE_STRIDE, T_PAGE = (
    tl.constexpr(k) for k in range(5))
TABLE_ROWS = 5
MAX_GRID_Y = 65535  # CUDA's limit on grid dimension y


# Sizes are not specialised on (==1, %16): one compiled kernel serves every job of a handler.
@triton.jit(do_not_specialize=["n", "n_pairs", "n_pieces"])
def _copy_pages(base, idx, table, n, n_pairs, n_pieces,
                STORE: tl.constexpr, HAS_SUB: tl.constexpr, ALIGN: tl.constexpr,
                BLOCK: tl.constexpr, PIECE: tl.constexpr):
    i = tl.program_id(0)                 # the i-th block of the job
    q = tl.program_id(1)                 # pair * n_pieces + piece
    p = q // n_pieces
    start = (q % n_pieces) * PIECE      # a multiple of BLOCK: keeps accesses aligned
    page = tl.multiple_of(tl.load(table + T_PAGE * n_pairs + p), ALIGN)
    if start < page:                     # pages of other pairs may be longer
        dev = tl.load(table + T_DEV_BASE * n_pairs + p) \
            + tl.load(idx + i) * tl.load(table + T_DEV_STRIDE * n_pairs + p)
        seg = tl.load(table + T_PLANE_BASE * n_pairs + p) \
            + tl.load(idx + n + i) * tl.load(table + T_PLANE_STRIDE * n_pairs + p)
        if HAS_SUB:                      # block_size_factor > 1: sub-block inside the row
            seg += tl.load(idx + 2 * n + i) * page
        if STORE:
            src, dst = dev, seg
        else:
            src, dst = seg, dev
        src = tl.multiple_of(src, ALIGN)  # lets Triton emit 16-byte loads and stores
        dst = tl.multiple_of(dst, ALIGN)
        for k in range(PIECE // BLOCK):  # a constant trip count; the mask ends the page
            o = start + k * BLOCK + tl.arange(0, BLOCK)
            m = o < page
            tl.store(base + dst + o, tl.load(base + src + o, mask=m), mask=m)


Launcher = Callable[[int, Any, int], None]


def launch(base: Any, idx: Any, table: Any, n: int, n_pairs: int, max_page_words: int, *,
           store: bool, has_sub: bool, align: int, block: int = 1024,
           piece_words: int = 4096, num_warps: int = 4) -> Launcher:
    """Copy ``n`` blocks of every pair on torch's current stream; returns a launcher for the
    next jobs with the same ``base``, ``table`` and flags: ``fast(n, idx, stream_handle)``,
    ``idx`` a tensor at a 16-byte aligned address.

    ``base``: a tensor of the word type; every table offset is in words from its address.
    ``idx``: int64 ``[device ids (n), segment rows (n), sub-blocks (n) if has_sub]``.
    ``piece_words``: words per program, a multiple of ``block``: cut to the page for small
    pages, raised where a page would need more programs than the grid's y dimension allows.
    """
    piece_words = min(piece_words, triton.cdiv(max_page_words, block) * block)
    pieces = triton.cdiv(max_page_words, piece_words)
    while pieces * n_pairs > MAX_GRID_Y:
        piece_words *= 2
        pieces = triton.cdiv(max_page_words, piece_words)
    consts = dict(STORE=store, HAS_SUB=has_sub, ALIGN=align, BLOCK=block, PIECE=piece_words)

    def slow(n: int, idx: Any, stream: int) -> Any:  # Triton's own path; stream: torch's current
        if n:
            return _copy_pages[(n, n_pairs * pieces)](base, idx, table, n, n_pairs, pieces,
                                                      **consts, num_warps=num_warps)
        return None

    kernel = slow(n, idx, 0)
    try:  # the launch of a compiled kernel as JITFunction.run does it (Triton 3.x)
        from triton import knobs
        rt = knobs.runtime
        run, function, meta = kernel.run, kernel.function, kernel.packed_metadata
        # Addresses as ints: the launcher then skips data_ptr() and a driver query per pointer
        base_p, table_p = base.data_ptr(), table.data_ptr()
    except Exception:  # another Triton (or the interpreter): its own path
        return lambda n, idx, stream: slow(n, idx, stream)

    def fast(n: int, idx: Any, stream: int) -> None:
        if _hooked(rt.launch_enter_hook, rt.launch_exit_hook):
            import torch  # a profiler is listening: let Triton call its hooks
            with torch.cuda.stream(torch.cuda.ExternalStream(stream)):
                slow(n, idx, stream)
        elif n:
            run(n, n_pairs * pieces, 1, stream, function, meta, None, None, None, base_p,
                idx.data_ptr(), table_p, n, n_pairs, pieces, store, has_sub, align, block,
                piece_words)
    return fast


def _hooked(enter: Any, leave: Any) -> bool:
    """Some launch hook would be called: not None, and not an empty HookChain (Triton 3.4+
    keeps one always). One plain call for both hooks: this runs once per job."""
    for h in (enter, leave):
        if h is not None and not (isinstance(getattr(h, "calls", None), list) and not h.calls):
            return True
    return False
