"""tools/bench_ring.py, run briefly as docs/benchmarks.md runs it: it completes and prints
every figure that page quotes, as one JSON object with --json.

Seed 19 gives a key of the 90th stored batch the crc32 (the key index's tag) of a key of the
14th: the kind of key whose store from grants made every full run stop with "ring
prepare_store refused or partial" until prepare_store verified tags (tests/test_grants.py
pins that down without depending on when grants arrive).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def test_bench_ring_runs_and_prints_every_figure():
    pytest.importorskip("zmq", reason="the zmq baseline needs pyzmq: pip install -e '.[bench]'")
    p = subprocess.run([sys.executable, str(ROOT / "tools" / "bench_ring.py"), "--json",
                        "--seed", "19", "--iterations", "100", "--warmup", "100",
                        "--local-iterations", "1000", "--idle-seconds", "0.1"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout)  # the whole of stdout
    assert r["params"]["seed"] == 19 and r["params"]["iterations"] == 100
    for t in ("ring", "zmq", "pipe"):
        for op in ("events", "store"):
            assert r["round_trip"][f"{t}/{op}"]["p50_us"] > 0
    assert set(r["ratios"]) == {f"{b}/ring {op} {q}" for b in ("zmq", "pipe")
                                for op in ("events", "store") for q in ("p50", "p99")}
    for figure in ("targets", "client_lookup32", "client_key_status", "idle_cpu_percent"):
        assert r[figure], figure
