"""A block this client holds, caught in the middle of an eviction: waiting for the decision.

This module owns what a client concludes about a block it holds (a lease, or the pin a load
just turned it into) whose entry is neither provably READY nor gone. An eviction (the
owner's) or a claim (another client's) marked it EVICTING, or is rewriting it (odd sequence
number), and has not read the holds yet. Our hold was written before that mark, or we would
not hold the block: the lease handshake guarantees that the evictor sees it and gives the
block back (READY). If the evictor dies first, whoever settles its work does the same: a
successor owner's rebuild, or the live owner's reclaim of a dead claimer. So the answer is
"not decided yet", never "evicted", however long the evictor is descheduled or stopped.

A load waits for the decision up to the manager's timeout (``decided_ready``), starting an
owner if none lives (a dead owner's eviction waits for its successor). It never writes the
table and never talks to the owner.
"""
from __future__ import annotations

import os
from collections.abc import Callable

from kvshm.crashpoints import crash_point
from kvshm.errors import BlockStateError
from kvshm.shm import layout as L
from kvshm.shm.table import BlockTable
from kvshm.shm.wait import poll_until

# An evictor on a CPU decides within microseconds: yield this often before sleeping.
_SPINS = 100


def verdict(table: BlockTable, block: int, key: bytes) -> bool | None:
    """Whether ``block`` holds ``key`` READY (True), no longer does (False), or is not decided
    yet (None: EVICTING, or mid-rewrite). Meaningful for a block we hold: only then is an
    eviction in flight bound to give it back."""
    seq, state = table.checked_state(block, key)  # (1, -1): a round that stays open
    if seq & 1 or state == L.EVICTING:
        return None
    return state == L.READY


def decided_ready(table: BlockTable, block: int, key: bytes, timeout: float,
                  ensure_owner: Callable[[], None]) -> bool:
    """``verdict`` of a block we hold, once decided: waits while it is not, with
    ``ensure_owner()`` (start an owner if none lives) at every look. ``BlockStateError`` if it
    stays undecided for ``timeout`` seconds (a stalled process holds the eviction: the block
    is neither gone nor safe to read)."""
    for _ in range(_SPINS):
        v = verdict(table, block, key)
        if v is not None:
            return v
        os.sched_yield()
    crash_point("client.load.wait_decision")
    got: list[bool] = []

    def decided() -> bool:
        v = verdict(table, block, key)
        if v is None:
            ensure_owner()  # a successor's rebuild settles what a dead owner left undecided
            return False
        got.append(v)
        return True

    if poll_until(decided, timeout, first=5e-5, cap=0.005):
        return got[-1]
    raise BlockStateError(f"key {key.hex()[:16]}…: its block has been undecided (an eviction "
                          f"in flight) for {timeout:g}s, held by a stalled process; lookup() "
                          "again later")
