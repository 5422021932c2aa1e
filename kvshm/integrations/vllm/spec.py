"""kvshm as a vLLM ``OffloadingSpec``: every vLLM instance on a host shares one CPU KV tier.

Load it with ``KVTransferConfig(kv_connector="OffloadingConnector", kv_role="kv_both",
kv_connector_extra_config={"spec_name": "KvshmOffloadingSpec", "spec_module_path":
"kvshm.integrations.vllm", "kvshm_segment": "NAME", "cpu_bytes_to_use": BYTES})``
(see ``docs/vllm.md``). This module owns the three vLLM-facing classes and nothing else:

* ``KvshmOffloadingSpec`` — validates the configuration and the vLLM version at
  construction, derives the segment layout and refuses one an existing segment does not
  match (before any KV cache is allocated), and builds the manager or the worker lazily
  (vLLM constructs the spec in every engine process without saying its role).
* ``KvshmOffloadingManager`` — vLLM's scheduler-side manager over kvshm's ``SharedManager``
  (a ``TieredManager`` with ``"kvshm_tier": true``: misses may be fetched from the lower
  tier, and the lookup answers RETRY meanwhile).
* ``KvshmOffloadingWorker`` — vLLM's worker over kvshm's transfer handlers (CUDA when the KV
  cache is on a GPU, the CPU copy path otherwise), on this rank's plane of the segment.

Version-specific vLLM names come from ``compat``; the logic lives in ``config``, ``core``,
``jobs`` and ``stats`` (testable without vLLM). The manager reports kvshm's statistics through
vLLM's ``get_stats`` (``vllm:kvshm_*``, declared in ``build_metric_definitions``); a store's spec
carries the scheduler's kvshm client (slot, generation), under which the worker registers
before copying. Importing this module imports vLLM and torch; ``import kvshm``
never imports it. It must never return False from a submit or report a failed job (vLLM 0.32
and 0.33 assert on both), and never let a lookup cost a round trip to the owner.
"""
from __future__ import annotations

import logging
from collections.abc import Collection, Iterable
from typing import Any

from kvshm.client.connect import connect
from kvshm.client.manager import SharedManager
from kvshm.errors import LayoutMismatchError
from kvshm.integrations.vllm import compat as V
from kvshm.integrations.vllm.config import (
    KvshmOptions,
    check_layout,
    explain_mismatch,
    layout_for,
    num_blocks_for,
    open_segment,
    quota_arg,
)
from kvshm.integrations.vllm.core import ManagerCore
from kvshm.integrations.vllm.jobs import WorkerCore
from kvshm.integrations.vllm.stats import KINDS, METRICS, StatsReader
from kvshm.shm import writers
from kvshm.shm.pins import PinProgress
from kvshm.shm.segment import Segment
from kvshm.tier.client import TieredManager

logger = logging.getLogger(__name__)


CONFIG_INFO_KEYS = ("kvshm_segment", "kvshm_policy", "kvshm_blocks", "kvshm_block_bytes")


class KvshmLoadStoreSpec(V.CPULoadStoreSpec):
    """Segment block ids (vLLM "chunk ids") in key order, and the scheduler's kvshm client
    (slot, generation) that the worker copies a store for; small and picklable (vLLM sends
    it to worker processes in the connector metadata)."""

    def __init__(self, block_ids: Any, writer: tuple[int, int] = (-1, 0)):
        super().__init__(block_ids)
        self.writer = (int(writer[0]), int(writer[1]))


