#!/usr/bin/env python3
"""Measure kvshm block-transfer throughput against the practical limit and a naive loop.

For every block size, one job of N blocks (default 1,000, shuffled ids on both sides: the worst
case, nothing coalesces) is stored (device -> segment plane) and loaded back. In the same run,
interleaved so that machine noise hits every column alike, it times the columns below, in the
order ``column_sequence`` gives: every column runs right after every other column equally often
(once per round; a round times each column k-1 times for k columns, and --reps sets how many
rounds: enough for at least that many timings). What ran just before matters: after the naive
loop, whose thousands of small copies evict the host's caches, a job's host work can take
several times longer, and a column with more host work pays more; so every column, kvshm's
included, gets the same predecessors.

  kvshm       the transfer handler (transfer_async + wait)
  contiguous  ONE plain copy of the same number of bytes: the practical limit
              (CPU: numpy copyto; CUDA: one copy_ between the device tensor and the pinned plane)
  loop        the naive per-block loop: ``dst[d].copy_(src[s])`` once per block, with torch's
              intra-op threads at 1 (a conservative baseline: with 2, each small copy waits
              for an OpenMP thread and collapses to 0.01-0.3 GB/s on a busy box), capped at
              --budget seconds and reported as a rate over the blocks it copied

and prints GB/s (10^9 bytes/s, median of --reps) and the ratios kvshm/contiguous, kvshm/loop.
With --checksums (CPU path) the plane is a real segment's, created with
``Layout(..., checksums=True)``, and a second column ``kvshm[sums]`` times the same handler
given ``checksums=BlockSums(segment)`` (a crc32 per block written after a store's copy,
recomputed after a load's); ``sums/plain`` is its rate over the plain kvshm column.
The CPU path always runs; the CUDA path runs when a GPU is visible (its name is recorded), with
the segment plane pinned by kvshm.transfer.pinning, once per copy method (auto, copy, batch, kernel,
triton); ``auto`` is what an engine gets: it picks a method per job by page size.

Reading the numbers: compare ratios within one run, never GB/s across runs or machines (a
shared box moves every column together). Targets: CPU path >= 80% of contiguous for blocks
>= 256 KiB and >= 60% at 64 KiB; CUDA path (auto) >= 85% of pinned contiguous at every block size
from 16 KiB to 2 MiB, both directions. Note that glibc copies >= ~192 MiB at once with non-temporal
stores, which per-block copies of any size never get: that is most of the CPU gap at 256 KiB+.

Examples:
  python tools/bench_transfer.py                       # default sizes, table
  python tools/bench_transfer.py --json > out.json     # one JSON object with every figure
  python tools/bench_transfer.py --sizes 16K,2M --blocks 500 --ids sequential --device cpu
  python tools/bench_transfer.py --device cpu --checksums --blocks 200   # cost of checksums
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from kvshm.errors import TransferError
from kvshm.transfer.factory import make_handler
from kvshm.transfer.spec import TransferSpec
from kvshm.units import parse_size

CUDA_METHODS = ("auto", "copy", "batch", "kernel", "triton")


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines()
                    if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        return platform.processor() or "unknown"


def column_sequence(k: int, rounds: int = 1) -> list[int]:
    """The order in which ``k`` columns run: ``rounds * k * (k - 1) + 1`` indices, starting and
    ending with column 0, in which every ordered pair of two different columns follows each
    other exactly ``rounds`` times (an Eulerian circuit of the complete directed graph). The
    first entry is run untimed (it only sets the predecessor of the second); each column is
    then timed ``rounds * (k - 1)`` times, once after each other column per round.
    A Latin square would not do with fewer reps than its rows: with 7 columns and 5 reps, the
    first column followed the heavy DMA columns in 4 of its 5 timings and another column in 2.
    """
    if k == 1:
        return [0] * (rounds + 1)
    # successors still to visit, per column; popping from the end visits b = a+1, a+2, ...
    # first, which spreads the heavy columns out
    todo = {a: [b % k for b in range(a + k - 1, a, -1)] * rounds for a in range(k)}
    stack, circuit = [0], []
    while stack:  # Hierholzer
        v = stack[-1]
        if todo[v]:
            stack.append(todo[v].pop())
        else:
            circuit.append(stack.pop())
    return circuit[::-1]


def run_interleaved(fns: dict[str, Callable[[], int | None]], reps: int,
                    total: int) -> dict[str, float]:
    """GB/s of every fn, median over its timed runs after one warm-up each; runs follow
    ``column_sequence`` with enough rounds for at least ``reps`` timings per fn.

    A fn returns the bytes it moved, or None for all ``total`` bytes (the time-capped loop
    returns how far it got, so its figure is a rate over the blocks it did copy).
    """
    names = list(fns)
    k = len(names)
    seq = column_sequence(k, max(1, -(-reps // max(1, k - 1))))
    for name in names[1:] + names[:1]:  # warm-up; the sequence's untimed head runs last
        fns[name]()
    rates: dict[str, list[float]] = {n: [] for n in names}
    for i in seq[1:]:
        name, fn = names[i], fns[names[i]]
        t0 = time.perf_counter()
        moved = fn()
        rates[name].append((total if moved is None else moved) / (time.perf_counter() - t0))
    return {n: statistics.median(v) / 1e9 for n, v in rates.items()}


def naive_loop(pairs: list[tuple[int, int]], src, dst, budget_s: float, page: int,
               sync: Callable[[], None] = lambda: None, **copy_kw) -> Callable[[], int]:
    """``dst[d].copy_(src[s])`` per block, with torch's intra-op threads at 1 (with more, every
    small copy waits for an OpenMP thread and the loop collapses to 0.01-0.3 GB/s whenever
    another core is busy), stopping after ``budget_s``; returns the bytes it copied."""
    import torch

    def loop() -> int:
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            deadline, done = time.perf_counter() + budget_s, 0
            for s, d in pairs:
                dst[d].copy_(src[s], **copy_kw)
                done += 1
                if done % 16 == 0 and time.perf_counter() > deadline:
                    break
            sync()
            return done * page
        finally:
            torch.set_num_threads(threads)
    return loop


def check(job: Callable[[], None], src, dst, si: np.ndarray, di: np.ndarray) -> None:
    """Zero the destination, run one kvshm job, and compare a few blocks with their sources."""
    import torch
    dst.zero_()
    job()
    for k in (0, len(si) // 2, -1):
        want = src[int(si[k])].cpu()
        assert bool(want.any()) and torch.equal(dst[int(di[k])].cpu(), want), "copy is wrong"


def bench_cpu(page: int, blocks: int, reps: int, ids: str, threads: int | None,
              copier: str, budget_s: float, checksums: bool = False) -> dict:
    import torch
    dev = torch.empty(blocks, page, dtype=torch.uint8).fill_(1)   # fill_ also faults pages in
    seg = None
    if checksums:  # a real segment: the sums live in it
        import uuid

        from kvshm.shm.checksums import BlockSums
        from kvshm.shm.layout import Layout
        from kvshm.shm.segment import Segment
        seg = Segment.create(f"bench-sums-{uuid.uuid4().hex[:8]}",
                             Layout((page,), 16, "bench", checksums=True), blocks)
        plane = seg.torch_planes()[0]
        plane.fill_(2)
        hs = make_handler([dev], [plane], threads=threads, copier=copier,
                          checksums=BlockSums(seg))
    else:
        plane = torch.empty(blocks, page, dtype=torch.uint8).fill_(2)
    rng = np.random.default_rng(0)
    d_ids = rng.permutation(blocks) if ids == "shuffled" else np.arange(blocks)
    s_ids = rng.permutation(blocks) if ids == "shuffled" else np.arange(blocks)
    h = make_handler([dev], [plane], threads=threads, copier=copier)
    job = iter(range(1 << 30))
    out = {}
    for kind in ("store", "load"):
        src, dst = (dev, plane) if kind == "store" else (plane, dev)
        si, di = (d_ids, s_ids) if kind == "store" else (s_ids, d_ids)
        pairs = list(zip(si.tolist(), di.tolist()))
        spec = TransferSpec(kind, d_ids, s_ids)
        src_np, dst_np = src.numpy().reshape(-1), dst.numpy().reshape(-1)

        def kvshm(h=h, spec=spec) -> None:
            j = next(job)
            h.transfer_async(j, spec)
            h.wait([j])
            assert all(r.success for r in h.get_finished())

        fns = {"kvshm": kvshm, "contiguous": lambda d=dst_np, s=src_np: np.copyto(d, s),
               "loop": naive_loop(pairs, src, dst, budget_s, page)}
        if seg is not None:
            fns["kvshm[sums]"] = lambda: kvshm(hs)
            if kind == "load":
                check(lambda: kvshm(hs), plane, dev, s_ids, d_ids)  # sums of this plane
        out[kind] = run_interleaved(fns, reps, blocks * page)
        if seg is not None:
            out[kind]["sums/plain"] = out[kind]["kvshm[sums]"] / out[kind]["kvshm"]
        check(kvshm, src, dst, si, di)
    h.shutdown()
    if seg is not None:
        hs.shutdown()
        seg.close()
        Segment.unlink(seg.name)
    return out


def one_job(h: Any, spec: TransferSpec, job: Iterator[int]) -> Callable[[], None]:
    """One job of ``spec`` on handler ``h``, waited for: what a column of kvshm times."""
    def run() -> None:
        j = next(job)
        h.transfer_async(j, spec)
        h.wait([j])
        assert all(r.success for r in h.get_finished())
    return run


def contiguous_copy(src: Any, dst: Any, stream: Any) -> Callable[[], None]:
    """One ``copy_`` of all of ``src`` on ``stream``, waited for: the baseline column."""
    import torch

    def run() -> None:
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()
    return run


def bench_cuda(page: int, blocks: int, reps: int, ids: str, methods: list[str],
               budget_s: float) -> dict:
    import torch

    from kvshm.transfer.pinning import pin_region
    dev = torch.empty(blocks, page, dtype=torch.uint8, device="cuda").fill_(1)
    plane = torch.empty(blocks, page, dtype=torch.uint8).fill_(2)
    region = pin_region(plane.data_ptr(), plane.nbytes)
    rng = np.random.default_rng(0)
    d_ids = rng.permutation(blocks) if ids == "shuffled" else np.arange(blocks)
    s_ids = rng.permutation(blocks) if ids == "shuffled" else np.arange(blocks)
    stream = torch.cuda.Stream()
    job = iter(range(1 << 30))
    out: dict = {"pinned": region is not None}
    handlers = {}
    for m in methods:
        try:
            handlers[m] = make_handler([dev], [plane], method=m)
        except TransferError as e:  # e.g. batch on a driver < 12.8, triton not installed
            out[f"{m}_unavailable"] = str(e)
    for kind in ("store", "load"):
        src, dst = (dev, plane) if kind == "store" else (plane, dev)
        si, di = (d_ids, s_ids) if kind == "store" else (s_ids, d_ids)
        pairs = list(zip(si.tolist(), di.tolist()))
        spec = TransferSpec(kind, d_ids, s_ids)

        contiguous = contiguous_copy(src, dst, stream)

        def synced() -> None:
            stream.synchronize()

        def loop(pairs=pairs, src=src, dst=dst) -> int:
            with torch.cuda.stream(stream):
                return naive_loop(pairs, src, dst, budget_s, page, synced, non_blocking=True)()

        fns = {f"kvshm[{m}]": one_job(h, spec, job) for m, h in handlers.items()}
        res = run_interleaved({**fns, "contiguous": contiguous, "loop": loop}, reps,
                              blocks * page)
        res["kvshm"] = res.get("kvshm[auto]", next(iter(res.values())))
        out[kind] = res
        for h in handlers.values():
            check(one_job(h, spec, job), src, dst, si, di)
    for h in handlers.values():
        h.shutdown()
    if region is not None:
        region.unregister()
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16K,64K,256K,2M",
                    help="comma-separated block sizes in bytes, K/M suffixes "
                         "(default: %(default)s)")
    ap.add_argument("--blocks", type=int, default=1000,
                    help="blocks per job; memory used is 2 x blocks x size (default: %(default)s)")
    ap.add_argument("--reps", type=int, default=5,
                    help="at least this many timed runs per column, in whole rounds (a round "
                         "times each of k columns k-1 times, once after each other column); "
                         "the median is reported (default: %(default)s)")
    ap.add_argument("--ids", choices=("shuffled", "sequential"), default="shuffled",
                    help="shuffled = worst case, no run coalesces; sequential = one run per job")
    ap.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                    help="auto = CPU path, plus CUDA when a GPU is visible (default: %(default)s)")
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU handler copy threads per job (default: min(2, cores))")
    ap.add_argument("--copier", choices=("memmove", "vm"), default="memmove",
                    help="CPU handler copy primitive: one memmove per run, or process_vm_readv "
                         "batches of 1,024 runs (default: %(default)s)")
    ap.add_argument("--cuda-methods", default=",".join(CUDA_METHODS),
                    help="CUDA handler methods to time (default: %(default)s)")
    ap.add_argument("--budget", type=float, default=1.0,
                    help="seconds: the naive loop stops after this long and reports its rate "
                         "over the blocks it copied (default: %(default)s)")
    ap.add_argument("--checksums", action="store_true",
                    help="CPU path: also time the handler with block checksums (a real "
                         "segment); adds kvshm[sums] and sums/plain")
    ap.add_argument("--json", action="store_true", help="print ONE JSON object instead of a table")
    args = ap.parse_args(argv)

    import torch
    sizes = [parse_size(s) for s in args.sizes.split(",") if s]
    want_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda but torch sees no GPU")
    report: dict = {"command": " ".join([os.path.basename(sys.argv[0]), *(argv or sys.argv[1:])]),
                    "cpu": cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
                    "blocks": args.blocks, "ids": args.ids, "reps": args.reps,
                    "threads": args.threads, "copier": args.copier,
                    "checksums": args.checksums, "results": [],
                    "column_order": "every column after every other equally often (column_sequence)"}
    if want_cuda:
        report["gpu"] = torch.cuda.get_device_name()
        report["cuda"] = torch.version.cuda
        try:
            import triton
            report["triton"] = triton.__version__
        except ImportError:
            report["triton"] = None
    report["loadavg_start"] = os.getloadavg()
    t_start = time.perf_counter()
    for page in sizes:
        if args.device in ("auto", "cpu"):
            r = bench_cpu(page, args.blocks, args.reps, args.ids, args.threads, args.copier,
                          args.budget, args.checksums)
            report["results"].append({"path": "cpu", "block_bytes": page, **r})
        if want_cuda:
            r = bench_cuda(page, args.blocks, args.reps, args.ids,
                           [m for m in args.cuda_methods.split(",") if m], args.budget)
            report["results"].append({"path": "cuda", "block_bytes": page, **r})
    report["seconds"] = round(time.perf_counter() - t_start, 1)
    report["loadavg_end"] = os.getloadavg()
    if args.json:
        print(json.dumps(report, indent=1))
        return 0
    print(f"# {report['cpu']} ({report['cores']} cores)"
          + (f", GPU {report['gpu']}" if want_cuda else "")
          + f"; {args.blocks} blocks/job, {args.ids} ids, median of {args.reps}")
    print(f"{'path':5} {'dir':5} {'block':>7} {'kvshm':>7} {'contig':>7} {'loop':>7} "
          f"{'kvshm/contig':>12} {'kvshm/loop':>10}   GB/s")
    for r in report["results"]:
        for kind in ("store", "load"):
            x = r[kind]
            extra = "  ".join(f"{k[6:-1]}={v:.1f}" for k, v in x.items() if k.startswith("kvshm["))
            if "sums/plain" in x:
                extra += f"  sums/plain={x['sums/plain']:.0%}"
            print(f"{r['path']:5} {kind:5} {r['block_bytes'] >> 10:>5}Ki {x['kvshm']:7.2f} "
                  f"{x['contiguous']:7.2f} {x['loop']:7.2f} {x['kvshm'] / x['contiguous']:12.0%} "
                  f"{x['kvshm'] / x['loop']:9.1f}x  {extra}")
    print(f"# {report['seconds']} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
