"""The key index's writing loops: inserts, and deletions by backward shift, Python and C.

This module owns the loops by which the owner changes the key index's slots (``keyindex``
says what a slot holds): a batch insert, a batch removal by block, and the backward-shift
deletion of one slot. Each exists twice, in Python and as a C loop built once per host
(``native``), and both make the same stores in the same order, each one aligned 64-bit word:
lock-free readers in other processes see exactly the states the Python loops would show them,
and an owner killed between two stores leaves what a takeover already repairs (``retain``).
The C loops only run the owner's hot path faster (a store of 16 keys evicting 16 spent a
quarter of the owner's time in them); where they are not built, the Python loops serve.

It must never decide which keys are indexed, read a key's bytes or touch the block table;
and no loop may run forever on a damaged index (every probe is bounded by the slot count).
"""
from __future__ import annotations

import ctypes
from array import array
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvshm.shm.native import CLibrary

# A slot as a u64 (tag | block << 32): empty (block -1, tag 0) is the least value with the
# block's sign bit set, and every used slot (block >= 0) is below it.
EMPTY = 0xFFFFFFFF << 32

_SOURCE = r"""
#include <stdint.h>
#define EMPTY (0xFFFFFFFFull << 32)
/* q: the index's slots (tag | block << 32), mask + 1 of them. Only the owner writes them,
   while other processes read them without a lock: every store is one aligned 64-bit store,
   released in program order, as the Python loops make them. */
static inline uint64_t get(uint64_t *q, uint64_t i) {
    return __atomic_load_n(&q[i], __ATOMIC_RELAXED);
}
static inline void put(uint64_t *q, uint64_t i, uint64_t v) {
    __atomic_store_n(&q[i], v, __ATOMIC_RELEASE);
}
/* Empty slot i: each entry after it in its cluster moves back into the hole unless its home
   lies cyclically in (hole, entry]; an entry is copied before its old slot empties. */
static void delete_at(uint64_t *q, uint64_t mask, uint64_t i) {
    uint64_t j = i;
    for (uint64_t step = 0; step < mask; step++) {
        j = (j + 1) & mask;
        uint64_t v = get(q, j);
        if (v >= EMPTY) break;
        if (((j - (v & mask)) & mask) >= ((j - i) & mask)) { put(q, i, v); i = j; }
    }
    put(q, i, EMPTY);
}
/* Insert block[k] under tag[k] at the first empty slot from its home. -1: a negative block
   (nothing written); -2: no empty slot (a damaged index; the keys before it are in). */
int64_t kvshm_index_insert(uint64_t *q, uint64_t mask, const uint32_t *tag,
                           const int32_t *block, int64_t n) {
    for (int64_t k = 0; k < n; k++)
        if (block[k] < 0) return -1;
    for (int64_t k = 0; k < n; k++) {
        uint64_t i = tag[k] & mask, step = 0;
        while (get(q, i) < EMPTY) {
            if (++step > mask) return -2;
            i = (i + 1) & mask;
        }
        put(q, i, (uint64_t)tag[k] | (uint64_t)(uint32_t)block[k] << 32);
    }
    return 0;
}
/* Delete the slot naming block[k] on tag[k]'s probe path, if any (a negative block names
   none: read as u32 it could match a damaged slot). */
int64_t kvshm_index_remove(uint64_t *q, uint64_t mask, const uint32_t *tag,
                           const int32_t *block, int64_t n) {
    for (int64_t k = 0; k < n; k++) {
        if (block[k] < 0) continue;
        uint64_t i = tag[k] & mask;
        for (uint64_t step = 0; step <= mask; step++) {
            uint64_t v = get(q, i);
            if (v >= EMPTY) break;
            if ((v >> 32) == (uint64_t)(uint32_t)block[k]) { delete_at(q, mask, i); break; }
            i = (i + 1) & mask;
        }
    }
    return 0;
}
"""


# --- the Python loops ---------------------------------------------------------------------
def insert_py(q: Any, mask: int, tags: Sequence[int], blocks: Sequence[int]) -> None:
    """Insert each block under its tag at the first empty slot from its home (``q``: the
    slots as a u64 memoryview). Its probes inlined: a call per key cost as much."""
    if len(blocks) and min(blocks) < 0:  # (before any store, as the C loop checks)
        raise ValueError(f"key index insert of block {min(blocks)}")
    for tag, block in zip(tags, blocks):
        i = tag & mask
        for _ in range(mask + 1):
            if q[i] >= EMPTY:
                break
            i = (i + 1) & mask
        else:
            raise RuntimeError("the key index has no empty slot (damaged)")
        q[i] = tag | block << 32


