"""The block table and the key index, as they lie in the segment.

This module owns the per-block records (state, key, writer, last use, pins) and the
open-addressing index from key to block. Only the owner writes them; every process may read
them without a lock. Writers bump a per-entry sequence number around each rewrite (odd while
writing, a seqlock), so a reader either sees a consistent entry or retries. The index may be
read while it is being changed: a reader verifies every candidate against the entry's key,
so a concurrent change can cause a spurious miss, never a wrong hit.
It never decides policy (see ``manager.py``) and never imports torch.
"""
from __future__ import annotations

import struct
import zlib
from typing import NamedTuple, Sequence

import numpy as np

from . import layout as L
from .fence import publish_fence

# struct.pack_into zero-fills its target before writing, so another process can observe a
# transient 0. Words that readers rely on (the seqlock word, last use, pins) are therefore
# written through memoryview casts, which store each word with one aligned copy; pack_into
# is only used for the entry body while the odd sequence number marks it as in flux.
_BODY = struct.Struct(f"<{L.ENTRY_FORMAT[2:]}{L.MAX_KEY_BYTES}s")  # all but seq, then the key
_KEY_OFF = L.ENTRY_KEY_OFFSET
_LAST_USE_WORD = L.entry_field_offset("last_use") // 8
_PINS_WORD = L.entry_field_offset("pins") // 8
_WORDS32 = L.ENTRY_BYTES // 4
_READ_SPINS = 100_000  # an owner rewrites an entry in microseconds; beyond this it died
_WORDS64 = L.ENTRY_BYTES // 8


class Entry(NamedTuple):
    seq: int
    state: int
    key: bytes
    writer: int  # client slot writing the block, -1 for none
    writer_gen: int
    writer_req: int
    last_use: int
    stored_ns: int
    pins: int


