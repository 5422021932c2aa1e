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
    "connect": "client", "SharedManager": "client",
    "LocalManager": "manager",
    "Segment": "segment", "list_segments": "segment",
    "Layout": "layout",
    "OffloadingManager": "api", "PrepareStoreOutput": "api", "OffloadingEvent": "api",
    "LookupResult": "api",
    "TransferSpec": "transfer", "TransferResult": "transfer", "TransferHandler": "transfer",
    "make_handler": "transfer",
    "SchedulerConnector": "connector", "WorkerConnector": "worker",
    "SchedulerChannel": "channel", "WorkerChannel": "channel",
    "block_hashes": "hashing", "offload_key": "hashing",
    "KvshmError": "errors",
}
__all__ = sorted(_PUBLIC) + ["errors"]


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
    from .api import LookupResult, OffloadingEvent, OffloadingManager, PrepareStoreOutput
    from .channel import SchedulerChannel, WorkerChannel
    from .client import SharedManager, connect
    from .connector import SchedulerConnector
    from .errors import KvshmError
    from .hashing import block_hashes, offload_key
    from .layout import Layout
    from .manager import LocalManager
    from .segment import Segment, list_segments
    from .transfer import TransferHandler, TransferResult, TransferSpec, make_handler
    from .worker import WorkerConnector
