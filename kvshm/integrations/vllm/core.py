"""The scheduler half of kvshm's vLLM integration, testable without vLLM.

This module owns ``ManagerCore``, the scheduler-side state (per-request leases, pins, stores
and the keys each request accessed, for vLLM's request-finished recency rules) over a kvshm
``SharedManager``. The configuration and the segment it opens are ``config.py``, the worker
half ``jobs.py``.

Inputs from vLLM are duck-typed (attributes only), so tests pass plain objects. It must never
let a per-key lookup go to the owner (a ring round trip).
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvshm.errors import KvshmError
from kvshm.index.access import INSERTED, MISSED, RANKED, REUSED, SEEN
from kvshm.index.api import LookupResult, PrepareStoreOutput, Running
from kvshm.shm import layout as L

logger = logging.getLogger(__name__)

Position = Callable[[bytes], "int | None"]  # a key's token position in its request (vLLM's)


class ManagerCore:
    """Scheduler-side state over a kvshm manager, keyed by vLLM request id.

    Leases: ``lookup`` of a hit leases the block so that it stays loadable although other
    engines evict. vLLM calls ``prepare_load`` only for keys that hit in the same scheduler
    step, so every lease still held at the step's end (``schedule_end``) is released: a
    waiting request never keeps blocks from being evicted. The client counts lookups per lease:
    one per request is kept, so one request's load or end leaves the others theirs.

    Pending keys: a key whose store is in flight is ``PENDING`` only if this engine stores it
    (vLLM then asks again next step); another engine's unfinished store is a ``MISS``, so a
    slow or stuck engine never stalls this one. Over a ``TieredManager`` a key the lower tier
    may bring is ``RETRY`` (vLLM asks again next step; no step waits on the network).

    After ``reset`` vLLM never completes the jobs it had in flight, so their pins and
    unfinished stores are dropped once the connector's flush of those jobs has run in every
    worker (before that the blocks may still be read or written): at ``reset_flushed``
    (vLLM 0.33's ``on_reset_flushed``) or at the first completion after the reset, whichever
    comes first. vLLM reports only jobs created after the reset, and a worker waits for the
    flushed jobs before it starts any of them; a count of scheduler steps proves nothing, as
    the scheduler runs ahead of the workers by as many batches as it keeps in flight.
    Recency follows vLLM's ``CPUOffloadingManager``: each request records the keys it loaded
    or offered for a store (skipping ones another store of this engine has in flight), and
    when it finishes they are applied head to tail (tails first, so the prefix head ends up
    most recent) as reused (ready when loaded or offered: an ARC frequency hit), inserted
    (stored by it: recency only) or seen. While it runs, only its new keys enter the order:
    as most recent (vLLM 0.32), or with ``provisional_ranks`` (vLLM 0.33's LRU) at the
    request's provisional rank, which every key it first records is raised to as well (the
    owner takes the rank when the request's first ranked frame arrives; ``position`` gives
    each key's token position, tails rank before heads). A store miss that hits an ARC ghost
    list adapts ARC's target once per request, before the store's eviction. ``reset``
    forgets all of it, as vLLM's new cache generation does.

    Completions and store refusals caused by kvshm errors are logged, not raised: an engine
    must not die because the shared cache lost a block it was about to publish.
    """

    def __init__(self, mgr: Any, provisional_ranks: bool = False):
        self.mgr = mgr
        # A TieredManager (``kvshm_tier``): the step's lookups that may hit below (RETRY)
        # are asked for together when the step ends.
        self._flush_wants = getattr(mgr, "flush_wants", None)
        self._ranked = provisional_ranks
        self._requests = 0  # the last number given to a request for the owner (``Running``)
        self._lease_reqs: dict[bytes, set[str]] = {}  # leased key -> requests that hit it
        self._loads: dict[str, list[list[bytes]]] = {}  # request -> its unfinished loads
        self._store_req: dict[bytes, str] = {}  # key whose store is in flight -> request
        # per reset: (load key lists, store key lists) of the jobs it flushed
        self._stale: list[tuple[list[list[bytes]], list[list[bytes]]]] = []
        self._access: dict[str, _Access] = {}  # request -> the keys it accessed

    # --- loads ------------------------------------------------------------------------
    def lookup(self, key: bytes, req_id: str) -> LookupResult:
        status = self.mgr.key_status(key)  # lock-free read of the segment, no owner round trip
        if status is LookupResult.HIT:  # one lookup per request counted on the lease
            if req_id in self._lease_reqs.setdefault(key, set()):
                self.mgr.release([key])
            self._lease_reqs[key].add(req_id)
        elif status is LookupResult.PENDING and key not in self._store_req:
            return LookupResult.MISS  # another engine is storing it: compute, don't wait
        return status

    def prepare_load(self, keys: Sequence[bytes], req_id: str,
                     position: Position | None = None) -> list[int]:
        keys = list(keys)
        try:
            blocks = self.mgr.prepare_load(keys)  # this client's leases of keys become pins
        except KvshmError as e:
            raise KvshmError(
                f"kvshm lost blocks that lookup() reported as hits in this step ({e}); vLLM "
                "cannot recover from a failed load (raise the segment's hold capacity "
                "if a step looks up more keys than half of it)") from e
        self._loads.setdefault(req_id, []).append(keys)
        for k in keys:  # the load took one lookup of each lease: ours, else another's
            reqs = self._lease_reqs.get(k)
            if reqs and req_id in reqs:
                reqs.discard(req_id)  # (an empty set stays until the step's end)
            elif reqs:
                self.mgr.key_status(k)  # count the other requests' lookup again
        acc = self._access_of(req_id)
        self._first_seen(acc, acc.record(keys, reused=keys), position)
        return blocks

    def complete_load(self, keys: Iterable[bytes], req_id: str) -> None:
        if self._stale:
            self.reset_flushed()  # a job of after the reset completed: the flush is done
        done = set(keys)
        jobs = self._loads.get(req_id, [])
        for i, job in enumerate(jobs):
            if set(job) == done:
                del jobs[i]
                if not jobs:
                    del self._loads[req_id]
                self._quietly(self.mgr.complete_load, job)
                self._count(loaded=len(job))
                return
        logger.warning("kvshm: complete_load of %d keys that request %s never prepared",
                       len(done), req_id)

    # --- stores -----------------------------------------------------------------------
    def prepare_store(self, keys: Sequence[bytes], req_id: str,
                      position: Position | None = None) -> PrepareStoreOutput | None:
        keys = list(keys)
        acc = self._access_of(req_id)
        find = self.mgr.index.find  # lock-free, takes no lease
        state = [find(k)[1] for k in keys]
        missing = [k for k, st in zip(keys, state) if st != L.READY and st != L.WRITING]
        ready = [k for k, st in zip(keys, state) if st == L.READY]
        new_misses = [k for k in missing if k not in acc.missed]
        if new_misses and not self._ranked:  # (ranked: LRU, which learns nothing from them)
            acc.missed.update(new_misses)  # ARC learns from ghost hits before the store
            self._quietly(self.mgr.touch, new_misses, bytes([MISSED]) * len(new_misses))
        recorded = set(missing).union(ready)
        new = acc.record([k for k in keys if k in recorded], reused=ready)
        self._first_seen(acc, new, position)
        running = self._running(acc, keys, position) if self._ranked else None
        try:
            out = self.mgr.prepare_store(keys, running=running)  # grants, or a round trip
        except KvshmError as e:
            logger.warning("kvshm: not storing %d chunks this step: %s", len(keys), e)
            return None  # vLLM offers them again next step
        if out is not None:
            self._store_req.update(dict.fromkeys(out.keys_to_store, req_id))
            acc.inserted.update(out.keys_to_store)
        return out

    def complete_store(self, keys: Iterable[bytes], req_id: str, success: bool = True,
                       position: Position | None = None) -> list[bytes]:
        """Complete this request's stores of ``keys``; the keys it completed."""
        if self._stale:
            self.reset_flushed()  # a job of after the reset completed: the flush is done
        # Only the stores this request still has in flight: after a reset they went stale
        # (and are freed on their own schedule), and a key stored again since belongs to
        # another request, whose block this late completion must never publish or free.
        keys = [k for k in keys if self._store_req.get(k) == req_id]
        for k in keys:
            del self._store_req[k]
        acc = self._access.get(req_id) if self._ranked and success else None
        # a granted block enters the index now: at the rank prepare_store would have given it
        running = self._running(acc, keys, position) if acc is not None else None
        try:
            self.mgr.complete_store(keys, success, running=running)
        except KvshmError as e:
            logger.warning("kvshm: complete_store failed: %s", e)
        if success:
            self._count(stored=len(keys))
        return keys

    def stored_or_storing(self, key: bytes) -> bool:
        """Whether ``key`` is in the segment (any state) or this engine is storing it."""
        return key in self._store_req or self.mgr.index.find(key)[1] >= 0

    # --- life cycle -------------------------------------------------------------------
    def schedule_end(self) -> None:
        """A scheduler step ended: its loads are prepared, so no lease is needed any more."""
        if self._flush_wants is not None:
            self._flush_wants()
        if self._lease_reqs:
            self._lease_reqs.clear()
            self.mgr.release(None)

    def reset_flushed(self) -> None:
        """The jobs in flight at the last reset are done (vLLM says so, or completed a job of
        after the reset): drop their holds now."""
        stale, self._stale = self._stale, []
        for loads, stores in stale:
            for keys in loads:
                self._quietly(self.mgr.complete_load, keys)
            for keys in stores:  # never published: their bytes may be partial
                self._quietly(self.mgr.complete_store, keys, False)

    def request_finished(self, req_id: str,
                         order: Callable[[list[bytes]], list[bytes]] | None = None) -> None:
        """Apply the request's accesses (``order``: its keys head to tail, as the installed vLLM
        orders them; default: first seen first). Its pins and stores wait for their
        completions, which may still arrive."""
        acc = self._access.pop(req_id, None)
        if acc is not None and acc.keys:
            keys = order(list(acc.keys)) if order is not None else list(acc.keys)
            how = bytes(REUSED if k in acc.reused else INSERTED if k in acc.inserted else SEEN
                        for k in keys)
            done = Running(acc.request, done=True) if acc.request else None  # owner forgets it
            self._quietly(self._touch, keys, how, done)
        mine = [k for k, reqs in self._lease_reqs.items() if req_id in reqs]
        for k in mine:
            self._lease_reqs[k].discard(req_id)
        if mine:
            self.mgr.release(mine)  # its lookups: the leases others hit stay

    def reset(self) -> None:
        """Forget this engine's in-flight state; data other engines stored is untouched."""
        self.mgr.release(None)
        self._lease_reqs.clear()
        loads = [k for jobs in self._loads.values() for k in jobs]
        by_req: dict[str, list[bytes]] = {}
        for k, r in self._store_req.items():
            by_req.setdefault(r, []).append(k)
        if loads or by_req:
            self._stale.append((loads, list(by_req.values())))
        self._loads.clear()
        self._store_req.clear()
        for acc in self._access.values():  # the owner forgets their provisional ranks
            if acc.request:
                self._quietly(self._touch, [], b"", Running(acc.request, done=True))
        self._access.clear()  # vLLM: requests of the old cache generation change nothing

    def shutdown(self) -> None:
        self.mgr.shutdown()  # the owner frees our unfinished stores; our pins go with our slot

    def _first_seen(self, acc: _Access, keys: list[bytes], position: Position | None) -> None:
        """vLLM 0.33's LRU: keys a running request records for the first time rise to its
        provisional rank (which the owner takes now if the request has none yet)."""
        if self._ranked and keys:
            self._quietly(self._touch, keys, bytes([RANKED]) * len(keys),
                          self._running(acc, keys, position))

    def _running(self, acc: _Access, keys: list[bytes], position: Position | None) -> Running:
        if not acc.request:  # a number the owner has never seen from this client
            self._requests += 1
            acc.request = self._requests
        pos: dict[bytes, int] = {}
        if position is not None:
            for k in keys:
                p = position(k)
                if p is not None:
                    pos[k] = int(p)
        return Running(acc.request, pos)

    def _touch(self, keys: list[bytes], how: bytes, running: Running | None) -> None:
        self.mgr.touch(keys, how, running=running)

    def _access_of(self, req_id: str) -> _Access:
        acc = self._access.get(req_id)
        if acc is None:
            acc = self._access[req_id] = _Access()
        return acc

    def _count(self, loaded: int = 0, stored: int = 0) -> None:
        """Per-client byte counters for kvshm-inspect (whole blocks: a partial first chunk
        of a load counts whole)."""
        block = self.mgr.segment.layout.block_bytes
        self.mgr.add_bytes(loaded=loaded * block, stored=stored * block)

    @staticmethod
    def _quietly(fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except KvshmError as e:
            logger.warning("kvshm: %s failed: %s", getattr(fn, "__name__", fn), e)


class _Access:
    """The keys one request accessed, first seen first, and how (vLLM's request cache access)."""

    __slots__ = ("keys", "inserted", "reused", "missed", "request")

    def __init__(self) -> None:
        self.keys: dict[bytes, None] = {}
        self.inserted: set[bytes] = set()
        self.reused: set[bytes] = set()  # ready when used, and not inserted by this request
        self.missed: set[bytes] = set()  # store misses ARC has already learned from
        self.request = 0  # its number for the owner (provisional ranks), 0: none yet

    def record(self, keys: Iterable[bytes], reused: Iterable[bytes] = ()) -> list[bytes]:
        """Record an access; the keys seen for the first time."""
        new = []
        for k in keys:
            if k not in self.keys:
                self.keys[k] = None
                new.append(k)
        self.reused.update(k for k in reused if k not in self.inserted)
        return new
