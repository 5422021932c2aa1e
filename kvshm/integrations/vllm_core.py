"""The vLLM-independent core of kvshm's vLLM integration, testable without vLLM.

This module owns: parsing kvshm's keys of ``kv_connector_extra_config``; the kvshm ``Layout``
derived from vLLM's ``OffloadingConfig`` (what decides which engines may share a segment);
where each canonical KV tensor's pages lie inside a segment plane; the translation of a vLLM
GPU block spec plus segment block ids into kvshm ``TransferSpec``s; and the two adapters'
state — ``ManagerCore`` (per-request leases, pins and stores over a ``SharedManager``) and
``WorkerCore`` (transfer handlers over the canonical KV tensors and this rank's plane).

Inputs from vLLM are duck-typed (attributes only), so tests pass plain objects. It must never
import vLLM, must not import torch at module level (``WorkerCore`` receives tensors), and must
never report a load or store finished before every part of it has finished.
"""
from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..api import LookupResult, PrepareStoreOutput
from ..errors import InvalidArgumentError, KvshmError, TransferError
from ..layout import Layout
from ..transfer import TransferHandler, TransferSpec

logger = logging.getLogger(__name__)

POLICIES = ("lru", "arc")
RESET_GRACE_STEPS = 3  # scheduler steps after reset_cache before this engine's stale holds go


@dataclass(frozen=True)
class KvshmOptions:
    """kvshm's own keys in ``kv_connector_extra_config``."""
    segment: str                # kvshm_segment: shared by every instance that names it
    nbytes: int | None          # cpu_bytes_to_use: data bytes, used when creating the segment
    policy: str = "lru"         # eviction_policy, recorded in the segment at creation
    mode: int = 0o600           # kvshm_mode: permissions of a segment this instance creates
    model_id: str | None = None  # kvshm_model_id: overrides the model name in the layout

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> "KvshmOptions":
        seg = extra.get("kvshm_segment")
        if not isinstance(seg, str) or not seg:
            raise InvalidArgumentError(
                "kv_connector_extra_config needs 'kvshm_segment': the name of the shared "
                "segment every vLLM instance of this model should use (e.g. \"llama8b\")")
        nbytes = extra.get("cpu_bytes_to_use")
        if nbytes is not None:
            try:
                nbytes = int(nbytes)
            except (TypeError, ValueError):
                nbytes = -1
            if nbytes <= 0:
                raise InvalidArgumentError(
                    f"cpu_bytes_to_use must be a positive number of bytes, got "
                    f"{extra.get('cpu_bytes_to_use')!r}")
        policy = str(extra.get("eviction_policy", "lru")).lower()
        if policy not in POLICIES:
            raise InvalidArgumentError(
                f"eviction_policy must be one of {POLICIES}, got {extra.get('eviction_policy')!r}")
        mode = extra.get("kvshm_mode", 0o600)
        try:
            mode = int(mode, 8) if isinstance(mode, str) else int(mode)
        except (TypeError, ValueError):
            mode = -1
        if not 0 <= mode <= 0o777:
            raise InvalidArgumentError(f"kvshm_mode must be permission bits such as \"0660\", "
                                       f"got {extra.get('kvshm_mode')!r}")
        model_id = extra.get("kvshm_model_id")
        return cls(seg, nbytes, policy, mode, str(model_id) if model_id else None)


def _short(name: str, limit: int = 120) -> str:
    """Keep the layout description small: a long model path becomes its tail plus a hash."""
    if len(name) <= limit:
        return name
    return "..." + name[-(limit - 20):] + "#" + hashlib.sha256(name.encode()).hexdigest()[:12]


