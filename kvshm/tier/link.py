"""The mover's link to the lower tier: connected, down for a backoff, probed back.

This module owns the lower tier's health as the mover sees it. The first use connects and
registers the memory the transfers read and write (the segment's data region, the mover's
header buffer). A call answered with an RPC failure marks the tier *down* for a backoff (1 s
doubling to 8 s), during which the mover answers wants at once (misses) and drops store events
(counted); then the next real call, or a probe once the backoff ends, tells whether it is
back. The state is shown in the tier area (``kvshm-inspect show``) and a change of it is one
log line. It never moves a block (``mover.py`` does).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from kvshm.tier.api import Code, LowerTier
from kvshm.tier.area import TierArea

log = logging.getLogger("kvshm.mover")  # the mover's log: these lines are its own

_BACKOFF_S, _BACKOFF_MAX_S = 1.0, 8.0


class TierLink:
    """The connection of one mover to ``tier``; ``regions`` are the (address, length) spans
    to register on every connect, in order."""

    def __init__(self, tier: LowerTier, area: TierArea,
                 regions: Sequence[tuple[int, int]]) -> None:
        self.tier = tier
        self.area = area
        self._regions = regions
        self.connected = False
        self._down_until = 0.0  # monotonic time before which no call is tried
        self._is_down = False
        self._backoff = _BACKOFF_S

    def usable(self) -> bool:
        """Whether the tier may be called now: connected (connecting if needed) and not in
        a backoff."""
        now = time.monotonic()
        if now < self._down_until:
            return False
        if not self.connected:
            if not self.tier.connect():
                self._down(None, "cannot connect")
                return False
            if not all(self.tier.register(addr, n) for addr, n in self._regions):
                self.tier.close()
                self._down(None, "cannot register the segment's memory")
                return False
            self.connected, self._is_down, self._backoff = True, False, _BACKOFF_S
            self.area.add("reconnects")
            self.area.set_state("connected")
            log.info("connected to %s", self.tier.description)
        return True

    def probe(self) -> None:
        """After a backoff, one cheap call tells whether the tier is back, so recovery (and
        the state kvshm-inspect shows) does not wait for the next block to move."""
        if self._is_down and self.connected and time.monotonic() >= self._down_until:
            self.codes(self.tier.exists(["kvshm1-probe"]))

    def codes(self, codes: Sequence[int]) -> None:
        """Learn from the codes of one call: an RPC failure puts the tier down, an answer
        (found or not) brings it up."""
        rpc = sum(1 for c in codes if c == Code.RPC_FAILED)
        if rpc:
            self.area.add("rpc_failures", rpc)
            self._down(Code.RPC_FAILED, "RPC failed")
        elif any(c >= 0 or c == Code.NOT_FOUND for c in codes):
            self._up()

    def _down(self, code: int | None, why: str) -> None:
        if code is not None:
            self.area.set_error(int(code))
        if not self._is_down:
            log.warning("lower tier unusable (%s%s); misses until it answers again",
                        why, f", code {int(code)}" if code is not None else "")
        self._is_down = True
        self._down_until = time.monotonic() + self._backoff
        self._backoff = min(self._backoff * 2, _BACKOFF_MAX_S)
        self.area.set_state("down")

    def _up(self) -> None:
        if self._is_down:
            log.info("lower tier answers again")
            self._is_down = False
            self.area.set_state("connected")
        self._backoff = _BACKOFF_S
