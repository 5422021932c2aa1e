"""Offers: a READY block the owner put in one client's grant ring, and that client's claim.

This module owns the one exception to "only the owner writes a block-table entry". When no
block is free, the owner grants a client the victims it would evict, still cached and
readable: ``offer`` marks them (writer, generation, ring position and the eviction clock, in
one seqlock round each; key and state stay). From then until the client publishes them or
dies, the owner writes nothing of those entries but their last_use word. The client takes
them for a store and claims them (``claim``: state CLAIMED, one seqlock round each), or gives
a claim back (``unclaim``) when a reader holds the block; an offer a request used since it
was offered (``used_since_offer``) it returns to the owner instead. A claim only ever touches
an entry offered to the claiming client. The handshake with readers (fence, then read every
slot's holds) is the caller's (``client/own_stores.py``); this module only reads and writes
entries.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvshm import crashpoints
from kvshm.shm import layout as L
from kvshm.shm.fence import publish_fence
from kvshm.shm.table import BlockTable


def offer(table: BlockTable, blocks: Sequence[int], slot: int, gen: int,
          positions: Sequence[int], tick: int) -> None:
    """Owner: offer READY ``blocks`` (distinct) to client (slot, gen), at grant-ring
    ``positions``, at eviction clock ``tick``."""
    b = np.asarray(blocks, np.intp)
    seqs = table.open_rounds(b)
    e = table.fields
    e["writer"][b], e["writer_gen"][b], e["offered_at"][b] = slot, gen, tick
    e["writer_req"][b] = np.asarray(positions, np.uint64)
    crashpoints.crash_point("table.offer.odd")
    table.close_rounds(b, seqs)


def states(table: BlockTable, blocks: np.ndarray) -> np.ndarray:
    """The blocks' state bytes now (a client reading the grants it just took, which the
    owner marked before it handed them over)."""
    return table.fields["state"][blocks]


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
    """Client (slot, gen): claim the offered ``blocks`` (distinct) it took from its grant
    ring: each one READY and offered to it becomes CLAIMED in one seqlock round (no lookup
    reads it any more; relets see its sequence number move). Returns which were claimed; an
    entry that is not an offer to us, or that is being rewritten, is left alone."""
    b = np.asarray(blocks, np.intp)
    seq = table.seqs(b)
    publish_fence()
    ok = offered_to(table, b, slot, gen)
    publish_fence()
    ok &= ((seq & 1) == 0) & (table.seqs(b) == seq)
    mine = b[ok]
    if mine.size:
        seqs = table.open_rounds(mine)
        crashpoints.crash_point("table.claim.odd")
        table.fields["state"][mine] = L.CLAIMED
        table.close_rounds(mine, seqs)
    return ok


def unclaim(table: BlockTable, blocks: np.ndarray) -> None:
    """Client: give back claims of ``blocks`` (CLAIMED by us, nothing written into them yet):
    READY again, still offered to us, in one seqlock round each."""
    b = np.asarray(blocks, np.intp)
    seqs = table.open_rounds(b)
    table.fields["state"][b] = L.READY
    table.close_rounds(b, seqs)
