"""Scheduler-side connector: turns an engine's requests into kvshm loads and stores.

This module owns the per-request and per-job bookkeeping between an engine's scheduler and a
kvshm manager, with vLLM's ``OffloadingConnectorScheduler`` semantics (0.14 flow, 0.33 job ids):

* ``get_num_new_matched_tokens``: touch the request's offloaded blocks, look up the ones beyond
  the locally (device-)cached prefix; the answer is whole offloaded blocks only. A SharedManager
  leases the hits, so they cannot be evicted by other engines before ``prepare_load``.
* ``update_state_after_alloc``: pin the hits (``prepare_load``) and queue one load job into the
  request's device blocks (skipping device blocks the local cache already holds).
* ``build_jobs``: store jobs for offloaded blocks that are full after this step, and ``flush``:
  the pending jobs that read or write device blocks the engine is about to reuse (preemption).
  The engine must submit a step's stores only after that step's KV is written (vLLM defers
  them to the next step for the same reason) and must wait for flushed jobs before reusing.
* ``jobs_finished``: a job completes once every one of ``num_workers`` workers reported it;
  only then ``complete_store`` (``success=False`` if any worker failed: the blocks are freed)
  or ``complete_load``. A job every worker finished successfully is counted in the
  manager's byte counters (``add_bytes``: kvshm-inspect's ``bytes_in``/``bytes_out``).
* ``request_finished``: True while jobs still use the request's device blocks (do not free
  them until ``jobs_finished`` lists the request as freeable).

Offloaded blocks are ``block_size_factor`` device blocks; the key of one is the offload key of
the hash of its LAST device block. It never copies data (workers do).
"""
from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from kvshm.engine.hashing import offload_key
from kvshm.errors import (
    BlockStateError,
    CacheFullError,
    InvalidArgumentError,
    KvshmError,
    UnknownKeyError,
)
from kvshm.index.api import OffloadingEvent, OffloadingManager
from kvshm.transfer.spec import TransferSpec

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Job:
    """One transfer for one request; every worker of the engine runs it on its own shard."""
    job_id: int
    req_id: str
    spec: TransferSpec
    # (manager slot, generation) of the scheduler the job copies for, when its manager is a
    # SharedManager: a worker refuses the job once that generation is dead (kvshm.shm.writers).
    writer: tuple[int, int] | None = None


@dataclass
class Jobs:
    """What a scheduling step hands to the workers."""
    loads: list[Job] = field(default_factory=list)
    stores: list[Job] = field(default_factory=list)
    flush: set[int] = field(default_factory=set)  # wait for these before reusing blocks


@dataclass(frozen=True)
class JobDone:
    """A job every worker has reported; ``keys`` are the offload keys it moved."""
    job_id: int
    req_id: str
    kind: str
    success: bool
    keys: tuple[bytes, ...]


@dataclass
class Completions:
    done: list[JobDone] = field(default_factory=list)
    freeable: list[str] = field(default_factory=list)  # finished requests, no job left


@dataclass
class _Req:
    hashes: Sequence[bytes]      # device-block hashes, kept by reference (the engine appends)
    keys: list[bytes] = field(default_factory=list)  # offload keys derived so far
    device_ids: list[int] = field(default_factory=list)
    next_stored: int = 0         # offloaded-block index of the next block to offer
    lookup: tuple[int, int, int] | None = None  # (start, hits, computed): looked up, not loaded
    jobs: set[int] = field(default_factory=set)
    finished: bool = False


@dataclass
class _JobState:
    kind: str
    req_id: str
    keys: list[bytes]
    device_ids: tuple[int, ...]
    remaining: int
    ok: bool = True


