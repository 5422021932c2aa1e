"""Transfer handlers: the interface, and the block-map logic every handler shares.

This module owns ``TransferSpec`` / ``TransferResult``, the ``TransferHandler`` interface, the
geometry check that pairs each canonical device tensor with its segment plane, validation of a
job against that geometry (ids in range, counts, duplicates), vLLM-style block-id expansion
(``block_size_factor`` and the skip of a partially device-cached first block), coalescing of
contiguous runs. ``make_handler`` lives in ``factory.py``.

It must never import torch at module level (``import kvshm`` stays light; torch is imported
inside the functions that receive tensors), move a byte, touch CUDA, or import a handler
(``cpu_copy`` and ``cuda_copy`` import this module; the reverse would be a cycle).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from kvshm.errors import InvalidArgumentError
from kvshm.transfer import native_check

if TYPE_CHECKING:
    import torch

KINDS = ("store", "load")
LANES = KINDS + ("expedited",)  # expedited loads never queue behind regular work


@dataclass(frozen=True)
class TransferSpec:
    """One job: ``store`` copies device -> segment, ``load`` copies segment -> device.

    The device blocks map onto consecutive sub-blocks of the segment blocks, starting
    ``skip`` sub-blocks into the FIRST segment block (the device already holds those). By
    default ``skip = len(segment_block_ids) * factor - len(device_block_ids)``, in
    ``[0, factor)``, so the job ends on a segment-block boundary; give ``skip`` explicitly for
    a job that also ends inside its last segment block (vLLM: a load ending mid-chunk).
    ``expedited`` (loads only): the caller waits for it within its step, so the handler runs
    it on its own lane, ahead of queued regular loads and stores.
    """
    kind: Literal["store", "load"]
    device_block_ids: Sequence[int]
    segment_block_ids: Sequence[int]
    skip: int | None = None
    expedited: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise InvalidArgumentError(
                f"TransferSpec.kind must be 'store' (device -> segment) or 'load' "
                f"(segment -> device), got {self.kind!r}")
        if self.expedited and self.kind != "load":
            raise InvalidArgumentError("only a load can be expedited")

    @property
    def lane(self) -> str:
        """The queue (CPU thread, CUDA stream) a handler runs this job on."""
        return "expedited" if self.expedited else self.kind


@dataclass(frozen=True)
class TransferResult:
    """Completion of one job. ``nbytes`` counts every plane; 0 when ``success`` is False.
    ``error``: why a failed job failed (a ``TransferError`` for a block checksum mismatch)."""
    job_id: int
    success: bool
    nbytes: int
    seconds: float
    kind: str
    error: Exception | None = None


class TransferHandler(ABC):
    """Moves KV blocks between one process's device tensors and the segment's planes."""

    @abstractmethod
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Validate ``spec`` completely, then queue it; True when queued.

        Raises InvalidArgumentError (bad ids, counts, duplicate job id) or TransferError
        (handler shut down) before any byte moves.
        """

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Jobs completed since the last call; FIFO order within a lane (a direction, or
        the expedited loads)."""

    @abstractmethod
    def wait(self, job_ids: Iterable[int]) -> None:
        """Return once those jobs are finished and their bytes are in place.

        Unknown or already reported ids return at once. Results stay queued for get_finished.
        """

    @abstractmethod
    def shutdown(self) -> None:
        """Drain queued jobs, stop threads/streams, release pins. Idempotent."""

    def __enter__(self) -> TransferHandler:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


# --- geometry ----------------------------------------------------------------------------
@dataclass(frozen=True)
class PlanePair:
    """A canonical device tensor (or one K/V half) and the segment plane that mirrors it."""
    device: Any            # (num_device_blocks, page_bytes) uint8 view of the engine tensor
    plane: Any             # (num_segment_blocks, factor * page_bytes) uint8 CPU view
    page_bytes: int
    device_stride: int     # bytes from one device block to the next
    plane_stride: int      # bytes from one segment block to the next
    device_ptr: int
    plane_ptr: int

    def device_span(self) -> int:
        """Bytes from the first device block's start to the last one's end."""
        return (self.device.shape[0] - 1) * self.device_stride + self.page_bytes

    def plane_span(self, factor: int) -> int:
        return (self.plane.shape[0] - 1) * self.plane_stride + factor * self.page_bytes


@dataclass(frozen=True)
class Geometry:
    pairs: tuple[PlanePair, ...]
    num_device_blocks: int
    num_segment_blocks: int
    factor: int


def _byte_rows(t: torch.Tensor, what: str) -> torch.Tensor:
    """``(n, ...)`` tensor -> zero-copy ``(n, row_bytes)`` uint8 view (rows may be strided)."""
    import torch
    if t.dim() < 1 or t.shape[0] == 0:
        raise InvalidArgumentError(f"{what} has shape {tuple(t.shape)}; it needs >= 1 block")
    if t.dim() == 1:
        t = t.unsqueeze(1)
    if not t[0].is_contiguous():
        raise InvalidArgumentError(
            f"{what}: the bytes of one block must be contiguous (shape {tuple(t.shape)}, "
            f"strides {t.stride()}); pass the tensor in its storage layout")
    try:
        return t.view(torch.uint8).view(t.shape[0], -1)
    except RuntimeError as e:  # e.g. a strided last dimension
        raise InvalidArgumentError(f"{what} cannot be viewed as bytes: {e}") from None


def build_geometry(device_tensors: Sequence[torch.Tensor], planes: Sequence[torch.Tensor],
                   block_size_factor: int = 1,
                   kv_dim_before_num_blocks: Sequence[bool] | None = None) -> Geometry:
    """Pair every canonical device tensor with its plane and check that they fit."""
    factor = block_size_factor
    if not isinstance(factor, int) or factor < 1:
        raise InvalidArgumentError(f"block_size_factor must be an int >= 1, got {factor!r}")
    if not device_tensors:
        raise InvalidArgumentError("make_handler needs at least one device tensor")
    flags = [False] * len(device_tensors) if kv_dim_before_num_blocks is None \
        else [bool(f) for f in kv_dim_before_num_blocks]
    if len(flags) != len(device_tensors):
        raise InvalidArgumentError(
            f"kv_dim_before_num_blocks has {len(flags)} entries for {len(device_tensors)} "
            f"device tensors; give one flag per tensor")
    halves: list[tuple[Any, str]] = []
    for i, (t, kvfirst) in enumerate(zip(device_tensors, flags)):
        if kvfirst:  # FlashAttention (2, num_blocks, ...): K and V are separate planes
            if t.dim() < 2 or t.shape[0] != 2:
                raise InvalidArgumentError(
                    f"device tensor {i} is flagged kv_dim_before_num_blocks but has shape "
                    f"{tuple(t.shape)}; expected (2, num_blocks, ...)")
            halves += [(t[0], f"device tensor {i} (K half)"), (t[1], f"device tensor {i} (V half)")]
        else:
            halves.append((t, f"device tensor {i}"))
    if len(planes) != len(halves):
        raise InvalidArgumentError(
            f"{len(planes)} planes given for {len(halves)} canonical device tensors (a K/V-first "
            f"tensor needs two planes, K then V)")
    device = device_tensors[0].device
    pairs: list[PlanePair] = []
    n_dev: int | None = None
    n_seg: int | None = None
    for (half, what), plane in zip(halves, planes):
        if half.device != device:
            raise InvalidArgumentError(f"{what} is on {half.device}, tensor 0 on {device}; "
                                       f"one handler serves one device")
        dev = _byte_rows(half, what)
        pname = f"plane {len(pairs)}"
        if plane.device.type != "cpu" or plane.dim() != 2 or plane.element_size() != 1:
            raise InvalidArgumentError(
                f"{pname} must be a 2-D uint8/int8 CPU tensor, got {plane.dtype} "
                f"{tuple(plane.shape)} on {plane.device}")
        pl = _byte_rows(plane, pname)
        page = dev.shape[1]
        if pl.shape[1] != factor * page:
            raise InvalidArgumentError(
                f"{pname} rows are {pl.shape[1]} bytes but {what} pages are {page} bytes and "
                f"block_size_factor is {factor}: expected {factor * page}")
        if n_dev not in (None, dev.shape[0]) or n_seg not in (None, pl.shape[0]):
            raise InvalidArgumentError(f"{what}/{pname}: every device tensor must have the same "
                                       f"number of blocks, and so must every plane")
        n_dev, n_seg = dev.shape[0], pl.shape[0]
        if dev.stride(0) < page or pl.stride(0) < factor * page:
            raise InvalidArgumentError(f"{what}/{pname}: blocks overlap (row stride < row size)")
        pairs.append(PlanePair(dev, pl, page, dev.stride(0), pl.stride(0), dev.data_ptr(),
                               pl.data_ptr()))
    assert n_dev is not None and n_seg is not None  # at least one pair was checked above
    return Geometry(tuple(pairs), n_dev, n_seg, factor)


# --- block maps ----------------------------------------------------------------------------
def expand_block_ids(block_ids: np.ndarray, factor: int, skip: int = 0) -> np.ndarray:
    """vLLM's expand_block_ids: ``[0, 1, 3]`` with factor 4 -> ``0..3, 4..7, 12..15``;
    the first ``skip`` sub-blocks (of the first block) are dropped."""
    ids = np.asarray(block_ids, dtype=np.int64)
    return (ids[:, None] * factor + np.arange(factor, dtype=np.int64)).ravel()[skip:]


@dataclass(frozen=True)
class BlockPlan:
    """A validated job, one entry per transferred device block (= segment sub-block)."""
    kind: str
    device_ids: np.ndarray     # int64
    segment_rows: np.ndarray   # segment block holding each sub-block
    segment_subs: np.ndarray   # position of the sub-block inside its segment block

    @property
    def n(self) -> int:
        return int(self.device_ids.shape[0])


_I64, _U64 = np.dtype(np.int64), np.dtype(np.uint64)


def _ids(values: Sequence[int], what: str) -> np.ndarray:
    # Always a copy the job owns (np.array copies; a list is converted once): the ids checked
    # must be the ids copied, whatever the caller does to its arrays once the job is issued.
    arr = np.array(values)
    if arr.dtype is _I64 and arr.ndim == 1:  # the usual job: nothing to convert or check
        return arr
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{what} must be a flat sequence of ints, got dtype "
                                   f"{arr.dtype} shape {arr.shape}")
    return arr.astype(np.int64, copy=False)


_max = np.maximum.reduce  # ndarray.max() adds a Python layer: ~0.5 us per call at 1,000 ids
_ZEROS = np.zeros(0, np.int64)


def _zeros(n: int) -> np.ndarray:
    """``n`` int64 zeros, read-only, from one buffer shared by every job (no allocation)."""
    global _ZEROS
    if _ZEROS.size < n:
        z = np.zeros(max(n, 4096), np.int64)
        z.flags.writeable = False
        _ZEROS = z
    return _ZEROS[:n]


def _check_range(ids: np.ndarray, limit: int, what: str) -> None:
    # One pass: a negative id is a huge unsigned one. The detailed search runs on failure only.
    if not ids.size or _max(ids.view(_U64)) < limit:
        return
    bad = np.flatnonzero((ids < 0) | (ids >= limit))
    i = int(bad[0])
    raise InvalidArgumentError(
        f"{what}[{i}] = {int(ids[i])} is out of range [0, {limit}) ({bad.size} bad ids); "
        f"nothing was copied")


def _check_unique(ids: np.ndarray, limit: int, what: str) -> None:
    """Refuse a destination named twice; ``ids`` are already known to lie in [0, limit)."""
    if ids.size < 2:
        return
    if limit <= 16 * ids.size:  # a mark per possible id: ~4 us for 1,000 ids, no sort
        seen = np.zeros(limit, np.bool_)
        seen[ids] = True
        if np.count_nonzero(seen) == ids.size:
            return
    else:  # sort the narrowest type: uint16 takes numpy's radix sort (~3 us for 1,000 ids),
        # int32 its SIMD quicksort (~6 us); int64 took ~11 us
        if limit <= 1 << 16:
            srt = np.sort(ids.astype(np.uint16), kind="stable")
        else:
            srt = np.sort(ids.astype(np.int32 if limit <= 1 << 31 else np.int64))
        if not np.any(srt[1:] == srt[:-1]):
            return
    srt = np.sort(ids)
    dup = np.flatnonzero(srt[1:] == srt[:-1])
    raise InvalidArgumentError(
        f"{what} names destination {int(srt[dup[0]])} more than once; a job may write "
        f"each destination block once")


def plan_transfer(spec: TransferSpec, geo: Geometry) -> BlockPlan:
    """Validate ``spec`` against ``geo`` and expand it; raises before anything is copied."""
    if not isinstance(spec, TransferSpec):
        raise InvalidArgumentError(f"expected a TransferSpec, got {type(spec).__name__}")
    dev = _ids(spec.device_block_ids, "device_block_ids")
    seg = _ids(spec.segment_block_ids, "segment_block_ids")
    f = geo.factor
    skip = seg.size * f - dev.size if spec.skip is None else spec.skip
    tail = seg.size * f - dev.size - skip  # unused sub-blocks at the end of the last block
    if not 0 <= skip < f or not 0 <= tail < f:
        raise InvalidArgumentError(
            f"{dev.size} device blocks starting {skip} sub-blocks in do not fit {seg.size} "
            f"segment blocks with block_size_factor {f}: the job must start in the first "
            f"and end in the last segment block (skip in [0, {f}))")
    # one compiled pass when it is sure the ids are good; numpy finds and words what is not
    if not native_check.check(dev, seg, geo.num_device_blocks, geo.num_segment_blocks,
                              spec.kind == "load"):
        _check_range(dev, geo.num_device_blocks, "device_block_ids")
        _check_range(seg, geo.num_segment_blocks, "segment_block_ids")
        if spec.kind == "store":
            _check_unique(seg, geo.num_segment_blocks, "segment_block_ids")
        else:
            _check_unique(dev, geo.num_device_blocks, "device_block_ids")
    if f == 1:  # the common case: no expansion, no division
        return BlockPlan(spec.kind, dev, seg, _zeros(seg.size))
    sub = expand_block_ids(seg, f, skip)[:dev.size]
    return BlockPlan(spec.kind, dev, sub // f, sub % f)


def coalesce(plan: BlockPlan, factor: int, device_contiguous: bool,
             plane_contiguous: bool) -> tuple[np.ndarray, np.ndarray]:
    """Runs of sub-blocks that are adjacent in memory on both sides: (first index, length).

    Device blocks ``d, d+1`` are adjacent when device rows are packed; segment sub-blocks are
    adjacent inside a segment block, and across blocks only when plane rows are packed.
    """
    n = plan.n
    if n == 0:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    if device_contiguous and n > 1:
        nxt = np.diff(plan.device_ids) == 1
        nxt &= np.diff(plan.segment_rows * factor + plan.segment_subs) == 1
        if not plane_contiguous:
            nxt &= plan.segment_rows[1:] == plan.segment_rows[:-1]
        starts = np.flatnonzero(np.concatenate(([True], ~nxt)))
    else:
        starts = np.arange(n, dtype=np.int64)
    return starts, np.diff(np.append(starts, n))


@dataclass(frozen=True)
class PairRuns:
    """Byte runs of one job in one plane pair: offsets from the pair's base pointers."""
    pair: PlanePair
    device_off: np.ndarray
    plane_off: np.ndarray
    nbytes: np.ndarray


def job_runs(plan: BlockPlan, geo: Geometry) -> list[PairRuns]:
    """Coalesced byte runs of ``plan`` for every pair, bounds-checked (defence in depth)."""
    cache: dict[tuple[bool, bool], tuple[np.ndarray, np.ndarray]] = {}
    out = []
    for p in geo.pairs:
        key = (p.device_stride == p.page_bytes, p.plane_stride == geo.factor * p.page_bytes)
        if key not in cache:  # run structure depends only on which sides are packed
            cache[key] = coalesce(plan, geo.factor, *key)
        starts, counts = cache[key]
        d = plan.device_ids[starts] * p.device_stride
        s = plan.segment_rows[starts] * p.plane_stride + plan.segment_subs[starts] * p.page_bytes
        nb = counts * p.page_bytes
        if nb.size and (d.min() < 0 or (d + nb).max() > p.device_span() or s.min() < 0
                        or (s + nb).max() > p.plane_span(geo.factor)):
            raise AssertionError("kvshm bug: a computed run leaves its tensor")  # pragma: no cover
        out.append(PairRuns(p, d, s, nb))
    return out

