#!/usr/bin/env python3
"""Replay a scheduler's offload-manager calls through vLLM's manager (or LocalManager) and kvshm.

Run ``python tools/bench_scheduler.py --help`` for what is measured; results are recorded in
docs/benchmarks.md ("Scheduler trace").
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import statistics
import sys
import time
import uuid
from typing import Any

from bench_teardown import remove_segment
from proc_clock import cpu_ns, loadavg

DESCRIPTION = """\
Per-key cost of the manager calls a vLLM scheduler makes, replayed from a synthetic trace
through an in-process baseline and through kvshm (kvshm.connect -> SharedManager, with the
owner process it starts; stores take blocks the owner granted ahead of time), in one run.

Baseline: vLLM's own CPUOffloadingManager (LRU) when vLLM is importable (run this script
with the Python of an environment that has vLLM), else kvshm's in-process LocalManager on a
private segment. LocalManager is measured too whenever it is not the baseline.

Traces (keys are vLLM's 36-byte offload keys: sha256 block hash + 4-byte group):
  t1  --requests (400) requests; each is a 64-key prefix from one of 4 system prompts
      followed by 16 keys unique to the request.
  t2  --requests2 (40) requests of 1,000-key prompts: an 800-key prefix from one of 4
      system prompts followed by 200 unique keys.
  t3  --requests3 (100) requests shaped as t1 whose 16 unique keys are stored one per
      prepare_store + complete_store, as a decode step stores the block a request just
      filled.
Per request, as vLLM 0.32's offloading connector calls its manager:
  lookup        one call per key, in order, until the first key that is not a HIT
                (vLLM: lookup(key, req_context); kvshm: key_status(key), which is what
                kvshm's vLLM integration calls; a HIT leases the block in kvshm)
  load          prepare_load + complete_load of the hit prefix (kvshm's integration also
                sends touch(keys) after prepare_load, a one-way frame: included)
  store         prepare_store + complete_store of the remaining keys (complete_store of
                the keys prepare_store returned; a refusal, None, is counted as no_room)
  finish        vLLM: on_request_finished; kvshm: release() of leases still held
                (the integration releases them at the step's end). Counted in 'whole'.
Reported per manager and trace: mean microseconds per key of each op (op time summed
over the trace / keys it covered), p50/p99 over calls of us/key, whole-trace wall time in
ms, and kvshm/baseline ratios (>1 means kvshm is slower). Each trace is replayed --repeat
times, alternating baseline and kvshm, each repeat with fresh keys on the same cache (so
later repeats start from a full cache, the steady state); the figures are the median over
repeats of each repeat's mean, and p50/p99 pooled over repeats. For kvshm also the owner
process's CPU time during the replay per stored key (from /proc/PID/schedstat, ns clock):
all it did meanwhile, its spinning while it waits for frames included; and of that, the
time it spent serving frames (the segment's owner_busy_ns counter: publish, refill and
evict, touches), the work a busy host pays for in the owner.

Cache size: every manager gets --capacity blocks (default: the 4 system prompts of the
longest trace plus half of the unique keys of one replay of the trace with the most), so
replays EVICT: that trace from about halfway through its first replay, every trace once
earlier replays have filled the cache (least recently used unique keys go). --capacity 0 sizes it to hold
every key of every repeat (no eviction). The kvshm segment uses a realistic layout:
--planes (28) planes of --page-bytes (16384) each, a 16-token block of a bf16 model with 28
layers and 2 KV heads of 128 dims (448 KiB per block); the manager never touches block
data, so page size only sets the segment's memory. A LocalManager baseline uses a private
segment with 4 KiB pages for the same reason.

--clients N: after the single-process figures, trace 1 is replayed by 1 and then by N
scheduler processes (spawned) at once: kvshm with all N attached to one segment (shared
system prompts, per-client unique keys), then the baseline with one private manager per
process. Each client's p50/p99 per op are reported, and the growth of p99 from 1 to N
clients (max over clients at N / the 1-client p99). Goal: kvshm p99 at 8 clients within 2x
of 1 client. The baseline's growth shows what CPU contention alone does on this host.
The growth of each client's busy time (its whole trace less --step-ms sleeps) is reported too,
and round_trip_stores: the kvshm stores of each run that its clients' grants did not cover
(the owner's counter; each client's first store at least, made before it is stocked).
--step-ms S paces every client as an engine whose model step takes S ms: request r starts S*r
ms after its first (at once if the client is behind), all clients starting together, so the
eight stores of a step reach the owner as one burst. Back to back (S 0), eight clients ask the
owner for more keys a second than it can publish; paced, the figures show whether engines
storing at their real rate ever wait for it.

The script removes its segments (unique names, Segment.unlink), stops the owner it started
and gives up after --max-seconds (replays stop early and say so in 'truncated').
"""

KEY_BYTES = 36
N_PROMPTS = 4
TRACES = {"t1": (64, 16), "t2": (800, 200), "t3": (64, 16)}  # (prefix, unique keys) a request
STORE_BATCH = {"t3": 1}  # keys a store call carries (others: all of a request's at once)


def _log(*a: Any) -> None:
    print(*a, file=sys.stderr, flush=True)


def _unique(tag: str) -> str:
    # Segment.unlink removes semaphores by prefix "<name>-": no name may prefix another.
    return f"bsched{os.getpid()}x{uuid.uuid4().hex[:8]}{tag}"


def _layout(page_bytes: int, planes: int):
    from kvshm.shm.layout import Layout
    return Layout((page_bytes,) * planes, 16, "bench-scheduler-28L-2kvh-128d-bf16")


def _small_layout():
    from kvshm.shm.layout import Layout
    return Layout((4096,), 16, "bench-scheduler-baseline")


# --- trace ---------------------------------------------------------------------------------
def make_trace(prefix: int, unique: int, requests: int, salt: str) -> list[list[bytes]]:
    """Each request's keys: chained block hashes of one of 4 system prompts, then its own."""
    from kvshm.engine.hashing import ROOT, offload_key
    import hashlib
    prompts = []
    for p in range(N_PROMPTS):
        h, keys = ROOT, []
        for i in range(prefix):
            h = hashlib.sha256(h + f"prompt{p}:{i}".encode()).digest()
            keys.append(offload_key(h))
        prompts.append((keys, h))
    out = []
    for r in range(requests):
        keys, h = prompts[r % N_PROMPTS]
        keys = list(keys)
        for i in range(unique):
            h = hashlib.sha256(h + f"{salt}:{r}:{i}".encode()).digest()
            keys.append(offload_key(h))
        out.append(keys)
    assert all(len(k) == KEY_BYTES for k in out[0])
    return out


# --- managers: one adapter each, the calls the scheduler makes --------------------------------
class _Vllm:
    name = "vllm"

    def __init__(self, capacity: int):
        from vllm.v1.kv_offload.base import LookupResult, ReqContext
        from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager
        self.m = CPUOffloadingManager(num_chunks=capacity, cache_policy="lru")
        self.HIT, self.Ctx = LookupResult.HIT, ReqContext

    def new_request(self, rid: str, keys: list[bytes]) -> Any:
        ctx = self.Ctx(req_id=rid)
        for i, k in enumerate(keys):  # the scheduler records positions (not timed)
            ctx.set_offload_key_position(k, 16 * (i + 1))
        self.m.on_new_request(ctx)
        return ctx

    def lookup(self, key: bytes, ctx: Any) -> bool:
        return self.m.lookup(key, ctx) is self.HIT

    def load(self, keys: list[bytes], ctx: Any) -> None:
        self.m.prepare_load(keys, ctx)
        self.m.complete_load(keys, ctx)

    def store(self, keys: list[bytes], ctx: Any) -> bool:
        out = self.m.prepare_store(keys, ctx)
        if out is None:
            return False
        self.m.complete_store(out.keys_to_store, ctx)
        return True

    def finish(self, ctx: Any) -> None:
        self.m.on_request_finished(ctx)

    def close(self) -> None:
        self.m.shutdown()


class _Kvshm:
    """SharedManager or LocalManager, called as kvshm's vLLM integration calls them."""

    def __init__(self, mgr: Any, name: str, shared: bool):
        from kvshm.index.api import LookupResult
        self.m, self.name, self.shared, self.HIT = mgr, name, shared, LookupResult.HIT

    def new_request(self, rid: str, keys: list[bytes]) -> Any:
        return rid

    def lookup(self, key: bytes, ctx: Any) -> bool:
        return self.m.key_status(key) is self.HIT

    def load(self, keys: list[bytes], ctx: Any) -> None:
        self.m.prepare_load(keys)
        self.m.touch(keys)
        self.m.complete_load(keys)

    def store(self, keys: list[bytes], ctx: Any) -> bool:
        out = self.m.prepare_store(keys)
        if out is None:
            return False
        self.m.complete_store(out.keys_to_store)
        return True

    def finish(self, ctx: Any) -> None:
        self.m.release(None)

    def close(self) -> None:
        pass


def _local_baseline(capacity: int) -> tuple[_Kvshm, Any]:
    from kvshm.owner.manager import LocalManager
    from kvshm.shm.segment import Segment
    name = _unique("L")
    seg = Segment.create(name, _small_layout(), capacity)
    m = LocalManager(seg)

    def close() -> None:
        m.shutdown()
        seg.close()
        Segment.unlink(name)
    return _Kvshm(m, "local", False), close


def _baseline_kind(force_local: bool) -> str:
    if force_local:
        return "local"
    try:
        import vllm.v1.kv_offload.cpu.manager  # noqa: F401
        return "vllm"
    except Exception:  # noqa: BLE001 - not installed, or unusable here
        return "local"


# --- replay --------------------------------------------------------------------------------
def replay(mgr: Any, trace: list[list[bytes]], deadline: float, tag: str,
           store_batch: int | None = None, step_s: float = 0.0) -> dict[str, Any]:
    """Run every request of ``trace`` through ``mgr``; per-call us/key samples per op.
    ``store_batch``: keys a store call carries (None: the request's whole rest at once).
    ``step_s``: request r starts ``r * step_s`` after the first (an engine's model step
    between them), or at once if the replay is behind; the time slept is reported, and
    ``busy_ms`` is the whole trace without it."""
    pc = time.perf_counter_ns
    lk: list[float] = []
    ld: list[float] = []
    st: list[float] = []
    tot = {"lookup": [0, 0], "load": [0, 0], "store": [0, 0]}  # ns, keys
    no_room = hits_total = done = slept = 0
    t_start = pc()
    for r, keys in enumerate(trace):
        if time.monotonic() > deadline:
            break
        if step_s:  # the engine's step between requests: a pace, not a synchronisation
            t0 = pc()
            wait = t_start + int(r * step_s * 1e9) - t0
            if wait > 0:
                time.sleep(wait / 1e9)
                slept += pc() - t0
        ctx = mgr.new_request(f"{tag}-{r}", keys)
        hits = 0
        for k in keys:
            t0 = pc()
            hit = mgr.lookup(k, ctx)
            dt = pc() - t0
            lk.append(dt / 1e3)
            tot["lookup"][0] += dt
            tot["lookup"][1] += 1
            if not hit:
                break
            hits += 1
        hits_total += hits
        if hits:
            h = keys[:hits]
            t0 = pc()
            mgr.load(h, ctx)
            dt = pc() - t0
            ld.append(dt / 1e3 / hits)
            tot["load"][0] += dt
            tot["load"][1] += hits
        rest = keys[hits:]
        step = store_batch or len(rest) or 1
        for i in range(0, len(rest), step):
            part = rest[i:i + step]
            t0 = pc()
            ok = mgr.store(part, ctx)
            dt = pc() - t0
            st.append(dt / 1e3 / len(part))
            tot["store"][0] += dt
            tot["store"][1] += len(part)
            no_room += not ok
        mgr.finish(ctx)
        done += 1
    whole_ms = (pc() - t_start) / 1e6
    return {"samples": {"lookup": lk, "load": ld, "store": st},
            "mean_us_per_key": {op: (ns / 1e3 / n if n else None) for op, (ns, n) in tot.items()},
            "whole_ms": whole_ms, "busy_ms": whole_ms - slept / 1e6, "requests": done,
            "truncated": done < len(trace),
            "keys": sum(len(k) for k in trace[:done]), "hit_keys": hits_total,
            "stored_keys": tot["store"][1],
            "no_room": no_room}


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))]


