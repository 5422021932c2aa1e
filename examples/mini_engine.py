"""A miniature LLM engine that keeps its KV offload tier in kvshm, using only kvshm's public API.

What it has, like a real engine: a device KV pool (CPU memory by default, CUDA tensors with
``device="cuda"``) with its own prefix cache and LRU; a scheduler loop with a token budget,
chunked prefill, decode and preemption; the kvshm scheduler connector (lookups, loads, stores,
flushes); and a worker that moves blocks — in a separate process that gets its jobs over a
kvshm job channel (default), or in-process (``worker="inline"``).

The "model" (``mini_model``) makes the KV of a token a function of its id and position, so
every block loaded from kvshm is verified byte for byte; ``stats["blocks_mismatched"]`` must
stay 0. numpy only in the scheduler process on CPU; the worker process imports torch.
"""
from __future__ import annotations

import collections
import ctypes
import mmap
import multiprocessing as mp
import os
import signal
from dataclasses import dataclass, field
from multiprocessing.reduction import DupFd
from typing import Any

import numpy as np

import kvshm
from kvshm.engine.channel import SchedulerChannel, WorkerChannel
from kvshm.engine.connector import SchedulerConnector
from kvshm.engine.hashing import block_hashes
from kvshm.engine.worker import WorkerConnector

from mini_model import kv, next_token
from mini_pool import BlockPool
from mini_sched import EngineLoop


@dataclass
class EngineConfig:
    cache: str                   # kvshm segment name (created by whoever runs the engines)
    name: str = "engine"
    block_tokens: int = 16       # tokens per device block
    block_size_factor: int = 1   # device blocks per kvshm block
    token_bytes: int = 1024      # KV bytes per token per plane
    planes: int = 2              # K and V
    device_blocks: int = 256
    max_running: int = 4
    step_tokens: int = 512       # token budget per step (chunked prefill)
    worker: str = "process"      # "process": over a kvshm job channel; "inline"
    device: str = "cpu"          # "cpu" or "cuda"


def layout_for(cfg: EngineConfig) -> "kvshm.Layout":
    """The kvshm layout every engine sharing a segment must agree on."""
    page = cfg.block_tokens * cfg.token_bytes * cfg.block_size_factor
    return kvshm.Layout((page,) * cfg.planes, cfg.block_tokens * cfg.block_size_factor,
                        "mini-engine", {"token_bytes": cfg.token_bytes})


class DeviceKV:
    """One ``(blocks, page_bytes)`` uint8 array per plane; shareable with the worker process."""

    def __init__(self, cfg: EngineConfig):
        self.planes, self.blocks = cfg.planes, cfg.device_blocks
        self.page = cfg.block_tokens * cfg.token_bytes
        self.cuda = cfg.device == "cuda"
        if self.cuda:
            import torch
            self.tensors = [torch.zeros(self.blocks, self.page, dtype=torch.uint8,
                                        device="cuda") for _ in range(self.planes)]
            return
        # Anonymous shared memory (memfd): nothing to clean up in /dev/shm, gone with us.
        self.fd = os.memfd_create(f"{cfg.name}-device-kv")
        os.ftruncate(self.fd, self.planes * self.blocks * self.page)
        self._mm = mmap.mmap(self.fd, self.planes * self.blocks * self.page)
        self.arrays = _views(self._mm, self.planes, self.blocks, self.page)

    def write(self, block: int, plane: int, offset: int, data: np.ndarray) -> None:
        if self.cuda:
            import torch
            self.tensors[plane][block, offset:offset + data.size].copy_(
                torch.from_numpy(np.ascontiguousarray(data).ravel()))
        else:
            self.arrays[plane][block, offset:offset + data.size] = data.ravel()

    def read(self, block: int, plane: int) -> np.ndarray:
        return self.tensors[plane][block].cpu().numpy() if self.cuda else \
            self.arrays[plane][block]

    def handle(self) -> Any:
        """What the worker process needs to map the same memory."""
        if self.cuda:
            return ("cuda", self.tensors)
        return ("cpu", DupFd(self.fd), self.planes, self.blocks, self.page)

    def torch_tensors(self) -> list:
        import torch
        return self.tensors if self.cuda else [torch.from_numpy(a) for a in self.arrays]

    def release(self) -> None:
        """The engine's last CUDA act, once its worker has exited: free the device KV and
        reset this process's CUDA context. A process that shared CUDA memory with another
        otherwise leaves the driver's ``cuda.shm.*`` file in /dev/shm when it exits."""
        if self.cuda:
            import ctypes

            import torch
            torch.cuda.synchronize()
            self.tensors = []
            torch.cuda.empty_cache()
            ctypes.CDLL("libcuda.so.1").cuDevicePrimaryCtxReset(torch.cuda.current_device())


