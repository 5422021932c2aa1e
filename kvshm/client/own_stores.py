"""A client's own stores on the grant path: what it took from its grant ring, and what it
published that the owner has not taken yet.

This module owns the client side of ``grants.py``: it is the consumer of the slot's grant
ring (``take``), it remembers the keys in flight (blocks taken, store not completed) and the
keys it published (``complete``: one-way ``Publish`` frames) until the owner has taken their
frame, so that the client reads its own completed stores back (``confirm``). It never writes
the block table or the key index and never waits longer than ``CONFIRM_WAIT_S``.
"""
from __future__ import annotations

from collections.abc import Sequence

from kvshm.client.owner_link import OwnerLink
from kvshm.crashpoints import crash_point
from kvshm.index import protocol as P
from kvshm.index.api import Running
from kvshm.shm import layout as L
from kvshm.shm import slots
from kvshm.shm.fence import publish_fence
from kvshm.shm.segment import Segment

CONFIRM_WAIT_S = 0.05  # a read of our own just-published store waits this long at most


class OwnStores:
    """The grant-path stores of one client slot."""

    def __init__(self, segment: Segment, slot: int, link: OwnerLink) -> None:
        self._gw, ids = slots.grants(segment, slot)  # counts, and ids the owner hands us
        self._gi = ids.data
        self._link = link
        self.taken = 0  # blocks taken from the grant ring (we alone store the word)
        self.inflight: dict[bytes, int] = {}  # key -> granted block, store not completed
        # key -> request ring position past its Publish: ours, in the index once it is taken
        self.unconfirmed: dict[bytes, int] = {}
        self._stalled_at = -1  # request ring head when the owner last kept a read waiting

    def mine(self, key: bytes) -> bool:
        """Whether ``key`` is our store in flight, or published and not yet taken."""
        return key in self.inflight or key in self.unconfirmed

    def take(self, keys: list[bytes]) -> list[int] | None:
        """Granted blocks for ``keys`` (now in flight), or None if the ring holds too few."""
        gw, n, t = self._gw, len(keys), self.taken
        if n > gw["granted"] - t:
            return None
        gi, cap = self._gi, L.GRANT_CAPACITY
        blocks = [gi[(t + i) % cap] for i in range(n)]
        crash_point("client.store.after_take")
        publish_fence()  # ids read before the count that lets the owner reuse their places
        self.taken = gw["taken"] = t + n
        self.inflight.update(zip(keys, blocks))
        return blocks

    def complete(self, keys: Sequence[bytes], success: bool, chunk: int,
                 running: Running | None = None) -> list[bytes]:
        """Publish (or fail) those of ``keys`` in flight, one-way, ``chunk`` keys a frame (the
        owner ranks them for ``running``). Returns the keys that are not ours (their
        completion is a round trip)."""
        inflight, mine, rest = self.inflight, {}, []
        for k in keys:
            b = inflight.get(k)
            if b is not None:
                mine[k] = b
            elif k not in mine and k not in self.unconfirmed:  # unconfirmed: done already
                rest.append(k)
        ks, bs = list(mine), list(mine.values())
        for i in range(0, len(ks), chunk):  # in flight until sent: a failed push can be redone
            part = ks[i:i + chunk]
            pos = self._link.push(P.Publish(0, part, bs[i:i + chunk], success,
                                            **P.running_fields(running, part)))
            for k in part:
                del inflight[k]
            if success:
                self.unconfirmed.update(dict.fromkeys(part, pos))
        return rest

    def confirm(self, key: bytes) -> bool:
        """Whether the index now shows our store of ``key``, which it did not a moment ago:
        True once the owner took its Publish meanwhile (look again). False if it had taken
        it before (the key is gone: a miss), or takes longer than ``CONFIRM_WAIT_S`` (a
        stalled owner: the key stays ours, read as still being stored). A read waits once
        per stall: while the owner has not moved since, it does not wait again."""
        pos, requests = self.unconfirmed[key], self._link.requests
        if requests.consumed(pos):
            del self.unconfirmed[key]
            return False
        if requests.head() == self._stalled_at or \
                not self._link.wait_consumed(pos, CONFIRM_WAIT_S):
            self._stalled_at = requests.head()
            return False
        del self.unconfirmed[key]
        return True

    def prune(self) -> None:
        """Forget our stores the owner has published (oldest first, in ring order)."""
        u, consumed = self.unconfirmed, self._link.requests.consumed
        while u:
            k = next(iter(u))
            if not consumed(u[k]):
                return
            del u[k]

    def close(self) -> None:
        self._gw.release()
        self._gi.release()