def _summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {"repeats": len(runs)}
    for op in ("lookup", "load", "store"):
        means = [r["mean_us_per_key"][op] for r in runs if r["mean_us_per_key"][op] is not None]
        pooled = [x for r in runs for x in r["samples"][op]]
        out[op] = {"mean_us_per_key": statistics.median(means) if means else None,
                   "p50_us_per_key": _pct(pooled, 0.50), "p99_us_per_key": _pct(pooled, 0.99),
                   "calls": len(pooled)}
    out["whole_ms"] = statistics.median(r["whole_ms"] for r in runs)
    if all("owner_cpu_ns" in r and r["stored_keys"] for r in runs):
        out["owner_us_per_stored_key"] = statistics.median(
            r["owner_cpu_ns"] / 1e3 / r["stored_keys"] for r in runs)
        out["owner_busy_us_per_stored_key"] = statistics.median(
            r["owner_busy_ns"] / 1e3 / r["stored_keys"] for r in runs)
    for k in ("requests", "keys", "hit_keys", "no_room"):
        out[k] = [r[k] for r in runs]
    out["truncated"] = any(r["truncated"] for r in runs)
    return out


def _ratios(kv: dict[str, Any], base: dict[str, Any]) -> dict[str, float | None]:
    r: dict[str, float | None] = {}
    for op in ("lookup", "load", "store"):
        a, b = kv[op]["mean_us_per_key"], base[op]["mean_us_per_key"]
        r[op] = a / b if a and b else None
    r["whole"] = kv["whole_ms"] / base["whole_ms"] if base["whole_ms"] else None
    return r


