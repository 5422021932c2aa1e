"""Offers: a READY block the owner put in one client's grant ring, and that client's claim.

This module owns the one exception to "only the owner writes a block-table entry". When no
block is free, the owner grants a client the victims it would evict, still cached and
readable: ``offer`` marks them (writer, generation, ring position and the eviction clock, in
one seqlock round each; key and state stay). From then until the client publishes them or
dies, the owner writes nothing of those entries but their last_use word. The client takes
them for a store and claims them: ``claim`` marks them EVICTING (no lookup reads them; a load
that held one before waits while it lasts, as for the owner's evictions), then, once the
caller has seen that no reader holds them, ``finish`` makes them CLAIMED (ours to write) or
``unclaim`` READY again. An offer a request used since it was offered
(``used_since_offer``) the client returns to the owner instead. A claim only ever touches an
entry offered to the claiming client. The handshake with readers (fence, then read every
slot's holds) is the caller's (``client/own_stores.py``); this module only reads and writes
entries.
"""
from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np

from kvshm import crashpoints
from kvshm.shm import layout as L
from kvshm.shm.fence import publish_fence
from kvshm.shm.records import ENTRY_DTYPE, field_offset
from kvshm.shm.table import BlockTable

# One entry's words for the one-block versions below, read with struct (a one-key store
# claims one block, and numpy's cost per call is most of what a claim would pay): state,
# key length (skipped), writer and writer generation lie side by side.
_HEAD = struct.Struct("<BxhI")
_HEAD_OFF = field_offset(ENTRY_DTYPE, "state")
assert [field_offset(ENTRY_DTYPE, n) - _HEAD_OFF for n in ("keylen", "writer", "writer_gen")] \
    == [1, 2, 4]
_U64 = struct.Struct("<Q")
_LAST_USE_OFF = field_offset(ENTRY_DTYPE, "last_use")
_OFFERED_AT_OFF = field_offset(ENTRY_DTYPE, "offered_at")


def offer(table: BlockTable, blocks: Sequence[int], slot: int, gen: int,
          positions: Sequence[int], tick: int) -> None:
    """Owner: offer READY ``blocks`` (distinct) to client (slot, gen), at grant-ring
    ``positions``, at eviction clock ``tick``."""
    b = np.asarray(blocks, np.intp)
    seqs = table.open_rounds(b)
    e = table.fields
    # The ring position first, the fields that name the client last: an owner dying in
    # between leaves an entry that names no live client (a successor settles it), or one
    # mid-rewrite whose position is new (at or above the client's granted count), which a
    # successor hands over as it lies: it cannot tell that round from a claim round of the
    # client, and never closes it (``Grants.settle``); the client's claim does (``claim``).
    # A stale position below it would make the entry look like one the client may be
    # claiming, which a successor leaves open (``rebuild``).
    e["writer_req"][b] = np.asarray(positions, np.uint64)
    e["offered_at"][b] = tick
    crashpoints.crash_point("table.offer.mid")
    e["writer_gen"][b], e["writer"][b] = gen, slot
    crashpoints.crash_point("table.offer.odd")
    table.close_rounds(b, seqs)


def states(table: BlockTable, blocks: np.ndarray) -> np.ndarray:
    """The blocks' state bytes now (a client reading the grants it just took, which the
    owner marked before it handed them over)."""
    return table.fields["state"][blocks]


def states_of(table: BlockTable, blocks: Sequence[int]) -> list[int]:
    """``states`` of a list of blocks, as a list: one block (a one-key store's) without
    numpy."""
    if len(blocks) == 1:
        return [state_one(table, blocks[0])]
    return states(table, np.asarray(blocks, np.intp)).tolist()


def used_since_offer(table: BlockTable, blocks: np.ndarray) -> np.ndarray:
    """Which offered ``blocks`` a request used after they were offered (last use past the
    offer): worth keeping, where the policy would now choose others."""
    e = table.fields
    return e["last_use"][blocks] > e["offered_at"][blocks]


