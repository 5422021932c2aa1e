#!/usr/bin/env python3
"""Can the copy engines and the SMs share one small-page job and beat either alone? (CUDA)

kvshm moves small pages (16-256 KiB) with one gather kernel whose SMs read or write the pinned
segment through UVA (``kvshm.transfer.triton_copy``). SM accesses of host memory top out near
90% of what the copy engines reach on one contiguous copy, and the copy engines pay per
descriptor on scattered pages (``tools/bench_gather.py``). Neither alone keeps the PCIe link
full; together they might. This probe splits a job of N shuffled blocks: the kernel copies the
first ``fraction`` of them on one stream while ONE ``cuMemcpyBatchAsync`` moves the rest on a
second stream, both forked from and joined back into the first:

  contig     one contiguous ``copy_`` of all N blocks' bytes: the limit
  split@F    kernel over F x N blocks, DMA batch over the rest (split@1.00 = kernel alone,
             split@0.00 = DMA alone); ``dma-first`` variants issue the DMA before the kernel

Two timings per column, medians: ``device`` (--inner jobs back to back between two CUDA events:
the rate the GPU sustains, GB/s) and ``job`` (one job then a synchronize, wall clock, host
included, columns alternating: GB/s). The host work that builds the DMA descriptors is done
once, before timing: the probe asks what the hardware can do; what the handler would add is
``bench_transfer``'s to measure. Bytes are checked in both parts of one split.

    python tools/probe_split_copy.py --sizes 16K,64K --json

Needs a CUDA GPU, Triton and a driver with cuMemcpyBatchAsync (>= 12.8).
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

FRACTIONS = (1.0, 0.95, 0.9, 0.85, 0.8, 0.75, 0.7, 0.6, 0.5, 0.0)


def device_gbs(fn: Callable[[], object], nbytes: int, stream: Any, reps: int,
               inner: int) -> float:
    import torch
    for _ in range(2):
        fn()
    stream.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(stream)
        for _ in range(inner):
            fn()
        b.record(stream)
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / inner)
    return round(nbytes / statistics.median(times) / 1e9, 2)


def job_gbs(fns: dict[str, Callable[[], object]], nbytes: int, stream: Any,
            reps: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(reps):  # alternating: noise hits every column alike
        for name, fn in fns.items():
            stream.synchronize()
            t0 = time.perf_counter()
            fn()
            stream.synchronize()
            times[name].append(time.perf_counter() - t0)
    return {k: round(nbytes / statistics.median(v) / 1e9, 2) for k, v in times.items()}


def probe(page: int, blocks: int, reps: int, inner: int) -> dict:
    import torch

    from kvshm.transfer import triton_copy
    from kvshm.transfer.cuda_dma import SRC_ORDER_ANY, SRC_ORDER_STREAM, DriverBatch
    from kvshm.transfer.cuda_gather import alias, pair_table, word_layout
    from kvshm.transfer.spec import build_geometry
    batch = DriverBatch.load()
    if batch is None:
        return {"error": "no cuMemcpyBatchAsync in this driver"}
    cuda = torch.device("cuda")
    dev = torch.empty(blocks, page, dtype=torch.uint8, device=cuda).random_(0, 255)
    host = torch.empty(blocks, page, dtype=torch.uint8, pin_memory=True)
    host.copy_(torch.randint_like(dev, 0, 255).cpu())
    geo = build_geometry([dev], [host])
    elem, align = word_layout(geo)
    base = torch.empty(64, dtype=torch.int32, device=cuda)
    table = torch.from_numpy(pair_table(geo, base.data_ptr(), elem)).to(cuda)
    rng = np.random.default_rng(0)
    d_ids, s_ids = rng.permutation(blocks), rng.permutation(blocks)
    s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
    fork, join = torch.cuda.Event(), torch.cuda.Event()
    nbytes = blocks * page
    out: dict = {}
    for kind in ("store", "load"):
        store = kind == "store"
        src, dst = (dev, host) if store else (host, dev)
        fns: dict[str, Callable[[], object]] = {}

        def contig(src=src, dst=dst) -> None:
            with torch.cuda.stream(s1):
                dst.copy_(src, non_blocking=True)
        fns["contig"] = contig
        keep = []  # pinned id buffers and descriptor arrays must outlive every queued job
        for frac in FRACTIONS:
            k = round(frac * blocks)
            pinned = torch.empty(max(2 * k, 2), dtype=torch.int64, pin_memory=True)
            pinned[:k] = torch.from_numpy(d_ids[:k])
            pinned[k:2 * k] = torch.from_numpy(s_ids[:k])
            ids = alias(pinned.data_ptr(), pinned.nbytes, cuda, "<i8")
            fast = None
            if k:
                with torch.cuda.stream(s1):  # the first launch compiles (and copies)
                    fast = triton_copy.launch(base, ids, table, k, 1, page // elem,
                                              store=store, has_sub=False, align=align)
            dp = (dev.data_ptr() + d_ids[k:] * page).astype(np.uint64)
            hp = (host.data_ptr() + s_ids[k:] * page).astype(np.uint64)
            nb = np.full(blocks - k, page, np.uint64)
            dma = (hp, dp) if store else (dp, hp)
            order = SRC_ORDER_STREAM if store else SRC_ORDER_ANY
            keep.append((pinned, ids, dma, nb))

            def split(k=k, fast=fast, ids=ids, dma=dma, nb=nb, order=order,
                      dma_first=False) -> None:
                fork.record(s1)
                s2.wait_event(fork)
                if dma_first and k < blocks:
                    batch.copy(dma[0], dma[1], nb, s2.cuda_stream, order)
                if fast is not None:
                    fast(k, ids, s1.cuda_stream)
                if not dma_first and k < blocks:
                    batch.copy(dma[0], dma[1], nb, s2.cuda_stream, order)
                join.record(s2)
                s1.wait_event(join)
            fns[f"split@{frac:.2f}"] = split
            if 0 < k < blocks:
                fns[f"split@{frac:.2f}-dma-first"] = \
                    lambda split=split: split(dma_first=True)  # type: ignore[misc]
        res: dict = {"device": {}, "job": {}}
        for name, fn in fns.items():
            try:
                res["device"][name] = device_gbs(fn, nbytes, s1, reps, inner)
            except Exception as e:  # one failed variant is reported, not fatal
                res["device"][name] = f"failed: {e}"
        ok = {n: f for n, f in fns.items() if isinstance(res["device"][n], float)}
        res["job"] = job_gbs(ok, nbytes, s1, reps * inner)
        # bytes: poison the destination, run a half split, check blocks from both parts
        half = fns.get("split@0.50")
        if half is not None:
            dst.zero_()
            half()
            s1.synchronize()
            si, di = (d_ids, s_ids) if store else (s_ids, d_ids)
            res["bytes_ok"] = all(torch.equal(dst[int(di[j])].cpu(), src[int(si[j])].cpu())
                                  for j in (0, blocks // 2 - 1, blocks // 2, blocks - 1))
        for part in ("device", "job"):
            c = res[part].get("contig")
            if isinstance(c, float):
                res[part + "_vs_contig"] = {n: round(v / c, 3) for n, v in res[part].items()
                                            if isinstance(v, float)}
        out[kind] = res
        del keep
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16K,64K",
                    help="comma-separated block sizes, K/M suffixes (default: %(default)s)")
    ap.add_argument("--blocks", type=int, default=1000, help="blocks per job (default: 1000)")
    ap.add_argument("--reps", type=int, default=15,
                    help="timed repetitions; medians are reported (default: %(default)s)")
    ap.add_argument("--inner", type=int, default=4,
                    help="jobs back to back per device timing (default: %(default)s)")
    ap.add_argument("--json", action="store_true", help="print ONE JSON object")
    args = ap.parse_args(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from sweep_triton_copy import cuda_torch
    torch = cuda_torch()
    if torch is None:  # one line, as every tool says what it needs, never a traceback
        print("probe_split_copy needs torch with CUDA, Triton and a CUDA GPU", file=sys.stderr)
        return 2
    report: dict = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
                    "blocks": args.blocks, "loadavg_start": os.getloadavg(), "results": []}
    for s in args.sizes.split(","):
        page = parse_size(s)
        report["results"].append({"block_bytes": page,
                                  **probe(page, args.blocks, args.reps, args.inner)})
    report["loadavg_end"] = os.getloadavg()
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"# {report['gpu']}, {args.blocks} shuffled blocks; GB/s (ratio to contig)")
    for r in report["results"]:
        for kind in ("store", "load"):
            x = r.get(kind, {})
            print(f"{kind} {r['block_bytes'] >> 10} KiB  bytes_ok={x.get('bytes_ok')}")
            for name in x.get("device", {}):
                dv, jb = x["device"][name], x["job"].get(name)
                dr = x.get("device_vs_contig", {}).get(name)
                jr = x.get("job_vs_contig", {}).get(name)
                print(f"  {name:24} device {dv} ({dr})   job {jb} ({jr})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