class KvshmOffloadingManager(V.OffloadingManager):
    """Scheduler side: vLLM's per-key calls mapped onto kvshm's shared index."""

    def __init__(self, shared: SharedManager | TieredManager, events: bool,
                 info: dict[str, Any] | None = None):
        self.core = ManagerCore(shared, provisional_ranks=V.PROVISIONAL_RANKS
                                and shared.segment.policy == "lru")
        self._events = events
        self._released: list[bytes] = []  # keys of failed stores, for metadata-only events
        self._writer = (shared.slot, shared.gen)
        self._stats = StatsReader(shared.segment, shared.slot)
        self._info = info or {}

    def lookup(self, key: bytes, req_context: V.ReqContext) -> V.LookupResult:
        return V.LOOKUP_FROM_KVSHM[self.core.lookup(key, req_context.req_id).value]

    def get_load_source(self, key: bytes, req_context: V.ReqContext) -> V.CacheHitSource:
        return V.HOST_SOURCE

    def prepare_load(self, keys: Collection[bytes],
                     req_context: V.ReqContext) -> KvshmLoadStoreSpec:
        return KvshmLoadStoreSpec(self.core.prepare_load(
            list(keys), req_context.req_id, req_context.get_offload_key_position))

    def touch(self, keys: Collection[bytes], req_context: V.ReqContext) -> None:
        self.core.mgr.touch(list(keys))

    def complete_load(self, keys: Collection[bytes], req_context: V.ReqContext) -> None:
        self.core.complete_load(keys, req_context.req_id)

    def prepare_store(self, keys: Collection[bytes],
                      req_context: V.ReqContext) -> V.PrepareStoreOutput | None:
        out = self.core.prepare_store(list(keys), req_context.req_id,
                                      req_context.get_offload_key_position)
        if out is None:
            return None  # vLLM counts an allocation failure and offers the chunks again
        return V.PrepareStoreOutput(keys_to_store=out.keys_to_store,
                                    store_spec=KvshmLoadStoreSpec(out.block_ids, self._writer),
                                    evicted_keys=out.evicted_keys)

    def complete_store(self, keys: Collection[bytes], req_context: V.ReqContext,
                       success: bool = True) -> None:
        done = self.core.complete_store(keys, req_context.req_id, success,
                                        req_context.get_offload_key_position)
        if not success and self._events and V.METADATA_ONLY_EVENTS:
            self._released += done

    def on_new_request(self, req_context: V.ReqContext) -> V.RequestOffloadingContext:
        return V.RequestOffloadingContext()

    def on_request_finished(self, req_context: V.ReqContext) -> None:
        self.core.request_finished(req_context.req_id,
                                   lambda keys: V.request_order(keys, req_context))

    def on_schedule_end(self, context: V.ScheduleEndContext) -> None:
        self.core.schedule_end()

    def take_events(self) -> Iterable[V.OffloadingEvent]:
        if not self._events:
            return ()  # called every step: no owner round trip unless events were asked for
        events = [V.event(list(e.keys), e.removed) for e in self.core.mgr.take_events()]
        # 0.33: released unless stored again meanwhile (the tracker's metadata is the new one's)
        released = [k for k in self._released if not self.core.stored_or_storing(k)]
        self._released = []
        if released:
            events.append(V.event(released, True, metadata_only=True))
        return events

    def get_stats(self) -> Any:
        # every step: this engine's counter deltas, the shared segment's state once a second
        return V.connector_stats(self._stats.take(), KINDS)

    def config_info(self) -> list[dict[str, Any]]:  # vLLM 0.33: vllm:kv_offload_config_info
        return [dict(self._info)]

    def reset_cache(self) -> None:
        self.core.reset()

    def on_reset_flushed(self) -> None:  # vLLM 0.33+: the reset's flushed jobs are done
        self.core.reset_flushed()

    def shutdown(self) -> None:
        self.core.shutdown()


class KvshmOffloadingWorker(V.OffloadingWorker):
    """Worker side: vLLM jobs as kvshm transfer jobs on this rank's plane."""

    def __init__(self, core: WorkerCore, segment: Segment, pin: Any = None):
        self.core = core
        self._segment = segment
        self._pin = pin

    @staticmethod
    def _gpu(spec: V.GPULoadStoreSpec) -> tuple[Any, Any, Any]:
        return spec.block_ids, spec.group_sizes, spec.block_indices

    def submit_store(self, job_id: int, src_spec: V.GPULoadStoreSpec,
                     dst_spec: V.LoadStoreSpec) -> bool:
        return self.core.submit(job_id, "store", *self._gpu(src_spec),
                                dst_spec.block_ids,  # type: ignore[attr-defined]
                                writer=getattr(dst_spec, "writer", None))

    def submit_load(self, job_id: int, src_spec: V.LoadStoreSpec,
                    dst_spec: V.GPULoadStoreSpec, expedited: bool = False) -> bool:
        # expedited (vLLM 0.33): waited for within the step, so it skips the queued loads
        return self.core.submit(job_id, "load", *self._gpu(dst_spec),
                                src_spec.block_ids, expedited)  # type: ignore[attr-defined]

    def get_finished(self) -> list[V.TransferResult]:
        return [V.TransferResult(job_id=j, success=ok, transfer_size=n, transfer_time=s)
                for j, ok, n, s in self.core.get_finished()]

    def wait(self, job_ids: set[int]) -> None:
        self.core.wait(job_ids)

    def shutdown(self) -> None:
        if self._segment is None:
            return
        self.core.shutdown()  # drains, then the handlers release the pin
        if self._pin is not None:
            self._pin.unregister()
        self._segment.close()
        self._segment = None  # type: ignore[assignment]


