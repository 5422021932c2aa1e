"""The prefixes a client loaded or stored, remembered so that asking for one again is cheap.

This module owns what a client keeps of a prefix it loaded (a ``Run``: its keys, their
blocks, lease codes and the entries' sequence numbers read while pinned) or stored (the
keys and blocks of its recent stores, proven READY by the first lookup of their first key,
then kept as a ``Run`` too), how far ahead one
``relet`` of it leases (``reach``) and how the last relet laid its leases out in the hold
array (``Plan``). The scheduler asks for a prefix key by key, over and over; the first lookup
of a remembered prefix leases many of its keys with one fence (``HoldTable.relet``) and the
lookups after it are dict hits. An unchanged sequence number proves the entry still holds
its key READY (the table's writer bumps it on every rewrite), so nothing is searched again.
``Runs`` leases from them (``relet``) through the hold table's public operations
(``HoldTable.write_holds``/``give_back``, its ``leases`` and ``ahead``); it never writes the
segment's table and never talks to the owner.
"""
from __future__ import annotations

from collections.abc import Sequence
from itertools import repeat
from typing import Protocol

import numpy as np

from kvshm.shm import layout as L
from kvshm.shm.fence import full_fence
from kvshm.shm.keys import key_array
from kvshm.shm.table import BlockTable


class HoldTable(Protocol):
    """What a relet uses of the client's hold table (``holds.HoldTable``)."""
    free: list[int]  # free hold entries, a stack
    leases: dict[bytes, int]  # leased key -> its hold entry
    ahead: set[bytes]  # leased ahead of their lookups

    def room(self) -> int: ...
    def drop_ahead(self) -> None: ...
    def write_holds(self, ia: np.ndarray, codes: np.ndarray, top: int) -> None: ...
    def give_back(self, ia: np.ndarray) -> None: ...


# How many keys of a prefix one relet leases at first (``Run.reach`` adapts it), and the
# shortest prefix worth remembering (below it numpy's set-up costs more than it saves).
RUN_AHEAD = 128
RUN_MIN = 8
# How many offsets of one run keep their ``Plan``: a scheduler asks a prefix from its head
# and, while ``reach`` grows, from a few offsets after it; each plan may be ``reach`` long.
PLANS_KEPT = 8
# How many of our own recent stores are remembered for the first lookup of them.
STORED_KEPT = 64


class Plan:
    """How a relet leased the keys of a run from one offset into the hold entries ``idx``
    (the top of the client's free stack then), built once. The next request that asks for
    the run usually finds the same entries on top of the free stack (its loads and releases
    gave them back in order); its relet then only writes and checks: a few numpy calls and
    C-level dict and set merges instead of per-key zips, which were most of a lookup's
    cost. Whether the entries are on top is checked every time, never assumed."""

    __slots__ = ("idx", "ia", "top", "leases", "ahead", "codes", "blocks", "seqs")

    def __init__(self, run: Run, off: int, idx: list[int]):
        end = off + len(idx)
        part = run.keys[off:end]
        self.idx = idx  # hold entries, in key order (as ``codes``)
        self.ia = np.array(idx, np.intp)
        self.top = max(idx) + 1  # what the hold mark must cover (a numpy max costs 1 us)
        self.leases = dict(zip(part, idx))  # merged into the client's leases as is
        self.ahead = frozenset(part[1:])  # leased ahead: nobody asked for them yet
        self.codes = run.codes[off:end]  # the holds to write
        self.blocks = run.blocks[off:end]  # whose sequence numbers to re-check
        self.seqs = run.seqs[off:end].tobytes()  # what they were, compared as bytes


class Run:
    """A prefix this client loaded (keys distinct, in order) and how it leases it again.

    ``reach`` follows what requests ask for: it doubles when one asks past a relet's keys
    (one relet of a long prefix, not one per ``RUN_AHEAD`` keys) and falls to what was asked
    when keys a relet took go unasked (a request that shares only the head of a long prefix
    does not lease, and give back, all of it; nor does one that shares a prefix we stored
    with the keys of our own request after it)."""

    __slots__ = ("keys", "blocks", "codes", "seqs", "plans", "reach")

    def __init__(self, keys: list[bytes], blocks: np.ndarray, seqs: np.ndarray):
        self.keys, self.blocks = keys, blocks
        self.codes = L.lease_code(blocks).astype(np.int32)  # what a lease writes
        self.seqs = seqs.astype(np.uint32)  # as the table keeps them: compared as bytes
        self.plans: dict[int, Plan] = {}  # offset -> how the last relet from it went
        self.reach = RUN_AHEAD

    def plan(self, off: int, idx: list[int]) -> Plan:
        """A fresh ``Plan`` of ``len(idx)`` keys from ``off`` in the hold entries ``idx``,
        kept for the next relet from ``off`` (the oldest plans go: at most ``PLANS_KEPT``)."""
        plans = self.plans
        plans.pop(off, None)
        while len(plans) >= PLANS_KEPT:
            del plans[next(iter(plans))]
        plan = plans[off] = Plan(self, off, idx)
        return plan

    def grow(self) -> None:
        """A request asked past what one relet took."""
        self.reach = min(2 * self.reach, len(self.keys))

    def shrink(self, asked: int) -> None:
        """Some of what one relet took went unasked: take what was ``asked`` next time (a
        prefix shared by requests that ask for less of it, even less than ``RUN_AHEAD``, is
        leased as far as they ask; one asking further grows it again)."""
        self.reach = max(RUN_MIN, asked)

    def cut(self, end: int) -> None:
        """Keep only the keys before ``end`` (and the plans within them)."""
        self.keys, self.blocks = self.keys[:end], self.blocks[:end]
        self.codes, self.seqs = self.codes[:end], self.seqs[:end]
        self.plans = {o: p for o, p in self.plans.items() if o + len(p.idx) <= end}

    def seqs_now(self, table: BlockTable, off: int, end: int) -> np.ndarray:
        """The entries' sequence numbers of keys ``off:end`` now: where they equal ``seqs``
        (compare the bytes: a ufunc and ``.all()`` cost 3 us), the key is still READY."""
        return table.seqs(self.blocks[off:end])


