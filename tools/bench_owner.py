#!/usr/bin/env python3
"""Owner throughput: how many stored keys per second one owner process sustains.

Run ``python tools/bench_owner.py --help`` for what is measured; results are recorded in
docs/benchmarks.md ("Owner throughput").
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time
import uuid
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench_teardown import remove_segment
from proc_clock import cpu_ns, loadavg

DESCRIPTION = """\
--clients N client processes store new keys as fast as they can through one segment and its
owner: each store is --batch (16) fresh 36-byte keys, prepare_store then complete_store with
no data copied (the owner never touches data either), so every client is as fast as a
scheduler can be and the owner is the bottleneck. The cache (--blocks, 65536) is filled first
and then evicts (the owner offers victims to the clients' grant rings) for the whole run.
--protected F (0) first has one more client, with a quota of F of the cache, store that
many keys: the oldest blocks, which no other client's store may evict (quotas).
--running R (0) has each store name one of R running requests in turn, its keys at the
request's next token positions, as vLLM 0.33's connector does (provisional LRU ranks).

Reported, over --seconds (5) after a 1-second warm-up:
  keys_per_s            stored keys per wall-clock second, all clients together
  owner_cpu_s           CPU time the owner process used meanwhile (all of it: serving,
                        refilling grants, choosing victims, its idle spinning too)
  keys_per_owner_cpu_s  stored keys per second of owner CPU: what one core running the
                        owner sustains; the goal is >= 1,000,000
  owner_us_per_key      the same, inverted: owner CPU microseconds per stored key
  owner_busy_us_per_key of it, the time spent serving frames (owner_busy_ns)
  client_us_per_key     mean client CPU microseconds per stored key (its critical path)
On a host with fewer idle cores than clients + 1 the clients and the owner share cores and
keys_per_s says more about the host than about the owner; keys_per_owner_cpu_s does not.
"""

KEY_BYTES = 36


def _client(name: str, idx: int, batch: int, running: int, ready: Any, go: Any,
            count_from: Any, stop: Any, out: Any) -> None:
    """Connect and say ``ready``; once told to ``go``, store fresh keys until ``stop``; count
    the keys and this process's CPU time from the monotonic time ``count_from`` on (the
    warm-up before it is not counted)."""
    import kvshm
    from kvshm.index.api import Running
    mgr = kvshm.connect(name)
    tokens = [0] * running  # each running request's next token position
    prefix = f"{idx:04d}{uuid.uuid4().hex[:8]}".encode()
    n = stored = t0 = 0
    counting = False
    ready.put(idx)
    go.wait()
    count_from = count_from.value
    try:
        while not stop.is_set():
            if not counting and time.monotonic() >= count_from:
                counting, stored, t0 = True, 0, time.process_time_ns()
            keys = [(prefix + b"%020d" % (n + i)).ljust(KEY_BYTES, b".") for i in range(batch)]
            run = None
            if running:
                r = (n // batch) % running
                run = Running(r + 1, {k: tokens[r] + 16 * i for i, k in enumerate(keys)})
                tokens[r] += 16 * batch
            n += batch
            got = mgr.prepare_store(keys, running=run)
            if got is not None:
                mgr.complete_store(got.keys_to_store, running=run)
                stored += len(got.keys_to_store)
        out.put((idx, stored, time.process_time_ns() - t0, time.monotonic() - count_from))
    finally:
        mgr.shutdown()


_WARMUP_S = 1.5  # connecting and filling the cache; then counting starts


def _protect(name: str, fraction: float) -> Any:
    """A client with a quota of ``fraction`` of the cache that stored as many keys."""
    import kvshm
    mgr = kvshm.connect(name, quota=fraction)
    for i in range(0, mgr.quota, 256):
        keys = [b"protected-%020d" % j for j in range(i, min(i + 256, mgr.quota))]
        got = mgr.prepare_store(keys)
        if got is not None:
            mgr.complete_store(got.keys_to_store)
    return mgr


def run(clients: int, blocks: int, batch: int, seconds: float, protected: float = 0.0,
        running: int = 0) -> dict[str, Any]:
    import kvshm
    from kvshm.shm.layout import Layout
    name = f"bowner{os.getpid()}x{uuid.uuid4().hex[:8]}"
    layout = Layout((4096,), 16, "bench-owner")
    mgr = kvshm.connect(name, layout, num_blocks=blocks, max_clients=clients + 3)
    keeper = _protect(name, protected) if protected else None
    owner_pid = mgr.segment.owner_record()[0]
    owner = mgr._link.owner_proc
    ctx = mp.get_context("spawn")
    stop, out, ready, go = ctx.Event(), ctx.Queue(), ctx.Queue(), ctx.Event()
    start_at = ctx.Value("d", 0.0)  # when counting starts: set once every client is connected
    kids = [ctx.Process(target=_client, args=(name, i, batch, running, ready, go, start_at, stop,
                                                     out))
            for i in range(clients)]
    try:
        for p in kids:
            p.start()
        for _ in kids:  # spawned interpreters start slowly, more so on a busy host
            ready.get(timeout=120)
        count_from = start_at.value = time.monotonic() + _WARMUP_S
        go.set()
        time.sleep(max(0.0, count_from - time.monotonic()))  # the warm-up runs meanwhile
        seg = mgr.segment
        c0, b0, s0 = cpu_ns(owner_pid), seg.counter("owner_busy_ns"), time.monotonic()
        time.sleep(seconds)  # the clients work; the owner's CPU is read around this window
        c1, b1, s1 = cpu_ns(owner_pid), seg.counter("owner_busy_ns"), time.monotonic()
        stop.set()
        res = [out.get(timeout=60) for _ in kids]
        for p in kids:
            p.join(timeout=30)
    finally:
        stop.set()
        for p in kids:
            if p.is_alive():
                p.terminate()
        if keeper is not None:
            keeper.shutdown()
        mgr.shutdown()
        remove_segment(name, owner, wait_s=10)
    wall = s1 - s0
    # Each client counted from count_from until it saw ``stop``: its rate, summed, over the
    # owner's window.
    keys = sum(r[1] for r in res)
    client_ns = sum(r[2] for r in res)
    keys_in_window = sum(r[1] / r[3] for r in res if r[3] > 0) * wall
    owner_cpu = (c1 - c0) / 1e9
    return {"clients": clients, "blocks": blocks, "batch": batch, "protected": protected,
            "running": running,
            "seconds": round(wall, 2),
            "keys_per_s": round(keys_in_window / wall),
            "owner_cpu_s": round(owner_cpu, 3),
            "keys_per_owner_cpu_s": round(keys_in_window / owner_cpu) if owner_cpu else None,
            "owner_us_per_key": round(owner_cpu * 1e6 / keys_in_window, 3) if keys_in_window
            else None,
            "owner_busy_us_per_key": round((b1 - b0) / 1e3 / keys_in_window, 3)
            if keys_in_window else None,
            "client_us_per_key": round(client_ns / 1e3 / keys, 3) if keys else None}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--clients", default="1,2,4",
                    help="comma-separated client counts, one run each (default: %(default)s)")
    ap.add_argument("--blocks", type=int, default=65536)
    ap.add_argument("--batch", type=int, default=16, help="keys per store (default 16)")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--protected", type=float, default=0.0,
                    help="fraction of the cache a quota protects (default 0: no quotas)")
    ap.add_argument("--running", type=int, default=0,
                    help="running requests each client's stores name in turn (default 0: "
                         "none)")
    ap.add_argument("--json", action="store_true", help="print ONE JSON object")
    a = ap.parse_args(argv)
    counts = [int(c) for c in a.clients.split(",") if c]
    if not counts or min(counts) < 1 or a.blocks < 64 or a.batch < 1 or a.seconds <= 0:
        ap.error("--clients, --blocks (>= 64), --batch and --seconds must be positive")
    if a.running < 0:
        ap.error("--running must be >= 0")
    if not 0.0 <= a.protected < 1.0:
        ap.error("--protected must be in [0, 1)")
    report: dict[str, Any] = {"tool": "bench_owner", "cpus": os.cpu_count(),
                              "load_start": loadavg(), "runs": []}
    for n in counts:
        report["runs"].append(run(n, a.blocks, a.batch, a.seconds, a.protected,
                                  a.running))
    report["load_end"] = loadavg()
    if a.json:
        print(json.dumps(report))
        return 0
    print(f"# {report['cpus']} cpus, load {report['load_start']}; {a.batch} keys per store")
    print(f"{'clients':>7} {'keys/s':>10} {'owner CPU s':>12} {'keys/owner-CPU-s':>17} "
          f"{'owner us/key':>13} {'busy us/key':>12} {'client us/key':>14}")
    for r in report["runs"]:
        print(f"{r['clients']:>7} {r['keys_per_s']:>10} {r['owner_cpu_s']:>12} "
              f"{r['keys_per_owner_cpu_s']:>17} {r['owner_us_per_key']:>13} "
              f"{r['owner_busy_us_per_key']:>12} {r['client_us_per_key']:>14}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
