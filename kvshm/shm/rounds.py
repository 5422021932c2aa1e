"""The block table's batch write round, as one compiled call: open, copy, close.

This module owns the C loop behind ``BlockTable.write_many``'s common case: every entry of a
batch opened (its sequence word made odd: readers retry), one release fence, each entry's
body copied in, one release fence, every entry closed (the word one higher, even). numpy
made the same stores with five fancy-indexing calls, a tenth of the owner's time on a store
that evicts. The stores and their order are the numpy path's, so a reader or a successor
sees nothing new: an owner killed inside leaves entries odd, which a takeover settles.

It must never write outside the table: every block id is range-checked before the first
store. It decides no field's value (the caller packs the bodies) and never runs where a crash
point must fire inside the round (tests): ``write`` answers False, and numpy does the round.
"""
from __future__ import annotations

import ctypes
from array import array
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvshm.shm.native import CLibrary

_SOURCE = r"""
#include <stdint.h>
#include <string.h>
/* table: entry 0's first byte; entries of `stride` bytes, each beginning with its u32
   sequence word; body: n bodies of `size` bytes, body k for block[k], copied to `off`. */
int64_t kvshm_table_round(uint8_t *table, int64_t num_blocks, int64_t stride, int64_t off,
                          int64_t size, const int32_t *block, const uint8_t *body,
                          int64_t n) {
    for (int64_t k = 0; k < n; k++)
        if (block[k] < 0 || block[k] >= num_blocks) return -1;
    for (int64_t k = 0; k < n; k++) {
        uint32_t *seq = (uint32_t *)(table + block[k] * stride);
        __atomic_store_n(seq, __atomic_load_n(seq, __ATOMIC_RELAXED) | 1u, __ATOMIC_RELAXED);
    }
    __atomic_thread_fence(__ATOMIC_RELEASE);
    for (int64_t k = 0; k < n; k++)
        memcpy(table + block[k] * stride + off, body + k * size, (size_t)size);
    __atomic_thread_fence(__ATOMIC_RELEASE);
    for (int64_t k = 0; k < n; k++) {  /* (| 1: a block named twice still ends even) */
        uint32_t *seq = (uint32_t *)(table + block[k] * stride);
        __atomic_store_n(seq, (__atomic_load_n(seq, __ATOMIC_RELAXED) | 1u) + 1u,
                         __ATOMIC_RELEASE);
    }
    return 0;
}
"""


def _self_test(fns: dict[str, Any]) -> bool:
    """Two bodies land at their blocks' offsets, the sequence words end one round on, and an
    id past the table is refused before any store."""
    table = np.zeros((4, 16), np.uint8)
    table[1, 0] = table[3, 0] = 6  # even: closed
    body = bytes(range(1, 9))
    fn, t = fns["kvshm_table_round"], table.ctypes.data
    b = array("i", [3, 1])
    ok = fn(t, 4, 16, 8, 4, b.buffer_info()[0], body, 2) == 0
    want = np.zeros((4, 16), np.uint8)
    want[1, 0] = want[3, 0] = 8
    want[3, 8:12], want[1, 8:12] = [1, 2, 3, 4], [5, 6, 7, 8]
    bad = array("i", [0, 4])
    return (ok and bool((table == want).all())
            and fn(t, 4, 16, 8, 4, bad.buffer_info()[0], body, 2) == -1
            and bool((table == want).all()))


LIBRARY = CLibrary("rounds", "table write rounds", _SOURCE, {"kvshm_table_round": (
    ctypes.c_int64, [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                     ctypes.c_int64, ctypes.c_void_p, ctypes.c_char_p, ctypes.c_int64])},
    _self_test)


def load() -> bool:
    """Build (once per host) and load the round; True when ``write`` will use it."""
    return LIBRARY.load()


def check_blocks(blocks: Sequence[int], num_blocks: int) -> None:
    """Refuse ``blocks`` unless every id names an entry of a table of ``num_blocks``: what the
    C loop checks, for the Python paths too (numpy wraps a negative id around to the end)."""
    if len(blocks) and not 0 <= min(blocks) <= max(blocks) < num_blocks:
        raise IndexError(f"a round over blocks {min(blocks)}..{max(blocks)} of a table of "
                         f"{num_blocks}")


def write(table: int, num_blocks: int, stride: int, blocks: Sequence[int], off: int,
          bodies: bytes) -> bool:
    """One round over ``blocks`` (distinct ids) of the table at address ``table`` (its
    ``num_blocks`` entries ``stride`` bytes apart): body k of ``bodies`` (``len(blocks)`` of
    one size) at byte ``off`` of block k's entry. False, with nothing written, when the loop
    is not loaded: the caller does the round itself."""
    fns = LIBRARY.fns
    if fns is None:
        return False
    try:
        b = array("i", blocks)
    except OverflowError:  # past any table: refused as the loop refuses one
        raise IndexError(f"a round over blocks {min(blocks)}..{max(blocks)}") from None
    size, rem = divmod(len(bodies), len(b) or 1)
    if rem or off + size > stride:
        raise ValueError(f"a round of {len(b)} blocks with {len(bodies)} bytes of bodies")
    if fns["kvshm_table_round"](table, num_blocks, stride, off, size, b.buffer_info()[0],
                                bodies, len(b)):
        raise IndexError(f"a round over blocks {min(b)}..{max(b)} of a table of {num_blocks}")
    return True
