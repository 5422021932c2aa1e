"""kvshm's vLLM integration against vLLM 0.33's offloading API, taken from the 0.33.0 wheel.

vLLM 0.33.0 cannot be installed next to the CPU build of 0.32 that CI runs, but its offloading
API is three pure-Python modules (``v1/kv_offload/{config,base}.py``, ``cpu/common.py``), and
its own CPU manager and cache policies five more (``load_033(manager=True)``). Run
as ``python vllm033.py WHEEL SEGMENT`` in the vLLM 0.32 venv, this script loads those modules
from the wheel in place of 0.32's, reports vLLM 0.33.0, imports the integration on top and
checks it: no abstract method left unimplemented, every call that 0.33's offloading connector
makes on the manager and the worker (read from the connector's source in the wheel) binds to
kvshm's signatures, and a manager and worker built from a 0.33 ``OffloadingConfig`` store,
load (an expedited load too) and handle a reset with ``on_reset_flushed``. Prints a JSON
summary; exits non-zero on a failed check.
"""
from __future__ import annotations

import ast
import importlib.util
import inspect
import json
import sys
import zipfile

PKG = "vllm/v1/kv_offload/"
CONNECTOR = "vllm/distributed/kv_transfer/kv_connector/v1/offloading/"
MODULES = [("vllm.v1.kv_offload.config", PKG + "config.py"),
           ("vllm.v1.kv_offload.base", PKG + "base.py"),
           ("vllm.v1.kv_offload.cpu.common", PKG + "cpu/common.py")]
# 0.33's own CPUOffloadingManager and its policies (pure Python too), for the differential test
MANAGER_MODULES = [(f"vllm.v1.kv_offload.cpu.{m}", f"{PKG}cpu/{m.replace('.', '/')}.py")
                   for m in ("policies.base", "policies.lru", "policies.arc",
                             "policies.factory", "manager")]


def load_033(wheel: str, manager: bool = False) -> dict[str, str]:
    """Put 0.33's offloading API modules (and with ``manager``, its ``CPUOffloadingManager``
    and cache policies) in place of 0.32's; the connector's sources."""
    import vllm

    with zipfile.ZipFile(wheel) as z:
        for name, path in MODULES + (MANAGER_MODULES if manager else []):
            spec = importlib.util.spec_from_loader(name, loader=None, origin=path)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            exec(compile(z.read(path), f"vllm-0.33.0/{path}", "exec"), mod.__dict__)
        sources = {f: z.read(CONNECTOR + f).decode() for f in ("scheduler.py", "worker.py")}
    vllm.__version__ = "0.33.0"
    return sources


def connector_calls(sources: dict[str, str]) -> list[tuple[str, str, int, list[str]]]:
    """(receiver, method, positional count, keywords) of every ``self.manager.X(...)`` and
    ``self.worker.X(...)`` call in the connector's scheduler and worker halves."""
    calls = []
    for src in sources.values():
        for node in ast.walk(ast.parse(src)):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            recv = node.func.value
            if (isinstance(recv, ast.Attribute) and recv.attr in ("manager", "worker")
                    and isinstance(recv.value, ast.Name) and recv.value.id == "self"):
                calls.append((recv.attr, node.func.attr, len(node.args),
                              sorted(k.arg for k in node.keywords if k.arg)))
    return calls