# --- the shared segment and its owner ------------------------------------------------------
class _Shared:
    def __init__(self, capacity: int, page_bytes: int, planes: int, clients: int):
        import kvshm
        self.name = _unique("S")
        self.layout = _layout(page_bytes, planes)
        self.mgr = kvshm.connect(self.name, self.layout, num_blocks=capacity,
                                 max_clients=max(8, clients + 2))
        self.owner = self.mgr._link.owner_proc  # the owner this process started
        self.owner_pid = self.mgr.segment.owner_record()[0]

    def rejoin(self) -> None:
        """Leave and connect again, as a client that stores nothing: the grant ring this
        process's replays grew (twice their largest store, up to the whole grant budget)
        goes back to the owner, so that the spawned clients are measured sharing the owner
        and the budget among themselves, not beside a client idle with a full ring."""
        import kvshm
        self.mgr.shutdown()
        self.mgr = kvshm.connect(self.name)
        pid = self.mgr.segment.owner_record()[0]
        if pid != self.owner_pid:  # (its owner left meanwhile: the runs would mix two)
            raise RuntimeError(f"the segment's owner changed ({self.owner_pid} -> {pid})")

    def close(self) -> None:
        try:
            self.mgr.shutdown()
        finally:
            remove_segment(self.name, self.owner, wait_s=3)


