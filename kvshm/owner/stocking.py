"""Stocking grant rings: how many blocks each storing client is kept ahead of its stores.

This module owns the sizing of grants and the refill of every client's grant ring (the ids,
then the count that hands them over) between the owner's frames. What a grant is, and what
publishing or ending one does, is ``grants.py``'s. A client's slot words are its own, so a
refill that finds them impossible reports the client (the caller quarantines it) and goes on
with the others. It never copies block data and never blocks.

Grants are kept small (an offer is a victim chosen early, before the touches that could have
spared it): a client is kept at ``grant_target`` (its share of a quarter of the cache) or at
twice its largest store, the growth beyond the share only while all grants together stay
within ``grant_budget`` (that quarter again).
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Protocol, TypeVar

import numpy as np

from kvshm.crashpoints import crash_point
from kvshm.owner.grants import Grants, grant_level
from kvshm.shm import layout as L
from kvshm.shm.fence import publish_fence
from kvshm.shm.layout import Geometry
from kvshm.shm.words import WordView

log = logging.getLogger("kvshm.owner")


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


def stock(grants: Grants, c: StockedClient, share: int, room: int) -> int | None:
    """One refill of client ``c``'s grant ring, sized by ``sized_target`` (its largest store
    so far grows from the blocks it took since the last refill). Returns the blocks
    granted, or None if its ring's counts are impossible (grant it nothing)."""
    head = c.grant_head
    granted, taken = head["granted"], head["taken"]
    level = grant_level(granted, taken)
    if level is None:
        return None
    if 0 < taken - c.taken_seen <= L.GRANT_CAPACITY:
        c.largest_store = max(c.largest_store, taken - c.taken_seen)
    c.taken_seen = taken
    target = sized_target(grants, level, (c.slot, c.gen), share, c.largest_store, room)
    return refill(grants, head, c.grant_ids, c.slot, c.gen, granted, level, target)


def stock_all(grants: Grants, clients: Sequence[_C], share: int,
              budget: int) -> list[tuple[_C, str]]:
    """One refill of every storing client's grant ring (``stock``), so that its next stores
    need no round trip, all clients' grants together within ``budget``. Returns the clients
    whose rings could not be stocked, and why: their slot, not the owner, is at fault (the
    caller quarantines them), so no failure of one stops the others' refills."""
    room = budget - grants.held()  # what may still be granted, to anyone
    bad: list[tuple[_C, str]] = []
    for c in clients:
        try:
            n = stock(grants, c, share, room)
        except Exception as e:  # its slot's words, never the owner's end
            log.exception("refilling client slot %d failed", c.slot)
            bad.append((c, f"its grant ring could not be refilled ({e!r})"))
            continue
        if n is None:
            bad.append((c, "its grant ring counts are impossible"))
        else:
            room -= n
    return bad
