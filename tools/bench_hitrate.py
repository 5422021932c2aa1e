#!/usr/bin/env python3
"""Hit rate at equal memory: a skewed prompt trace through vLLM's manager and through kvshm.

Run ``python tools/bench_hitrate.py --help`` for what is measured; results are recorded in
docs/benchmarks.md ("Hit rate at equal memory").
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

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

DESCRIPTION = """\
Replays one trace through managers of the same number of blocks and reports the fraction of
requested keys each one answered as a hit (keys a request found cached, so did not recompute).

Trace: --requests (3000) requests. Each asks for one of --prompts (40) shared prompts of
--prompt-keys (48) keys, then --own-keys (8) keys of its own. The prompt is drawn with a
heavy-tailed popularity: index = floor(X) mod prompts, X ~ Pareto(--shape 1.1) (numpy's
Lomax form, so prompt 0 is asked about half the time and the tail rarely). Keys are vLLM's
36-byte offload keys (chained sha256 block hashes). The trace is fixed by --seed.

Each manager is driven as vLLM's offloading connector drives its manager, one request at a
time: look keys up in order until the first that is not a hit, load the hit prefix, store the
rest, finish the request. Managers, each with --blocks blocks (a comma list; default
256,512,1024):
  vllm     vLLM's own CPUOffloadingManager (LRU), when vLLM is importable: run this script
           with the Python of an environment that has vLLM
  local    kvshm's in-process LocalManager (no owner process, no grants)
  kvshm    kvshm.connect(): a client of a segment with its owner process, storing through the
           blocks the owner grants it ahead of its stores, as engines do
