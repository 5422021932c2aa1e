"""``KvshmOffloadingSpec`` calls that fail, in a process of their own (the vLLM venv's).

Run as ``python spec_failures.py``: it imports torch, vLLM and kvshm's spec once (most of a
case's time), then reads lines ``CASE SEGMENT`` from stdin and runs each case in a child
forked for it (so that each starts from a process no other case touched). The child builds a
spec of segment ``SEGMENT`` from a vLLM ``OffloadingConfig`` (tiny: 2 KV tensors of 256-byte
pages, 64 blocks), makes one call fail, and prints one JSON line, ``{"pid": ..., "raised":
"ErrorType: message"}``. Then it waits for a line on stdin, so that the test can look at the
child from outside while the failed call's leftovers (descriptors, mappings, a client slot)
would still be alive; with CASE ``worker_again`` it then asks the same spec for its worker
again, with KV tensors that fit, and prints ``{"built": true}`` once that worker has copied a
block into the segment and back. Once the child is gone (it ended, or the test killed it),
the parent prints ``{"exit": STATUS}`` (``os.waitstatus_to_exitcode``) and reads the next line.
Both read stdin a byte at a time: neither may buffer a line meant for the other.

The cases:

* ``worker_core``: ``get_worker`` with KV tensors wider than the layout's pages
  (``WorkerCore`` refuses them, after the segment and the writer registrations were opened);
* ``worker_plane``: ``get_worker`` of a rank the segment has no plane for (rank 1 of 1);
* ``worker_again``: ``worker_core``, then ``get_worker`` again;
* ``manager``: ``get_manager`` (``kvshm_tier``) whose ``TieredManager`` raises, after
  ``connect`` returned a live client of the owner it started.
"""
from __future__ import annotations

import json
import os
import sys
import traceback
from typing import Any

PAGE = 256  # bytes of one block of one KV tensor


def main(case: str, segment: str) -> None:
    import torch
    from vllm.v1.kv_offload import base as B, config as C

    from kvshm.integrations.vllm import spec as S

    rank = 1 if case == "worker_plane" else 0
    config = C.OffloadingConfig(
        groups=(C.OffloadingGroupConfig(32, ("l0", "l1"), 0),),
        worker_kv_bytes_per_block=2 * PAGE, enable_kv_cache_events=False,
        extra_config={"kvshm_segment": segment, "cpu_bytes_to_use": 64 * 2 * PAGE,
                      "kvshm_tier": case == "manager"},
        engine_id="e", model=C.OffloadingModelConfig("tiny", "float32"),
        cache=C.OffloadingCacheConfig(tokens_per_hash=32, blocks_per_chunk=1),
        parallel=C.OffloadingParallelConfig(rank, 1, 1, 1, 1, 1, 0, 1, 0, False))
    spec = S.KvshmOffloadingSpec(config)

    def caches(page: int) -> Any:
        tensors = [torch.randint(-128, 127, (8, page), dtype=torch.int8) for _ in range(2)]
        return B.CanonicalKVCaches(
            tensors=[B.CanonicalKVCacheTensor(t, page) for t in tensors],
            group_data_refs=[[B.CanonicalKVCacheRef(0, page), B.CanonicalKVCacheRef(1, page)]])

    def broken() -> None:
        raise RuntimeError("injected: building the tiered manager failed")

    try:
        if case == "manager":
            S.TieredManager = lambda shared: broken()  # type: ignore[assignment,misc]
            spec.get_manager()
        else:
            spec.get_worker(caches(2 * PAGE if case != "worker_plane" else PAGE))
    except Exception as e:
        raised = f"{type(e).__name__}: {e}"
        del e  # (its traceback holds the failed call's frame)
    else:
        raise SystemExit(f"{case}: nothing was raised")
    print(json.dumps({"pid": os.getpid(), "raised": raised}), flush=True)
    _line()  # the test looks at this process meanwhile
    if case == "worker_again":
        kv = caches(PAGE)
        worker = spec.get_worker(kv)
        src = B.GPULoadStoreSpec([1], group_sizes=[1], block_indices=[0])
        seg = S.KvshmLoadStoreSpec([5])
        assert worker.submit_store(1, src, seg)
        worker.wait({1})
        dst = B.GPULoadStoreSpec([2], group_sizes=[1], block_indices=[0])
        assert worker.submit_load(2, seg, dst)
        worker.wait({2})
        done = sorted((r.job_id, r.success) for r in worker.get_finished())
        assert done == [(1, True), (2, True)], done
        assert all(torch.equal(t.tensor[2], t.tensor[1]) for t in kv.tensors)
        worker.shutdown()
        print(json.dumps({"built": True}), flush=True)


def _line() -> str:
    """One line of stdin, read without reading ahead ("" at its end)."""
    out = b""
    while (c := os.read(0, 1)) and c != b"\n":
        out += c
    return out.decode() if c or out else ""


def serve() -> None:
    import torch  # noqa: F401  (what every case imports: once, before any fork)
    from vllm.v1.kv_offload import base, config  # noqa: F401

    from kvshm.integrations.vllm import spec  # noqa: F401
    while line := _line():
        case, segment = line.split()
        sys.stdout.flush()
        if (pid := os.fork()) == 0:
            code = 1
            try:
                main(case, segment)
                code = 0
            except BaseException:  # (SystemExit too: its message is the reason)
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)  # not the parent's exit handlers
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"exit": os.waitstatus_to_exitcode(status)}), flush=True)


if __name__ == "__main__":
    serve()
