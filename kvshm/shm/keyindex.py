"""The key index, as it lies in the segment: key -> block, for lock-free lookups.

This module owns the open-addressing hash table (linear probing, crc32 tags, at most half
full) from a key to the block whose table entry holds it. Only the owner writes it; every
process may read it without a lock, while it changes: a reader verifies every candidate
against the block's entry (``BlockTable``), so a concurrent change can cause a spurious miss,
never a wrong hit. Deletion shifts entries back (no tombstones to rot). It never decides
which keys are cached (see ``owner/manager.py``).
"""
from __future__ import annotations

import zlib
from collections.abc import Sequence

import numpy as np

from kvshm.shm import layout as L
from kvshm.shm import probing
from kvshm.shm.table import BlockTable

_EMPTY = probing.EMPTY  # a slot as a u64: tag | block << 32; every used slot is below it


def tags_of(keys: Sequence[bytes]) -> list[int]:
    """The index tags (crc32) of ``keys``, computed in one C-level pass. A key's table
    checksum is its tag xor a constant of its length (``entry.KEYSUM_XOR``), so a batch
    writer that needs both computes one crc32 per key."""
    return list(map(zlib.crc32, keys))


class KeyIndex:
    """Linear-probing hash table key -> block id (crc32 tags), at most half full."""

    def __init__(self, buf: memoryview, geometry: L.Geometry, table: BlockTable):
        self.buf = buf
        self.base = geometry.index_offset
        self.mask = geometry.index_slots - 1
        self.table = table
        self._slots = np.frombuffer(buf, np.int32, 2 * geometry.index_slots,
                                    self.base).reshape(-1, 2)
        # The owner's writers go through flat word views (slot i: tag at 2i, block at 2i+1):
        # an item store is one aligned 32-bit word, cheaper than packing a struct.
        flat = self._slots.reshape(-1)
        self._words, self._uwords = flat.data, flat.view(np.uint32).data
        # The owner's batch writers see a slot as one little-endian u64 (tag | block << 32):
        # one load reads both fields and one aligned store writes both, so a reader never
        # sees a slot half moved, and the probe loops do half the memory operations.
        assert self.base % 8 == 0 and np.little_endian
        self._slot64 = flat.view(np.uint64).data
        # (the compiled loops' view of the same words; this object keeps the mapping alive,
        # as the segment's buffer cannot be closed while a view of it is exported)
        self._addr = flat.ctypes.data

    def find_prefix(self, keys: Sequence[bytes], karr: np.ndarray
                    ) -> tuple[np.ndarray, np.ndarray]:
        """(blocks, states) of equal-length ``keys`` (``karr``: their bytes as an (n, len)
        uint8 array), vectorised over the home slots.

        A key not in its home slot (a collision pushed it further, or it is absent) is
        resolved by the scalar ``find``, up to the first real miss: entries after it are
        left at state -1, as a prefix lookup does not need them.
        """
        crc = zlib.crc32
        tags = np.fromiter((crc(k) for k in keys), np.uint32, len(keys))
        slots = self._slots[(tags & self.mask).astype(np.intp)]
        blocks = slots[:, 1].copy()
        home = (slots[:, 0].view(np.uint32) == tags) & (blocks >= 0) & \
            (blocks < self.table.num_blocks)
        states = np.full(len(keys), -1, np.int16)
        if home.any():
            states[home] = self.table.states_if_keys(blocks[home], karr[home])
        for i in np.flatnonzero(states < 0).tolist():
            blocks[i], states[i] = self.find(keys[i])
            if states[i] < 0:
                break
        return blocks, states

    def probe(self, key: bytes) -> int:
        """The block of the first slot whose tag is ``key``'s, or -1: a candidate only, which
        the caller verifies against the entry (``find`` does the whole search). A slot
        naming a block past the table (damaged) is no candidate."""
        w, u, mask, n = self._words, self._uwords, self.mask, self.table.num_blocks
        tag = zlib.crc32(key)
        i = tag & mask
        for _ in range(mask + 1):
            block = w[2 * i + 1]
            if block < 0:
                return -1
            if u[2 * i] == tag and block < n:
                return block
            i = (i + 1) & mask
        return -1

    def find(self, key: bytes) -> tuple[int, int]:
        """(block, state) holding ``key``, or (-1, -1). Lock-free; may miss spuriously."""
        w, u, mask = self._words, self._uwords, self.mask
        tag = zlib.crc32(key)
        i = tag & mask
        for _ in range(mask + 1):
            block = w[2 * i + 1]
            if block < 0:
                return -1, -1
            # a block past the table (a slot damaged) names nothing: a miss, never a fault
            if u[2 * i] == tag and block < self.table.num_blocks:
                state = self.table.state_if_key(block, key)
                if state >= 0:
                    return block, state
            i = (i + 1) & mask
        return -1, -1

    # --- owner-only writers -------------------------------------------------------------
    def insert(self, key: bytes, block: int) -> None:
        self.insert_many([block], [zlib.crc32(key)])

    def insert_many(self, blocks: Sequence[int], tags: Sequence[int]) -> None:
        """``insert`` of each key (none indexed yet) at its block, given the keys' tags
        (``tags_of``): a store's batch in one call (``probing``: compiled where built)."""
        probing.insert(self._slot64, self._addr, self.mask, tags, blocks)

    def remove(self, key: bytes, block: int) -> None:
        """Delete ``key``'s slot with backward-shift deletion (no tombstones to rot)."""
        self.remove_many([block], [zlib.crc32(key)])

    def remove_many(self, blocks: Sequence[int], tags: Sequence[int]) -> None:
        """``remove`` of each key, given its block and its tag (``tags_of``), in one call.

        The slot is found by its block (a block holds one key), so the key bytes are not
        needed: a caller that knows the tags (from ``tags_of``, or the table's key checksum)
        spares a checksum per key."""
        probing.remove(self._slot64, self._addr, self.mask, tags, blocks)

    def retain(self, blocks: Sequence[int], tags: Sequence[int]) -> None:
        """Empty every slot but one of each key at ``blocks`` with ``tags`` (as
        ``insert_many`` wrote them), so that a process dying anywhere in here leaves each
        kept key findable: a takeover cuts its predecessor's index down to the offers it
        keeps indexed, and that index is the next takeover's record of them.

        The slot of a kept key is the first holding it that a probe from its home reaches:
        a copy further on (an owner killed inside a backward shift leaves the entry it moved
        in two slots) goes, or it would outlive the key's removal, naming the block for a
        key it no longer holds. Slots on no kept slot's probe path go in one batch (emptying
        them breaks no path); the few left are deleted one by one (``_delete_at``)."""
        q, mask = self._slots.reshape(-1).view(np.uint64), self.mask
        kept = [tag | block << 32 for tag, block in zip(tags, blocks)]
        on_path = np.zeros(len(q), bool)
        for p in self._first_slots(kept):
            home = int(q[p]) & mask
            if home <= p:
                on_path[home:p + 1] = True
            else:  # (wrapped around the end)
                on_path[home:] = True
                on_path[:p + 1] = True
        q[(q < _EMPTY) & ~on_path] = _EMPTY
        # Highest slot first: a deletion moves only entries after its slot, so the others'
        # places hold, but for a cluster wrapping around the end (a moved one is left to the
        # next round, which finds it again; each round deletes its highest slot at least).
        while left := sorted(set(np.flatnonzero(q < _EMPTY).tolist()) -
                             self._first_slots(kept), reverse=True):
            for i, v in zip(left, q[left].tolist()):
                if int(q[i]) == v:
                    self._delete_at(i)

    def _first_slots(self, values: list[int]) -> set[int]:
        """The slot of each of ``values`` (slots as u64s) that a probe from its home reaches
        first (none for a value no probe reaches)."""
        q, mask = self._slot64, self.mask
        found = set()
        for v in values:
            i = v & mask
            for _ in range(mask + 1):  # (bounded: a damaged index may have no empty slot)
                w = q[i]
                if w >= _EMPTY:
                    break
                if w == v:
                    found.add(i)
                    break
                i = (i + 1) & mask
        return found

    def _delete_at(self, i: int) -> None:
        """Empty slot ``i`` by backward-shift deletion (``probing.delete_at_py``)."""
        probing.delete_at_py(self._slot64, self.mask, i)

    def clear(self) -> None:
        n = self.mask + 1
        self.buf[self.base:self.base + 8 * n] = L.INDEX_SLOT.pack(0, -1) * n
