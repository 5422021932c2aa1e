"""The owner and cache benchmarks of docs/benchmarks.md, run briefly: each completes and prints
the figures that page quotes, as one JSON object with --json (the vLLM baseline is left to
the runs the page records; here the in-process LocalManager stands in for it)."""
from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def _tool_module(name: str) -> Any:
    """The tool ``tools/<name>.py`` imported, for a test of its own functions."""
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "tools"))


def tool(name: str, *args: str) -> dict:
    p = subprocess.run([sys.executable, str(ROOT / "tools" / name), "--json", *args],
                       capture_output=True, text=True, timeout=300, env=ENV)
    assert p.returncode == 0, p.stderr[-3000:]
    return json.loads(p.stdout)  # the whole of stdout


def test_bench_hitrate_prints_every_hit_rate_and_ratio():
    r = tool("bench_hitrate.py", "--blocks", "64", "--requests", "60", "--prompts", "8",
             "--settle")
    (row,) = r["sizes"]
    for kind in ("local", "kvshm_settled"):
        assert 0 < row[kind]["hit_rate"] < 1
    assert row["kvshm"][0]["keys"] == row["local"]["keys"] == 60 * (48 + 8)
    assert row["ratio_kvshm_over_baseline"][0] > 0 and row["ratio_settled_over_baseline"] > 0


@pytest.mark.parametrize("protected", ["0", "0.25"])
def test_bench_owner_prints_the_owner_figures(protected):
    r = tool("bench_owner.py", "--clients", "1", "--seconds", "0.5", "--blocks", "1024",
             "--protected", protected)
    (run,) = r["runs"]
    assert run["protected"] == float(protected)
    assert run["keys_per_s"] > 0 and run["keys_per_owner_cpu_s"] > 0
    assert run["owner_us_per_key"] > 0 and run["client_us_per_key"] > 0


def test_bench_scheduler_paces_its_clients_and_leaves_the_steps_out_of_busy_time():
    r = tool("bench_scheduler.py", "--requests", "6", "--requests2", "0", "--requests3", "0",
             "--repeat", "1", "--clients", "2", "--client-requests", "4", "--step-ms", "50")
    runs = [c for n in ("1", "2") for c in r["clients"][n]]
    assert len(runs) == 3
    for c in runs:
        for who in ("kvshm", "baseline"):
            x = c[who]
            assert x["requests"] == 4 and not x["truncated"]
            # the 4th request starts 3 steps after the first: it slept at least 150 ms less
            # the first 3 requests' work (~10 ms here; the margin is for a loaded host)
            assert x["whole_ms"] >= 150 and 0 < x["busy_ms"] < x["whole_ms"] - 50
    assert r["clients"]["round_trip_stores"]["1"] >= 1  # its first store: no grants yet
    growth = r["clients"]["busy_growth_max_client"]
    assert growth["kvshm"] > 0 and growth["baseline"] > 0
    assert set(r["clients"]["p99_growth_max_client"]["kvshm"]) == {"lookup", "load", "store"}


@pytest.mark.unit
def test_bench_scheduler_paces_from_the_first_request_and_leaves_out_only_sleep(monkeypatch):
    bs = _tool_module("bench_scheduler")
    now = [0]  # a fake clock (ns): each sleep overshoots 2 ms, each store takes its work
    work = iter([25, 1, 1, 1, 1])  # ms: the first request ends 2.5 steps late

    def sleep(s: float) -> None:
        now[0] += int(s * 1e9) + 2_000_000

    class Mgr:  # misses every lookup; each store takes the next of ``work``
        def new_request(self, rid, keys):
            return rid

        def lookup(self, key, ctx):
            return False

        def store(self, keys, ctx):
            now[0] += next(work) * 1_000_000
            return True

        def finish(self, ctx):
            pass

    monkeypatch.setattr(bs.time, "perf_counter_ns", lambda: now[0])
    monkeypatch.setattr(bs.time, "sleep", sleep)
    r = bs.replay(Mgr(), [[b"k"]] * 5, float("inf"), "t", step_s=0.010)
    # r0 at 0; r1, r2 at once (behind, at 25 and 26); r3 sleeps to 30 (+2), r4 to 40 (+2):
    # the overshoot is slept time, not busy time, and the schedule does not drift by it
    assert r["requests"] == 5
    assert (r["whole_ms"], r["busy_ms"]) == (pytest.approx(43), pytest.approx(29))


