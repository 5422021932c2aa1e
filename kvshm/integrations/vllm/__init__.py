"""kvshm as vLLM's CPU offloading tier (``spec_module_path="kvshm.integrations.vllm"``)."""
from kvshm.integrations.vllm.spec import KvshmOffloadingSpec

__all__ = ["KvshmOffloadingSpec"]
