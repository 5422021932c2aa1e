#!/usr/bin/env python3
"""Measure the CUDA copy methods kvshm can choose from, without the handler around them.

What the CUDA handler's ``auto`` picks per job comes from these figures. For every block size,
1,000 shuffled blocks between a pinned host buffer and device memory, timed with CUDA events
(device time only, median of --reps after warm-ups), GB/s:

  contig          one contiguous ``copy_`` of the same bytes: the limit
  triton[B/P/W]   kvshm's gather/scatter kernel (kvshm.transfer.triton_copy), B words of
                  4 bytes per iteration, P words per program, W warps; ids read through UVA
  triton-devidx   the default configuration with the ids in device memory instead
  torch           torch indexing through UVA (the ``kernel`` method)
  batch           one cuMemcpyBatchAsync over the 1,000 descriptors (the ``batch`` method)

Then, host side (perf_counter, median): plan_transfer, the Triton launch through Triton's
own path and through kvshm's cached launcher, an event create+record, and the whole
``transfer_async + wait`` of the handler at the smallest size, with ``wait`` as torch's
synchronize and with ``blocking_wait`` (the rest of the host cost is the difference to the
device time).

``--host-stub`` needs no GPU: it runs the real ``CudaTransferHandler`` with every CUDA call
(streams, events, the kernel launch, pinned allocations) replaced by a no-op, so what it times
is the handler's own Python and numpy per job (``transfer_async`` + ``wait`` +
``get_finished``) and its pieces: validation (``plan_transfer``), the method choice, writing
the ids into the index buffer. Add the CUDA calls' cost from a GPU run to get a job's host
time.

  python tools/bench_gather.py --json > gather.json
  python tools/bench_gather.py --sizes 16K,2M --reps 5
  python tools/bench_gather.py --host-stub --json     # on any machine, CPU only
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvshm.units import parse_size

CONFIGS = [(1024, 4096, 4), (2048, 8192, 8), (512, 2048, 4), (1024, 16384, 4), (2048, 4096, 4),
           (1024, 4096, 8), (4096, 16384, 8)]


def events_ms(fn: Callable[[], object], reps: int, warm: int = 2, inner: int = 4) -> float:
    """Device ms per call: ``inner`` calls back to back between two events, so the host's
    launch cost overlaps the device work of the call before (except for the first)."""
    import torch
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(inner):
            fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / inner)
    return statistics.median(times)


def host_us(fn: Callable[[], object], reps: int = 200,
            after: Callable[[], object] = lambda: None) -> float:
    fn()
    after()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
        after()
    return statistics.median(times) * 1e6


def device_rates(page: int, blocks: int, reps: int) -> dict:
    import torch

    from kvshm.transfer.cuda_gather import pair_table, word_layout
    from kvshm.transfer.spec import build_geometry
    dev = torch.empty(blocks, page, dtype=torch.uint8, device="cuda").random_(0, 255)
    host = torch.empty(blocks, page, dtype=torch.uint8, pin_memory=True)
    host.copy_(dev.cpu())
    geo = build_geometry([dev], [host])
    elem, align = word_layout(geo)
    base = torch.empty(64, dtype=torch.int32, device="cuda")
    table = torch.from_numpy(pair_table(geo, base.data_ptr(), elem)).cuda()
    rng = np.random.default_rng(0)
    ids = rng.permutation(blocks), rng.permutation(blocks)
    with torch.cuda.stream(torch.cuda.Stream()):  # a real stream: events and launches share it
        return {kind: _rates(kind, dev, host, geo, base, table, align, ids, reps)
                for kind in ("store", "load")}


def _rates(kind: Any, dev, host, geo, base, table, align: int, ids: tuple, reps: int) -> dict:
    import torch

    from kvshm.transfer import triton_copy
    from kvshm.transfer.cuda_dma import SRC_ORDER_ANY, SRC_ORDER_STREAM, DriverBatch
    from kvshm.transfer.cuda_gather import alias, write_ids
    from kvshm.transfer.spec import TransferSpec, plan_transfer
    blocks, page = dev.shape
    d_ids, s_ids = ids
    plan = plan_transfer(TransferSpec(kind, d_ids, s_ids), geo)
    pinned_ids = torch.empty(2 * blocks, dtype=torch.int64, pin_memory=True)
    write_ids(pinned_ids.numpy(), plan, False)
    uva_ids = alias(pinned_ids.data_ptr(), pinned_ids.nbytes, torch.device("cuda"), "<i8")
    dev_ids = pinned_ids.cuda()
    src, dst = (dev, host) if kind == "store" else (host, dev)
    stream = torch.cuda.current_stream().cuda_stream
    fns: dict[str, Callable[[], object]] = {"contig": lambda: dst.copy_(src, non_blocking=True)}
    for b, p, w in CONFIGS:  # the first call compiles; time the cached launcher
        fast = triton_copy.launch(base, uva_ids, table, blocks, 1, page // 4,
                                  store=kind == "store", has_sub=False, align=align,
                                  block=b, piece_words=p, num_warps=w)
        fns[f"triton[{b}/{p}/{w}]"] = lambda f=fast: f(blocks, uva_ids, stream)  # type: ignore[misc]
    fast_d = triton_copy.launch(base, dev_ids, table, blocks, 1, page // 4,
                                store=kind == "store", has_sub=False, align=align)
    fns["triton-devidx"] = lambda: fast_d(blocks, dev_ids, stream)
    hv = alias(host.data_ptr(), host.nbytes, torch.device("cuda")).view(blocks, page)
    dw, hw = dev.view(torch.int32), hv.view(torch.int32)
    di, si = torch.from_numpy(d_ids).cuda(), torch.from_numpy(s_ids).cuda()
    if kind == "load":
        fns["torch"] = lambda: dw.index_copy_(0, di, hw.index_select(0, si))
    else:
        fns["torch"] = lambda: hw.index_copy_(0, si, dw.index_select(0, di))
    batch = DriverBatch.load()
    if batch is not None:
        dp = (dev.data_ptr() + d_ids * page).astype(np.uint64)
        hp = (host.data_ptr() + s_ids * page).astype(np.uint64)
        nb = np.full(blocks, page, np.uint64)
        d_, s_ = (hp, dp) if kind == "store" else (dp, hp)
        order = SRC_ORDER_STREAM if kind == "store" else SRC_ORDER_ANY
        fns["batch"] = lambda: batch.copy(d_, s_, nb, stream, order)
    res: dict = {}
    for name, fn in fns.items():
        try:
            res[name] = round(blocks * page / events_ms(fn, reps) / 1e6, 2)
        except Exception as e:  # a variant that fails is reported, not fatal
            res[name] = f"failed: {e}"
    # the kernel's bytes must be right: poison, copy, compare a few blocks
    dst.fill_(0)
    fns["triton[1024/4096/4]"]()
    torch.cuda.synchronize()
    si_, di_ = (d_ids, s_ids) if kind == "store" else (s_ids, d_ids)
    res["triton_bytes_ok"] = all(torch.equal(dst[int(di_[k])].cpu(), src[int(si_[k])].cpu())
                                 for k in (0, 7, -1))
    return res


def host_costs(page: int, blocks: int) -> dict:
    import torch

    from kvshm.transfer import triton_copy
    from kvshm.transfer.factory import make_handler
    from kvshm.transfer.pinning import pin_region
    from kvshm.transfer.spec import TransferSpec, build_geometry, plan_transfer
    dev = torch.empty(blocks, page, dtype=torch.uint8, device="cuda").fill_(1)
    plane = torch.empty(blocks, page, dtype=torch.uint8).fill_(2)
    region = pin_region(plane.data_ptr(), plane.nbytes)
    rng = np.random.default_rng(0)
    spec = TransferSpec("load", rng.permutation(blocks).tolist(), rng.permutation(blocks).tolist())
    geo = build_geometry([dev], [plane])
    sync = torch.cuda.synchronize
    out: dict = {}

    def measure(name: str, fn: Callable[[], float]) -> None:
        try:
            out[name] = round(fn(), 1)
        except Exception as e:  # one failed figure is reported, not fatal
            out[name] = f"failed: {e}"

    measure("plan_transfer", lambda: host_us(lambda: plan_transfer(spec, geo)))
    measure("event_create_record",
            lambda: host_us(lambda: torch.cuda.Event(enable_timing=True).record()))
    h = make_handler([dev], [plane], method="triton")
    hb = make_handler([dev], [plane], method="batch")
    h0 = make_handler([dev], [plane], method="triton", blocking_wait=True)
    job = iter(range(1 << 30))

    def one(hh: Any) -> None:
        j = next(job)
        hh.transfer_async(j, spec)
        hh.wait([j])
        hh.get_finished()
    for hh in (h, hb, h0):
        one(hh)
    g = h._gather  # type: ignore[attr-defined]
    base, table, idx = g._base, g._table, g._alloc(2 * blocks).device
    words = page // 4
    measure("triton_launch_triton_path", lambda: host_us(
        lambda: triton_copy._copy_pages[(blocks, 1)](
            base, idx, table, blocks, 1, 1, STORE=False, HAS_SUB=False, ALIGN=4, BLOCK=1024,
            PIECE=words, num_warps=4), after=sync))
    stream = torch.cuda.current_stream().cuda_stream

    def cached() -> float:
        fast = triton_copy.launch(base, idx, table, blocks, 1, words, store=False,
                                  has_sub=False, align=4, piece_words=words)
        return host_us(lambda: fast(blocks, idx, stream), after=sync)
    measure("triton_launch_cached", cached)
    measure("transfer_async_triton", lambda: host_us(
        lambda: h.transfer_async(next(job), spec), after=lambda: (sync(), h.get_finished())))
    measure("transfer_async_batch", lambda: host_us(
        lambda: hb.transfer_async(next(job), spec), after=lambda: (sync(), hb.get_finished())))
    times: dict[str, list[float]] = {"triton": [], "triton_blocking_wait": [], "batch": []}
    for _ in range(100):  # interleaved: noise hits all alike
        for name, hh in (("triton", h), ("triton_blocking_wait", h0), ("batch", hb)):
            t0 = time.perf_counter()
            one(hh)
            times[name].append(time.perf_counter() - t0)
    for name, v in times.items():
        out[f"job_us_{name}"] = round(statistics.median(v) * 1e6, 1)
    for hh in (h, hb, h0):
        hh.shutdown()
    if region is not None:
        region.unregister()
    return out


# --- host side without a GPU --------------------------------------------------------------
def _noop(*a: Any, **k: Any) -> None:
    return None


class _Event:
    """A CUDA event that is always complete; every call is a no-op."""
    __init__ = record = synchronize = wait = _noop

    def query(self) -> bool:
        return True

    def elapsed_time(self, other: Any) -> float:
        return 0.0


class _Stream:
    cuda_stream = 0
    __init__ = wait_event = synchronize = _noop


class _Pin:
    pinned = True
    unregister = _noop


def stub_handler(blocks: int, page: int, method: str = "triton", factor: int = 1) -> tuple:
    """A real ``CudaTransferHandler`` over CPU tensors with every CUDA call a no-op; returns
    (handler, launches, stack): ``launches`` gets (n, ids) per kernel launch, the ids copied
    from the index buffer; ``stack.close()`` undoes the patches (after ``shutdown``)."""
    import contextlib
    import importlib.util
    from unittest import mock

    import torch

    from kvshm.transfer import cuda_copy, cuda_gather
    from kvshm.transfer.index_pool import IndexBuffer

    class CudaLike(torch.Tensor):  # a CPU tensor that says it is on cuda:0
        @property
        def device(self) -> Any:  # type: ignore[override]
            return torch.device("cuda", 0)

    launches: list[tuple[int, np.ndarray]] = []

    class HostGather(cuda_gather.Gather):
        def __init__(self, geo: Any, device: Any) -> None:
            super().__init__(geo, torch.device("cpu"))
            for key in ((s, h) for s in (False, True) for h in (False, True)):
                self._fast[key] = self._record

        def _record(self, n: int, idx: Any, stream: int) -> None:
            idx.data_ptr()  # what the real launcher asks of it
            if len(launches) < 64:
                launches.append((n, idx.numpy()[:3 * n].copy()))

        def ready(self) -> bool:
            return True

        def _alloc(self, words: int) -> IndexBuffer:
            host = torch.zeros(words, dtype=torch.int64)
            return IndexBuffer(host.numpy(), host, owner=host)

    find = importlib.util.find_spec
    stack = contextlib.ExitStack()
    for target, value in (
            ("torch.cuda.Stream", _Stream), ("torch.cuda.Event", _Event),
            ("torch.cuda.device_count", lambda: 1), ("torch.cuda.current_device", lambda: 0),
            ("torch.cuda.current_stream", lambda *a: _Stream()),
            ("torch._C._cuda_getCurrentRawStream", lambda i: 0),
            ("importlib.util.find_spec", lambda name, *a: True if name == "triton"
             else find(name, *a))):
        stack.enter_context(mock.patch(target, value, create=True))
    stack.enter_context(mock.patch.object(cuda_copy, "Gather", HostGather))
    stack.enter_context(mock.patch.object(cuda_copy.DriverBatch, "load", lambda: None))
    dev = torch.zeros(blocks * factor, page, dtype=torch.uint8).as_subclass(CudaLike)
    plane = torch.zeros(blocks, factor * page, dtype=torch.uint8)
    try:
        h = cuda_copy.CudaTransferHandler([dev], [plane], block_size_factor=factor,
                                          method=method, pin=_Pin())
    except BaseException:
        stack.close()
        raise
    return h, launches, stack


def host_stub(page: int, blocks: int, reps: int) -> dict:
    """Host us per job of the handler's own code, GPU calls stubbed (median of ``reps``)."""
    h, _, stack = stub_handler(blocks, page)
    try:
        return {kind: _host_stub_kind(h, kind, blocks, reps) for kind in ("load", "store")}
    finally:
        h.shutdown()
        stack.close()