def test_bench_scheduler_measures_its_clients_without_the_grants_of_its_own_replays():
    # The single-process replays grow their client's grant ring; idle beside the spawned
    # clients, it would hold the grant budget they share.
    bs = _tool_module("bench_scheduler")
    from kvshm.inspect.snapshot import snapshot
    from kvshm.owner.stocking import grant_target

    shared = bs._Shared(656, 4096, 2, 8)
    try:
        seg = shared.mgr.segment
        trace = bs.make_trace(*bs.TRACES["t1"], 20, "rejoin")
        bs.replay(bs._Kvshm(shared.mgr, "kvshm", True), trace, float("inf"), "r",
                  bs.STORE_BATCH.get("t1"))
        [me] = [c for c in snapshot(seg)["clients"] if c["alive"]]
        assert me["granted"] > grant_target(seg.geometry)  # grown past a client's share
        shared.rejoin()
        after = snapshot(shared.mgr.segment)
        assert [c["granted"] for c in after["clients"] if c["alive"]] == [0]
        assert after["owner"]["pid"] == shared.owner_pid  # the same owner serves on
    finally:
        shared.close()


def test_bench_quotas_prints_the_three_runs_and_their_ratios():
    r = tool("bench_quotas.py", "--blocks", "128", "--requests", "40", "--prompts", "4",
             "--prompt-keys", "8")
    runs = r["runs"]
    assert runs["alone"]["flooded_keys"] == 0 < runs["flood"]["flooded_keys"]
    for run in runs.values():
        assert run["keys"] == 3 * 40 * (8 + 8) and 0 < run["hit_rate"] < 1
    assert r["ratio_quotas_over_alone"] > 0 and r["ratio_flood_over_alone"] > 0


def test_probe_host_reads_without_cupy_says_what_it_needs_and_exits_2():
    """CI has no GPU and no CuPy: the probe must say so in one line, not crash."""
    try:
        import cupy  # noqa: F401
        pytest.skip("CuPy is installed here")
    except ImportError:
        pass
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "probe_host_reads.py"), "--json"],
                       capture_output=True, text=True, timeout=60, env=ENV)
    assert p.returncode == 2
    assert p.stdout == ""
    assert p.stderr.strip() == "probe_host_reads needs CuPy and a CUDA GPU"


@pytest.mark.parametrize("name, why", [
    ("sweep_triton_copy.py", "sweep_triton_copy needs torch with CUDA, Triton and a CUDA GPU"),
    ("probe_split_copy.py", "probe_split_copy needs torch with CUDA, Triton and a CUDA GPU"),
    ("bench_gather.py", "bench_gather needs torch with CUDA and a CUDA GPU (--host-stub "
                        "runs without one)")],
    ids=["sweep_triton_copy", "probe_split_copy", "bench_gather"])
def test_cuda_tools_without_cuda_say_what_they_need_and_exit_2(name, why):
    """As probe_host_reads: on a host without CUDA, one line on stderr, not a traceback."""
    from lazy import torch
    if torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    p = subprocess.run([sys.executable, str(ROOT / "tools" / name), "--json"],
                       capture_output=True, text=True, timeout=120, env=ENV)
    assert (p.returncode, p.stdout, p.stderr) == (2, "", why + "\n")


@pytest.mark.unit
@pytest.mark.parametrize("k", [1, 2, 3, 7])
@pytest.mark.parametrize("rounds", [1, 2])
def test_bench_transfer_runs_every_column_after_every_other_equally_often(k, rounds):
    from collections import Counter
    seq = _tool_module("bench_transfer").column_sequence(k, rounds)
    assert seq[0] == seq[-1] == 0  # the warm-up ends with column 0: the head's predecessor
    follows = Counter(zip(seq, seq[1:]))
    want = {(a, b) for a in range(k) for b in range(k) if a != b} or {(0, 0)}
    assert set(follows) == want and set(follows.values()) == {rounds}


@pytest.mark.unit
def test_bench_transfer_times_every_column_at_least_reps_times_after_each_predecessor():
    from collections import Counter
    calls: list[str] = []
    fns = {n: (lambda n=n: calls.append(n)) for n in ("a", "b", "c", "d")}
    rates = _tool_module("bench_transfer").run_interleaved(fns, reps=5, total=1)
    assert set(rates) == set(fns)
    warm, timed = calls[:4], calls[4:]
    assert warm[-1] == "a" and sorted(warm) == sorted(fns)
    # 5 reps over 3 predecessors: two rounds, 6 timings each, twice after each other column
    assert Counter(timed) == {n: 6 for n in fns}
    pairs = Counter(zip(calls[3:], calls[4:]))
    assert all(pairs[(x, y)] == 2 for x in fns for y in fns if x != y)


def test_bench_transfer_cpu_prints_every_column_as_json():
    r = tool("bench_transfer.py", "--device", "cpu", "--sizes", "16K", "--blocks", "64",
             "--reps", "2", "--budget", "0.05")
    (row,) = r["results"]
    for kind in ("store", "load"):
        assert {"kvshm", "contiguous", "loop"} <= set(row[kind])
        assert all(v > 0 for v in row[kind].values())