class BlockTable:
    """Typed access to the block table of a mapped segment."""

    def __init__(self, buf: memoryview, geometry: L.Geometry):
        self.buf = buf
        self.base = geometry.table_offset
        self.num_blocks = geometry.num_blocks
        region = buf[self.base:self.base + self.num_blocks * L.ENTRY_BYTES]
        self._w32 = region.cast("I")
        self._w64 = region.cast("Q")
        self._rows = np.frombuffer(buf, np.uint8, self.num_blocks * L.ENTRY_BYTES,
                                   self.base).reshape(self.num_blocks, L.ENTRY_BYTES)
        self._seqs = self._rows[:, :4].view(np.uint32)[:, 0]

    def close(self) -> None:
        self._w32.release()
        self._w64.release()
        del self._rows, self._seqs

    def states_if_keys(self, blocks: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Vectorised ``state_if_key``: ``keys`` is an (n, keylen) uint8 array of equal-length
        keys. Entries caught mid-rewrite read as -1 (a spurious miss, never a wrong hit)."""
        seq = self._seqs[blocks]
        publish_fence()
        rows = self._rows[blocks]
        publish_fence()
        klen = keys.shape[1]
        same = (rows[:, 5] == klen) & (rows[:, _KEY_OFF:_KEY_OFF + klen] == keys).all(axis=1)
        stable = ((seq & 1) == 0) & (self._seqs[blocks] == seq)
        return np.where(same & stable, rows[:, 4].astype(np.int16), -1)

    def read(self, block: int) -> Entry:
        """A consistent snapshot of ``block``'s entry (retries while the owner rewrites it)."""
        off = self.base + block * L.ENTRY_BYTES
        w, i = self._w32, block * _WORDS32
        while True:
            seq = w[i]
            publish_fence()
            f = _BODY.unpack_from(self.buf, off + 4)
            publish_fence()
            if not seq & 1 and w[i] == seq:
                return Entry(seq, f[0], f[8][:f[1]], *f[2:8])

    def state_if_key(self, block: int, key: bytes) -> int:
        """``block``'s state if it currently holds ``key``, else -1. Lock-free reader."""
        buf, off, w, i = self.buf, self.base + block * L.ENTRY_BYTES, self._w32, block * _WORDS32
        for _ in range(_READ_SPINS):
            seq = w[i]
            if seq & 1:
                continue
            publish_fence()
            state, keylen = buf[off + 4], buf[off + 5]
            same = keylen == len(key) and buf[off + _KEY_OFF:off + _KEY_OFF + keylen] == key
            publish_fence()
            if w[i] == seq:
                return state if same else -1
        return -1  # left odd by a dead owner: a miss until the next owner settles it

    # --- owner-only writers -------------------------------------------------------------
    def write(self, block: int, state: int, key: bytes, writer: int = -1, writer_gen: int = 0,
              writer_req: int = 0, last_use: int = 0, stored_ns: int = 0, pins: int = 0) -> None:
        w, i = self._w32, block * _WORDS32
        seq = w[i] | 1  # a writer that died mid-rewrite left it odd: move on from there
        w[i] = seq
        publish_fence()
        _BODY.pack_into(self.buf, self.base + block * L.ENTRY_BYTES + 4, state, len(key),
                        writer, writer_gen, writer_req, last_use, stored_ns, pins, key)
        publish_fence()
        w[i] = (seq + 1) & 0xFFFFFFFF

    def publish(self, block: int, tick: int, stored_ns: int) -> None:
        """WRITING -> READY: state, writer, last use and store time in one seqlock round
        (the key, already in place, stays)."""
        w, i = self._w32, block * _WORDS32
        seq = w[i] | 1
        w[i] = seq
        publish_fence()
        off = self.base + block * L.ENTRY_BYTES
        self.buf[off + 4] = L.READY
        self.buf[off + 6:off + 8] = b"\xff\xff"  # writer -1: nobody writes a ready block
        self._w64[block * _WORDS64 + _LAST_USE_WORD] = tick
        self._w64[block * _WORDS64 + _LAST_USE_WORD + 1] = stored_ns
        publish_fence()
        w[i] = (seq + 1) & 0xFFFFFFFF

    def set_state(self, block: int, state: int) -> None:
        w, i = self._w32, block * _WORDS32
        seq = w[i] | 1
        w[i] = seq
        publish_fence()
        self.buf[self.base + block * L.ENTRY_BYTES + 4] = state
        publish_fence()
        w[i] = (seq + 1) & 0xFFFFFFFF

    def settle(self, block: int) -> bool:
        """Owner only, at takeover: end a rewrite a dead owner left half done (odd seq).

        Nobody else would ever make the sequence even again, and every reader of the entry
        would spin forever. Returns True if the entry was torn; the caller decides what its
        contents are worth.
        """
        w, i = self._w32, block * _WORDS32
        seq = w[i]
        if not seq & 1:
            return False
        publish_fence()
        w[i] = (seq + 1) & 0xFFFFFFFF
        return True

    def set_last_use(self, block: int, tick: int) -> None:
        # A lone aligned word store: readers may see old or new, both are fine.
        self._w64[block * _WORDS64 + _LAST_USE_WORD] = tick

    def set_pins(self, block: int, pins: int) -> None:
        self._w64[block * _WORDS64 + _PINS_WORD] = pins


class KeyIndex:
    """Linear-probing hash table key -> block id (crc32 tags), at most half full."""

    def __init__(self, buf: memoryview, geometry: L.Geometry, table: BlockTable):
        self.buf = buf
        self.base = geometry.index_offset
        self.mask = geometry.index_slots - 1
        self.table = table
        self._slots = np.frombuffer(buf, np.int32, 2 * geometry.index_slots,
                                    self.base).reshape(-1, 2)

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
        home = (slots[:, 0].view(np.uint32) == tags) & (blocks >= 0)
        states = np.full(len(keys), -1, np.int16)
        if home.any():
            states[home] = self.table.states_if_keys(blocks[home], karr[home])
        for i in np.flatnonzero(states < 0):
            blocks[i], states[i] = self.find(keys[i])
            if states[i] < 0:
                break
        return blocks, states

    def find(self, key: bytes) -> tuple[int, int]:
        """(block, state) holding ``key``, or (-1, -1). Lock-free; may miss spuriously."""
        unpack, buf, base, mask = L.INDEX_SLOT.unpack_from, self.buf, self.base, self.mask
        tag = zlib.crc32(key)
        i = tag & mask
        for _ in range(mask + 1):
            t, block = unpack(buf, base + 8 * i)
            if block < 0:
                return -1, -1
            if t == tag:
                state = self.table.state_if_key(block, key)
                if state >= 0:
                    return block, state
            i = (i + 1) & mask
        return -1, -1

    # --- owner-only writers -------------------------------------------------------------
    def insert(self, key: bytes, block: int) -> None:
        unpack, buf, base, mask = L.INDEX_SLOT.unpack_from, self.buf, self.base, self.mask
        tag = zlib.crc32(key)
        i = tag & mask
        while unpack(buf, base + 8 * i)[1] >= 0:
            i = (i + 1) & mask
        # Block before tag would be nicer, but a torn slot only ever costs a spurious miss:
        # readers verify every candidate against the entry's key.
        L.INDEX_SLOT.pack_into(buf, base + 8 * i, tag, block)

    def remove(self, key: bytes, block: int) -> None:
        """Delete ``key``'s slot with backward-shift deletion (no tombstones to rot)."""
        unpack, pack, buf, base, mask = (L.INDEX_SLOT.unpack_from, L.INDEX_SLOT.pack_into,
                                         self.buf, self.base, self.mask)
        i = zlib.crc32(key) & mask
        while True:
            t, b = unpack(buf, base + 8 * i)
            if b < 0:
                return  # not present
            if b == block:
                break
            i = (i + 1) & mask
        j = i
        while True:
            j = (j + 1) & mask
            t, b = unpack(buf, base + 8 * j)
            if b < 0:
                break
            home = t & mask
            # Move j back into the hole at i unless its home lies cyclically in (i, j].
            if (j - home) & mask >= (j - i) & mask:
                pack(buf, base + 8 * i, t, b)
                i = j
        pack(buf, base + 8 * i, 0, -1)

    def clear(self) -> None:
        n = self.mask + 1
        self.buf[self.base:self.base + 8 * n] = L.INDEX_SLOT.pack(0, -1) * n
