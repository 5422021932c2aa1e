#!/usr/bin/env python3
"""What sharing one kvshm cache buys co-located engines, against private caches.

Run ``python tools/bench_sharing.py --help`` for what is measured; results are recorded in
docs/benchmarks.md ("Sharing").
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from dataclasses import asdict, fields, replace
from typing import Any

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))

from colocated_engines import OPTION_HELP, Options, run  # noqa: E402

DESCRIPTION = """\
Runs the co-located engines demo's workload (examples/colocated_engines.py: N engine
processes, shared system prompts, multi-turn conversations whose turns are routed round-robin
across engines, every loaded block verified) three times, changing only the offload tier:

  (a) shared       ONE kvshm cache of M bytes that all N engines use     memory M
  (b) private M/N  one cache of M/N per engine (what engines do today)   memory M
  (c) private M    one cache of M per engine                             memory N x M

and prints, side by side:
  kvshm hit rate   prompt tokens loaded from the offload tier / prompt tokens that missed
                   the engine's own device prefix cache (the tier's hit rate)
  prefix hit rate  prompt tokens not recomputed (device hits + tier hits) / prompt tokens
  recomputed       prompt tokens the engines had to compute
  cross-engine     blocks stored by one engine and loaded by another
and the ratios (a)/(b) (equal memory) and (a)/(c) (how close sharing M comes to N x M).
"""

CONFIGS = (("a", "one shared cache of M", False, 1.0),
           ("b", "N private caches of M/N", True, None),
           ("c", "N private caches of M", True, 1.0))


def measure(o: Options) -> dict[str, Any]:
    runs = {}
    for key, label, private, scale in CONFIGS:
        mib = o.cache_mib * (scale if scale is not None else 1 / o.engines)
        r = run(replace(o, private=private, cache_mib=mib, cache=None, keep=False))
        t = r["total"]
        missed = t["prompt_tokens"] - t["device_hit_tokens"]
        runs[key] = {
            "label": label, "memory_bytes": r["cache_bytes_each"] * len(r["caches"]),
            "kvshm_hit_rate": t["kvshm_hit_tokens"] / max(1, missed),
            "prefix_hit_rate": (t["device_hit_tokens"] + t["kvshm_hit_tokens"])
            / max(1, t["prompt_tokens"]),
            "recomputed_tokens": t["recomputed_tokens"], "prompt_tokens": t["prompt_tokens"],
            "cross_engine_blocks": r["cross_engine_blocks"],
            "blocks_verified": t["blocks_verified"], "blocks_mismatched": t["blocks_mismatched"],
            "wrong_outputs": r["wrong_outputs"], "seconds": r["seconds"]}
    a, b, c = runs["a"], runs["b"], runs["c"]

    def ratio(x: float, y: float) -> float | None:
        return round(x / y, 3) if y else None

    return {"schema": "kvshm.bench_sharing/1", "options": asdict(o), "machine": machine(),
            "runs": runs, "ratios": {
                "hit_rate_shared_over_private_equal_memory": ratio(a["kvshm_hit_rate"],
                                                                   b["kvshm_hit_rate"]),
                "hit_rate_shared_over_private_n_times_memory": ratio(a["kvshm_hit_rate"],
                                                                     c["kvshm_hit_rate"]),
                "prefix_hit_rate_shared_over_private_equal_memory": ratio(
                    a["prefix_hit_rate"], b["prefix_hit_rate"]),
                "recomputed_private_equal_memory_over_shared": ratio(b["recomputed_tokens"],
                                                                     a["recomputed_tokens"]),
                "recomputed_private_n_times_memory_over_shared": ratio(c["recomputed_tokens"],
                                                                       a["recomputed_tokens"])}}


def machine() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        cpu = next(line.split(":", 1)[1].strip() for line in out.splitlines()
                   if line.startswith("Model name"))
    except (OSError, subprocess.CalledProcessError, StopIteration):
        cpu = platform.processor() or "unknown"
    return f"{cpu}, {os.cpu_count()} cores, Python {platform.python_version()}"


def print_table(res: dict[str, Any]) -> None:
    o = res["options"]
    print(f"{o['engines']} engines, {o['conversations']} conversations x {o['turns']} turns, "
          f"{o['system_prompts']} system prompts of {o['system_tokens']} tokens, M = "
          f"{o['cache_mib']:g} MiB; {res['machine']}\n")
    head = ("config", "memory", "kvshm hit", "prefix hit", "recomputed", "cross-engine",
            "mismatched", "seconds")
    print(f"{head[0]:30}" + "".join(f"{h:>13}" for h in head[1:]))
    for key, r in res["runs"].items():
        vals = (f"{r['memory_bytes'] / 2**20:.1f} MiB", f"{100 * r['kvshm_hit_rate']:.1f}%",
                f"{100 * r['prefix_hit_rate']:.1f}%", r["recomputed_tokens"],
                r["cross_engine_blocks"], r["blocks_mismatched"], f"{r['seconds']:.1f}")
        print(f"({key}) {r['label']:26}" + "".join(f"{v:>13}" for v in vals))
    q = res["ratios"]
    print(f"\nequal memory, shared / private: kvshm hit rate "
          f"{q['hit_rate_shared_over_private_equal_memory']}x, prefix hit rate "
          f"{q['prefix_hit_rate_shared_over_private_equal_memory']}x, "
          f"{q['recomputed_private_equal_memory_over_shared']}x fewer tokens recomputed")
    print(f"shared M vs private N x M: kvshm hit rate "
          f"{q['hit_rate_shared_over_private_n_times_memory']}x, "
          f"{q['recomputed_private_n_times_memory_over_shared']}x fewer tokens recomputed")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="bench_sharing.py", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Options()
    skip = {"private", "cache", "keep", "device", "inline_workers", "cache_mib"}
    for f in fields(Options):
        if f.name not in skip:
            ap.add_argument("--" + f.name.replace("_", "-"), type=int,
                            default=getattr(d, f.name),
                            help=f"{OPTION_HELP[f.name]} (default {getattr(d, f.name)})")
    ap.add_argument("--cache-mib", type=float, default=d.cache_mib,
                    help=f"M, the shared cache's size in MiB (default {d.cache_mib:g})")
    ap.add_argument("--inline-workers", action="store_true",
                    help="workers inside the engine processes (fewer processes)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = vars(ap.parse_args(argv))
    as_json = a.pop("json")
    res = measure(replace(d, device="cpu", **a))
    if as_json:
        print(json.dumps(res, indent=2))
    else:
        print_table(res)
    bad = any(r["blocks_mismatched"] or r["wrong_outputs"] for r in res["runs"].values())
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