class KvshmOffloadingSpec(V.OffloadingSpec):
    """vLLM OffloadingSpec whose CPU tier is the kvshm segment named ``kvshm_segment``."""

    def __init__(self, config: V.OffloadingConfig):
        V.check_version()
        super().__init__(config)
        self.options = KvshmOptions.from_extra(self.extra_config)
        self.layout = layout_for(config, self.options.model_id)
        # An engine whose layout the existing segment refuses fails here, before its worker
        # allocates the KV cache (vLLM builds the worker's spec just before that).
        check_layout(self.options, self.layout)
        self._manager: KvshmOffloadingManager | None = None
        self._worker: KvshmOffloadingWorker | None = None

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        """kvshm's ``vllm:kvshm_*`` metrics (see ``stats``); vLLM adds its own."""
        return V.metric_definitions(METRICS)

    @classmethod
    def config_info_keys(cls, extra_config: dict[str, Any]) -> tuple[str, ...]:
        """vLLM 0.33's ``vllm:kv_offload_config_info`` labels that the manager fills."""
        return CONFIG_INFO_KEYS

    def get_manager(self) -> KvshmOffloadingManager:
        if self._manager is None:
            o, events = self.options, bool(self.kv_events_config.enable_kv_cache_events)
            try:
                # Without cpu_bytes_to_use it only attaches (and hold_capacity goes unused).
                blocks = None if o.nbytes is None else num_blocks_for(self.layout, o.nbytes)
                shared = connect(o.segment, self.layout, num_blocks=blocks, policy=o.policy,
                                 mode=o.mode, events=events, hold_capacity=o.hold_capacity,
                                 quota=quota_arg(o.quota))
            except LayoutMismatchError as e:
                raise explain_mismatch(e, o.segment) from None
            try:
                g = shared.segment.geometry
                mgr = TieredManager(shared) if o.tier else shared
                self._manager = KvshmOffloadingManager(mgr, events, dict(zip(CONFIG_INFO_KEYS, (
                    o.segment, shared.segment.policy, g.num_blocks, self.layout.block_bytes))))
            except BaseException:
                shared.shutdown()  # its client slot back: this process may well live on
                raise
            logger.info("kvshm: scheduler attached to segment %r (%d blocks of %d bytes%s)",
                        o.segment, g.num_blocks, self.layout.block_bytes,
                        "; misses are looked up below" if o.tier else "")
        return self._manager

    def get_worker(self, kv_caches: V.CanonicalKVCaches) -> KvshmOffloadingWorker:
        if self._worker is None:
            from kvshm.transfer.factory import make_handler
            seg = open_segment(self.options, self.layout)
            pin: Any = None
            regs: writers.Registrations | None = None
            try:
                plane = seg.torch_planes()[self.config.parallel.rank]
                tensors = [t.tensor for t in kv_caches.tensors]
                groups = [[r.tensor_idx for r in refs] for refs in kv_caches.group_data_refs]
                options: dict[str, Any] = {}
                if tensors and tensors[0].device.type == "cpu":
                    # vLLM's compute threads hold every core: copy in the engine's thread
                    options["inline"] = ("load", "store")
                    options["finish_loads"] = True
                if tensors and tensors[0].device.type == "cuda":
                    from kvshm.transfer.pinning import pin_in_background
                    pin = pin_in_background(plane.data_ptr(), plane.numel(),
                                            turn=seg.pin_turn, progress=PinProgress(seg.buf))
                    options["pin"] = pin
                regs = writers.Registrations(seg)  # (a descriptor of its own)
                core = WorkerCore(tensors, groups, plane, self.blocks_per_chunk,
                                  make_handler=make_handler, writers=regs, **options)
            except BaseException:
                if regs is not None:
                    regs.close()
                if pin is not None:
                    pin.unregister()
                seg.close()
                raise
            self._worker = KvshmOffloadingWorker(core, seg, pin)
            logger.info("kvshm: worker rank %d copies KV into plane %d of segment %r",
                        self.config.parallel.rank, self.config.parallel.rank,
                        self.options.segment)
        return self._worker
