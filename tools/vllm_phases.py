"""Per-phase time of an offloading spec inside a single-process vLLM engine (bench_vllm).

``instrument()`` wraps, at class level, the scheduler-side manager's and the worker's methods
of kvshm's spec and of the comparator (vLLM's CPUOffloadingManager with the toy torch copy
worker) with wall-clock timers, and counts what the workers report (bytes, copy seconds).
In single-process mode the scheduler and the worker run in the engine's one thread, so
``request wall time - manager time - worker time`` is what the engine itself spent (model,
vLLM's own bookkeeping), which is where interference from other threads and processes shows.
"""
from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

MANAGER_CALLS = ("lookup", "prepare_load", "touch", "complete_load", "prepare_store",
                 "complete_store", "on_new_request", "on_request_finished", "on_schedule_end",
                 "take_events", "get_stats")
WORKER_CALLS = ("submit_load", "submit_store", "get_finished", "wait")

NS: dict[str, int] = defaultdict(int)  # phase -> nanoseconds, cumulative
CALLS: dict[str, int] = defaultdict(int)
_done: set[type] = set()


def _timed(fn: Any, key: str) -> Any:
    def timed(*args: Any, **kwargs: Any) -> Any:
        t = time.perf_counter_ns()
        try:
            out = fn(*args, **kwargs)
        finally:
            NS[key] += time.perf_counter_ns() - t
            CALLS[key] += 1
        if key.endswith("get_finished"):
            for r in out:
                NS["copy_reported"] += int(1e9 * (r.transfer_time or 0.0))
                CALLS["jobs_reported"] += 1
        return out
    return timed


def _wrap(cls: type, names: tuple[str, ...], side: str) -> None:
    if cls in _done:
        return
    _done.add(cls)
    for name in names:
        fn = cls.__dict__.get(name)
        if fn is None:  # inherited from vLLM's base class: time it there, under this class
            fn = getattr(cls, name, None)
        if fn is not None:
            setattr(cls, name, _timed(fn, f"{side}.{name}"))


def instrument() -> None:
    """Wrap kvshm's and the comparator's manager and worker (once per process)."""
    from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager

    from kvshm.integrations.vllm.spec import KvshmOffloadingManager, KvshmOffloadingWorker
    from tests.vllm_support.toy_spec import TorchCopyWorker
    _wrap(KvshmOffloadingManager, MANAGER_CALLS, "manager")
    _wrap(CPUOffloadingManager, MANAGER_CALLS, "manager")
    _wrap(KvshmOffloadingWorker, WORKER_CALLS, "worker")
    _wrap(TorchCopyWorker, WORKER_CALLS, "worker")


def snapshot() -> tuple[dict[str, int], dict[str, int]]:
    return dict(NS), dict(CALLS)


def per_request(before: tuple[dict[str, int], dict[str, int]], requests: int,
                wall_s: float) -> dict[str, Any]:
    """Milliseconds per request spent in each phase since ``before``: every timed call, the
    manager and worker totals, the copies the workers reported (on their own threads for
    kvshm: they overlap the engine), and the engine's own rest of the wall time."""
    ns0, calls0 = before
    ns = {k: v - ns0.get(k, 0) for k, v in NS.items() if v != ns0.get(k, 0)}
    calls = {k: v - calls0.get(k, 0) for k, v in CALLS.items() if v != calls0.get(k, 0)}
    ms = {k: round(v / 1e6 / requests, 4) for k, v in sorted(ns.items())}
    manager = sum(v for k, v in ns.items() if k.startswith("manager.")) / 1e6 / requests
    worker = sum(v for k, v in ns.items() if k.startswith("worker.")) / 1e6 / requests
    return {"calls_per_request": {k: round(v / requests, 2) for k, v in sorted(calls.items())},
            "ms_per_request": ms, "manager_ms": round(manager, 4),
            "worker_ms": round(worker, 4),
            "engine_rest_ms": round(1e3 * wall_s / requests - manager - worker, 4)}


@contextlib.contextmanager
def copy_threads(on: bool) -> Iterator[None]:
    """While on: kvshm's CPU transfer handlers built meanwhile copy on their lane threads,
    never inline (how kvshm copied for CPU engines before; for comparisons)."""
    if not on:
        yield
        return
    from kvshm.transfer.cpu_copy import CpuTransferHandler
    init = CpuTransferHandler.__init__

    def threaded(self: Any, *args: Any, **kwargs: Any) -> None:
        kwargs["inline"] = ()
        init(self, *args, **kwargs)
    CpuTransferHandler.__init__ = threaded  # type: ignore[method-assign]
    try:
        yield
    finally:
        CpuTransferHandler.__init__ = init  # type: ignore[method-assign]


if __name__ == "__main__":  # a library: say what it is and who runs it
    import os.path
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from library_help import explain
    explain("vllm_phases.py", __doc__, instead="tools/bench_vllm.py")
