"""kvshm as vLLM's CPU offloading tier (``spec_module_path="kvshm.integrations.vllm"``).

``KvshmOffloadingSpec`` is imported on first use (vLLM's ``getattr(module, spec_name)``), so
the vLLM-free halves (``config``, ``core``, ``jobs``) import without vLLM.
"""
from typing import Any

__all__ = ["KvshmOffloadingSpec"]


def __getattr__(name: str) -> Any:
    if name == "KvshmOffloadingSpec":
        from kvshm.integrations.vllm.spec import KvshmOffloadingSpec
        return KvshmOffloadingSpec
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
