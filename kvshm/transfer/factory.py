"""``make_handler``: the transfer handler that fits the device tensors it is given.

This module owns the choice between the CUDA and the CPU-thread handler. It imports both
lazily, inside ``make_handler``: ``spec`` (the interface both implement) never imports a
handler, so there is no import cycle, and importing this module loads neither torch nor Triton.
It must never copy, validate geometry or hold state: the handlers do that.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from kvshm.errors import InvalidArgumentError

if TYPE_CHECKING:
    import torch

    from kvshm.transfer.spec import TransferHandler


def make_handler(device_tensors: Sequence[torch.Tensor], planes: Sequence[torch.Tensor], *,
                 block_size_factor: int = 1,
                 kv_dim_before_num_blocks: Sequence[bool] | None = None,
                 **options: Any) -> TransferHandler:
    """CUDA handler if the device tensors are on CUDA, CPU-thread handler otherwise.

    ``options`` go to the handler: CPU ``threads``, ``split_min_bytes``, ``checksums`` (a
    ``kvshm.shm.checksums.BlockSums``: write sums on stores, verify them on loads); CUDA ``pin`` (a
    PinnedRegion or BackgroundPin the handler owns and releases on shutdown), ``method``,
    ``kernel_below`` (see ``kvshm.transfer.cuda_copy``).
    """
    if not device_tensors:
        raise InvalidArgumentError("make_handler needs at least one device tensor")
    if device_tensors[0].device.type == "cuda":
        from kvshm.transfer.cuda_copy import CudaTransferHandler
        return CudaTransferHandler(device_tensors, planes, block_size_factor=block_size_factor,
                                   kv_dim_before_num_blocks=kv_dim_before_num_blocks, **options)
    from kvshm.transfer.cpu_copy import CpuTransferHandler
    return CpuTransferHandler(device_tensors, planes, block_size_factor=block_size_factor,
                              kv_dim_before_num_blocks=kv_dim_before_num_blocks, **options)