class SchedulerConnector:
    """Per-engine scheduler state over one ``OffloadingManager`` (local or shared)."""

    def __init__(self, manager: OffloadingManager, *, device_block_tokens: int,
                 block_size_factor: int = 1, num_workers: int = 1, group: int = 0,
                 block_bytes: int | None = None) -> None:
        """``block_bytes``: bytes of one offloaded block (every plane), for the byte counters;
        by default the manager's segment layout says (``manager.segment.layout``)."""
        for name, v in (("device_block_tokens", device_block_tokens),
                        ("block_size_factor", block_size_factor), ("num_workers", num_workers)):
            if not isinstance(v, int) or v < 1:
                raise InvalidArgumentError(f"{name} must be an int >= 1, got {v!r}")
        if block_bytes is None:
            try:
                block_bytes = manager.segment.layout.block_bytes  # type: ignore[attr-defined]
            except AttributeError:
                raise InvalidArgumentError(
                    f"{type(manager).__name__} has no segment layout to size blocks by; pass "
                    "SchedulerConnector(..., block_bytes=...)") from None
        if not isinstance(block_bytes, int) or block_bytes < 1 or block_bytes % block_size_factor:
            raise InvalidArgumentError(f"block_bytes must be an int >= 1 divisible by "
                                       f"block_size_factor, got {block_bytes!r}")
        self.manager = manager
        self.device_block_bytes = block_bytes // block_size_factor
        self.device_block_tokens = device_block_tokens
        self.factor = block_size_factor
        self.block_tokens = device_block_tokens * block_size_factor  # per offloaded block
        self.num_workers = num_workers
        self.group = group
        self._reqs: dict[str, _Req] = {}
        self._jobs: dict[int, _JobState] = {}
        self._block_jobs: dict[int, set[int]] = {}  # device block -> jobs using it
        self._loads: list[Job] = []
        self._next_job = 1
        self.store_refused = 0  # prepare_store said "no room": retried next step

    # --- lookups and loads --------------------------------------------------------------
    def _keys(self, st: _Req) -> list[bytes]:
        """Offload keys of every full offloaded block hashed so far (extended lazily)."""
        f, have = self.factor, len(st.keys)
        for i in range(have, len(st.hashes) // f):
            st.keys.append(offload_key(st.hashes[i * f + f - 1], self.group))
        return st.keys

    def get_num_new_matched_tokens(self, req_id: str, block_hashes: Sequence[bytes],
                                   num_computed_tokens: int) -> int | None:
        """Tokens beyond ``num_computed_tokens`` (the device-cached prefix) loadable from kvshm.

        None (vLLM's "ask again later"): the manager's lookup said a fetch from a lower tier
        may bring more (``kvshm.tier.TieredManager``); leave the request waiting this step.

        ``block_hashes`` (one per full device block) is kept by reference: an engine that
        appends hashes as blocks fill during decode gets those blocks stored too.
        """
        if num_computed_tokens % self.device_block_tokens:
            raise InvalidArgumentError(
                f"num_computed_tokens ({num_computed_tokens}) must be a multiple of the device "
                f"block size ({self.device_block_tokens}): it is the locally cached prefix")
        st = self._reqs.get(req_id)
        if st is None:
            st = self._reqs[req_id] = _Req(block_hashes)
        self._release(st)  # (its keys name the leases: before they are derived again)
        if st.hashes is not block_hashes:
            st.hashes, st.keys = block_hashes, []
        keys = self._keys(st)
        if keys:
            self.manager.touch(keys)  # GPU-cached prefix blocks count as used too (vLLM)
        obs = self.block_tokens
        if len(keys) * obs - num_computed_tokens < obs:
            return 0  # less than one whole offloaded block left to gain
        start = num_computed_tokens // obs
        hits = self.manager.lookup(keys[start:])
        if hits is None:  # a lower-tier fetch is in flight; nothing is leased meanwhile
            return None
        if hits == 0:
            return 0
        st.lookup = (start, hits, num_computed_tokens)
        return obs * (start + hits) - num_computed_tokens

    def update_state_after_alloc(self, req_id: str, device_block_ids: Sequence[int],
                                 num_external_tokens: int) -> int:
        """Queue the load of the hit blocks into ``device_block_ids`` (the request's blocks).

        Returns the tokens that will be loaded: ``num_external_tokens``, or 0 when nothing
        is to be loaded or the hit was lost meanwhile (the engine then computes them).
        """
        st = self._reqs.get(req_id)
        if st is None:
            raise InvalidArgumentError(f"request {req_id!r} was never looked up; call "
                                       "get_num_new_matched_tokens first")
        st.device_ids = list(device_block_ids)
        st.next_stored = 0  # a (re)admitted request offers its blocks again (dedup'd by kvshm)
        look, st.lookup = st.lookup, None
        if not num_external_tokens or look is None:
            if look is not None:
                self._release_keys(st.keys[look[0]:look[0] + look[1]])
            return 0
        start, hits, computed = look
        end = start + hits
        obs, f = self.block_tokens, self.factor
        if num_external_tokens != obs * end - computed or len(st.device_ids) < end * f:
            self._release_keys(st.keys[start:end])
            raise InvalidArgumentError(
                f"request {req_id!r}: {num_external_tokens} external tokens and "
                f"{len(st.device_ids)} device blocks do not match the lookup "
                f"({obs * end - computed} tokens up to device block {end * f}); pass back the "
                "value get_num_new_matched_tokens returned, with blocks for the whole hit")
        first_dev = computed // self.device_block_tokens  # already in the device cache
        keys = st.keys[start:end]
        try:
            segment_ids = self.manager.prepare_load(keys)
        except (UnknownKeyError, BlockStateError, CacheFullError) as e:
            # The lease was dropped (or another engine's store still runs): recompute instead.
            log.info("kvshm: load of %d blocks for %r lost its hit (%s); recomputing",
                     len(keys), req_id, e)
            self._release_keys(keys)
            return 0
        job = self._new_job("load", req_id, keys, st.device_ids[first_dev:end * f],
                            segment_ids)
        self._loads.append(job)
        st.next_stored = end  # loaded blocks are in kvshm already
        return num_external_tokens

    # --- stores ------------------------------------------------------------------------
    def build_jobs(self, scheduled: Mapping[str, tuple[int, Sequence[int]]], *,
                   preempted: Iterable[str] = (), reused: Iterable[int] = ()) -> Jobs:
        """The jobs of one step.

        ``scheduled``: request -> (tokens computed once this step ran, its device block ids).
        ``preempted``: requests whose device blocks the engine frees now; ``reused``: device
        blocks the engine is about to overwrite. Jobs still using those blocks are returned in
        ``flush``: the workers must finish them before the blocks are written. A preempted
        request's load that was not handed out yet is cancelled (its pins are released).
        """
        jobs = Jobs(self._loads, [], set())
        self._loads = []
        for req_id in preempted:
            st = self._reqs.get(req_id)
            if st is not None:
                self._release(st)
                for job in [j for j in jobs.loads if j.req_id == req_id]:
                    jobs.loads.remove(job)  # never sent: cancel it instead of waiting for it
                    js = self._jobs[job.job_id]
                    js.ok = False  # nothing moved: unpin, count no bytes
                    self._finish(job.job_id, js, Completions())
                jobs.flush |= st.jobs
                st.device_ids = []
        for b in reused:
            jobs.flush |= self._block_jobs.get(b, set())
        jobs.flush -= {j.job_id for j in jobs.loads}  # unsent: nothing to wait for
        obs, f = self.block_tokens, self.factor
        for req_id, (num_computed, device_ids) in scheduled.items():
            st = self._reqs.get(req_id)
            if st is None:
                raise InvalidArgumentError(f"request {req_id!r} is unknown to the connector; "
                                           "call get_num_new_matched_tokens when admitting it")
            st.device_ids = list(device_ids)
            keys = self._keys(st)
            n = min(num_computed // obs, len(keys), len(st.device_ids) // f)
            if n <= st.next_stored:
                continue
            offer = keys[st.next_stored:n]
            out = self.manager.prepare_store(offer)
            if out is None:
                self.store_refused += 1  # nothing evictable now: offer them again next step
                continue
            self.manager.touch(keys[:n])
            where = {k: i for i, k in enumerate(offer, st.next_stored)}
            st.next_stored = n
            if not out.keys_to_store:
                continue
            dev = [st.device_ids[where[k] * f + j] for k in out.keys_to_store for j in range(f)]
            jobs.stores.append(self._new_job("store", req_id, list(out.keys_to_store), dev,
                                             out.block_ids))
        return jobs

    def _new_job(self, kind: Literal["store", "load"], req_id: str, keys: list[bytes],
                 device_ids: Sequence[int], segment_ids: Sequence[int]) -> Job:
        job_id, self._next_job = self._next_job, self._next_job + 1
        dev = tuple(int(b) for b in device_ids)
        self._jobs[job_id] = _JobState(kind, req_id, keys, dev, self.num_workers)
        self._reqs[req_id].jobs.add(job_id)
        for b in set(dev):
            self._block_jobs.setdefault(b, set()).add(job_id)
        slot, gen = getattr(self.manager, "slot", None), getattr(self.manager, "gen", None)
        writer = (slot, gen) if isinstance(slot, int) and isinstance(gen, int) else None
        return Job(job_id, req_id, TransferSpec(kind, dev, tuple(int(s) for s in segment_ids)),
                   writer)

    # --- completions -------------------------------------------------------------------
    def jobs_finished(self, results: Iterable[Any]) -> Completions:
        """Count worker reports, ``(job_id, success)`` pairs or TransferResult-like objects."""
        out = Completions()
        for r in results:
            job_id, success = (r.job_id, r.success) if hasattr(r, "job_id") else r
            js = self._jobs.get(job_id)
            if js is None:
                log.warning("kvshm: report for unknown or completed job %s ignored", job_id)
                continue
            js.remaining -= 1
            js.ok = js.ok and bool(success)
            if js.remaining:
                continue  # vLLM 0.33: a job is done once every worker reported it
            self._finish(job_id, js, out)
        return out

    def _finish(self, job_id: int, js: _JobState, out: Completions) -> None:
        del self._jobs[job_id]
        for b in set(js.device_ids):
            s = self._block_jobs.get(b)
            if s is not None:
                s.discard(job_id)
                if not s:
                    del self._block_jobs[b]
        try:
            if js.kind == "store":
                self.manager.complete_store(js.keys, success=js.ok)
            else:
                self.manager.complete_load(js.keys)
            if js.ok:  # every device block the job copied (a load may skip a partial head)
                n = len(js.device_ids) * self.device_block_bytes
                self.manager.add_bytes(**{"stored" if js.kind == "store" else "loaded": n})
        except KvshmError as e:  # e.g. our client was reclaimed: nothing left to release
            log.warning("kvshm: completing %s job %d failed: %s", js.kind, job_id, e)
        out.done.append(JobDone(job_id, js.req_id, js.kind, js.ok, tuple(js.keys)))
        st = self._reqs.get(js.req_id)
        if st is not None:
            st.jobs.discard(job_id)
            if st.finished and not st.jobs:
                del self._reqs[js.req_id]
                out.freeable.append(js.req_id)

    def request_finished(self, req_id: str) -> bool:
        """The request ended. True: jobs still use its device blocks, free them later."""
        st = self._reqs.get(req_id)
        if st is None:
            return False
        self._release(st)
        if st.jobs:
            st.finished = True
            return True
        del self._reqs[req_id]
        return False

    # --- misc --------------------------------------------------------------------------
    def pending_jobs(self) -> set[int]:
        """Jobs handed out and not yet completed by every worker."""
        return set(self._jobs) | {j.job_id for j in self._loads}

    def take_events(self) -> list[OffloadingEvent]:
        return list(self.manager.take_events())

    def _release(self, st: _Req) -> None:
        if st.lookup is not None:
            start, hits, _ = st.lookup
            st.lookup = None
            self._release_keys(st.keys[start:start + hits])

    def _release_keys(self, keys: Sequence[bytes]) -> None:
        if keys:
            self.manager.release(keys)  # a SharedManager's lookup leases; no-op elsewhere