def remove_py(q: Any, mask: int, tags: Sequence[int], blocks: Sequence[int]) -> None:
    """Delete the slot naming each block on its tag's probe path (absent: nothing)."""
    for tag, block in zip(tags, blocks):
        i = tag & mask
        for _ in range(mask + 1):
            v = q[i]
            if v >= EMPTY:
                break
            if v >> 32 == block:
                delete_at_py(q, mask, i)
                break
            i = (i + 1) & mask


def delete_at_py(q: Any, mask: int, i: int) -> None:
    """Empty slot ``i`` by backward-shift deletion: each entry after it in its cluster moves
    back into the hole unless its home lies cyclically in (hole, entry] (its home is its
    tag's low bits: the low word's, as mask < 2**32); an entry is copied before its old slot
    is emptied, so a reader never misses it."""
    j = i
    for _ in range(mask):
        j = (j + 1) & mask
        v = q[j]
        if v >= EMPTY:
            break
        if (j - (v & mask)) & mask >= (j - i) & mask:
            q[i] = v
            i = j
    q[i] = EMPTY


# --- the compiled loops -------------------------------------------------------------------
def _self_test(fns: dict[str, Any]) -> bool:
    """Known inserts and removals on a small table end in the Python loops' slots."""
    tags = [5, 21, 6, 37, 7, 15]  # homes 5, 5, 6, 5, 7, 15 of 16: a cluster, and a wrap
    blocks = list(range(len(tags)))
    want, got = np.full(16, EMPTY, np.uint64), np.full(16, EMPTY, np.uint64)
    insert_py(want.data, 15, tags, blocks)
    remove_py(want.data, 15, tags[:2], blocks[:2])
    t, b = array("I", tags), array("i", blocks)
    q = got.ctypes.data
    return (fns["kvshm_index_insert"](q, 15, t.buffer_info()[0], b.buffer_info()[0], 6) == 0
            and fns["kvshm_index_remove"](q, 15, t.buffer_info()[0], b.buffer_info()[0], 2)
            == 0 and bool((got == want).all()))


_SIGNATURE = (ctypes.c_int64, [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_void_p,
                               ctypes.c_void_p, ctypes.c_int64])
LIBRARY = CLibrary("index", "key index loops", _SOURCE,
                   {"kvshm_index_insert": _SIGNATURE, "kvshm_index_remove": _SIGNATURE},
                   _self_test)


def load() -> bool:
    """Build (once per host) and load the C loops; True when ``insert`` and ``remove`` will
    use them. The owner calls it as it starts; no other process writes the index."""
    return LIBRARY.load()


def insert(q: Any, addr: int, mask: int, tags: Sequence[int], blocks: Sequence[int]) -> None:
    """``insert_py``, compiled where loaded (``addr``: the address of ``q``'s first slot)."""
    _run("kvshm_index_insert", insert_py, q, addr, mask, tags, blocks)


def remove(q: Any, addr: int, mask: int, tags: Sequence[int], blocks: Sequence[int]) -> None:
    """``remove_py``, compiled where loaded."""
    _run("kvshm_index_remove", remove_py, q, addr, mask, tags, blocks)


def _run(name: str, python: Callable[[Any, int, array, array], None], q: Any, addr: int,
         mask: int, tags: Sequence[int], blocks: Sequence[int]) -> None:
    """Loop ``name`` over the keys, or ``python`` where it is not loaded. Both read the ids
    as u32 and i32 arrays, whatever the caller's ints (a numpy int32 block shifted by 32 in
    the Python loop wraps): range-checked (OverflowError), their items Python ints. The C
    loop's codes raise what the Python loop raises."""
    t, b = array("I", tags), array("i", blocks)
    if len(t) != len(b):
        raise ValueError(f"key index change of {len(b)} blocks with {len(t)} tags")
    fns = LIBRARY.fns
    if fns is None:
        python(q, mask, t, b)
        return
    rc = fns[name](addr, mask, t.buffer_info()[0], b.buffer_info()[0], len(t))
    if rc == -1:
        raise ValueError(f"key index insert of block {min(b)}")
    if rc:
        raise RuntimeError("the key index has no empty slot (damaged)")
