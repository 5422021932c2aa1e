#!/usr/bin/env python3
"""Sweep the Triton copy kernel's launch shape against one contiguous pinned copy (CUDA only).

For each page size and each (block words, piece words, warps) variant, a fresh ``triton``
handler copies --blocks shuffled blocks between a device tensor and a pinned plane, both
directions, interleaved with one contiguous ``copy_`` of the same bytes (the baseline); the
ratio kvshm / contiguous is printed per variant. Used to choose ``triton_copy.launch``'s
defaults; results are recorded in docs/benchmarks.md.

    python tools/sweep_triton_copy.py [--sizes 16K,64K] [--json]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from types import ModuleType

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VARIANTS = [(1024, 4096, 4), (2048, 4096, 4), (4096, 4096, 4), (4096, 4096, 8),
            (2048, 4096, 8), (1024, 4096, 8), (1024, 2048, 4), (1024, 1024, 4),
            (2048, 2048, 8), (4096, 8192, 8), (8192, 8192, 8), (4096, 4096, 16)]


def cuda_torch() -> ModuleType | None:
    """torch, if it can run the sweep here: built with CUDA, a GPU seen, Triton installed."""
    import importlib.util
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or importlib.util.find_spec("triton") is None:
        return None
    return torch


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="16K,64K,256K,2M", help="page sizes (K, M suffixes)")
    ap.add_argument("--blocks", type=int, default=1000, help="blocks per job (default 1000)")
    ap.add_argument("--reps", type=int, default=5, help="timed runs per column (default 5)")
    ap.add_argument("--json", action="store_true", help="print ONE JSON object")
    a = ap.parse_args(argv)
    torch = cuda_torch()
    if torch is None:  # one line, as every tool says what it needs, never a traceback
        print("sweep_triton_copy needs torch with CUDA, Triton and a CUDA GPU", file=sys.stderr)
        return 2
    import bench_transfer as B
    import numpy as np

    from kvshm.transfer import triton_copy as tc
    from kvshm.transfer.factory import make_handler
    from kvshm.transfer.pinning import pin_region
    from kvshm.transfer.spec import TransferSpec

    out: dict = {"tool": "sweep_triton_copy", "gpu": torch.cuda.get_device_name(),
                 "load_start": " ".join(f"{x:.2f}" for x in os.getloadavg()), "sizes": {}}
    job = iter(range(1 << 30))
    for size in a.sizes.split(","):
        page = B.parse_size(size)
        dev = torch.empty(a.blocks, page, dtype=torch.uint8, device="cuda").fill_(1)
        plane = torch.empty(a.blocks, page, dtype=torch.uint8).fill_(2)
        region = pin_region(plane.data_ptr(), plane.nbytes)
        rng = np.random.default_rng(0)
        d_ids, s_ids = rng.permutation(a.blocks), rng.permutation(a.blocks)
        stream = torch.cuda.Stream()
        rows = {}
        for block, piece, warps in VARIANTS:
            tc.launch.__kwdefaults__.update(block=block, piece_words=piece, num_warps=warps)
            h = make_handler([dev], [plane], method="triton")
            row = {}
            for kind in ("store", "load"):
                src, dst = (dev, plane) if kind == "store" else (plane, dev)
                spec = TransferSpec(kind, d_ids, s_ids)
                r = B.run_interleaved({"kvshm": B.one_job(h, spec, job),
                                       "contiguous": B.contiguous_copy(src, dst, stream)},
                                      a.reps, a.blocks * page)
                row[kind] = round(r["kvshm"] / r["contiguous"], 3)
                row[kind + "_gbs"] = round(r["kvshm"], 1)
            h.shutdown()
            rows[f"{block}/{piece}/{warps}"] = row
            if not a.json:
                print(f"{size:>5} block {block:5} piece {piece:5} warps {warps:2}: "
                      f"store {row['store']:.3f} ({row['store_gbs']} GB/s) "
                      f"load {row['load']:.3f} ({row['load_gbs']} GB/s)", flush=True)
        out["sizes"][size] = rows
        if region is not None:
            region.unregister()
        del dev, plane
    out["load_end"] = " ".join(f"{x:.2f}" for x in os.getloadavg())
    if a.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
