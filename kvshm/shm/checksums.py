"""Optional block checksums: a crc32 per block and plane, stored in the segment.

This module owns the checksum region that ``Layout(checksums=True)`` adds after the key index
(``Geometry.sums_offset``: a ``(num_blocks, num_planes)`` little-endian u32 array, absent
without the option), how a plane's page is summed, and the ``checksum_failures`` counter.

Who writes what, and when:

* A sum is ``zlib.crc32`` of one plane's whole page of one block (``factor`` device blocks
  with a ``block_size_factor``). It is written by the process that copied that plane into the
  block (each tensor-parallel worker writes the planes it owns), after its copy and before it
  reports the job done, so before ``complete_store`` publishes the block READY. A store that
  fills only part of a page sums the whole page as it stands: vLLM stores whole blocks.
* A load (the CPU handler) recomputes the sum of each page it copied out, after the copy. The
  block is pinned READY while it is loaded, so the page is what was copied. A mismatch fails
  the job with ``TransferError`` (the engine recomputes) and adds 1 to ``checksum_failures``:
  a header counter that, unlike the others, any copying process writes, under the kernel lock
  on byte ``LOCK_CHECKSUM_FAILURES`` (read, add, store) plus a thread lock (OFD locks do not
  exclude two threads of one process).
* ``kvshm-inspect verify --data`` checks every READY block's planes.
* The CUDA handler neither writes nor checks sums: a segment with checksums needs the CPU
  handler on every process that stores into it, or loads report mismatches.

zlib.crc32 sums about 2-2.5 GB/s on one core here, serially after the copy in the copying
thread, which caps a checksummed CPU transfer near that rate: 14-40% of the plain handler's
throughput as measured by ``tools/bench_transfer.py --checksums`` (docs/benchmarks.md); the
option is off by default for that reason. This module never maps memory of its own.
"""
from __future__ import annotations

import threading
import zlib
from typing import TYPE_CHECKING

import numpy as np

from kvshm.errors import InvalidArgumentError
from kvshm.shm import layout as L
from kvshm.shm import locks

if TYPE_CHECKING:  # (segment imports this module lazily)
    from kvshm.shm.segment import Segment

_failures_lock = threading.Lock()


def page_sum(page: np.ndarray) -> int:
    """crc32 of one block's page of one plane (a C-contiguous uint8 row)."""
    return zlib.crc32(page.data)


class BlockSums:
    """The checksum region of an attached segment with ``Layout(checksums=True)``."""

    def __init__(self, seg: Segment) -> None:
        g = seg.geometry
        if not g.checksums:
            raise InvalidArgumentError(
                f"segment {seg.name!r} was created without block checksums; create it with "
                "Layout(..., checksums=True)")
        self.segment = seg
        self.planes = seg.planes()
        self.sums = np.frombuffer(seg.buf, "<u4", g.num_blocks * len(g.page_bytes),
                                  g.sums_offset).reshape(g.num_blocks, len(g.page_bytes))
        self._bases = {int(p.ctypes.data): i for i, p in enumerate(self.planes)}

    def plane_of(self, address: int) -> int:
        """The plane index whose first byte is at ``address`` in this process."""
        try:
            return self._bases[int(address)]
        except KeyError:
            raise InvalidArgumentError(
                "a plane given to the transfer handler is not a plane of the checksummed "
                "segment; pass segment.torch_planes() (whole planes)") from None

    def store(self, blocks: np.ndarray, planes: list[int]) -> None:
        """Record the sums of ``planes`` of ``blocks`` (after their copy, before done)."""
        for i in planes:
            plane = self.planes[i]
            for b in blocks.tolist():
                self.sums[b, i] = page_sum(plane[b])

    def bad(self, blocks: np.ndarray, planes: list[int]) -> list[tuple[int, int]]:
        """(block, plane) pairs of ``blocks`` whose page no longer matches its sum."""
        return [(b, i) for i in planes for b in blocks.tolist()
                if page_sum(self.planes[i][b]) != int(self.sums[b, i])]

    def count_failure(self, n: int = 1) -> None:
        """Add ``n`` to the header counter ``checksum_failures`` (any process may)."""
        seg = self.segment
        k = L.COUNTER_NAMES.index("checksum_failures")
        with _failures_lock, locks.holding(seg.fd, L.LOCK_CHECKSUM_FAILURES):
            seg._counters[k] = (int(seg._counters[k]) + n) & 0xFFFFFFFFFFFFFFFF
