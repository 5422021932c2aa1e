"""Stocking grant rings: how many blocks each storing client is kept ahead of its stores.

This module owns the sizing of grants and the refill of every client's grant ring (the ids,
then the count that hands them over) between the owner's frames. What a grant is, and what
publishing or ending one does, is ``grants.py``'s. A client's slot words are its own, so a
refill that finds them impossible reports the client (the caller quarantines it) and goes on
with the others. It never copies block data and never blocks.

Grants are kept small (an offer is a victim chosen early, before the touches that could have
spared it): a client is kept at ``grant_target`` (its share of a quarter of the cache) or at
twice its largest store, the growth beyond the share only while all grants together stay
within ``grant_budget`` (that quarter again). A client that has taken nothing for
``IDLE_SECONDS`` is kept at its share, and once the budget is spent while a busy client wants
more, what it holds beyond its share is recalled (``recall``): a client that stored alone and
then went idle does not keep the budget from the ones storing now.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import Protocol, TypeVar

import numpy as np

from kvshm.crashpoints import crash_point
from kvshm.owner.grants import Grants, grant_level
from kvshm.shm import layout as L
from kvshm.shm.fence import full_fence, publish_fence
from kvshm.shm.layout import Geometry
from kvshm.shm.words import WordView

log = logging.getLogger("kvshm.owner")

# A client that took no granted block for this long is idle. An engine's scheduler stores at
# nearly every step (tens of milliseconds) while it serves: a second without a take is a
# pause, not a gap between two steps.
IDLE_SECONDS = 1.0


def grant_target(g: Geometry) -> int:
    """Blocks a storing client is kept stocked with at first: its share of a quarter of the
    cache (0: tiny caches store by round trip)."""
    return min(L.GRANT_CAPACITY, g.num_blocks // (4 * g.max_clients))


def grant_budget(g: Geometry) -> int:
    """Blocks all clients' grants together may hold: a quarter of the cache."""
    return g.num_blocks // 4 if grant_target(g) else 0


class StockedClient(Protocol):
    """What ``stock`` reads and keeps of a client (the owner's ``_Client``)."""
    slot: int
    gen: int
    grant_head: WordView  # its slot's grant counts (records.GRANT_HEAD_DTYPE)
    grant_ids: np.ndarray  # its slot's grant ring
    taken_seen: int  # its taken count at the last refill
    taken_at: float  # when a refill last saw that count move (time.monotonic)
    largest_store: int  # in blocks, the most it took between two refills or in one store


_C = TypeVar("_C", bound=StockedClient)


def sized_target(grants: Grants, level: int, writer: tuple[int, int], share: int,
                 largest: int, room: int) -> int:
    """The level to refill ``writer``'s ring to: twice its ``largest`` store, so one store
    takes at most half and a refill (at half) follows every store; never less than its
    ``share`` (counting its taken, unpublished blocks, so a client whose taken count runs
    ahead of its publishes is not refilled without end); the growth beyond the share within
    ``room``. It never shrinks: a scheduler's step sizes recur."""
    inflight = grants.held(writer) - level
    grown = min(L.GRANT_CAPACITY, max(share, 2 * largest))
    return min(grown, max(share - inflight, level + room, 0))


def refill(grants: Grants, head: WordView, ids: np.ndarray, slot: int, gen: int,
           granted: int, level: int, target: int) -> int:
    """Top up one client's grant ring (``granted`` pushed so far, ``level`` in it, from
    ``grant_level``) to ``target`` blocks, when it is half empty. The ids go in first, then
    the count that publishes them. Returns the blocks granted."""
    if level > target // 2:
        return 0
    blocks = grants.grant(slot, gen, target - level, granted)
    _ring(ids, granted, blocks)
    crash_point("owner.grant.before_count")
    _count(head, granted + len(blocks))
    return len(blocks)


def hand_over(head: WordView, ids: np.ndarray, granted: int, blocks: list[int]) -> int:
    """Ring ``blocks`` (granted already, at positions from ``granted`` on: what a dead
    predecessor began to hand over, ``Grants.settle``) as a refill does. Returns the new
    granted count."""
    _ring(ids, granted, blocks)
    _count(head, granted + len(blocks))
    return granted + len(blocks)


