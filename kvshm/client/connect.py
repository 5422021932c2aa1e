"""``kvshm.connect()``: attach this process to a shared cache, creating it if asked.

This module owns the one call an engine makes to join a segment: attach it (or create it,
sized by blocks or by bytes, with the eviction policy and permissions it records), then
build the process's ``SharedManager``, which starts an owner if none serves. It closes what
it opened when that fails, and copies no block data.
"""
from __future__ import annotations

from kvshm.client.manager import SharedManager
from kvshm.errors import InvalidArgumentError
from kvshm.shm.creation import blocks_for_bytes
from kvshm.shm.layout import Layout
from kvshm.shm.segment import Segment


def connect(name: str, layout: Layout | None = None, *, num_blocks: int | None = None,
            nbytes: int | str | None = None, policy: str = "lru", mode: int = 0o600,
            events: bool = False, grants: bool = True, timeout: float = 30.0,
            quota: int | float | None = None, **create_kw: int) -> SharedManager:
    """Attach this process to shared cache ``name`` and return its manager.

    Give ``num_blocks`` or ``nbytes`` (with ``layout``; bytes, or a size such as "64M") to
    create the segment if it does not exist yet; without them the segment must exist.
    ``layout``, when given, must match the segment's. An owner process is started if none
    is serving. ``events=True`` makes ``take_events`` report every store and eviction in the
    shared cache. ``grants=False`` stores by round trip only, so that other clients see a
    store in flight as such (PENDING) rather than as a miss: for a client others wait for,
    like the lower tier's mover. ``quota``: this client's share of the cache, in blocks (an
    int) or as a fraction of it (a float in (0, 1]): over it, its stores evict its own
    blocks first; within it, no other client's stores evict them (None: no quota). All
    quotas together keep at most three quarters of the cache: the owner cuts one asked
    beyond what the others left (the manager's ``quota`` is the one applied).
    """
    if num_blocks is None and nbytes is not None:
        if layout is None:
            raise TypeError("connect(nbytes=...) needs the layout to size blocks")
        num_blocks = blocks_for_bytes(layout, nbytes)
    if num_blocks is not None:
        if layout is None:
            raise TypeError("connect(num_blocks=...) needs the layout of the blocks")
        seg = Segment.create(name, layout, num_blocks, mode=mode, policy=policy,
                             exist_ok=True, **create_kw)
    else:
        seg = Segment.attach(name, layout)
    try:
        blocks = quota_blocks(quota, seg.geometry.num_blocks)
        return SharedManager(seg, events=events, grants=grants, timeout=timeout, quota=blocks)
    except BaseException:
        seg.close()
        raise


def quota_blocks(quota: int | float | None, num_blocks: int) -> int:
    """A ``quota`` as blocks of a cache of ``num_blocks`` (0: no quota): blocks (an int >= 1,
    at most the cache) or a fraction of the cache (a float in (0, 1], at least one block)."""
    if quota is None:
        return 0
    if isinstance(quota, bool) or not isinstance(quota, (int, float)):
        raise InvalidArgumentError(f"quota must be a number of blocks (an int) or a fraction "
                                   f"of the cache (a float in (0, 1]), got {quota!r}")
    if isinstance(quota, int):
        if not 1 <= quota <= num_blocks:
            raise InvalidArgumentError(f"quota={quota} blocks: give 1..{num_blocks} (the "
                                       "cache's blocks), or a fraction such as 0.25")
        return quota
    if not 0.0 < quota <= 1.0:
        raise InvalidArgumentError(f"quota={quota!r}: a fraction of the cache must be in "
                                   "(0, 1], e.g. 0.25; or give a number of blocks")
    return max(1, int(quota * num_blocks))