def _host_stub_kind(h: Any, kind: str, blocks: int, reps: int) -> dict:
    from kvshm.transfer.cuda_gather import write_ids
    from kvshm.transfer.spec import TransferSpec, plan_transfer
    rng = np.random.default_rng(0)
    spec = TransferSpec(kind, rng.permutation(blocks), rng.permutation(blocks))  # type: ignore
    geo = h._geo
    plan = plan_transfer(spec, geo)
    ids = np.zeros(3 * blocks, np.int64)
    job = iter(range(1 << 30))

    def whole() -> None:
        j = next(job)
        h.transfer_async(j, spec)
        h.wait([j])
        h.get_finished()
    r = {"plan_transfer": host_us(lambda: plan_transfer(spec, geo), reps),
         "choose": host_us(lambda: h._memo.get(plan.kind) or h._choose(plan), reps),
         "write_ids": host_us(lambda: write_ids(ids, plan, False), reps),
         "transfer_async": host_us(lambda: h.transfer_async(next(job), spec), reps,
                                   after=h.get_finished),
         "job": host_us(whole, reps)}
    return {k: round(v, 2) for k, v in r.items()}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16K,64K,256K,512K,1M,2M")
    ap.add_argument("--blocks", type=int, default=1000)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--host-stub", action="store_true",
                    help="no GPU: time the handler's own host code per job, CUDA calls stubbed")
    args = ap.parse_args(argv)
    if args.host_stub:
        res = {s: host_stub(parse_size(s), args.blocks, max(args.reps, 2000))
               for s in args.sizes.split(",")[:1]}
        if args.json:
            print(json.dumps(res, indent=1))
        else:
            for s, r in res.items():
                for kind, v in r.items():
                    print(f"{s:>5} {kind:5} host us/job: "
                          + "  ".join(f"{k}={x}" for k, x in v.items()))
        return 0
    try:
        import torch
        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:  # one line, as every tool says what it needs, never a traceback
        print("bench_gather needs torch with CUDA and a CUDA GPU (--host-stub runs without one)",
              file=sys.stderr)
        return 2
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "blocks": args.blocks, "loadavg_start": os.getloadavg(), "device": {}}
    for s in args.sizes.split(","):
        report["device"][s] = device_rates(parse_size(s), args.blocks, args.reps)
        torch.cuda.empty_cache()
    try:
        with torch.cuda.stream(torch.cuda.Stream()):
            report["host_us_16K"] = host_costs(16 << 10, args.blocks)
    except Exception as e:  # keep the device figures
        report["host_us_16K"] = f"failed: {e!r}"
    report["loadavg_end"] = os.getloadavg()
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"# {report['gpu']}, {args.blocks} shuffled blocks, device time, GB/s")
    for s, r in report["device"].items():
        for kind in ("store", "load"):
            print(f"{s:>5} {kind:5} " + "  ".join(f"{k}={v}" for k, v in r[kind].items()))
    print("# host us at 16K:", report["host_us_16K"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
