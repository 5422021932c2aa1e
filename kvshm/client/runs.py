"""The prefixes a client loaded, remembered so that asking for one again is cheap.

This module owns what a client keeps of a prefix it loaded (a ``Run``: its keys, their
blocks, lease codes and the entries' sequence numbers read while pinned), how far ahead one
``relet`` of it leases (``reach``) and how the last relet laid its leases out in the hold
array (``Plan``). The scheduler asks for a prefix key by key, over and over; the first lookup
of a remembered prefix leases many of its keys with one fence (``HoldTable.relet``) and the
lookups after it are dict hits. An unchanged sequence number proves the entry still holds
its key READY (the table's writer bumps it on every rewrite), so nothing is searched again.
It only describes; ``holds.py`` takes and gives back the holds. It never writes the segment,
never talks to the owner and never imports torch.
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from kvshm.shm import layout as L
from kvshm.shm.table import BlockTable

# How many keys of a prefix one relet leases at first (``Run.reach`` adapts it), and the
# shortest prefix worth remembering (below it numpy's set-up costs more than it saves).
RUN_AHEAD = 128
RUN_MIN = 8
# How many offsets of one run keep their ``Plan``: a scheduler asks a prefix from its head
# and, while ``reach`` grows, from a few offsets after it; each plan may be ``reach`` long.
PLANS_KEPT = 8


class Plan:
    """How a relet leased the keys of a run from one offset into the hold entries ``idx``
    (the top of the client's free stack then), built once. The next request that asks for
    the run usually finds the same entries on top of the free stack (its loads and releases
    gave them back in order); its relet then only writes and checks: a few numpy calls and
    C-level dict and set merges instead of per-key zips, which were most of a lookup's
    cost. Whether the entries are on top is checked every time, never assumed."""

    __slots__ = ("idx", "ia", "leases", "ahead")

    def __init__(self, part: list[bytes], idx: list[int]):
        self.idx = idx  # hold entries, in key order (as ``Run.codes``)
        self.ia = np.array(idx, np.intp)
        self.leases = dict(zip(part, idx))  # merged into the client's leases as is
        self.ahead = frozenset(part[1:])  # leased ahead: nobody asked for them yet


class Run:
    """A prefix this client loaded (keys distinct, in order) and how it leases it again.

    ``reach`` follows what requests ask for: it doubles when one asks past a relet's keys
    (one relet of a long prefix, not one per ``RUN_AHEAD`` keys) and halves when most keys a
    relet took go unasked (a request that shares only the head of a long prefix does not
    lease, and give back, all of it)."""

    __slots__ = ("keys", "blocks", "codes", "seqs", "plans", "reach")

    def __init__(self, keys: list[bytes], blocks: np.ndarray, seqs: np.ndarray):
        self.keys, self.blocks = keys, blocks
        self.codes = L.lease_code(blocks).astype(np.int32)  # what a lease writes
        self.seqs = seqs.astype(np.uint32)  # as the table keeps them: compared as bytes
        self.plans: dict[int, Plan] = {}  # offset -> how the last relet from it went
        self.reach = RUN_AHEAD

    def plan(self, off: int, n: int, idx: list[int]) -> Plan:
        """A fresh ``Plan`` of ``n`` keys from ``off`` in the hold entries ``idx``, kept for
        the next relet from ``off`` (the oldest plans go: at most ``PLANS_KEPT``)."""
        plans = self.plans
        plans.pop(off, None)
        while len(plans) >= PLANS_KEPT:
            del plans[next(iter(plans))]
        plan = plans[off] = Plan(self.keys[off:off + n], idx)
        return plan

    def grow(self) -> None:
        """A request asked past what one relet took."""
        self.reach = min(2 * self.reach, len(self.keys))

    def shrink(self) -> None:
        """Most of what one relet took went unasked."""
        self.reach = max(RUN_AHEAD, self.reach // 2)

    def seqs_now(self, table: BlockTable, off: int, end: int) -> np.ndarray:
        """The entries' sequence numbers of keys ``off:end`` now: where they equal ``seqs``
        (compare the bytes: a ufunc and ``.all()`` cost 3 us), the key is still READY."""
        return table.seqs(self.blocks[off:end])


def remember(keys: Sequence[bytes], blocks: Sequence[int], table: BlockTable) -> Run | None:
    """A ``Run`` of ``keys`` (a prefix, in order), just pinned at ``blocks`` and found READY,
    or None when there is nothing worth keeping (too short, or an entry being rewritten). A
    key named twice is kept once: a relet would lease it twice and leak one of the holds."""
    if len(keys) < RUN_MIN:
        return None
    if len(set(keys)) != len(keys):
        first = dict(zip(keys, blocks))  # in first-seen order; a key's block is one
        keys, blocks = list(first), list(first.values())
        if len(keys) < RUN_MIN:
            return None
    b = np.array(blocks, np.intp)
    seqs = table.ready_seqs(b)
    if (seqs < 0).any():
        return None  # a rewrite in progress: no proof to keep
    return Run(list(keys), b, seqs)