def remember(keys: Sequence[bytes], blocks: Sequence[int], table: BlockTable,
             held: bool = True) -> Run | None:
    """A ``Run`` of ``keys`` (a prefix, in order), just pinned at ``blocks`` and found READY,
    or None when there is nothing worth keeping (too short, or an entry being rewritten). A
    key named twice is kept once: a relet would lease it twice and leak one of the holds.
    ``held=False``: nothing holds the blocks, so each entry must show its key as well, and
    the run is the prefix of keys whose entries do."""
    if len(keys) < RUN_MIN:
        return None
    if len(set(keys)) != len(keys):
        first = dict(zip(keys, blocks))  # in first-seen order; a key's block is one
        keys, blocks = list(first), list(first.values())
        if len(keys) < RUN_MIN:
            return None
    b = np.array(blocks, np.intp)
    if held:
        seqs = table.ready_seqs(b)
        if (seqs < 0).any():
            return None  # a rewrite in progress: no proof to keep
        return Run(list(keys), b, seqs)
    karr = key_array(keys)
    if karr is None:
        return None
    seqs = table.ready_seqs(b, karr)
    unproven = np.flatnonzero(seqs < 0)
    n = int(unproven[0]) if unproven.size else len(keys)  # the prefix the table proves
    return Run(list(keys[:n]), b[:n], seqs[:n]) if n >= RUN_MIN else None