The figure of merit is kvshm's hit rate over vLLM's (over local's without vLLM): 1.0 means
sharing costs no hit rate at equal memory. The owner runs asynchronously: a client's next
request may come before the owner has applied its last one (its stores are then not yet
hits, its grant ring not yet refilled), which depends on how busy the host is, so kvshm's
figure varies from run to run (--repeat runs it several times). --settle also runs kvshm
with the client waiting, after each request, until the owner has applied it and refilled
its grant ring (two round trips, each served in a later pass of the owner): the cache's own
hit rate, without the owner's lag ("kvshm_settled").
"""

KEY_BYTES = 36


def make_trace(requests: int, prompts: int, prompt_keys: int, own_keys: int, shape: float,
               seed: int) -> list[list[bytes]]:
    """Each request's keys: one shared prompt's chained block hashes, then its own."""
    from kvshm.engine.hashing import ROOT, offload_key
    rng = np.random.default_rng(seed)
    shared = []
    for p in range(prompts):
        h, keys = ROOT, []
        for i in range(prompt_keys):
            h = hashlib.sha256(h + f"prompt{p}:{i}".encode()).digest()
            keys.append(offload_key(h))
        shared.append((keys, h))
    which = np.floor(rng.pareto(shape, requests)).astype(np.int64) % prompts
    out = []
    for r, p in enumerate(which.tolist()):
        keys, h = shared[p]
        keys = list(keys)
        for i in range(own_keys):
            h = hashlib.sha256(h + f"req{seed}:{r}:{i}".encode()).digest()
            keys.append(offload_key(h))
        out.append(keys)
    return out


class _Vllm:
    def __init__(self, blocks: int) -> None:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
        self.m = CPUOffloadingManager(num_chunks=blocks, cache_policy="lru")
        self.HIT, self.Ctx = LookupResult.HIT, ReqContext

    def request(self, rid: int, keys: list[bytes]) -> int:
        ctx = self.Ctx(req_id=str(rid))
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, 16 * (i + 1))
        self.m.on_new_request(ctx)
        hits = 0
        for k in keys:
            if self.m.lookup(k, ctx) is not self.HIT:
                break
            hits += 1
        if hits:
            self.m.prepare_load(keys[:hits], ctx)
            self.m.complete_load(keys[:hits], ctx)
        if hits < len(keys):
            out = self.m.prepare_store(keys[hits:], ctx)
            if out is not None:
                self.m.complete_store(out.keys_to_store, ctx)
        self.m.on_request_finished(ctx)
        return hits

    def close(self) -> None:
        self.m.shutdown()


class _Kvshm:
    """A LocalManager or a SharedManager, called as kvshm's vLLM integration calls them.
    ``settle``: after each request, wait until the owner applied it and refilled the grants."""

    def __init__(self, mgr: Any, close: Any, settle: bool = False) -> None:
        from kvshm.index.api import LookupResult
        self.m, self._close, self.HIT, self.settle = mgr, close, LookupResult.HIT, settle

    def request(self, rid: int, keys: list[bytes]) -> int:
        m = self.m
        hits = 0
        for k in keys:
            if m.key_status(k) is not self.HIT:
                break
            hits += 1
        if hits:
            m.prepare_load(keys[:hits])
            m.touch(keys[:hits])
            m.complete_load(keys[:hits])
        if hits < len(keys):
            out = m.prepare_store(keys[hits:])
            if out is not None:
                m.complete_store(out.keys_to_store)
        m.release(None)
        if self.settle:  # the second call is served in a pass after the refill of the first
            m.take_events()
            m.take_events()
        return hits

    def close(self) -> None:
        self._close()


def _layout():
    from kvshm.shm.layout import Layout
    return Layout((4096,), 16, "bench-hitrate")


def _local(blocks: int) -> _Kvshm:
    from kvshm.owner.manager import LocalManager
    from kvshm.shm.segment import Segment
    name = f"bhit{os.getpid()}x{uuid.uuid4().hex[:8]}L"
    seg = Segment.create(name, _layout(), blocks)
    m = LocalManager(seg)

    def close() -> None:
        m.shutdown()
        seg.close()
        Segment.unlink(name)
    return _Kvshm(m, close)


def _shared(blocks: int, settle: bool = False) -> _Kvshm:
    import kvshm
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_teardown import remove_segment
    name = f"bhit{os.getpid()}x{uuid.uuid4().hex[:8]}S"
    m = kvshm.connect(name, _layout(), num_blocks=blocks)
    owner = m._link.owner_proc

    def close() -> None:
        try:
            m.shutdown()
        finally:
            remove_segment(name, owner)
    return _Kvshm(m, close, settle)


def run(mgr: Any, trace: list[list[bytes]]) -> dict[str, Any]:
    hits = keys = 0
    t0 = time.perf_counter()
    try:
        for rid, req in enumerate(trace):
            hits += mgr.request(rid, req)
            keys += len(req)
    finally:
        mgr.close()
    return {"hits": hits, "keys": keys, "hit_rate": hits / keys,
            "seconds": round(time.perf_counter() - t0, 2)}


def _has_vllm() -> bool:
    try:
        import vllm.v1.kv_offload.cpu.manager  # noqa: F401
        return True
    except Exception:
        return False


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", default="256,512,1024",
                    help="comma-separated cache sizes in blocks (default: %(default)s)")
    ap.add_argument("--requests", type=int, default=3000)
    ap.add_argument("--prompts", type=int, default=40)
    ap.add_argument("--prompt-keys", type=int, default=48)
    ap.add_argument("--own-keys", type=int, default=8)
    ap.add_argument("--shape", type=float, default=1.1, help="Pareto shape of prompt popularity")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeat", type=int, default=1, help="kvshm runs per size (default 1)")
    ap.add_argument("--settle", action="store_true",
                    help="also run kvshm waiting for the owner after each request")
    ap.add_argument("--json", action="store_true", help="print ONE JSON object")
    a = ap.parse_args(argv)
    sizes = [int(s) for s in a.blocks.split(",") if s]
    if any(s < 1 for s in sizes) or min(a.requests, a.prompts, a.prompt_keys) < 1:
        ap.error("--blocks, --requests, --prompts and --prompt-keys must be positive")
    trace = make_trace(a.requests, a.prompts, a.prompt_keys, a.own_keys, a.shape, a.seed)
    vllm = _has_vllm()
    base = "vllm" if vllm else "local"
    report: dict[str, Any] = {"tool": "bench_hitrate", "baseline": base, "args": vars(a),
                              "sizes": []}
    for n in sizes:
        row: dict[str, Any] = {"blocks": n}
        if vllm:
            row["vllm"] = run(_Vllm(n), trace)
        row["local"] = run(_local(n), trace)
        row["kvshm"] = [run(_shared(n), trace) for _ in range(a.repeat)]
        ref = row[base]["hit_rate"]
        row["ratio_kvshm_over_baseline"] = [r["hit_rate"] / ref for r in row["kvshm"]]
        if a.settle:
            row["kvshm_settled"] = run(_shared(n, settle=True), trace)
            row["ratio_settled_over_baseline"] = row["kvshm_settled"]["hit_rate"] / ref
        row["ratio_local_over_baseline"] = row["local"]["hit_rate"] / ref
        report["sizes"].append(row)
    if a.json:
        print(json.dumps(report))
        return 0
    print(f"# {a.requests} requests, {a.prompts} prompts x {a.prompt_keys} keys + "
          f"{a.own_keys} own, Pareto({a.shape}); baseline: {base}")
    print(f"{'blocks':>7} {'vllm':>8} {'local':>8} {'kvshm':>8} {'kvshm/' + base:>12}"
          + (f" {'settled':>8} {'settled/' + base:>14}" if a.settle else ""))
    for row in report["sizes"]:
        v = f"{row['vllm']['hit_rate']:.4f}" if "vllm" in row else "-"
        settled = (f" {row['kvshm_settled']['hit_rate']:>8.4f} "
                   f"{row['ratio_settled_over_baseline']:>14.4f}") if a.settle else ""
        for r, ratio in zip(row["kvshm"], row["ratio_kvshm_over_baseline"]):
            print(f"{row['blocks']:>7} {v:>8} {row['local']['hit_rate']:>8.4f} "
                  f"{r['hit_rate']:>8.4f} {ratio:>12.4f}" + settled)
    return 0


if __name__ == "__main__":
    sys.exit(main())
