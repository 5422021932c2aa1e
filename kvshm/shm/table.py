"""The block table, as it lies in the segment: one record per block.

This module owns the per-block records (state, key and its checksum, writer, last use, pins;
where each lies is ``entry.py``, the key index that finds them ``keyindex.py``). Only the
owner writes them; every process may read them without a lock. Writers bump a per-entry
sequence number around each rewrite (odd while writing, a seqlock), so a reader either sees a
consistent entry or retries, for a bounded number of spins: an entry a dead owner left odd is
reported as torn, never waited on.
The owner's batch writers (``write_many`` and friends) open every entry, copy every body, then
close every entry: one compiled call (``rounds``) or a few numpy operations, no loop per block.

It must never store into an entry with ``struct.pack_into`` (which zero-fills its target
first, so a death mid-write would leave a key with a zeroed tail under a READY state): an
entry body is packed aside and copied in with one slice assignment, and single words go
through aligned memoryview casts. Every key is written together with its checksum
(``entry.key_checksum``), so a successor can tell a torn key from an intact one.
It never decides policy (see ``owner/manager.py``).
"""
from __future__ import annotations

import os
from collections.abc import Iterable, Sequence
from itertools import repeat
from operator import xor

import numpy as np

from kvshm import crashpoints
from kvshm.shm import layout as L
from kvshm.shm import rounds
from kvshm.shm.entry import (
    BODY,
    BODY_OFF,
    EMPTY_KEYSUM,
    KEY_OFF,
    KEYLEN_OFF,
    KEYSUM_XOR,
    LAST_USE_WORD,
    PINS_WORD,
    STATE_OFF,
    STORED_NS_WORD,
    WORDS32,
    WORDS64,
    WRITER_OFF,
    Entry,
    decode,
    key_checksum,
)
from kvshm.shm.fence import publish_fence
from kvshm.shm.records import ENTRY_DTYPE

# Below this many entries the batch writers loop over the scalar ones: numpy's per-call cost
# (one to a few microseconds an operation on a small host) outweighs that many struct packs
# (measured: the batch writes break even at about 16 entries and win 2-8x from 64).
VECTOR_MIN = 16
_READ_SPINS = 100_000  # an owner rewrites an entry in microseconds; beyond this it died
# read(): tries before an entry is reported torn; after the first few it yields the CPU so
# that an owner preempted mid-rewrite can finish (two loaded cores are enough to need it).
_READ_TRIES = 10_000
_READ_YIELD_AFTER = 100