# --- N clients -----------------------------------------------------------------------------
def _client(idx: int, seg_name: str, base_kind: str, capacity: int, requests: int,
            salt: str, barrier: Any, queue: Any, deadline_wall: float, step_s: float) -> None:
    """One spawned scheduler: kvshm replay on the shared segment, then its baseline."""
    res: dict[str, Any] = {"client": idx}
    try:
        import kvshm
        pre, uni = TRACES["t1"]
        deadline = time.monotonic() + max(1.0, deadline_wall - time.time())
        mgr = kvshm.connect(seg_name)
        try:
            trace = make_trace(pre, uni, requests, f"{salt}c{idx}k")
            barrier.wait(timeout=120)
            res["kvshm"] = _strip(replay(_Kvshm(mgr, "kvshm", True), trace, deadline, "k",
                                         step_s=step_s))
        finally:
            mgr.shutdown()
        if base_kind == "vllm":
            base, close = _Vllm(capacity), (lambda: None)
        else:
            base, close = _local_baseline(capacity)
        try:
            trace = make_trace(pre, uni, requests, f"{salt}c{idx}b")
            barrier.wait(timeout=120)
            res["baseline"] = _strip(replay(base, trace, deadline, "b", step_s=step_s))
        finally:
            close()
    except BaseException as e:  # noqa: BLE001 - report to the parent
        res["error"] = repr(e)
        try:
            barrier.abort()
        except Exception:  # noqa: BLE001
            pass
    queue.put(res)


def _strip(run: dict[str, Any]) -> dict[str, Any]:
    s = run.pop("samples")
    for op in ("lookup", "load", "store"):
        run[op] = {"p50_us_per_key": _pct(s[op], 0.5), "p99_us_per_key": _pct(s[op], 0.99),
                   "mean_us_per_key": run["mean_us_per_key"][op]}
    del run["mean_us_per_key"]
    return run


