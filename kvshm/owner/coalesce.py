"""Publish frames queued behind each other in one client's ring, applied as one.

This module owns which one-way ``Publish`` frames the owner may take together with the one at
the head of a client's request ring, and the merged frame it applies in their place. A
decode step stores one block per request, each a frame of one key; applied one by one every
frame paid the publish's fixed cost (a tick, a table round, the policy and index calls),
about three quarters of a one-key frame. Merged, frames queued behind a busy owner share it,
so the busier the owner, the less each frame costs it.

Applying the merged frame is applying its frames in ring order, as far as stores and loads
tell: a Publish's keys are published in ring order (the policy's order, and a tick per key in
the table, from which a successor rebuilds recency), each at its own frame's running request's
provisional rank (the frame whose block of it is published decides), a
key already published stays and a later block of it is freed, the sender's ``taken`` count
only grows, and a block not granted to the sender is ignored. So only frames that succeed or
fail alike are merged, and only the head frame may return offers (those are ended before its
keys, as alone). Two differences remain. Event subscribers get the run's evictions (the
claimed offers' old keys) before its stores, one event of each kind for the run. And a key
published by one frame whose old block is an offer claimed by a later frame of the run stays
cached in the new block (one by one it would have been found cached and that block freed):
only a client that stores a key the index still names gets there, and ``prepare_store``
refuses that to an honest one.

None of the frames is released from the ring before the merged one is applied
(``Ring.peek_after``/``include``): a successor replays what is left, harmlessly, as for one
frame. It never executes anything and never writes shared memory (a frame it looked at and
left stays in the ring, decoded again when its turn comes).
"""
from __future__ import annotations

import msgspec

from kvshm.errors import KvshmError
from kvshm.index import protocol as P
from kvshm.index.api import Running
from kvshm.shm import keys as K
from kvshm.shm.ring import Ring

MAX_KEYS = 4096  # keys merged at most: each frame's keys are applied in one batch anyway


class Merged(P.Publish, frozen=True):
    """Publish frames taken together (never on the wire): their keys and blocks in ring
    order, the head frame's outcome and returned offers, and each frame's running request
    and key count, for the ranks (``RunningRanks.rank_of_frames``)."""
    runs: list[tuple[Running | None, int]] = msgspec.field(default_factory=list)


def plain(m: P.Request) -> bool:
    """Whether ``m`` is a Publish that may be merged: one-way and none of what the Publish
    handler refuses or counts as an error (a refused frame is refused alone, never with
    the frames merged with it)."""
    return type(m) is P.Publish and not m.req and len(m.keys) == len(m.blocks) and \
        (m.positions is None or len(m.positions) == len(m.keys)) and _good_keys(m.keys)


def merge(ring: Ring, head: P.Publish, most: int) -> tuple[P.Publish, int]:
    """``head`` (the peeked head frame of ``ring``, ``plain``) and the mergeable Publish
    frames queued right behind it, as one ``Merged`` frame of at most ``most`` frames (what
    the owner's pass still grants this client), and how many frames it stands for. The
    ring's next ``advance()`` releases them all; a frame that cannot be merged (another
    kind, one that fails to decode or to check, returned offers, the other outcome) ends
    the run and stays in the ring, served on its own."""
    keys, blocks = list(head.keys), list(head.blocks)
    runs = [(P.running_of(head), len(head.keys))]
    while len(runs) < most and len(keys) < MAX_KEYS:
        try:
            got = ring.peek_after()
        except KvshmError:  # a scribbled ring: the head frame is served, the next peek fails
            break
        if got is None:
            break
        view, end = got
        try:
            m = P.request_decoder.decode(view)
        except Exception:  # (as the owner's own decode: served on its own, its error its own)
            break
        finally:
            view.release()
        if not plain(m) or m.success != head.success or m.returned:
            break
        keys += m.keys
        blocks += m.blocks
        runs.append((P.running_of(m), len(m.keys)))
        ring.include(end)
    if len(runs) == 1:
        return head, 1
    return Merged(0, keys, blocks, head.success, returned=head.returned, runs=runs), len(runs)


def _good_keys(keys: list[bytes]) -> bool:
    """Whether ``keys`` pass the Publish handler's check."""
    try:
        K.check_keys(keys)
    except KvshmError:
        return False
    return True