def layout_for(config: Any, model_id: str | None = None) -> Layout:
    """The kvshm layout of a vLLM ``OffloadingConfig``: one plane per worker rank.

    Deterministic in everything that decides what a block's bytes mean (model, cache dtype,
    KV cache layout, block and chunk sizes, bytes per block, parallel shape) and free of
    anything per-engine (engine id, rank, memory sizes), so every instance of the same model
    and configuration agrees and any other is refused by the segment's fingerprint.
    """
    if getattr(config, "canonical_layout", False):
        raise InvalidArgumentError(
            "kvshm does not support vLLM's 'canonical_layout'; remove it from "
            "kv_connector_extra_config")
    per_block = int(config.worker_kv_bytes_per_block)
    if per_block <= 0:
        raise InvalidArgumentError(
            f"vLLM reports {per_block} KV bytes per block for this worker; kvshm needs the "
            "KV cache to be allocated (is this a model without attention KV?)")
    bpc = int(config.cache.blocks_per_chunk)
    par = config.parallel
    groups = [(int(g.tokens_per_block), len(g.layer_names)) for g in config.groups]
    return Layout(
        page_bytes=(per_block * bpc,) * int(par.world_size),
        tokens_per_block=groups[0][0] * bpc if groups else int(config.cache.tokens_per_hash),
        model=_short(model_id or str(config.model.name)),
        extra={
            "engine": "vllm",
            "dtype": str(config.model.dtype),
            "kv_cache_layout": str(getattr(config, "kv_cache_layout", None)),
            "groups": groups,  # (tokens per block, layers) per KV cache group
            "blocks_per_chunk": bpc,
            "tokens_per_hash": int(config.cache.tokens_per_hash),
            "kv_bytes_per_block": per_block,
            "parallel": [int(par.tp_size), int(par.pp_size), int(par.pcp_size),
                         int(par.dcp_size)],
        })


