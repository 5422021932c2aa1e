"""The worker half of kvshm's vLLM integration, testable without vLLM.

This module owns where each canonical KV tensor's pages lie inside this rank's segment plane,
the translation of a vLLM GPU block spec plus segment block ids into kvshm ``TransferSpec``s
(one per KV cache group), and ``WorkerCore``: the transfer handlers over the tensors and the
plane, and the bookkeeping that reports a vLLM job once every part of it has finished.

A worker may be a process apart from its scheduler (tensor parallelism, vLLM's multiprocess
executors) and outlive it. With a writer registry (``writers=``), a store job names its
scheduler's kvshm client (slot, generation), and the worker copies only while registered
under it (``kvshm.shm.writers``): registered before the copy starts, a store of a generation
that is already dead is skipped (nobody will complete it), and the registration goes once
that generation is dead and none of its copies is in flight (looked at by ``get_finished``
at most every ``RETIRE_EVERY_S``). Meanwhile the owner keeps the dead scheduler's WRITING
blocks from being reused.

Inputs from vLLM are duck-typed. It must never import vLLM or import torch at module level
(it receives tensors), and never report a job before all of its bytes are in place.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from kvshm.errors import InvalidArgumentError
from kvshm.shm import writers as W
from kvshm.transfer.spec import TransferHandler, TransferSpec

logger = logging.getLogger(__name__)

# How often get_finished looks for dead schedulers to unregister from: a dead one's blocks
# stay out of reach this much longer, the live ones cost no syscall in most steps.
RETIRE_EVERY_S = 0.05


def plane_columns(tensor_pages: Sequence[int], bpc: int, plane_page: int) -> list[tuple[int, int]]:
    """(offset, width) of each canonical tensor inside a plane row.

    A row is one chunk of this rank: tensor 0's ``bpc`` pages, then tensor 1's, ... (vLLM's
    own CPU layout), so a chunk's pages of one tensor are contiguous and copies coalesce.
    """
    cols, at = [], 0
    for page in tensor_pages:
        cols.append((at, bpc * int(page)))
        at += bpc * int(page)
    if at > plane_page:
        raise InvalidArgumentError(
            f"the canonical KV tensors need {at} bytes per chunk but the layout gives this "
            f"rank {plane_page} (worker_kv_bytes_per_block x blocks_per_chunk); this KV "
            "cache layout is not supported by kvshm")
    return cols


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def split_job(block_ids: Sequence[int], group_sizes: Sequence[int],
              block_indices: Sequence[int], segment_ids: Sequence[int],
              bpc: int) -> list[tuple[int, list[int], list[int], int]]:
    """vLLM's GPU spec + segment chunk ids -> ``(group, device ids, segment ids, skip)``.

    Device blocks of all groups are concatenated in group order, and so are the chunk ids:
    group g uses ``cdiv(skip + size, bpc)`` chunks where ``skip = block_indices[g] % bpc``
    (its first device block is sub-block ``skip`` of its first chunk); it may also end
    inside its last chunk, which kvshm's explicit ``TransferSpec.skip`` expresses.
    """
    dev, seg = list(map(int, block_ids)), list(map(int, segment_ids))
    if len(group_sizes) != len(block_indices) or sum(group_sizes) != len(dev):
        raise InvalidArgumentError(
            f"GPU spec with {len(dev)} blocks, group_sizes {list(group_sizes)} and "
            f"block_indices {list(block_indices)} does not add up")
    out, d, s = [], 0, 0
    for g, (size, first) in enumerate(zip(group_sizes, block_indices)):
        if size == 0:
            continue
        skip = int(first) % bpc
        n = _cdiv(skip + size, bpc)
        out.append((g, dev[d:d + size], seg[s:s + n], skip))
        d, s = d + size, s + n
    if s != len(seg):
        raise InvalidArgumentError(
            f"{len(seg)} segment blocks given but the GPU spec needs {s}")
    return out


@dataclass
class _Job:
    parts: set[int]
    success: bool = True
    nbytes: int = 0
    seconds: float = 0.0


class WorkerCore:
    """Transfers of one worker rank between its canonical KV tensors and its segment plane.

    One kvshm handler per distinct set of tensors that a KV cache group uses (usually one
    handler), each pairing a tensor with its columns of the plane. A vLLM job becomes one
    handler job per group; it is reported when all of them have finished.
    """

    def __init__(self, tensors: Sequence[Any], group_tensors: Sequence[Sequence[int]],
                 plane: Any, bpc: int, *, make_handler: Callable[..., TransferHandler],
                 writers: W.Registrations | None = None, finish_loads: bool = False,
                 **handler_options: Any):
        cols = plane_columns([t.shape[1] for t in tensors], bpc, plane.shape[1])
        self._handlers: dict[tuple[int, ...], TransferHandler] = {}
        self._group_handler: list[TransferHandler | None] = []
        for idxs in group_tensors:
            key = tuple(sorted(set(idxs)))
            if key and key not in self._handlers:
                self._handlers[key] = make_handler(
                    [tensors[i] for i in key],
                    [plane[:, cols[i][0]:cols[i][0] + cols[i][1]] for i in key],
                    block_size_factor=bpc, **handler_options)
            self._group_handler.append(self._handlers.get(key))
        self.bpc = bpc
        self._next_part = 0
        self._part_job: dict[int, tuple[int, TransferHandler]] = {}
        self._jobs: dict[int, _Job] = {}
        self._done: list[tuple[int, bool, int, float]] = []
        self._writers = writers
        # CPU KV caches: a load's request cannot run before it, and a copy thread racing the
        # engine's own threads for the cores gains nothing: get_finished waits for loads.
        self._finish_loads = finish_loads
        self._loading: set[int] = set()  # parts of unreported loads
        self._writing: dict[int, tuple[int, int]] = {}  # store job -> the writer it copies for
        self._next_retire = 0.0

    def submit(self, job_id: int, kind: str, block_ids: Sequence[int],
               group_sizes: Sequence[int], block_indices: Sequence[int],
               segment_ids: Sequence[int], expedited: bool = False,
               writer: tuple[int, int] | None = None) -> bool:
        """Queue vLLM job ``job_id``; an ``expedited`` load runs ahead of queued work.
        A store names ``writer``, its scheduler's (client slot, generation)."""
        parts = split_job(block_ids, group_sizes, block_indices, segment_ids, self.bpc)
        if parts and kind == "store" and writer is not None and writer[0] >= 0 \
                and self._writers is not None and not self._admit(job_id, writer):
            parts = []  # its scheduler is gone: its blocks may belong to someone else now
        if not parts:
            self._done.append((job_id, True, 0, 0.0))
            return True
        job = self._jobs[job_id] = _Job(set())
        for g, dev, seg, skip in parts:
            handler = self._group_handler[g] if g < len(self._group_handler) else None
            if handler is None:
                raise InvalidArgumentError(f"job {job_id} moves blocks of KV cache group {g}, "
                                           "which has no KV tensors in this worker")
            part = self._next_part
            self._next_part += 1
            handler.transfer_async(part, TransferSpec(kind, dev, seg, skip, expedited))  # type: ignore[arg-type]
            job.parts.add(part)
            self._part_job[part] = (job_id, handler)
            if kind == "load":
                self._loading.add(part)
        return True

    def _admit(self, job_id: int, writer: tuple[int, int]) -> bool:
        """Register under ``writer`` and say whether the store may copy (False: skip it)."""
        assert self._writers is not None
        if not self._writers.register(*writer):  # (logged) only if someone holds its copier
            # lock exclusively, which keeps the owner from reusing the blocks while it does:
            # vLLM may not fail a job, so it copies
            logger.error("kvshm: store job %d copies unregistered", job_id)
        elif not W.generation_alive(self._writers.seg, *writer):
            logger.warning("kvshm: store job %d skipped: its scheduler (client slot %d "
                           "generation %d) is gone", job_id, *writer)
            if writer not in self._writing.values():  # no copy of ours for it in flight
                self._writers.unregister(*writer)
            return False
        self._writing[job_id] = writer
        return True

    def get_finished(self) -> list[tuple[int, bool, int, float]]:
        """(vLLM job id, success, bytes, seconds) of every job whose parts all finished
        (with ``finish_loads``, every load submitted so far among them)."""
        if self._finish_loads and self._loading:
            self.wait({self._part_job[p][0] for p in self._loading if p in self._part_job})
        for handler in self._handlers.values():
            for r in handler.get_finished():
                self._loading.discard(r.job_id)
                job_id, _ = self._part_job.pop(r.job_id)
                job = self._jobs[job_id]
                job.parts.discard(r.job_id)
                job.success &= r.success
                job.nbytes += r.nbytes
                job.seconds += r.seconds
                if not r.success:
                    logger.error("kvshm: %s part of job %d failed", r.kind, job_id)
                if not job.parts:
                    del self._jobs[job_id]
                    self._done.append((job_id, job.success, job.nbytes, job.seconds))
        out, self._done = self._done, []
        if self._writers is not None:
            for job_id, *_ in out:
                self._writing.pop(job_id, None)
            now = time.monotonic()  # (vLLM asks every step: a liveness check costs a syscall)
            if now >= self._next_retire:
                self._next_retire = now + RETIRE_EVERY_S
                self._writers.retire(set(self._writing.values()))
        return out

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until those jobs' bytes are in place; unknown or finished ids are ignored."""
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            for part in list(job.parts) if job else ():
                entry = self._part_job.get(part)
                if entry is not None:
                    entry[1].wait([part])

    def shutdown(self) -> None:
        for handler in self._handlers.values():  # drain everything before any pin goes away
            handler.wait([p for p, (_, h) in self._part_job.items() if h is handler])
        for handler in self._handlers.values():
            handler.shutdown()
        self._handlers.clear()
        if self._writers is not None:  # nothing copies any more
            self._writers.close()