def _views(mm: mmap.mmap, planes: int, blocks: int, page: int) -> list[np.ndarray]:
    return [np.frombuffer(mm, np.uint8, blocks * page, p * blocks * page).reshape(blocks, page)
            for p in range(planes)]


def make_copier(tensors: list, segment: Any, factor: int) -> kvshm.TransferHandler:
    """The transfer handler between this process's KV tensors and the segment's planes.

    On CUDA it first pins the segment's data region (``cudaHostRegister``), as kvshm's vLLM
    integration does: on a background thread, so the engine starts at once, and one process
    at a time (the segment's pin turn). Unpinned, copies run from pageable memory: slower, and
    they block the calling thread. The handler unregisters the pin when it shuts down."""
    pin = None
    if tensors[0].device.type == "cuda":
        from kvshm.transfer.pinning import pin_in_background
        addr, nbytes = segment.data_address()
        pin = pin_in_background(addr, nbytes, turn=segment.pin_turn)
    try:
        return kvshm.make_handler(tensors, segment.torch_planes(), block_size_factor=factor,
                                  **({"pin": pin} if pin is not None else {}))
    except BaseException:
        if pin is not None:  # no handler owns it yet
            pin.unregister()
        raise


def worker_main(cfg: EngineConfig, address: tuple, box: list, parent: int) -> None:
    """The engine's worker process: serve the job channel with a transfer handler.

    ``box`` holds the handle of the engine's device memory; the worker takes it out, so that
    its own locals are the only references to CUDA tensors the engine shared (the Process
    object keeps its arguments until the interpreter ends)."""
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the engine
    handle = box.pop()
    if os.getppid() != parent:
        return
    if handle[0] == "cuda":
        tensors = handle[1]
    else:
        import torch
        _, dupfd, planes, blocks, page = handle
        mm = mmap.mmap(dupfd.detach(), planes * blocks * page)
        tensors = [torch.from_numpy(a) for a in _views(mm, planes, blocks, page)]
    chan = WorkerChannel(*address)
    handler = make_copier(tensors, chan.segment, cfg.block_size_factor)
    try:
        WorkerConnector(handler).serve(chan)
    finally:
        handler.shutdown()
        chan.close()
        cuda = handle[0] == "cuda"
        # Release the engine's CUDA tensors now, while torch can: a received tensor freed
        # only at interpreter exit (or never) leaves its IPC reference count up, and the
        # engine, exiting after us, warns "Producer process has been terminated before all
        # shared CUDA tensors released".
        del handler, tensors, handle
        if cuda:
            import gc
            import torch
            gc.collect()  # views of them in reference cycles too
            torch.cuda.synchronize()


class _Inline:
    """Worker in this process: jobs run on the handler's threads."""

    def __init__(self, dev: DeviceKV, mgr: "kvshm.SharedManager", factor: int):
        self.w = WorkerConnector(make_copier(dev.torch_tensors(), mgr.segment, factor))

    def send(self, jobs: list) -> None:
        self.w.submit(jobs)

    def wait(self, job_ids) -> list:
        self.w.flush(job_ids)
        return self.w.results()

    def poll(self) -> list:
        return self.w.results()

    def close(self) -> None:
        self.w.handler.shutdown()


class _Process:
    """Worker in its own process, jobs over a kvshm job channel."""

    def __init__(self, cfg: EngineConfig, dev: DeviceKV):
        self.chan = SchedulerChannel(cfg.cache)
        ctx = mp.get_context("spawn")
        self.proc = ctx.Process(target=worker_main, name=f"{cfg.name}-worker", daemon=True,
                                args=(cfg, self.chan.address, [dev.handle()], os.getpid()))
        self.proc.start()
        self.chan.wait_worker(timeout=120, starting=self.proc.is_alive)

    def send(self, jobs: list) -> None:
        self.chan.send(jobs)

    def wait(self, job_ids) -> list:
        ids = list(job_ids)
        self.chan.flush(ids)  # the worker finishes them before any later job
        return self.chan.wait(ids)

    def poll(self) -> list:
        return self.chan.poll()

    def close(self) -> None:
        self.chan.stop()
        self.proc.join(30)
        if self.proc.is_alive():
            self.proc.kill()
            self.proc.join()
        self.chan.close()