def num_blocks_for(layout: Layout, nbytes: int) -> int:
    """Segment blocks (chunks) that fit ``nbytes`` of data, like vLLM's cpu_bytes_to_use."""
    n = nbytes // layout.block_bytes
    if n < 1:
        raise InvalidArgumentError(
            f"cpu_bytes_to_use={nbytes} cannot hold one chunk of {layout.block_bytes} bytes "
            f"(all ranks); give kvshm more memory")
    return n


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
              bpc: int) -> list[tuple[int, list[int], list[int]]]:
    """vLLM's GPU spec + segment chunk ids -> ``(group, device ids, segment ids)`` per group.

    Device blocks of all groups are concatenated in group order, and so are the chunk ids:
    group g uses ``cdiv(skip + size, bpc)`` chunks where ``skip = block_indices[g] % bpc``
    (its first device block is sub-block ``skip`` of its first chunk). kvshm's TransferSpec
    expresses that head skip; a group that ends inside a chunk is refused.
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
        if (skip + size) % bpc:
            raise TransferError(
                f"group {g}: {size} blocks from sub-block {skip} end inside a chunk of "
                f"{bpc}; kvshm's TransferSpec cannot skip the tail of the last chunk yet "
                "(use blocks_per_chunk=1)")
        out.append((g, dev[d:d + size], seg[s:s + n]))
        d, s = d + size, s + n
    if s != len(seg):
        raise InvalidArgumentError(
            f"{len(seg)} segment blocks given but the GPU spec needs {s}")
    return out


class ManagerCore:
    """Scheduler-side state over a kvshm manager, keyed by vLLM request id.

    ``lookup`` of a hit leases the block (it stays loadable although other engines evict);
    leases are per key in the client, so several requests that hit one key share it and it
    is released only when the last of them no longer needs it: at its ``prepare_load`` (the
    lease becomes a pin) or when it finishes. After ``reset`` the engine never completes the
    jobs it had in flight, so their pins and unfinished stores are dropped a few scheduler
    steps later, once the connector's flush of those jobs has surely run.
    """

    def __init__(self, mgr: Any):
        self.mgr = mgr
        self._lease_reqs: dict[bytes, set[str]] = {}
        self._req_leases: dict[str, set[bytes]] = {}
        self._loads: dict[str, list[list[bytes]]] = {}
        self._stores: dict[str, set[bytes]] = {}
        self._stale: list[list[Any]] = []  # [steps left, load key lists, store key lists]

    # --- loads ------------------------------------------------------------------------
    def lookup(self, key: bytes, req_id: str) -> LookupResult:
        status = self.mgr.key_status(key)  # lock-free read of the segment, no owner round trip
        if status is LookupResult.HIT:
            self._lease_reqs.setdefault(key, set()).add(req_id)
            self._req_leases.setdefault(req_id, set()).add(key)
        return status

    def prepare_load(self, keys: Sequence[bytes], req_id: str) -> list[int]:
        keys = list(keys)
        try:
            blocks = self.mgr.prepare_load(keys)  # this client's leases of keys become pins
        except KvshmError as e:
            raise KvshmError(
                f"kvshm lost blocks that lookup() reported as hits ({e}); vLLM 0.32 cannot "
                "recover from a failed load") from e
        self._loads.setdefault(req_id, []).append(keys)
        mine = self._req_leases.get(req_id, set())
        for k in keys:
            mine.discard(k)
            others = self._lease_reqs.pop(k, set()) - {req_id}
            if others:  # the lease went into our pin: take a new one for the others
                self._lease_reqs[k] = others
                self.mgr.key_status(k)
        self._release_leases(req_id)  # hits it did not load (trimmed) need no protection
        self.mgr.touch(keys)  # loaded keys become most recent (the 0.32 connector never touches)
        return blocks

    def complete_load(self, keys: Iterable[bytes], req_id: str) -> None:
        done = set(keys)
        jobs = self._loads.get(req_id, [])
        for i, job in enumerate(jobs):
            if set(job) == done:
                del jobs[i]
                if not jobs:
                    del self._loads[req_id]
                self.mgr.complete_load(job)
                return
        logger.warning("kvshm: complete_load of %d keys that request %s never prepared",
                       len(done), req_id)

    def _release_leases(self, req_id: str) -> None:
        drop = []
        for k in self._req_leases.pop(req_id, ()):
            reqs = self._lease_reqs.get(k)
            if reqs is not None:
                reqs.discard(req_id)
                if not reqs:
                    del self._lease_reqs[k]
                    drop.append(k)
        if drop:
            self.mgr.release(drop)

    # --- stores -----------------------------------------------------------------------
    def prepare_store(self, keys: Sequence[bytes], req_id: str) -> PrepareStoreOutput | None:
        out = self.mgr.prepare_store(list(keys))  # a round trip to the owner
        if out is not None and out.keys_to_store:
            self._stores.setdefault(req_id, set()).update(out.keys_to_store)
        return out

    def complete_store(self, keys: Iterable[bytes], req_id: str, success: bool = True) -> None:
        keys = list(keys)
        pending = self._stores.get(req_id, set())
        pending.difference_update(keys)
        if not pending:
            self._stores.pop(req_id, None)
        self.mgr.complete_store(keys, success)

    # --- life cycle -------------------------------------------------------------------
    def request_finished(self, req_id: str) -> None:
        """Drop its leases; its pins and stores wait for their completions (still due)."""
        self._release_leases(req_id)

    def reset(self) -> None:
        """Forget this engine's in-flight state; data other engines stored is untouched."""
        self.mgr.release(None)
        self._lease_reqs.clear()
        self._req_leases.clear()
        loads = [k for jobs in self._loads.values() for k in jobs]
        stores = [sorted(s) for s in self._stores.values() if s]
        if loads or stores:
            self._stale.append([RESET_GRACE_STEPS, loads, stores])
        self._loads.clear()
        self._stores.clear()

    def schedule_end(self) -> None:
        """One scheduler step passed: drop stale holds whose grace period is over."""
        if not self._stale:
            return
        for entry in self._stale:
            entry[0] -= 1
        due = [e for e in self._stale if e[0] <= 0]
        self._stale = [e for e in self._stale if e[0] > 0]
        for _, loads, stores in due:
            for keys in loads:
                self.mgr.complete_load(keys)
            for keys in stores:
                self.mgr.complete_store(keys, False)  # never published: their data may be partial

    def shutdown(self) -> None:
        self.mgr.shutdown()  # the owner frees our unfinished stores and our pins go with our slot


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

    def submit(self, job_id: int, kind: str, block_ids: Sequence[int],
               group_sizes: Sequence[int], block_indices: Sequence[int],
               segment_ids: Sequence[int]) -> bool:
        parts = split_job(block_ids, group_sizes, block_indices, segment_ids, self.bpc)
        if not parts:
            self._done.append((job_id, True, 0, 0.0))
            return True
        job = self._jobs[job_id] = _Job(set())
        for g, dev, seg in parts:
            handler = self._group_handler[g] if g < len(self._group_handler) else None
            if handler is None:
                raise InvalidArgumentError(f"job {job_id} moves blocks of KV cache group {g}, "
                                           "which has no KV tensors in this worker")
            part = self._next_part
            self._next_part += 1
            handler.transfer_async(part, TransferSpec(kind, dev, seg))  # type: ignore[arg-type]
            job.parts.add(part)
            self._part_job[part] = (job_id, handler)
        return True

    def get_finished(self) -> list[tuple[int, bool, int, float]]:
        """(vLLM job id, success, bytes, seconds) of every job whose parts all finished."""
        for handler in self._handlers.values():
            for r in handler.get_finished():
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
