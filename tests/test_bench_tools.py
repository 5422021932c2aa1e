"""The owner and cache benchmarks of docs/benchmarks.md, run briefly: each completes and prints
the figures that page quotes, as one JSON object with --json (the vLLM baseline is left to
the runs the page records; here the in-process LocalManager stands in for it)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


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