def offered_to(table: BlockTable, blocks: np.ndarray, slot: int, gen: int) -> np.ndarray:
    """Which of ``blocks`` are READY and offered to client (slot, gen)."""
    e = table.fields
    return (e["state"][blocks] == L.READY) & (e["writer"][blocks] == slot) & \
        (e["writer_gen"][blocks] == gen)


def claim(table: BlockTable, blocks: np.ndarray, slot: int, gen: int) -> np.ndarray:
    """Client (slot, gen): begin to claim the offered ``blocks`` (distinct) it took from its
    grant ring: each one READY and offered to it becomes EVICTING in one seqlock round (no
    lookup reads it any more; relets see its sequence number move). Returns which were
    marked; an entry that is not an offer to us, or that changed meanwhile, is left alone.
    An offer to us whose round is open and stays so was left so by an owner that died
    writing it: nobody but us writes an offer we took, so our round goes on from there.
    The caller fences, reads the holds, then ``finish``es or ``unclaim``s each one."""
    b = np.asarray(blocks, np.intp)
    seq = table.seqs(b)
    publish_fence()
    ok = offered_to(table, b, slot, gen)
    publish_fence()
    ok &= table.seqs(b) == seq
    mine = b[ok]
    if mine.size:
        _set_state(table, mine, L.EVICTING, "table.claim.odd")
    return ok


def finish(table: BlockTable, blocks: np.ndarray) -> None:
    """Client: end claims of ``blocks`` that no reader holds: CLAIMED, ours to write."""
    _set_state(table, np.asarray(blocks, np.intp), L.CLAIMED)


def unclaim(table: BlockTable, blocks: np.ndarray) -> None:
    """Client: give back claims of ``blocks`` a reader holds (nothing written into them):
    READY again, still offered to us."""
    _set_state(table, np.asarray(blocks, np.intp), L.READY)


def _set_state(table: BlockTable, b: np.ndarray, state: int, point: str | None = None) -> None:
    """The state of entries ``b`` (distinct), in one seqlock round each."""
    if b.size:
        seqs = table.open_rounds(b)
        if point is not None:
            crashpoints.crash_point(point)
        table.fields["state"][b] = state
        table.close_rounds(b, seqs)


# --- one block: what the functions above do for ``[block]``, without numpy -----------------
def _at(table: BlockTable, block: int) -> int:
    return table.base + block * L.ENTRY_BYTES


def state_one(table: BlockTable, block: int) -> int:
    """``states`` of one block."""
    return table.buf[_at(table, block) + _HEAD_OFF]


def used_since_offer_one(table: BlockTable, block: int) -> bool:
    """``used_since_offer`` of one block."""
    off = _at(table, block)
    return _U64.unpack_from(table.buf, off + _LAST_USE_OFF)[0] > \
        _U64.unpack_from(table.buf, off + _OFFERED_AT_OFF)[0]


def offered_to_one(table: BlockTable, block: int, slot: int, gen: int) -> bool:
    """``offered_to`` of one block."""
    state, writer, writer_gen = _HEAD.unpack_from(table.buf, _at(table, block) + _HEAD_OFF)
    return state == L.READY and writer == slot and writer_gen == gen


def claim_one(table: BlockTable, block: int, slot: int, gen: int) -> bool:
    """``claim`` of one block: whether it was marked EVICTING."""
    seq = table.seq(block)
    publish_fence()
    ok = offered_to_one(table, block, slot, gen)
    publish_fence()
    if not ok or table.seq(block) != seq:
        return False
    table.set_state(block, L.EVICTING, "table.claim.odd")
    return True


def finish_one(table: BlockTable, block: int) -> None:
    """``finish`` of one block."""
    table.set_state(block, L.CLAIMED)


def unclaim_one(table: BlockTable, block: int) -> None:
    """``unclaim`` of one block."""
    table.set_state(block, L.READY)
