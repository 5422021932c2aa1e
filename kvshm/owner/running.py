"""Running requests' provisional ranks in the owner's index (vLLM 0.33's LRU rule).

This module owns the table of running requests that clients named (``api.Running``): for each
``(client slot, generation, request)`` the rank number the policy gave it when it first needed
one, so that all its keys share that rank, tails before heads. It checks what a client sent
before anything changes, keeps at most ``MAX_RUNNING`` requests (the oldest go first: a client
that never ends its requests cannot grow the owner) and forgets a request when it ends or its
client goes. It never reads or writes the segment, never decides an eviction (``policy.py``
orders keys) and never blocks.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvshm.errors import InvalidArgumentError
from kvshm.index.api import Running
from kvshm.owner.policy import CachePolicy, Rank

MAX_RUNNING = 1 << 16  # running requests remembered (all clients together)
_U64 = 1 << 64

RankOf = Callable[["bytes | None"], "Rank | None"]


class RunningRanks:
    """The rank numbers of running requests, per client, for one ``CachePolicy``."""

    def __init__(self, policy: CachePolicy) -> None:
        self.policy = policy
        # (slot, gen, request) -> rank number, oldest first
        self.ranks: OrderedDict[tuple[int, int, int], int] = OrderedDict()

    def rank_of(self, running: Running | None, client: tuple[int, int]) -> RankOf | None:
        """For ``running`` (checked now: ``InvalidArgumentError`` before anything changes),
        the provisional rank of a key of it (None for a key without a position); the request's
        rank number is taken from the policy at the first call, ``rank_of(None)`` included."""
        if running is None:
            return None
        req, pos = running.request, running.positions
        if type(req) is not int or not 0 < req < _U64 or not all(
                type(p) is int and 0 <= p < _U64 for p in pos.values()):
            raise InvalidArgumentError(
                "a running request needs a number in 1..2**64-1 and token positions in "
                "0..2**64-1")
        ident = (*client, req)

        def rank_of(key: bytes | None) -> Rank | None:
            p = None if key is None else pos.get(key)
            if key is not None and p is None:
                return None
            r = self.ranks.get(ident)
            if r is None:
                r = self.ranks[ident] = self.policy.new_rank()
                if len(self.ranks) > MAX_RUNNING:
                    self.ranks.popitem(last=False)  # the oldest (a dict's front is slow)
            return None if p is None else (r, -p)
        return rank_of

    def rank_of_frames(self, frames: Sequence[tuple[Running | None, int]],
                       client: tuple[int, int]) -> tuple[list[RankOf | None], int]:
        """``rank_of`` of each of several Publish frames taken together (given as each
        frame's running request and key count; None: it names none, or a bad one), and how
        many named a bad request (``InvalidArgumentError``: their keys take fresh ranks, as
        such a frame alone)."""
        fns: list[RankOf | None] = []
        bad = 0
        for running, _ in frames:
            try:
                fns.append(self.rank_of(running, client))
            except InvalidArgumentError:
                bad += 1
                fns.append(None)
        return fns, bad

    def end(self, running: Running | None, client: tuple[int, int]) -> None:
        """Forget ``running`` if it says it is done."""
        if running is not None and running.done:
            self.ranks.pop((*client, running.request), None)

    def drop_client(self, slot: int, gen: int) -> None:
        """Forget every request of a client that is gone."""
        for ident in [i for i in self.ranks if i[:2] == (slot, gen)]:
            del self.ranks[ident]