def run_clients(n: int, shared: _Shared, base_kind: str, capacity: int, requests: int,
                deadline: float, step_s: float = 0.0) -> list[dict[str, Any]]:
    ctx = mp.get_context("spawn")
    barrier, queue = ctx.Barrier(n), ctx.Queue()
    salt = uuid.uuid4().hex[:8]
    deadline_wall = time.time() + (deadline - time.monotonic())
    procs = [ctx.Process(target=_client, args=(i, shared.name, base_kind, capacity, requests,
                                               salt, barrier, queue, deadline_wall, step_s))
             for i in range(n)]
    for p in procs:
        p.start()
    out = []
    try:
        for _ in procs:
            out.append(queue.get(timeout=max(5.0, deadline - time.monotonic() + 30)))
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
    return sorted(out, key=lambda r: r["client"])


# --- main ----------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=400,
                    help="requests in trace 1 (64 shared + 16 unique keys each; default 400)")
    ap.add_argument("--requests2", type=int, default=40,
                    help="requests in trace 2 (800 shared + 200 unique keys each; default 40;"
                         " 0 skips trace 2)")
    ap.add_argument("--requests3", type=int, default=100,
                    help="requests in trace 3 (t1's shape, unique keys stored one a call; "
                         "default 100; 0 skips trace 3)")
    ap.add_argument("--repeat", type=int, default=3,
                    help="replays of each trace per manager, alternating (default 3)")
    ap.add_argument("--capacity", type=int, default=None,
                    help="cache blocks of every manager (default: the 4 system prompts of "
                         "the longest trace plus half of one replay's unique keys, so the "
                         "trace evicts; 0: hold every key of every repeat, no eviction)")
    ap.add_argument("--page-bytes", type=int, default=16384,
                    help="bytes of one plane of a block in the kvshm segment (default 16384)")
    ap.add_argument("--planes", type=int, default=28,
                    help="planes (layers) per block in the kvshm segment (default 28)")
    ap.add_argument("--clients", type=int, default=0,
                    help="also replay trace 1 with 1 and then N scheduler processes at once "
                         "on one segment, reporting each client's p50/p99 (default 0: skip)")
    ap.add_argument("--client-requests", type=int, default=None,
                    help="requests per client in the --clients runs (default --requests)")
    ap.add_argument("--step-ms", type=float, default=0.0,
                    help="in the --clients runs, start each client's requests this many ms "
                         "apart, all clients together, as engines whose model steps take that "
                         "long (default 0: back to back, as fast as the managers go)")
    ap.add_argument("--idle-client", action="store_true",
                    help="keep this process's client, whose single-process replays grew "
                         "its grant ring, connected and idle while the --clients run: an "
                         "engine that stored alone and then paused (the owner recalls what "
                         "it holds beyond its share once it is idle and others lack room)")
    ap.add_argument("--baseline", choices=("auto", "local"), default="auto",
                    help="auto: vLLM's CPUOffloadingManager if importable, else LocalManager;"
                         " local: LocalManager even when vLLM is importable")
    ap.add_argument("--max-seconds", type=float, default=300,
                    help="stop replays after this many seconds (default 300)")
    ap.add_argument("--profile", metavar="FILE",
                    help="cProfile one extra kvshm replay of trace 1 and dump stats to FILE")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    a = ap.parse_args(argv)
    if a.step_ms and not a.clients:
        ap.error("--step-ms paces the --clients runs: give --clients N too")
    if a.step_ms < 0:
        ap.error("--step-ms is a step's length: 0 or more")

    t_begin = time.monotonic()
    deadline = t_begin + a.max_seconds
    base_kind = _baseline_kind(a.baseline == "local")
    traces = {"t1": a.requests, "t2": a.requests2, "t3": a.requests3}
    traces = {t: n for t, n in traces.items() if n > 0}
    uniq = max(TRACES[t][1] * n for t, n in traces.items())
    prefix = max(TRACES[t][0] for t in traces) * N_PROMPTS
    if a.capacity is None:
        capacity, evicts = prefix + uniq // 2, True
    elif a.capacity == 0:
        total = sum(TRACES[t][0] * N_PROMPTS + TRACES[t][1] * n for t, n in traces.items())
        capacity, evicts = total * a.repeat + 16, False
        if a.clients:
            capacity += TRACES["t1"][1] * (a.client_requests or a.requests) * (1 + a.clients)
    else:
        capacity, evicts = a.capacity, None
    result: dict[str, Any] = {
        "tool": "bench_scheduler", "python": platform.python_version(),
        "cpus": os.cpu_count(), "load_start": loadavg(), "baseline": base_kind,
        "capacity_blocks": capacity, "evicts": evicts,
        "layout": {"planes": a.planes, "page_bytes": a.page_bytes,
                   "block_bytes": a.planes * a.page_bytes, "tokens_per_block": 16},
        "args": vars(a)}
    if base_kind == "vllm":
        import vllm
        result["vllm_version"] = vllm.__version__
    _log(f"baseline {base_kind}, capacity {capacity} blocks, load {result['load_start']}")

    shared = _Shared(capacity, a.page_bytes, a.planes, a.clients)
    closers = []
    try:
        kv = _Kvshm(shared.mgr, "kvshm", True)
        if base_kind == "vllm":
            base = _Vllm(capacity)
            local, lclose = _local_baseline(capacity)
            closers.append(lclose)
            managers = [base, local, kv]
        else:
            base, bclose = _local_baseline(capacity)
            closers.append(bclose)
            managers = [base, kv]
        result["traces"] = {}
        for t, n in traces.items():
            pre, uni = TRACES[t]
            runs: dict[str, list] = {m.name: [] for m in managers}
            for rep in range(a.repeat):
                for m in managers:
                    trace = make_trace(pre, uni, n, f"{t}r{rep}{m.name}")
                    seg = shared.mgr.segment
                    o0 = cpu_ns(shared.owner_pid) if m is kv else 0
                    b0 = seg.counter("owner_busy_ns") if m is kv else 0
                    runs[m.name].append(replay(m, trace, deadline, f"{t}{rep}",
                                               STORE_BATCH.get(t)))
                    if m is kv:  # all the owner did meanwhile: publish, refill, touch, evict
                        runs[m.name][-1]["owner_cpu_ns"] = cpu_ns(shared.owner_pid) - o0
                        runs[m.name][-1]["owner_busy_ns"] = seg.counter("owner_busy_ns") - b0
            summ = {name: _summarise(rs) for name, rs in runs.items()}
            result["traces"][t] = {
                "requests": n, "prefix_keys": pre, "unique_keys": uni, "managers": summ,
                "ratio_kvshm_over_baseline": _ratios(summ["kvshm"], summ[base.name])}
            if base_kind == "vllm":
                result["traces"][t]["ratio_kvshm_over_local"] = _ratios(summ["kvshm"],
                                                                        summ["local"])
            _log(f"{t} done, load {loadavg()}")
        if a.profile:
            import cProfile
            trace = make_trace(*TRACES["t1"], a.requests, "profile")
            prof = cProfile.Profile()
            prof.runcall(replay, kv, trace, deadline, "p")
            prof.dump_stats(a.profile)
            result["profile"] = a.profile
        if a.clients:
            creq = a.client_requests or a.requests
            result["clients"] = {"requests_per_client": creq, "round_trip_stores": {}}
            if not a.idle_client:
                shared.rejoin()
            for n in sorted({1, a.clients}):
                trips = shared.mgr.segment.counter("round_trip_stores")
                result["clients"][str(n)] = run_clients(n, shared, base_kind, capacity, creq,
                                                        deadline, a.step_ms / 1e3)
                # kvshm stores its clients' grants did not cover (each client's first, at least)
                result["clients"]["round_trip_stores"][str(n)] = \
                    shared.mgr.segment.counter("round_trip_stores") - trips
                _log(f"{n} clients done, load {loadavg()}")
            growth: dict[str, Any] = {}
            busy: dict[str, float | None] = {}
            one = result["clients"]["1"][0]
            many = result["clients"][str(a.clients)]
            for who in ("kvshm", "baseline"):
                g = {}
                for op in ("lookup", "load", "store"):
                    p1 = one.get(who, {}).get(op, {}).get("p99_us_per_key")
                    pn = [c[who][op]["p99_us_per_key"] for c in many
                          if who in c and c[who][op]["p99_us_per_key"]]
                    g[op] = max(pn) / p1 if p1 and pn else None
                growth[who] = g
                # the trace's own time, the steps slept between requests left out
                b1 = one.get(who, {}).get("busy_ms")
                bn = [c[who]["busy_ms"] for c in many if who in c]
                busy[who] = max(bn) / b1 if b1 and bn else None
            result["clients"]["p99_growth_max_client"] = growth
            result["clients"]["busy_growth_max_client"] = busy
            result["clients"]["goal_kvshm_p99_within_2x"] = all(
                v is not None and v <= 2 for v in growth["kvshm"].values())
    finally:
        for c in closers:
            c()
        shared.close()
    result["load_end"] = loadavg()
    result["seconds"] = time.monotonic() - t_begin
    if a.json:
        print(json.dumps(result))
    else:
        _print(result)
    return 0


