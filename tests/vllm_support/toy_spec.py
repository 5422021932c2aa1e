"""Throwaway out-of-tree OffloadingSpec used to validate the vLLM test harness.

``TorchCPUSpec`` = vLLM 0.32's own ``CPUOffloadingManager`` (scheduler side, via
``CPUOffloadingSpec.get_manager``) + ``TorchCopyWorker``, a tiny synchronous pure-torch
``OffloadingWorker`` that copies between the engine's CPU KV tensors and private host
tensors. vLLM's own ``CPUOffloadingWorker`` is CUDA/XPU-only, so on a CPU box this is the
minimal worker that makes the ``OffloadingConnector`` work end to end.

Load with ``kv_connector_extra_config={"spec_name": "TorchCPUSpec",
"spec_module_path": "tests.vllm_support.toy_spec", "cpu_bytes_to_use": N}``.
Optional extra_config keys (toy only):
  ``toy_log_path``      append one JSON line per event (init / store / load) to this file
  ``toy_corrupt_load``  zero the loaded pages (negative control: output must change)

The worker implements the same copy semantics as vLLM's ``SingleDirectionOffloadingHandler``
(direct layout): host row per chunk = ``blocks_per_chunk`` GPU pages back to back; for
group g the GPU blocks are logical blocks ``block_indices[g] .. +group_sizes[g]`` of the
request, so the first chunk skips ``block_indices[g] % blocks_per_chunk`` sub-pages; chunk
ids of all groups are concatenated in group order; one copy of ``ref.page_size_bytes``
bytes per (block, ref of the group).

Imports vllm/torch at module import: only import it inside the vLLM venv.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import torch

from vllm.v1.kv_offload.base import (
    BlockIDsLoadStoreSpec,
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.cpu.spec import CPUOffloadingSpec

# In-process counters (meaningful in single-process CI mode, where the test process
# hosts both the scheduler-side and the worker-side spec objects).
STATS: dict[str, int] = {
    "spec_inits": 0,
    "store_jobs": 0,
    "store_blocks": 0,
    "load_jobs": 0,
    "load_blocks": 0,
}


def _log(path: str | None, **rec: Any) -> None:
    if not path:
        return
    rec.setdefault("pid", os.getpid())
    rec.setdefault("t", time.time())
    with open(path, "a") as f:
        f.write(json.dumps(rec, default=str) + "\n")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class TorchCopyWorker(OffloadingWorker):
    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        num_chunks: int,
        log_path: str | None = None,
        corrupt_load: bool = False,
    ):
        self.k = blocks_per_chunk
        self.num_chunks = num_chunks
        self.refs = kv_caches.group_data_refs
        self.log_path = log_path
        self.corrupt_load = corrupt_load
        self.dev: list[torch.Tensor] = []  # (num_blocks, page) int8 views of engine KV
        self.host: list[torch.Tensor] = []  # (num_chunks * k, page) private host copies
        for t in kv_caches.tensors:
            page = t.page_size_bytes
            dev = t.tensor.view(torch.int8).view(-1, page)
            self.dev.append(dev)
            self.host.append(torch.zeros((num_chunks * self.k, page), dtype=torch.int8))
        self._finished: list[TransferResult] = []

    def _plan(self, gpu: GPULoadStoreSpec, cpu: LoadStoreSpec):
        """Yield (group_idx, gpu_block_ids, host_row_ids) per non-empty group."""
        assert isinstance(cpu, BlockIDsLoadStoreSpec)
        gpu_ids = gpu.block_ids.tolist()
        chunk_ids = cpu.block_ids.tolist()
        assert len(gpu.group_sizes) == len(self.refs) == len(gpu.block_indices)
        g_off = c_off = 0
        for g, (size, first) in enumerate(zip(gpu.group_sizes, gpu.block_indices)):
            if size == 0:
                continue
            skip = first % self.k
            n_chunks = _cdiv(skip + size, self.k)
            chunks = chunk_ids[c_off : c_off + n_chunks]
            rows = [c * self.k + j for c in chunks for j in range(self.k)]
            yield g, gpu_ids[g_off : g_off + size], rows[skip : skip + size]
            g_off += size
            c_off += n_chunks
        assert g_off == len(gpu_ids), (g_off, len(gpu_ids))
        assert c_off == len(chunk_ids), (c_off, len(chunk_ids))

    def _copy(self, job_id: int, gpu, cpu, store: bool) -> bool:
        t0 = time.perf_counter()
        nbytes = nblocks = 0
        for g, gpu_ids, rows in self._plan(gpu, cpu):
            gi = torch.tensor(gpu_ids, dtype=torch.long)
            hi = torch.tensor(rows, dtype=torch.long)
            for ref in self.refs[g]:
                n = ref.page_size_bytes
                dev, host = self.dev[ref.tensor_idx], self.host[ref.tensor_idx]
                if store:
                    host[hi, :n] = dev[gi, :n]
                else:
                    dev[gi, :n] = 0 if self.corrupt_load else host[hi, :n]
                nbytes += len(gpu_ids) * n
            nblocks += len(gpu_ids)
        dt = time.perf_counter() - t0
        kind = "store" if store else "load"
        STATS[f"{kind}_jobs"] += 1
        STATS[f"{kind}_blocks"] += nblocks
        _log(
            self.log_path,
            ev=kind,
            job=job_id,
            gpu_block_ids=gpu.block_ids.tolist(),
            group_sizes=list(gpu.group_sizes),
            block_indices=list(gpu.block_indices),
            cpu_spec=type(cpu).__name__,
            chunk_ids=cpu.block_ids.tolist(),
            nbytes=nbytes,
        )
        self._finished.append(TransferResult(job_id, True, nbytes, dt))
        return True

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._copy(job_id, src_spec, dst_spec, store=True)

    def submit_load(
        self, job_id: int, src_spec: LoadStoreSpec, dst_spec: GPULoadStoreSpec
    ) -> bool:
        return self._copy(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[TransferResult]:
        out, self._finished = self._finished, []
        return out

    def wait(self, job_ids: set[int]) -> None:
        return  # synchronous: everything submitted is already done

    def shutdown(self) -> None:
        self.dev.clear()
        self.host.clear()


class TorchCPUSpec(CPUOffloadingSpec):
    """CPUOffloadingSpec sizing + manager; pure-torch CPU worker."""

    def __init__(self, config: OffloadingConfig):
        super().__init__(config)
        STATS["spec_inits"] += 1
        self._log_path = self.extra_config.get("toy_log_path")
        _log(
            self._log_path,
            ev="spec_init",
            engine_id=config.engine_id,
            model=config.model,
            cache=config.cache,
            parallel=config.parallel,
            groups=config.groups,
            worker_kv_bytes_per_block=config.worker_kv_bytes_per_block,
            enable_kv_cache_events=config.enable_kv_cache_events,
            replicated_layout=config.replicated_layout,
            canonical_layout=config.canonical_layout,
            kv_cache_layout=config.kv_cache_layout,
            tokens_per_block=self.tokens_per_block,
            tokens_per_hash=self.tokens_per_hash,
            blocks_per_chunk=self.blocks_per_chunk,
            offload_prompt_only=self.offload_prompt_only,
            num_chunks=self.num_chunks,
            kv_bytes_per_chunk=self.kv_bytes_per_chunk,
        )

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if self._worker is None:
            _log(
                self._log_path,
                ev="worker_init",
                tensors=[
                    {
                        "shape": list(t.tensor.shape),
                        "dtype": str(t.tensor.dtype),
                        "stride": list(t.tensor.stride()),
                        "device": str(t.tensor.device),
                        "page_size_bytes": t.page_size_bytes,
                        "data_ptr": t.tensor.data_ptr(),
                    }
                    for t in kv_caches.tensors
                ],
                group_data_refs=[
                    [
                        {
                            "tensor_idx": r.tensor_idx,
                            "page_size_bytes": r.page_size_bytes,
                            "mapping": r.mapping,
                        }
                        for r in refs
                    ]
                    for refs in kv_caches.group_data_refs
                ],
            )
            self._worker = TorchCopyWorker(  # type: ignore[assignment]
                kv_caches,
                self.blocks_per_chunk,
                self.num_chunks,
                log_path=self._log_path,
                corrupt_load=bool(self.extra_config.get("toy_corrupt_load", False)),
            )
        return self._worker  # type: ignore[return-value]
