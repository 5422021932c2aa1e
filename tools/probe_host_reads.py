#!/usr/bin/env python3
"""How fast can the GPU's SMs read scattered pages of pinned host memory? (CUDA, CuPy)

kvshm's small-page loads run one gather kernel whose SMs read the pinned segment through UVA
(``kvshm.transfer.triton_copy``); the copy engines move the same bytes faster as one
contiguous copy, but pay per descriptor when the pages are scattered. This probe asks whether
another way of issuing the SMs' reads closes that gap, with plain CUDA C kernels compiled at
run time (CuPy's NVRTC), so that a winner can then be built into the Triton kernel:

  plain     16-byte loads, each thread copying its 16-byte pieces one after another
  unrolled  the same, every load of a thread issued before its first store (more reads in
            flight per thread)
  l2-128    unrolled, with the ``.L2::128B`` prefetch-size hint on every load
  l2-256    unrolled, with ``.L2::256B`` (the L2 fetches 256 bytes per miss: larger reads
            across PCIe)
  nc-256    unrolled, ``ld.global.nc.L2::256B`` (the read-only path)

each at 256 and 64 threads a block (one block per page piece of 16 x threads x unroll
bytes), against one contiguous ``cudaMemcpyAsync`` of the same bytes (the copy engines: the
limit). Two timings per column, medians: ``device`` (--inner launches back to back between
two CUDA events: the rate the GPU sustains) and ``job`` (one launch then a synchronize,
wall clock: what one transfer job costs, host included). Loads read host pages and write
device pages; stores the reverse (for them the hints apply to device reads and matter less).

    python tools/probe_host_reads.py --sizes 16K,64K,256K --json

Needs a CUDA GPU and CuPy; prints one JSON object with --json. Results are recorded in
docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from proc_clock import loadavg

from kvshm.units import parse_size

SOURCE = r"""
#ifndef U
#define U 4
#endif
__device__ __forceinline__ uint4 ld16(const char* p) {
    uint4 v;
#if HINT == 0
    v = *reinterpret_cast<const uint4*>(p);
#elif HINT == 1
    asm volatile("ld.global.L2::128B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#elif HINT == 2
    asm volatile("ld.global.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#else
    asm volatile("ld.global.nc.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
#endif
    return v;
}

extern "C" __global__ void gather(const long long* __restrict__ sidx,
                                  const long long* __restrict__ didx,
                                  const char* src, char* dst, long long page) {
    const char* s = src + sidx[blockIdx.x] * page;
    char* d = dst + didx[blockIdx.x] * page;
    long long base = (long long)blockIdx.y * blockDim.x * U * 16;
#if SEQ
    for (int u = 0; u < U; ++u) {
        long long off = base + ((long long)u * blockDim.x + threadIdx.x) * 16;
        if (off < page) *reinterpret_cast<uint4*>(d + off) = ld16(s + off);
    }
#else
    uint4 v[U];
#pragma unroll
    for (int u = 0; u < U; ++u) {
        long long off = base + ((long long)u * blockDim.x + threadIdx.x) * 16;
        if (off < page) v[u] = ld16(s + off);
    }
#pragma unroll
    for (int u = 0; u < U; ++u) {
        long long off = base + ((long long)u * blockDim.x + threadIdx.x) * 16;
        if (off < page) *reinterpret_cast<uint4*>(d + off) = v[u];
    }
#endif
}
"""

# name -> (HINT, SEQ)
VARIANTS = {"plain": (0, 1), "unrolled": (0, 0), "l2-128": (1, 0), "l2-256": (2, 0),
            "nc-256": (3, 0)}
SHAPES = [(256, 4), (64, 16)]  # (threads a block, 16-byte loads a thread)


def compile_kernels(cp, arch: str | None = None) -> dict:
    """Every (variant, shape) compiled once: {(name, threads, unroll): RawKernel}."""
    out = {}
    for name, (hint, seq) in VARIANTS.items():
        for threads, unroll in SHAPES:
            opts = (f"-DHINT={hint}", f"-DSEQ={seq}", f"-DU={unroll}", "-std=c++17")
            if arch:
                opts += (f"--gpu-architecture={arch}",)
            mod = cp.RawModule(code=SOURCE, options=opts)
            out[(name, threads, unroll)] = mod.get_function("gather")
    return out


def median_job_s(fn, sync, reps: int) -> float:
    for _ in range(3):
        fn()
    sync()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def median_device_s(cp, fn, reps: int, inner: int) -> float:
    start, end = cp.cuda.Event(), cp.cuda.Event()
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        times.append(cp.cuda.get_elapsed_time(start, end) / 1e3 / inner)
    return statistics.median(times)


def probe_size(cp, kernels: dict, page: int, blocks: int, reps: int, inner: int) -> dict:
    import numpy as np
    nbytes = page * blocks
    host_mem = cp.cuda.alloc_pinned_memory(nbytes)
    host = np.frombuffer(host_mem, np.uint8, nbytes)
    rows = host.reshape(blocks, page)
    col = np.arange(page, dtype=np.int64)
    for r in range(blocks):  # every byte tells its page and offset apart from its neighbours
        rows[r] = (col + 13 * r) % 251
    dev = cp.zeros(nbytes, cp.uint8)
    rng = np.random.default_rng(0)
    sidx = cp.asarray(rng.permutation(blocks).astype(np.int64))
    didx = cp.asarray(rng.permutation(blocks).astype(np.int64))
    hptr, dptr = host.ctypes.data, dev.data.ptr
    stream = cp.cuda.Stream(non_blocking=True)
    sync = stream.synchronize
    rt = cp.cuda.runtime
    row: dict = {}
    for kind, (src, dst) in (("load", (hptr, dptr)), ("store", (dptr, hptr))):
        def contig(src=src, dst=dst):
            rt.memcpyAsync(dst, src, nbytes, rt.memcpyDefault, stream.ptr)
        cols = {"contiguous": contig}
        for (name, threads, unroll), k in kernels.items():
            piece = threads * unroll * 16
            grid = (blocks, (page + piece - 1) // piece)

            def run(k=k, grid=grid, threads=threads, src=src, dst=dst):
                k(grid, (threads,), (sidx, didx, cp.uint64(src), cp.uint64(dst),
                                      cp.int64(page)), stream=stream)
            cols[f"{name}/{threads}x{unroll}"] = run
        res = {}
        with stream:
            # one check that every kernel copies the right bytes (loads only: stores are the
            # same kernel the other way round), on 64 of the pages
            if kind == "load":
                some = slice(0, min(64, blocks))
                want = rows[cp.asnumpy(sidx[some])]
                for name, fn in cols.items():
                    if name == "contiguous":
                        continue
                    dev.fill(0)
                    fn()
                    got = cp.asnumpy(dev.reshape(blocks, page)[didx[some]])
                    if not np.array_equal(got, want):
                        raise SystemExit(f"{name} copied wrong bytes at page {page}")
            for name, fn in cols.items():
                d = median_device_s(cp, fn, reps, inner)
                j = median_job_s(fn, sync, reps * inner)
                res[name] = {"device_gbs": round(nbytes / d / 1e9, 2),
                             "job_gbs": round(nbytes / j / 1e9, 2)}
        c = res["contiguous"]
        for r in res.values():
            r["device_ratio"] = round(r["device_gbs"] / c["device_gbs"], 3)
            r["job_ratio"] = round(r["job_gbs"] / c["job_gbs"], 3)
        row[kind] = res
    del dev, host, rows, host_mem
    return row


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16K,64K,256K", help="page sizes (K, M suffixes)")
    ap.add_argument("--blocks", type=int, default=1000, help="pages per job (default 1000)")
    ap.add_argument("--reps", type=int, default=9, help="timed reps per column (default 9)")
    ap.add_argument("--inner", type=int, default=8,
                    help="launches between two events for the device rate (default 8)")
    ap.add_argument("--json", action="store_true", help="print ONE JSON object")
    a = ap.parse_args(argv)
    try:
        import cupy as cp
    except ImportError:
        print("probe_host_reads needs CuPy and a CUDA GPU", file=sys.stderr)
        return 2
    kernels = compile_kernels(cp)
    out: dict = {"tool": "probe_host_reads",
                 "gpu": cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
                 "load_start": loadavg(), "sizes": {}}
    for size in a.sizes.split(","):
        row = probe_size(cp, kernels, parse_size(size), a.blocks, a.reps, a.inner)
        out["sizes"][size] = row
        if not a.json:
            for kind, res in row.items():
                for name, r in res.items():
                    print(f"{size:>4} {kind:5} {name:18} device {r['device_gbs']:6.1f} GB/s "
                          f"({r['device_ratio']:.1%})  job {r['job_gbs']:6.1f} GB/s "
                          f"({r['job_ratio']:.1%})", flush=True)
    out["load_end"] = loadavg()
    if a.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
