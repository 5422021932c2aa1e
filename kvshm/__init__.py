"""kvshm: one shared-memory CPU tier for the KV caches of every engine on a host.

Public names are loaded on first use, so ``import kvshm`` costs almost nothing and never
imports torch (only the data path — ``make_handler`` and the integrations — needs it).

    mgr = kvshm.connect("cache", layout, nbytes=8 << 30)   # attach or create, start an owner
    n = mgr.lookup(keys)                                    # lock-free, from shared memory
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_PUBLIC = {
    "connect": "client.connect", "SharedManager": "client.manager",
    "LocalManager": "owner.manager",
    "Segment": "shm.segment", "list_segments": "shm.names",
    "Layout": "shm.layout",
    "OffloadingManager": "index.api", "PrepareStoreOutput": "index.api",
    "OffloadingEvent": "index.api", "LookupResult": "index.api",
    "TransferSpec": "transfer.spec", "TransferResult": "transfer.spec",
    "TransferHandler": "transfer.spec", "make_handler": "transfer.factory",
    "SchedulerConnector": "engine.connector", "WorkerConnector": "engine.worker",
    "SchedulerChannel": "engine.channel", "WorkerChannel": "engine.channel",
    "block_hashes": "engine.hashing", "offload_key": "engine.hashing",
    "KvshmError": "errors",
    "TieredManager": "tier.client", "connect_tiered": "tier.client",
}
# Spelled out, not computed, so that linters and type checkers see the public names.
__all__ = [
    "KvshmError", "Layout", "LocalManager", "LookupResult", "OffloadingEvent",
    "OffloadingManager", "PrepareStoreOutput", "SchedulerChannel", "SchedulerConnector",
    "Segment", "SharedManager", "TieredManager", "TransferHandler", "TransferResult",
    "TransferSpec", "WorkerChannel", "WorkerConnector", "block_hashes", "connect",
    "connect_tiered", "errors", "list_segments", "make_handler", "offload_key",
]
assert sorted(__all__) == sorted([*_PUBLIC, "errors"])  # one list, kept in step with the map


def __getattr__(name: str) -> Any:
    if name == "errors":
        return importlib.import_module(".errors", __name__)
    mod = _PUBLIC.get(name)
    if mod is None:
        raise AttributeError(f"module 'kvshm' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


if TYPE_CHECKING:  # for type checkers and IDEs only
    from kvshm.client.connect import connect
    from kvshm.client.manager import SharedManager
    from kvshm.engine.channel import SchedulerChannel, WorkerChannel
    from kvshm.engine.connector import SchedulerConnector
    from kvshm.engine.hashing import block_hashes, offload_key
    from kvshm.engine.worker import WorkerConnector
    from kvshm.errors import KvshmError
    from kvshm.index.api import LookupResult, OffloadingEvent, OffloadingManager, PrepareStoreOutput
    from kvshm.owner.manager import LocalManager
    from kvshm.shm.layout import Layout
    from kvshm.shm.names import list_segments
    from kvshm.shm.segment import Segment
    from kvshm.tier.client import TieredManager, connect_tiered
    from kvshm.transfer.factory import make_handler
    from kvshm.transfer.spec import TransferHandler, TransferResult, TransferSpec
