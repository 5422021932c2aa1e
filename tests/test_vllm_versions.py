"""kvshm's vLLM integration across vLLM releases: 0.33's API (from its wheel, its reset-flush
signal included), its manager's eviction order, and expedited loads.

The 0.33 checks run ``tests/vllm_support/vllm033.py`` and ``recency_diff.py`` in the vLLM
venv's interpreter (see ``test_vllm.py``) on the vLLM 0.33.0 wheel: ``$KVSHM_VLLM033_WHEEL``, else
``.cache-vllm033/vllm-0.33.0-*.whl`` (``.ci/install_vllm.sh`` downloads it there). It skips,
naming what is missing, when either is absent once an install in progress is over
(``conftest.vllm033_wheel``). The other tests need neither.
"""
from __future__ import annotations

import json
import os
import subprocess
import threading
from pathlib import Path

import pytest
from lazy import torch  # imported at its first use, not when the suite is collected

from kvshm.errors import InvalidArgumentError
from kvshm.transfer.factory import make_handler
from kvshm.transfer.spec import TransferSpec

from test_vllm import VLLM_PY, needs_vllm, recency_diff

REPO = Path(__file__).resolve().parents[1]


@needs_vllm
def test_vllm_033_api_and_connector_calls_are_implemented(seg_name, vllm033_wheel):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(REPO)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    proc = subprocess.run([VLLM_PY, str(REPO / "tests/vllm_support/vllm033.py"), vllm033_wheel,
                           seg_name], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert res["version"] == "0.33.0" and res["api_is_033"] and res["flush_signal"]
    assert res["provisional_ranks"] and res["metadata_only_events"]
    assert res["abstract_left"] == {"KvshmOffloadingManager": [], "KvshmOffloadingWorker": [],
                                    "KvshmOffloadingSpec": []}
    assert res["unbound_calls"] == []
    assert "worker.submit_load(*+*+*+expedited)" in res["calls"]  # the 0.33 sync-load call
    assert "manager.on_reset_flushed()" in res["calls"] and len(res["calls"]) >= 15
    assert res["hits"] == ["HIT"] * 4 and res["events"] == [[4, False, False]]
    assert res["finished"] == [[1, True], [2, True]] and res["loaded_ok"]
    assert res["held"] == [2, 2, 0]  # a reset's pins go at on_reset_flushed, not after steps


@needs_vllm
def test_eviction_order_matches_vllm_033s_own_manager(vllm033_wheel):
    """The differential test of ``test_vllm.py`` against 0.33's ``CPUOffloadingManager`` and
    cache policies (from the wheel): LRU's provisional rank for running requests and the
    metadata-only removal of a failed store's keys included. Without the provisional ranks,
    26 of 60 LRU sequences differed."""
    recency_diff(vllm033_wheel)


@pytest.mark.unit
def test_an_expedited_load_runs_ahead_of_queued_loads_and_stores():
    dev = [torch.randint(-128, 127, (8, 64), dtype=torch.int8)]
    plane = torch.zeros(8, 64, dtype=torch.uint8)
    h = make_handler(dev, [plane])
    gate, real = threading.Event(), h._copy
    h._copy = lambda job: (job.job_id == 0 and gate.wait(30), real(job))[1]
    try:
        h.transfer_async(0, TransferSpec("load", [0], [0]))  # blocks the load lane
        h.transfer_async(1, TransferSpec("load", [1], [1]))
        h.transfer_async(2, TransferSpec("store", [2], [2]))
        h.transfer_async(3, TransferSpec("load", [3], [3], expedited=True))
        h.wait([3])
        done = [r.job_id for r in h.get_finished()]
        assert 3 in done and 0 not in done and 1 not in done
    finally:
        gate.set()
        h.wait([0, 1, 2])
        h.shutdown()
    with pytest.raises(InvalidArgumentError, match="only a load"):
        TransferSpec("store", [0], [0], expedited=True)