def main(wheel: str, segment: str) -> dict:
    sources = load_033(wheel, manager=True)
    import numpy as np
    import torch

    from kvshm.integrations.vllm import compat as V
    from kvshm.integrations.vllm import spec as S
    from vllm.v1.kv_offload import base as B, config as C

    out: dict = {"version": V.installed_version(),
                 "flush_signal": hasattr(B.OffloadingManager, "on_reset_flushed"),
                 "provisional_ranks": V.PROVISIONAL_RANKS,
                 "metadata_only_events": V.METADATA_ONLY_EVENTS,
                 "api_is_033": V.OffloadingManager is B.OffloadingManager
                 and hasattr(B.OffloadingManager, "config_info")}
    out["abstract_left"] = {c.__name__: sorted(c.__abstractmethods__) for c in
                            (S.KvshmOffloadingManager, S.KvshmOffloadingWorker,
                             S.KvshmOffloadingSpec)}
    classes = {"manager": S.KvshmOffloadingManager, "worker": S.KvshmOffloadingWorker}
    bad, seen = [], set()
    for recv, meth, npos, kws in connector_calls(sources):
        seen.add(f"{recv}.{meth}({'+'.join(['*'] * npos + kws)})")
        fn = getattr(classes[recv], meth, None)
        try:
            inspect.signature(fn).bind(None, *[None] * npos, **dict.fromkeys(kws))
        except (TypeError, ValueError) as e:
            bad.append(f"{recv}.{meth}: {e}")
    out["calls"], out["unbound_calls"] = sorted(seen), bad

    config = C.OffloadingConfig(
        groups=(C.OffloadingGroupConfig(32, ("l0", "l1"), 0, sliding_window_size_in_chunks=None),),
        worker_kv_bytes_per_block=2 * 256, enable_kv_cache_events=True,
        extra_config={"kvshm_segment": segment, "cpu_bytes_to_use": 64 * 512},
        engine_id="e033", model=C.OffloadingModelConfig("tiny", "float32", max_model_len=512),
        cache=C.OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
        parallel=C.OffloadingParallelConfig(0, 1, 1, 1, 1, 1, 0, 1, 0, False))
    spec = S.KvshmOffloadingSpec(config)
    mgr, ctx = spec.get_manager(), B.ReqContext(req_id="r1")
    keys = [bytes([i]) * 36 for i in range(4)]
    with mgr.lock:
        mgr.on_new_request(ctx)
        stored = mgr.prepare_store(keys, ctx)
        mgr.complete_store(stored.keys_to_store, ctx)
        hits = [mgr.lookup(k, ctx).name for k in keys]
        load_spec = mgr.prepare_load(keys[:2], ctx)
        mgr.on_schedule_end(B.ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
    out["hits"], out["config_info"] = hits, list(mgr.config_info())
    out["events"] = [(len(e.keys), e.removed, e.metadata_only) for e in mgr.take_events()]

    tensors = [torch.randint(-128, 127, (8, 256), dtype=torch.int8) for _ in range(2)]
    caches = B.CanonicalKVCaches(
        tensors=[B.CanonicalKVCacheTensor(t, 256) for t in tensors],
        group_data_refs=[[B.CanonicalKVCacheRef(0, 256), B.CanonicalKVCacheRef(1, 256)]])
    worker = spec.get_worker(caches)
    gpu = B.GPULoadStoreSpec([1, 2, 3, 4], group_sizes=[4], block_indices=[0])
    assert worker.submit_store(1, gpu, stored.store_spec)
    worker.wait({1})
    dst = B.GPULoadStoreSpec([6, 7], group_sizes=[2], block_indices=[0])
    assert worker.submit_load(2, load_spec, dst, expedited=True)
    worker.wait({2})
    out["finished"] = sorted((r.job_id, r.success) for r in worker.get_finished())
    out["loaded_ok"] = all(torch.equal(t[6], t[1]) and torch.equal(t[7], t[2]) for t in tensors)
    held = mgr.core.mgr.held_blocks()
    mgr.reset_cache()  # the load's pins wait for on_reset_flushed, not for steps
    for _ in range(5):
        mgr.on_schedule_end(B.ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))
    held_after_steps = mgr.core.mgr.held_blocks()
    mgr.on_reset_flushed()
    out["held"] = [held, held_after_steps, mgr.core.mgr.held_blocks()]
    worker.shutdown()
    mgr.shutdown()
    out["np"] = np.__version__
    return out


if __name__ == "__main__":
    res = main(sys.argv[1], sys.argv[2])
    print(json.dumps(res))