def state_counts(states: np.ndarray) -> list[int]:
    """Blocks per state from an array of state bytes: index = state, and ``L.INVALID`` for
    any byte that is no state (counted apart, never as a real state)."""
    return np.bincount(np.minimum(states, L.INVALID), minlength=L.INVALID + 1).tolist()


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
        self._words = self._rows.view(np.uint64)  # (num_blocks, ENTRY_BYTES // 8)
        self._addr = self._rows.ctypes.data  # for ``rounds``; gone with the views at close
        # Every entry by field (records.ENTRY_DTYPE), for writers of a few fields at once
        self.fields = np.frombuffer(buf, ENTRY_DTYPE, self.num_blocks, self.base)

    def close(self) -> None:
        self._w32.release()
        self._w64.release()
        del self._rows, self._seqs, self._words, self.fields, self._addr

    def states_if_keys(self, blocks: np.ndarray, keys: np.ndarray) -> np.ndarray:
        """Vectorised ``state_if_key``: ``keys`` is an (n, keylen) uint8 array of equal-length
        keys. Entries caught mid-rewrite read as -1 (a spurious miss, never a wrong hit)."""
        seq = self._seqs[blocks]
        publish_fence()
        rows = self._rows[blocks]
        publish_fence()
        stable = _same_keys(rows, keys) & ((seq & 1) == 0) & (self._seqs[blocks] == seq)
        return np.where(stable, rows[:, STATE_OFF].astype(np.int16), -1)

    def ready_seqs(self, blocks: np.ndarray, keys: np.ndarray | None = None) -> np.ndarray:
        """Each block's sequence number where its entry is READY and stable (int64; -1 where
        not): with a key the caller knows the block holds (it pins it), an unchanged number
        later proves the entry still holds that key READY. With ``keys`` (as for
        ``states_if_keys``) only where the entry holds its key too: the proof for a caller
        that holds none of the blocks."""
        seq = self._seqs[blocks]
        publish_fence()
        same: np.ndarray | bool = True
        if keys is None:
            state = self._rows[blocks, STATE_OFF]
        else:  # the keys copied in the same round as the state, compared after it
            rows = self._rows[blocks]
            state, same = rows[:, STATE_OFF], _same_keys(rows, keys)
        publish_fence()
        ok = same & ((seq & 1) == 0) & (state == L.READY) & (self._seqs[blocks] == seq)
        return np.where(ok, seq.astype(np.int64), -1)

    def seqs(self, blocks: np.ndarray) -> np.ndarray:
        """The blocks' sequence numbers now (vectorised ``seq``)."""
        return self._seqs[blocks]

    def read(self, block: int) -> Entry:
        """A consistent snapshot of ``block``'s entry, retrying while the owner rewrites it.

        Bounded: if the sequence number stays odd (a dead owner left the entry mid-rewrite,
        only the next owner settles it) or never holds still, the last attempt is returned
        with ``torn=True``; callers must not trust its fields (the key above all).
        """
        off = self.base + block * L.ENTRY_BYTES + BODY_OFF
        w, i, unpack, buf = self._w32, block * WORDS32, BODY.unpack_from, self.buf
        for n in range(_READ_TRIES):
            seq = w[i]
            publish_fence()
            f = unpack(buf, off)
            publish_fence()
            if not seq & 1 and w[i] == seq:
                return decode(seq, f, False)
            if n >= _READ_YIELD_AFTER:
                os.sched_yield()
        return decode(seq, f, True)

    def state_if_key(self, block: int, key: bytes) -> int:
        """``block``'s state if it currently holds ``key``, else -1. Lock-free reader."""
        return self.checked_state(block, key)[1]

    def checked_state(self, block: int, key: bytes) -> tuple[int, int]:
        """``state_if_key`` and the (even) sequence number it was read under: while the seq
        stays that, the entry still holds ``key`` in that state (every rewrite bumps it)."""
        buf, off, w, i = self.buf, self.base + block * L.ENTRY_BYTES, self._w32, block * WORDS32
        for _ in range(_READ_SPINS):
            seq = w[i]
            if seq & 1:
                continue
            publish_fence()
            state, keylen = buf[off + STATE_OFF], buf[off + KEYLEN_OFF]
            same = keylen == len(key) and buf[off + KEY_OFF:off + KEY_OFF + keylen] == key
            publish_fence()
            if w[i] == seq:
                return seq, (state if same else -1)
        return 1, -1  # left odd by a dead owner: a miss until the next owner settles it

    def seq(self, block: int) -> int:
        """``block``'s sequence number now (odd: being rewritten)."""
        return self._w32[block * WORDS32]

    # --- owner-only writers: every rewrite is one seqlock round, _odd() ... _even() ---------
    def _odd(self, block: int) -> int:
        """Open a rewrite of ``block``: readers now retry. Returns the odd sequence number."""
        w, i = self._w32, block * WORDS32
        seq = w[i] | 1  # a writer that died mid-rewrite left it odd: move on from there
        w[i] = seq
        publish_fence()
        return seq

    def _even(self, block: int, seq: int) -> None:
        """Close the rewrite ``_odd`` opened: what was stored in between is published."""
        publish_fence()
        self._w32[block * WORDS32] = (seq + 1) & 0xFFFFFFFF

    def write(self, block: int, state: int, key: bytes, writer: int = -1, writer_gen: int = 0,
              writer_req: int = 0, last_use: int = 0, stored_ns: int = 0, pins: int = 0,
              tenant: int = -1, tenant_gen: int = 0) -> None:
        """Rewrite ``block``'s whole entry (key, its checksum and every field) in one round.
        ``tenant``: the slot whose store the block holds (-1: nobody's), of ``tenant_gen``.

        The body is packed first, so a value out of range raises before the entry is touched.
        """
        self._put(block, BODY.pack(state, len(key), writer, writer_gen, key_checksum(key),
                                    writer_req, last_use, stored_ns, pins, key, tenant + 1, b"",
                                    tenant_gen))

    def _put(self, block: int, body: bytes) -> None:
        """One seqlock round that copies a packed ``body`` into ``block``'s entry."""
        off = self.base + block * L.ENTRY_BYTES + BODY_OFF
        seq = self._odd(block)
        if crashpoints.ARMED:
            self._copy_armed(off, body)
        else:
            self.buf[off:off + BODY.size] = body  # one memcpy
        self._even(block, seq)

    def _copy_armed(self, off: int, body: bytes) -> None:
        """The body copy with crash point ``table.write.odd`` inside it (tests only).

        A memcpy killed midway may have stored any subset of its bytes, so the test needs the
        worst one deterministically: the first half of the key bytes changed while state,
        key length and checksum still hold their old values (a READY entry whose key is
        neither the old nor the new one). Copying the rest afterwards gives the same result
        as the single copy when the point does not fire.
        """
        k, half = KEY_OFF - BODY_OFF, KEY_OFF - BODY_OFF + L.MAX_KEY_BYTES // 2
        self.buf[off + k:off + half] = body[k:half]
        crashpoints.crash_point("table.write.odd")
        self.buf[off:off + k] = body[:k]
        self.buf[off + half:off + BODY.size] = body[half:]

    def _ready(self, block: int) -> None:
        """Inside a round: state READY, writer -1 (nobody writes a ready block)."""
        off = self.base + block * L.ENTRY_BYTES
        self.buf[off + STATE_OFF] = L.READY
        self.buf[off + WRITER_OFF:off + WRITER_OFF + 2] = b"\xff\xff"

    def publish(self, block: int, tick: int, stored_ns: int) -> None:
        """WRITING -> READY: state, writer, last use and store time in one seqlock round
        (the key, already in place, stays)."""
        seq = self._odd(block)
        self._ready(block)
        self._w64[block * WORDS64 + LAST_USE_WORD] = tick
        self._w64[block * WORDS64 + STORED_NS_WORD] = stored_ns
        self._even(block, seq)

    def set_state(self, block: int, state: int, point: str | None = None) -> None:
        """``block``'s state, in one seqlock round (crash ``point``, if named, inside it)."""
        seq = self._odd(block)
        if point is not None:
            crashpoints.crash_point(point)
        self.buf[self.base + block * L.ENTRY_BYTES + STATE_OFF] = state
        self._even(block, seq)

    def reset_ready(self, block: int) -> None:
        """Owner only, at takeover: make an adopted entry READY, with no writer and no pins
        (the dead owner's pin counts died with it), in one seqlock round.

        Only the state byte, the writer half-word and the pins word are stored: the key, its
        length and checksum are never rewritten, so dying here cannot tear them either.
        """
        seq = self._odd(block)
        self._ready(block)
        self._w64[block * WORDS64 + PINS_WORD] = 0
        self._even(block, seq)

    def settle(self, block: int) -> bool:
        """Owner only, at takeover: end a rewrite a dead owner left half done (odd seq).

        Nobody else would ever make the sequence even again, and every reader of the entry
        would spin forever. Returns True if the entry was torn; the caller decides what its
        contents are worth.
        """
        w, i = self._w32, block * WORDS32
        seq = w[i]
        if not seq & 1:
            return False
        publish_fence()
        w[i] = (seq + 1) & 0xFFFFFFFF
        return True

    def set_last_use(self, block: int, tick: int) -> None:
        # A lone aligned word store: readers may see old or new, both are fine.
        self._w64[block * WORDS64 + LAST_USE_WORD] = tick

    def set_pins(self, block: int, pins: int) -> None:
        self._w64[block * WORDS64 + PINS_WORD] = pins

    # --- owner-only batch writers: the rounds of many entries side by side --------------
    def open_rounds(self, blocks: np.ndarray) -> np.ndarray:
        """``_odd`` for every block (distinct ids): readers of any of them now retry."""
        seqs = self._seqs[blocks] | 1
        self._seqs[blocks] = seqs
        publish_fence()
        return seqs

    def close_rounds(self, blocks: np.ndarray, seqs: np.ndarray) -> None:
        publish_fence()
        self._seqs[blocks] = seqs + np.uint32(1)  # wraps like the scalar round

    def write_many(self, blocks: Sequence[int], state: int, keys: Sequence[bytes] | None = None,
                   writer: int = -1, writer_gen: int = 0, writer_req: int | Sequence[int] = 0,
                   last_use: int | Sequence[int] = 0, stored_ns: int = 0,
                   tags: Sequence[int] | None = None, tenant: int = -1,
                   tenant_gen: int = 0) -> None:
        """``write`` of each of ``blocks`` (distinct ids) with its key of ``keys`` (none: empty
        keys) and the same other fields; ``writer_req`` and ``last_use`` may differ per block
        (a sequence, one value each). ``tags``: the keys' crc32s, if the caller has them
        (``keyindex.tags_of``): their checksums follow (``entry.KEYSUM_XOR``) in no pass more.

        Every body is built first (a bad value raises before any entry is touched), then all
        the entries are opened (odd), copied and closed (even) together. A death in between
        leaves them all odd: the next owner settles each, trusting a key only where its
        checksum verifies.
        """
        n = len(blocks)
        if keys and len(keys) != n:
            raise ValueError(f"write_many of {n} blocks with {len(keys)} keys")
        if n < VECTOR_MIN and (crashpoints.ARMED or rounds.LIBRARY.fns is None):
            rounds.check_blocks(blocks, self.num_blocks)  # (before any store, as the C round)
            reqs = [writer_req] * n if isinstance(writer_req, int) else writer_req
            uses = [last_use] * n if isinstance(last_use, int) else last_use
            bodies = [BODY.pack(state, len(k), writer, writer_gen, key_checksum(k), reqs[i],
                                 uses[i], stored_ns, 0, k, tenant + 1, b"", tenant_gen)
                      for i, k in enumerate(keys or [b""] * n)]
            for blk, packed in zip(blocks, bodies):
                self._put(blk, packed)
            return
        # The bodies packed by struct in one C-level pass (range-checked as the scalar path)
        bkeys: Iterable[bytes]
        if keys:
            if max(map(len, keys)) > L.MAX_KEY_BYTES:  # (struct would truncate it silently)
                raise ValueError(f"write_many of a key over {L.MAX_KEY_BYTES} bytes")
            sums: Iterable[int] = map(key_checksum, keys) if tags is None else \
                map(xor, tags, map(KEYSUM_XOR.__getitem__, map(len, keys)))
            lens: Iterable[int] = map(len, keys)
            bkeys = keys
        else:
            bkeys, sums, lens = repeat(b"", n), repeat(EMPTY_KEYSUM, n), repeat(0, n)
        req_of: Iterable[int] = repeat(writer_req, n) if isinstance(writer_req, int) else \
            writer_req
        use_of: Iterable[int] = repeat(last_use, n) if isinstance(last_use, int) else last_use
        packed = b"".join(map(
            BODY.pack, repeat(state, n), lens, repeat(writer, n), repeat(writer_gen, n), sums,
            req_of, use_of, repeat(stored_ns, n), repeat(0, n), bkeys,
            repeat(tenant + 1, n), repeat(b"", n), repeat(tenant_gen, n)))
        if len(packed) != n * BODY.size:
            raise ValueError(f"write_many of {n} blocks with {len(packed) // BODY.size} "
                             "writer_req or last_use values")
        # the round in one compiled call (``rounds``), else (or for a crash point inside) numpy
        if not crashpoints.ARMED and rounds.write(self._addr, self.num_blocks, L.ENTRY_BYTES,
                                                  blocks, BODY_OFF, packed):
            return
        rounds.check_blocks(blocks, self.num_blocks)  # (numpy would wrap a negative id)
        rows = np.frombuffer(packed, np.uint8).reshape(n, BODY.size)
        b = np.asarray(blocks, np.intp)
        seqs = self.open_rounds(b)  # (``rounds`` makes the same stores in the same order)
        if crashpoints.ARMED:
            self._rows_armed(b, rows)
        else:
            self._rows[b, BODY_OFF:BODY_OFF + BODY.size] = rows
        self.close_rounds(b, seqs)

    def _rows_armed(self, b: np.ndarray, rows: np.ndarray) -> None:
        """The batch copy with crash point ``table.write_many.odd`` inside it (tests only): the
        worst a killed copy can leave, every entry odd, the first half of the rows copied and
        the next row's key half changed under its old state, length and checksum."""
        half, k = len(b) // 2, KEY_OFF - BODY_OFF
        self._rows[b[:half], BODY_OFF:BODY_OFF + BODY.size] = rows[:half]
        mid = int(b[half]) * L.ENTRY_BYTES
        self._rows.reshape(-1)[mid + KEY_OFF:mid + KEY_OFF + L.MAX_KEY_BYTES // 2] = \
            rows[half, k:k + L.MAX_KEY_BYTES // 2]
        crashpoints.crash_point("table.write_many.odd")
        self._rows[b[half:], BODY_OFF:BODY_OFF + BODY.size] = rows[half:]

    def set_states(self, blocks: Sequence[int], state: int) -> None:
        """``set_state`` of every block (distinct ids)."""
        if len(blocks) < VECTOR_MIN:
            for blk in blocks:
                self.set_state(blk, state)
            return
        b = np.asarray(blocks, np.intp)
        seqs = self.open_rounds(b)
        self._rows[b, STATE_OFF] = state
        self.close_rounds(b, seqs)

    def publish_many(self, blocks: Sequence[int], tick: int, stored_ns: int) -> None:
        """``publish`` of every block (distinct ids): WRITING -> READY, keys unchanged."""
        if len(blocks) < VECTOR_MIN:
            for blk in blocks:
                self.publish(blk, tick, stored_ns)
            return
        b = np.asarray(blocks, np.intp)
        seqs = self.open_rounds(b)
        self._rows[b, STATE_OFF] = L.READY
        self._rows[b, WRITER_OFF:WRITER_OFF + 2] = 0xFF
        self._words[b, LAST_USE_WORD] = tick
        self._words[b, STORED_NS_WORD] = stored_ns
        self.close_rounds(b, seqs)

    def set_last_uses(self, blocks: Sequence[int], tick: int) -> None:
        """``set_last_use`` of every block: lone aligned word stores, as the scalar one."""
        if len(blocks) < VECTOR_MIN:
            for blk in blocks:
                self.set_last_use(blk, tick)
        else:
            self._words[np.asarray(blocks, np.intp), LAST_USE_WORD] = tick


def _same_keys(rows: np.ndarray, keys: np.ndarray) -> np.ndarray:
    """Which entry ``rows`` (copied out of the table) hold their key of ``keys``."""
    klen = keys.shape[1]
    return (rows[:, KEYLEN_OFF] == klen) & (rows[:, KEY_OFF:KEY_OFF + klen] == keys).all(axis=1)