def _ring(ids: np.ndarray, granted: int, blocks: list[int]) -> None:
    for i, b in enumerate(blocks):
        ids[(granted + i) % L.GRANT_CAPACITY] = b


def _count(head: WordView, granted: int) -> None:
    publish_fence()  # ids before the count that hands them over
    head["granted"] = granted


def recall(grants: Grants, c: StockedClient, keep: int, now: float) -> int:
    """Take back what client ``c``'s grant ring holds beyond ``keep`` blocks: the ids at its
    last positions, which it has not taken. The count goes down first, then the client's
    intent word is read (each fenced before reading the other's word, as the client's take
    is): a client taking any of those positions meanwhile has announced it, and then the
    count goes back up and the recall is refused; else the client reads the lowered count
    before it takes, and the blocks are ended (``Grants.take_back``). An owner dying in
    between leaves them granted above the count: its successor hands them over again
    (``Grants.settle``). A refused client is not asked again until it has idled anew.
    Nothing is recalled from a client whose words contradict its takes (its taken count
    below one seen before, or above its intent): what it took cannot be told from them.
    Returns the blocks taken back."""
    head = c.grant_head
    granted, taken = head["granted"], head["taken"]
    level = grant_level(granted, taken)
    if level is None or level <= keep or not c.taken_seen <= taken <= head["intent"]:
        return 0
    back = taken + keep
    head["granted"] = back
    full_fence()  # our count before we read its intent; it stores its intent, then reads ours
    crash_point("owner.recall.lowered")
    if head["intent"] > back or head["taken"] > back:
        head["granted"] = granted  # it is taking them: they stay its own
        c.taken_at = now
        grants.segment.counter_add("recalls_refused")
        return 0
    return grants.take_back((c.slot, c.gen), back)


def _idle(c: StockedClient, now: float) -> bool:
    """``c`` took no granted block for ``IDLE_SECONDS``."""
    return c.grant_head["taken"] == c.taken_seen and now - c.taken_at >= IDLE_SECONDS


def stock(grants: Grants, c: StockedClient, share: int, room: int, now: float) -> int | None:
    """One refill of client ``c``'s grant ring, sized by ``sized_target`` (its largest store
    so far grows from the blocks it took since the last refill; an idle client is kept at
    its share). Returns the blocks granted, or None if its ring's counts are impossible
    (grant it nothing)."""
    head = c.grant_head
    granted, taken = head["granted"], head["taken"]
    level = grant_level(granted, taken)
    if level is None:
        return None
    if 0 < taken - c.taken_seen <= L.GRANT_CAPACITY:
        c.largest_store = max(c.largest_store, taken - c.taken_seen)
    if taken != c.taken_seen:
        c.taken_seen, c.taken_at = taken, now
    target = sized_target(grants, level, (c.slot, c.gen), share, c.largest_store, room)
    if _idle(c, now):
        target = min(target, share)
    return refill(grants, head, c.grant_ids, c.slot, c.gen, granted, level, target)


def stock_all(grants: Grants, clients: Sequence[_C], share: int,
              budget: int) -> list[tuple[_C, str]]:
    """One refill of every storing client's grant ring (``stock``), so that its next stores
    need no round trip, all clients' grants together within ``budget``; when the budget is
    spent and a busy client wants more than its share, idle clients' rings are first cut
    down to their share (``recall``). Returns the clients whose rings could not be stocked,
    and why: their slot, not the owner, is at fault (the caller quarantines them), so no
    failure of one stops the others' refills."""
    now = time.monotonic()
    room = budget - grants.held()  # what may still be granted, to anyone
    short = room <= 0 and any(2 * c.largest_store > share and not _idle(c, now)
                              for c in clients)
    bad: list[tuple[_C, str]] = []
    for c in clients:
        try:
            if short and _idle(c, now):
                room += recall(grants, c, share, now)
            n = stock(grants, c, share, room, now)
        except Exception as e:  # its slot's words, never the owner's end
            log.exception("refilling client slot %d failed", c.slot)
            bad.append((c, f"its grant ring could not be refilled ({e!r})"))
            continue
        if n is None:
            bad.append((c, "its grant ring counts are impossible"))
        else:
            room -= n
    return bad
