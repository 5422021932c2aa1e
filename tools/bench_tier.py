#!/usr/bin/env python3
"""kvshm's lower tier on Mooncake Store: throughput against raw Mooncake, and hit rates.

Run ``python tools/bench_tier.py --help`` for what is measured; results are recorded in
docs/benchmarks.md ("Lower tier").
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import time
import uuid
from dataclasses import replace
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "examples"))
sys.path.insert(0, ROOT)

DESCRIPTION = """\
Starts a mooncake_master on free loopback ports and measures, in one run:

  spill   kvshm: N blocks are stored in host A's segment; time until A's mover has put them
          all (write-through: header + pages straight from the segment, crc32 per plane).
          raw:   a Mooncake client in another process puts the same N blocks (same sizes,
                 same batch) with batch_put_from from a registered buffer, one per block.
  fill    kvshm: an engine on host B looks the N keys up (TieredManager); time until the
          lookup answers N (B's mover checked existence, prepare_store'd, batch-fetched into
          the blocks, verified length + header + crc32, complete_store'd).
          raw:   a client in this process (like host B's mover) gets them with
                 batch_get_into.
  ratio   kvshm throughput / raw throughput (goal: >= 80%). Rounds alternate raw and kvshm.

and the hit rate of the two-hosts demo's workload (examples/two_hosts.py: consecutive turns on
different hosts) against the same engines sharing ONE segment on one host, at equal total
memory (one segment of 2 x (segment + Mooncake share)), and against two hosts without a
lower tier (private per host): prefix hit rate = prompt tokens not recomputed / prompt tokens.
"""


def _store_blocks(mgr, keys: list[bytes]) -> None:
    import numpy as np
    out = mgr.prepare_store(keys)
    planes = mgr.segment.planes()
    for k, b in zip(out.keys_to_store, out.block_ids):
        seed = int.from_bytes(k[-4:], "little")
        for p in planes:
            p[b] = np.random.default_rng(seed).integers(0, 256, p.shape[1], np.uint8)
    mgr.complete_store(out.keys_to_store)


def _tier(name: str) -> dict[str, Any]:
    from kvshm.inspect.snapshot import tier_snapshot
    from kvshm.shm.segment import Segment
    with Segment.attach(name) as seg:
        return tier_snapshot(seg) or {"state": "none", "counters": {}}


def _wait(cond, timeout: float, what: str) -> None:
    from kvshm.shm.wait import poll_until
    # Polls back off to 2 ms: cheap enough not to take the movers' CPU on a small machine.
    if not poll_until(cond, timeout, first=1e-4, cap=2e-3):
        raise RuntimeError(f"timed out waiting for {what}")


def _raw_putter(cfg: tuple[str, str, str], global_mib: int, n: int, bb: int, batch: int,
                conn) -> None:
    """Child process: a plain Mooncake client that puts what it is told, timing its calls."""
    from mooncake.store import MooncakeDistributedStore
    host, metadata, master = cfg
    raw = MooncakeDistributedStore()
    buf = mmap.mmap(-1, n * bb)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    ok = raw.setup(host, metadata, global_mib << 20, 64 << 20, "tcp", "", master) == 0
    conn.send(ok and raw.register_buffer(addr, n * bb) == 0)
    while (msg := conn.recv()) is not None:
        if isinstance(msg, tuple):  # ("remove", keys)
            raw.batch_remove(msg[1])
            conn.send(True)
            continue
        t0 = time.perf_counter()
        for lo in range(0, n, batch):
            rc = raw.batch_put_from(msg[lo:lo + batch],
                                    [addr + i * bb for i in range(lo, min(n, lo + batch))],
                                    [bb] * len(msg[lo:lo + batch]))
            assert all(x == 0 for x in rc), rc
        conn.send(time.perf_counter() - t0)
    raw.close()


def throughput(a: argparse.Namespace, master) -> dict[str, Any]:
    import kvshm
    from mooncake.store import MooncakeDistributedStore
    from kvshm.tier.area import TierArea
    from kvshm.tier.client import TieredManager
    page = a.block_kib * 1024 // 2
    lay = kvshm.Layout((page, page), 16, "bench-tier")
    n, bb = a.blocks, lay.block_bytes
    names = [f"benchtier-{os.getpid()}-{uuid.uuid4().hex[:6]}-{h}" for h in "ab"]
    movers, mgrs = [], []
    # Raw: two clients in two processes, like the two movers (each contributing the same
    # share): a child puts, this process gets, so blocks take the same cross-process path as
    # kvshm's. (Two clients in one process would let Mooncake copy in memory.)
    c = master.config
    ctx = mp.get_context("spawn")
    parent_end, child_end = ctx.Pipe()
    putter = ctx.Process(target=_raw_putter, args=((c.local_host, c.metadata, c.master),
                                                   a.global_mib, n, bb, a.batch, child_end))
    putter.start()
    if not parent_end.recv():
        raise RuntimeError("raw Mooncake putter setup failed")
    raw_b = MooncakeDistributedStore()
    buf = mmap.mmap(-1, n * bb)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    if raw_b.setup(c.local_host, c.metadata, a.global_mib << 20, 64 << 20, "tcp", "", c.master):
        raise RuntimeError("raw Mooncake client setup failed")
    raw_b.register_buffer(addr, n * bb)
    rounds: list[dict[str, float]] = []
    try:
        for name in names:
            kvshm.Segment.create(name, lay, n + 8, max_clients=8).close()
            movers.append(subprocess.Popen(
                master.mover_command(name, "--global-segment", f"{a.global_mib}M", "--batch",
                                     str(a.batch), "--log-level", "WARNING"),
                env={**os.environ, "PYTHONPATH": ROOT}))
        for name in names:
            _wait(lambda: _tier(name)["state"] == "connected", 120, "movers")
        ma = TieredManager(kvshm.connect(names[0]))  # its complete_store wakes the mover
        area_a = TierArea.attach(ma.segment)
        puts = lambda: area_a.counters["puts"]  # noqa: E731
        mb = TieredManager(kvshm.connect(names[1]), max_wait=600.0, want_ahead=n)
        mgrs += [ma, mb]
        for r in range(a.rounds):
            keys = [b"bench-r%03d-%08d" % (r, i) for i in range(n)]
            # raw
            rk = [f"raw-{r}-{i}" for i in range(n)]
            parent_end.send(rk)
            put_s = parent_end.recv()
            t1 = time.perf_counter()
            for lo in range(0, n, a.batch):
                rc = raw_b.batch_get_into(rk[lo:lo + a.batch],
                                        [addr + i * bb for i in range(lo, min(n, lo + a.batch))],
                                        [bb] * len(rk[lo:lo + a.batch]))
                assert all(x == bb for x in rc), rc
            t2 = time.perf_counter()
            parent_end.send(("remove", rk))
            parent_end.recv()
            # kvshm spill (A) and fill (B)
            base = puts()
            _store_blocks(ma, keys)
            t3 = time.perf_counter()
            _wait(lambda: puts() >= base + n, 300, "spill")
            t4 = time.perf_counter()
            got: list = []
            _wait(lambda: got.append(mb.lookup(keys)) or got[-1] == n, 300, "fill")
            t5 = time.perf_counter()
            mb.release()  # every lookup of the poll above counted its hits
            rounds.append({"raw_put_s": put_s, "raw_get_s": t2 - t1, "spill_s": t4 - t3,
                           "fill_s": t5 - t4})
        tb, ta = _tier(names[1])["counters"], _tier(names[0])["counters"]
        area_a.close()
    finally:
        for m in mgrs:
            m.shutdown()
        for p in movers:
            p.terminate()
            p.wait(30)
        parent_end.send(None)
        putter.join(30)
        raw_b.close()
        from colocated_engines import release_cache
        for name in names:
            release_cache(name, remove=True)  # the tier area goes with its segment

    def rate(k: str) -> float:
        best = sorted(r[k] for r in rounds)[len(rounds) // 2]  # median round
        return n * bb / best / 1e9

    out = {"blocks": n, "block_bytes": bb, "batch": a.batch, "rounds": rounds,
           "raw_put_GBps": rate("raw_put_s"), "raw_get_GBps": rate("raw_get_s"),
           "spill_GBps": rate("spill_s"), "fill_GBps": rate("fill_s"),
           "fill_rejected": tb.get("get_rejected", 0), "fill_failed": tb.get("get_failed", 0),
           "spill_failed": ta.get("put_failed", 0)}
    out["spill_ratio"] = out["spill_GBps"] / out["raw_put_GBps"]
    out["fill_ratio"] = out["fill_GBps"] / out["raw_get_GBps"]
    return out


def hit_rates(a: argparse.Namespace) -> dict[str, Any]:
    import colocated_engines as co
    import two_hosts as th
    o = th.Options(conversations=a.conversations, turns=a.turns, cache_mib=a.seg_mib,
                   global_segment_mib=a.share_mib)

    def rate(t: dict[str, int]) -> float:
        return (t["device_hit_tokens"] + t["kvshm_hit_tokens"]) / max(1, t["prompt_tokens"])

    r2 = th.run(o)
    demo = co.Options(engines=2, conversations=o.conversations, turns=o.turns,
                      system_prompts=o.system_prompts, system_tokens=o.system_tokens,
                      user_tokens=o.user_tokens, reply_tokens=o.reply_tokens, seed=o.seed,
                      inline_workers=True)
    shared = co.run(replace(demo, cache_mib=2 * (a.seg_mib + a.share_mib)))
    private = co.run(replace(demo, cache_mib=a.seg_mib, private=True))
    return {"two_hosts_with_tier": rate(r2["total"]), "one_shared_segment": rate(shared["total"]),
            "two_hosts_without_tier": rate(private["total"]),
            "cross_host_blocks": r2["cross_host_blocks"],
            "mismatched": r2["mismatched"] + shared["total"]["blocks_mismatched"]
            + private["total"]["blocks_mismatched"],
            "memory_each_host_mib": a.seg_mib, "mooncake_share_each_host_mib": a.share_mib,
            "shared_segment_mib": 2 * (a.seg_mib + a.share_mib)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_tier.py", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=256, help="blocks per round (default 256)")
    ap.add_argument("--block-kib", type=int, default=256,
                    help="KiB per block, two planes (default 256)")
    ap.add_argument("--batch", type=int, default=64, help="blocks per call (default 64)")
    ap.add_argument("--rounds", type=int, default=3, help="rounds, median reported (default 3)")
    ap.add_argument("--global-mib", type=int, default=512,
                    help="each Mooncake client's share of the pool in MiB (default 512)")
    ap.add_argument("--conversations", type=int, default=8, help="hit-rate workload (default 8)")
    ap.add_argument("--turns", type=int, default=4, help="hit-rate workload (default 4)")
    ap.add_argument("--seg-mib", type=int, default=4, help="each host's segment (default 4)")
    ap.add_argument("--share-mib", type=int, default=16,
                    help="each host's Mooncake share in the hit-rate runs (default 16)")
    ap.add_argument("--skip-hit-rate", action="store_true", help="throughput only")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    from kvshm.tier.mooncake import start_master
    master = start_master()
    try:
        tp = throughput(a, master)
    finally:
        master.stop()
    hr = None if a.skip_hit_rate else hit_rates(a)
    res = {"schema": "kvshm.bench_tier/1", "throughput": tp, "hit_rate": hr,
           "machine": {"cpus": os.cpu_count(), "python": platform.python_version(),
                       "load": os.getloadavg()}}
    if a.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"{tp['blocks']} blocks of {tp['block_bytes'] >> 10} KiB, batch {tp['batch']}, "
          f"median of {len(tp['rounds'])} rounds, load {res['machine']['load'][0]:.2f}")
    print(f"  spill  kvshm {tp['spill_GBps']:.3f} GB/s  raw batch_put_from "
          f"{tp['raw_put_GBps']:.3f} GB/s  ratio {tp['spill_ratio']:.0%}")
    print(f"  fill   kvshm {tp['fill_GBps']:.3f} GB/s  raw batch_get_into "
          f"{tp['raw_get_GBps']:.3f} GB/s  ratio {tp['fill_ratio']:.0%}")
    if hr:
        print(f"prefix hit rate: two hosts + Mooncake {hr['two_hosts_with_tier']:.1%}, one "
              f"shared segment of {hr['shared_segment_mib']} MiB {hr['one_shared_segment']:.1%},"
              f" two hosts without a lower tier {hr['two_hosts_without_tier']:.1%}; "
              f"{hr['cross_host_blocks']} cross-host blocks, {hr['mismatched']} mismatched")
    return 0


if __name__ == "__main__":
    sys.exit(main())