def _f(x: Any, fmt: str = "8.2f") -> str:
    return format(x, fmt) if isinstance(x, (int, float)) else f"{'-':>8}"


def _print(r: dict[str, Any]) -> None:
    print(f"baseline: {r['baseline']}{' ' + r.get('vllm_version', '') if r['baseline'] == 'vllm' else ''}"
          f"   capacity {r['capacity_blocks']} blocks ({'evicts' if r['evicts'] else 'as given' if r['evicts'] is None else 'no eviction'})"
          f"   load {r['load_start']} -> {r['load_end']}   {r['seconds']:.0f} s")
    for t, d in r["traces"].items():
        print(f"\ntrace {t}: {d['requests']} requests x ({d['prefix_keys']} shared + "
              f"{d['unique_keys']} unique keys), median of {r['args']['repeat']} replays")
        print(f"  {'manager':8} {'lookup':>8} {'load':>8} {'store':>8}   us/key (mean)"
              f"   {'whole ms':>9}   p99 us/key lookup/load/store")
        for name, s in d["managers"].items():
            print(f"  {name:8} {_f(s['lookup']['mean_us_per_key'])} "
                  f"{_f(s['load']['mean_us_per_key'])} {_f(s['store']['mean_us_per_key'])}"
                  f"                  {s['whole_ms']:9.1f}   "
                  f"{_f(s['lookup']['p99_us_per_key'], '.2f')} / "
                  f"{_f(s['load']['p99_us_per_key'], '.2f')} / "
                  f"{_f(s['store']['p99_us_per_key'], '.2f')}"
                  f"{'  TRUNCATED' if s['truncated'] else ''}  no_room {s['no_room']}")
            if "owner_us_per_stored_key" in s:
                print(f"  {'':8} owner CPU {s['owner_us_per_stored_key']:.2f} us per stored key, "
                      f"{s['owner_busy_us_per_stored_key']:.2f} of it serving frames")
        for key in ("ratio_kvshm_over_baseline", "ratio_kvshm_over_local"):
            if key in d:
                q = d[key]
                print(f"  {key:26} lookup {_f(q['lookup'], '.2f')}x  load "
                      f"{_f(q['load'], '.2f')}x  store {_f(q['store'], '.2f')}x  whole "
                      f"{_f(q['whole'], '.2f')}x")
    c = r.get("clients")
    if c:
        step = r["args"]["step_ms"]
        print(f"\nclients: {c['requests_per_client']} trace-1 requests each"
              f"{f', one every {step:g} ms' if step else ''}; p50 / p99 us/key")
        for n in (k for k in c if k.isdigit()):
            for cl in c[n]:
                if "error" in cl:
                    print(f"  N={n} client {cl['client']}: ERROR {cl['error']}")
                    continue
                for who in ("kvshm", "baseline"):
                    x = cl[who]
                    print(f"  N={n:>2} c{cl['client']} {who:8} " + "  ".join(
                        f"{op} {_f(x[op]['p50_us_per_key'], '.2f')}/"
                        f"{_f(x[op]['p99_us_per_key'], '.2f')}"
                        for op in ("lookup", "load", "store"))
                        + f"  whole {x['whole_ms']:.0f} ms, busy {x['busy_ms']:.0f} ms"
                        + ("  TRUNCATED" if x["truncated"] else ""))
        print("  kvshm stores by round trip (grants did not cover them), all clients: " +
              ", ".join(f"N={n} {v}" for n, v in c["round_trip_stores"].items()))
        for who, g in c["p99_growth_max_client"].items():
            print(f"  p99 growth 1 -> N (worst client) {who:8} " + "  ".join(
                f"{op} {_f(v, '.2f')}x" for op, v in g.items())
                + f"  busy time {_f(c['busy_growth_max_client'][who], '.2f')}x")
        print(f"  goal kvshm p99 at N within 2x of 1 client: "
              f"{'met' if c['goal_kvshm_p99_within_2x'] else 'NOT met'}")


if __name__ == "__main__":
    sys.exit(main())