@dataclass
class Request:
    req_id: str
    tokens: list[int]            # prompt, then generated tokens appended
    max_new_tokens: int
    block_tokens: int
    hashes: list[bytes] = field(default_factory=list)  # kept by the connector by reference
    blocks: list[int] = field(default_factory=list)
    num_computed: int = 0
    scheduled: int = 0
    output: list[int] = field(default_factory=list)
    prompt_len: int = 0
    admitted: bool = False
    first_load: bool = False     # the pending load is the one of the first admission
    load: tuple[int, int, int] = (0, 0, 0)  # device blocks [first, end) loading, local tokens

    def __post_init__(self) -> None:
        self.prompt_len = len(self.tokens)
        self.hashes = block_hashes(self.tokens, self.block_tokens)

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self.output.append(token)
        bt = self.block_tokens
        if len(self.tokens) % bt == 0:  # one more full block: extend the hash chain
            self.hashes += block_hashes(self.tokens[-bt:], bt,
                                        parent=self.hashes[-1] if self.hashes else None)


STAT_KEYS = ("requests", "prompt_tokens", "device_hit_tokens", "kvshm_hit_tokens",
             "kvshm_blocks_own", "kvshm_blocks_other", "recomputed_tokens", "bytes_loaded",
             "bytes_stored", "blocks_stored", "blocks_verified", "blocks_mismatched",
             "loads_failed", "stores_failed", "preemptions", "jobs_flushed", "steps")


class Engine(EngineLoop):
    """One engine instance: connect to the shared cache, start the worker, serve requests."""

    def __init__(self, cfg: EngineConfig, manager: "kvshm.SharedManager | None" = None):
        self.cfg = cfg
        self._own_mgr = manager is None
        self.mgr = manager if manager is not None else kvshm.connect(cfg.cache, layout_for(cfg))
        self.conn = SchedulerConnector(self.mgr, device_block_tokens=cfg.block_tokens,
                                       block_size_factor=cfg.block_size_factor)
        self.dev = DeviceKV(cfg)
        self.pool = BlockPool(cfg.device_blocks)
        self.worker = _Inline(self.dev, self.mgr, cfg.block_size_factor) \
            if cfg.worker == "inline" else _Process(cfg, self.dev)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}
        self.deferred: dict[str, Request] = {}  # finished, blocks still read by stores
        self.finished: dict[str, list[int]] = {}
        self.jobs: dict[int, str] = {}  # outstanding job -> kind
        self.own_keys: set[bytes] = set()  # keys this engine stored
        self.stats = dict.fromkeys(STAT_KEYS, 0)

    def add_request(self, req_id: str, prompt: list[int], max_new_tokens: int) -> None:
        need = -(-(len(prompt) + max_new_tokens) // self.cfg.block_tokens)
        if need > self.cfg.device_blocks:
            raise ValueError(f"request {req_id!r} needs {need} device blocks; the pool has "
                             f"{self.cfg.device_blocks}: give the engine more device_blocks")
        self.waiting.append(Request(req_id, list(prompt), max_new_tokens, self.cfg.block_tokens))
        self.stats["requests"] += 1
        self.stats["prompt_tokens"] += len(prompt)

    def write_kv(self, r: Request, start: int, n: int) -> None:
        """The forward pass: KV of tokens ``start .. start+n`` into the request's blocks."""
        bt, tb = self.cfg.block_tokens, self.cfg.token_bytes
        for p in range(self.cfg.planes):
            data = kv(r.tokens[start:start + n], start, p, tb)
            pos = start
            while pos < start + n:
                m = min(bt - pos % bt, start + n - pos)
                self.dev.write(r.blocks[pos // bt], p, (pos % bt) * tb,
                               data[pos - start:pos - start + m])
                pos += m
        if self.dev.cuda:
            import torch
            torch.cuda.synchronize()  # the worker's stores must see this KV (other process)

    def verify(self, r: Request, first: int, end: int) -> bool:
        """Loaded device blocks ``[first, end)`` hold exactly the model's KV of their tokens."""
        bt, tb = self.cfg.block_tokens, self.cfg.token_bytes
        return all(np.array_equal(self.dev.read(r.blocks[i], p),
                                  kv(r.tokens[i * bt:(i + 1) * bt], i * bt, p, tb).ravel())
                   for i in range(first, end) for p in range(self.cfg.planes))

    def close(self) -> dict[str, int]:
        """Finish outstanding jobs, stop the worker, leave the cache. Returns the stats."""
        self.drain()
        self.worker.close()  # first: it releases our CUDA tensors before we exit
        if self._own_mgr:
            self.mgr.shutdown()
        self.dev.release()
        return dict(self.stats)

    @staticmethod
    def next_token(r: Request) -> int:
        return next_token(r.tokens[-1], len(r.tokens))


if __name__ == "__main__":  # a library: say what it is and what to run instead
    from library_help import explain
    explain("mini_engine.py", __doc__)
