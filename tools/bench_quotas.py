#!/usr/bin/env python3
"""Quotas against a flood: the hit rate of engines sharing prompts beside one that floods.

Run ``python tools/bench_quotas.py --help`` for what is measured; results are recorded in
docs/benchmarks.md ("Quotas against a flood").
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
import uuid
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_hitrate import _Kvshm, _layout, make_trace  # noqa: E402
from bench_teardown import remove_segment  # noqa: E402

DESCRIPTION = """\
Three sharers and one flooder are clients of one segment of --blocks (1024) blocks, each
driven as kvshm's vLLM integration drives its manager (look the keys up, load the hit
prefix, store the rest). Each sharer replays its own trace of --requests (1500) requests:
one of --prompts (16) prompts of --prompt-keys (32) keys that all three share (popularity
Pareto(--shape 1.1), a seed per sharer), then --own-keys (8) keys of its own. The flooder
stores keys nobody asks for again: after each round (one request of each sharer) it stores
--rate (10) times the keys one sharer stored that round, so it stores at 10x their rate.

Three runs on fresh segments, the same traces:
  alone       the three sharers without the flooder: the hit rate to keep
  flood       the flooder beside them, no quotas
  quotas      the flooder beside them, each sharer connected with quota=--quota (0.25 of
              the cache); the flooder has none
The figure of merit is the sharers' hit rate (hits over keys they asked for) of each run
over "alone"; the goal is quotas/alone >= 0.9. Every client waits, after each request,
until the owner has applied it (as bench_hitrate --settle), so the figures are the cache's
and do not depend on how busy the host is.
"""

SHARERS = 3


def flood_keys(round_no: int, n: int) -> list[bytes]:
    """``n`` keys no sharer asks for, unique to round ``round_no``."""
    from kvshm.engine.hashing import offload_key
    return [offload_key(hashlib.sha256(b"flood:%d:%d" % (round_no, i)).digest())
            for i in range(n)]


def run(a: argparse.Namespace, traces: list[list[list[bytes]]], flood: bool,
        quota: float | None) -> dict[str, Any]:
    import kvshm
    name = f"bquota{os.getpid()}x{uuid.uuid4().hex[:8]}"
    first = kvshm.connect(name, _layout(), num_blocks=a.blocks, max_clients=SHARERS + 2)
    owner = first._link.owner_proc
    made = [first]
    try:
        sharers = []
        for _ in range(SHARERS):
            made.append(kvshm.connect(name, quota=quota))
            sharers.append(_Kvshm(made[-1], lambda: None, settle=True))
        made.append(kvshm.connect(name))
        flooder = _Kvshm(made[-1], lambda: None, settle=True)
        hits = asked = flooded = 0
        t0 = time.perf_counter()
        for r in range(a.requests):
            stored = 0
            for s, trace in zip(sharers, traces):
                keys = trace[r]
                got = s.request(r, keys)
                hits, asked, stored = hits + got, asked + len(keys), stored + len(keys) - got
            if flood:
                n = max(1, round(a.rate * stored / SHARERS))
                flooder.request(r, flood_keys(r, n))
                flooded += n
        return {"hits": hits, "keys": asked, "hit_rate": hits / asked,
                "flooded_keys": flooded, "seconds": round(time.perf_counter() - t0, 2)}
    finally:
        for m in reversed(made):
            try:
                m.shutdown()
            except Exception:
                pass
        remove_segment(name, owner)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=1024, help="cache size (default 1024)")
    ap.add_argument("--requests", type=int, default=1500, help="requests per sharer")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-keys", type=int, default=32)
    ap.add_argument("--own-keys", type=int, default=8)
    ap.add_argument("--shape", type=float, default=1.1, help="Pareto shape of prompt popularity")
    ap.add_argument("--rate", type=float, default=10.0,
                    help="flooder's stored keys per round over one sharer's (default 10)")
    ap.add_argument("--quota", type=float, default=0.25,
                    help="each sharer's quota, a fraction of the cache (default 0.25)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true", help="print ONE JSON object")
    a = ap.parse_args(argv)
    if min(a.blocks, a.requests, a.prompts, a.prompt_keys) < 1 or a.rate <= 0 \
            or not 0 < a.quota <= 1:
        ap.error("--blocks, --requests, --prompts, --prompt-keys and --rate must be "
                 "positive, --quota in (0, 1]")
    traces = [make_trace(a.requests, a.prompts, a.prompt_keys, a.own_keys, a.shape,
                         a.seed + s) for s in range(SHARERS)]
    load = os.getloadavg()[0]
    runs = {"alone": run(a, traces, False, None), "flood": run(a, traces, True, None),
            "quotas": run(a, traces, True, a.quota)}
    ref = runs["alone"]["hit_rate"]
    report: dict[str, Any] = {
        "tool": "bench_quotas", "args": vars(a), "runs": runs,
        "ratio_flood_over_alone": runs["flood"]["hit_rate"] / ref if ref else None,
        "ratio_quotas_over_alone": runs["quotas"]["hit_rate"] / ref if ref else None,
        "load_start": round(load, 2), "load_end": round(os.getloadavg()[0], 2)}
    report["goal_met"] = (report["ratio_quotas_over_alone"] or 0) >= 0.9
    if a.json:
        print(json.dumps(report))
        return 0
    print(f"# {SHARERS} sharers x {a.requests} requests ({a.prompts} prompts x "
          f"{a.prompt_keys} keys + {a.own_keys} own), {a.blocks} blocks, flooder at "
          f"{a.rate:g}x, quota {a.quota:g}; load {report['load_start']}")
    print(f"{'run':>8} {'hit rate':>9} {'/alone':>7} {'flooded':>8}")
    for k, r in runs.items():
        print(f"{k:>8} {r['hit_rate']:>9.4f} {r['hit_rate'] / ref if ref else 0:>7.3f} "
              f"{r['flooded_keys']:>8}")
    print(f"goal quotas/alone >= 0.9: {'met' if report['goal_met'] else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