class Runs:
    """The prefixes one client loaded (key -> its run and offset), and the relets of them."""

    def __init__(self, table: BlockTable, limit: int) -> None:
        self.table = table
        self.limit = limit  # keys remembered, all runs together
        self.by_key: dict[bytes, tuple[Run, int]] = {}
        # The first key of one of our recent stores -> its keys and their blocks, not proven
        # READY yet (the owner publishes them after us): the first lookup of that key proves
        # them and leases them as a prefix loaded before (``relet``), as the engine that
        # stored a prefix is the one most likely to ask for it next.
        self.stored: dict[bytes, tuple[Sequence[bytes], list[int]]] = {}
        # the last relet's run, its offset into it and how many keys it took
        self._last: tuple[Run, int, int] | None = None

    def clear(self) -> None:
        self.by_key.clear()
        self.stored.clear()
        self._last = None

    def step_over(self) -> None:
        """Every lease was given back: the next lookup asks past no relet."""
        self._last = None

    def unasked(self, n: int) -> None:
        """``n`` keys the last relet took ahead were given back unasked."""
        if self._last is not None and n > 0:
            run, off, taken = self._last  # take as far as the prefix was asked, from its
            run.shrink(off + taken - n)  # head, next time (and no plan rebuilt for a tail
            # given back out of order: the free stack keeps its order when nothing is)

    def follow(self, keys: Sequence[bytes], blocks: Sequence[int]) -> None:
        """``keys`` (a prefix, in order) were just pinned at ``blocks`` and found READY:
        remember them with their entries' sequence numbers for ``relet``."""
        self._keep(remember(keys, blocks, self.table))

    def stored_by_us(self, keys: Sequence[bytes], blocks: list[int]) -> None:
        """Our store of ``keys`` (in order) at ``blocks`` was published: the first lookup of
        its first key proves and leases them (the oldest of ``STORED_KEPT`` go)."""
        if len(keys) < RUN_MIN:
            return
        stored = self.stored
        stored.pop(keys[0], None)
        if len(stored) >= STORED_KEPT:
            del stored[next(iter(stored))]
        stored[keys[0]] = (keys, blocks)

    def _keep(self, run: Run | None) -> None:
        if run is None:
            return
        if len(self.by_key) + len(run.keys) > self.limit:
            self.by_key.clear()
        self.by_key.update(zip(run.keys, zip(repeat(run), range(len(run.keys)))))

    def proven(self, keys: list[bytes], blocks: list[int]) -> bool:
        """Whether ``keys`` at ``blocks`` are the head of a remembered prefix whose entries
        are all unchanged since (so each still holds its key READY): the whole batch proven
        with one comparison."""
        at = self.by_key.get(keys[0]) if keys else None
        if at is None or at[1] != 0:
            return False
        run, n = at[0], len(keys)
        if run.keys[:n] != keys or run.blocks[:n].tolist() != blocks:
            return False
        return run.seqs_now(self.table, 0, n).tobytes() == run.seqs[:n].tobytes()

    def still_ready(self, key: bytes, block: int) -> bool:
        """Whether a remembered prefix proves that ``block`` still holds ``key`` READY."""
        at = self.by_key.get(key)
        if at is None:
            return False
        run, off = at
        return int(run.blocks[off]) == block and self.table.seq(block) == int(run.seqs[off])

    def relet(self, h: HoldTable, key: bytes) -> bool:
        """Lease ``key`` and the keys that followed it in a remembered prefix into ``h``, all
        with one handshake: the scheduler asks for a prefix key by key, so the next lookups
        are dict hits. Each key is leased only if its entry is unchanged since the load
        proved it READY (same sequence number). False: ``key`` not leased (not in a loaded
        prefix, changed, or no room)."""
        at = self.by_key.get(key)
        if at is None:
            ours = self.stored.pop(key, None) if self.stored else None
            if ours is None:
                return False
            self._prove(*ours)
            at = self.by_key.get(key)
            if at is None:
                return False
        h.drop_ahead()
        run, off = at
        last, self._last = self._last, None
        if last is not None and last[0] is run and off > 0:  # asked past the last relet
            run.grow()
        n = min(len(run.keys) - off, run.reach, h.room())
        if n <= 0:
            return False
        self._last = (run, off, n)
        top = h.free[-n:]
        plan = run.plans.get(off)
        if plan is None or top != plan.idx:  # (compares identical ints: cheap)
            plan = run.plan(off, top)
        if h.leases and not h.leases.keys().isdisjoint(plan.leases.keys()):
            return self._relet_partly(h, run, off, n)  # some leased already: never twice
        h.write_holds(plan.ia, plan.codes, plan.top)
        full_fence()  # our holds before our re-checks: the owner fences the other way round
        now = self.table.seqs(plan.blocks)
        if now.tobytes() == plan.seqs:  # (a ufunc and .all() cost 3 us)
            h.leases.update(plan.leases)
            h.ahead.update(plan.ahead)
            return True
        ok = now == run.seqs[off:off + n]
        self._cut(run, off + int(np.argmin(ok)))
        return self._keep_unchanged(h, key, plan, ok)

    def _prove(self, keys: Sequence[bytes], blocks: list[int]) -> None:
        """Remember what of our store of ``keys`` at ``blocks`` the table shows READY, as a
        prefix loaded before; the rest, if the owner has not published it yet (it publishes a
        long store a frame at a time), under its own first key."""
        run = remember(keys, blocks, self.table, held=False)
        self._keep(run)
        if run is not None and len(keys) - len(run.keys) >= RUN_MIN and \
                run.keys == keys[:len(run.keys)]:  # (no key named twice: the rest follows)
            m = len(run.keys)
            self.stored[keys[m]] = (keys[m:], blocks[m:])

    def _cut(self, run: Run, end: int) -> None:
        """The entry of ``run``'s key ``end`` changed since it was proven: the keys from it on
        are forgotten (the next lookups of them take the long way, once), so that no relet
        re-checks a dead tail again (the unique keys after a prefix we stored, evicted)."""
        by_key = self.by_key
        for k in run.keys[end:]:
            if by_key.get(k, (None, 0))[0] is run:
                del by_key[k]
        run.cut(end)

    def _relet_partly(self, h: HoldTable, run: Run, off: int, n: int) -> bool:
        """``relet`` up to the first key of the run that is leased already."""
        part = run.keys[off:off + n]
        n = next(i for i, k in enumerate(part) if k in h.leases)
        if n == 0:
            return False
        plan = Plan(run, off, h.free[-n:])
        h.write_holds(plan.ia, plan.codes, plan.top)
        full_fence()  # our holds before our re-checks: the owner fences the other way round
        return self._keep_unchanged(h, part[0], plan, run.seqs_now(self.table, off, off + n)
                                    == run.seqs[off:off + n])

    @staticmethod
    def _keep_unchanged(h: HoldTable, key: bytes, plan: Plan, ok: np.ndarray) -> bool:
        """Keep the holds ``plan`` just wrote where ``ok`` (the entry is unchanged since the
        load), give back the rest; whether ``key`` (the one asked for) is leased."""
        h.give_back(plan.ia[~ok])
        good = [kj for kj, g in zip(plan.leases.items(), ok.tolist()) if g]
        h.leases.update(good)
        h.ahead.update(k for k, _ in good)
        if ok[0]:
            h.ahead.discard(key)
        return bool(ok[0])
