"""The mover's link to the lower tier: connecting off the loop, connected, down for a
backoff, probed back.

This module owns the lower tier's health as the mover sees it. Connecting (joining the store,
then registering the memory the transfers read and write: the segment's data region, the
mover's header buffer) runs in a thread of its own, so the mover's loop goes on while it
waits without the GIL. A backend may hold the GIL while it waits (Mooncake's setup, with a
master that takes connections but does not answer, for minutes): the loop and the stop
handlers stop with it, so while a connect runs SIGTERM and SIGINT are left to the kernel and
end the process at once. Until a connect succeeds the tier is not usable: the
mover answers wants at once (misses) and drops store events (counted), and a failed connect
is tried again after a backoff. A call answered with an RPC failure marks the tier *down* for
a backoff (1 s doubling to 8 s), with the same effect; then the next real call, or a probe
once the backoff ends, tells whether it is back. Engines see a tier that is not connected as
no tier (``client.py``). The state is shown in the tier area (``kvshm-inspect show``) and a
change of it is one log line. It never moves a block (``mover.py`` does), and never lets two
threads call the tier at once: the connect thread's calls end before the loop's begin.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence

from kvshm.signals import StopSignals
from kvshm.tier.api import Code, LowerTier
from kvshm.tier.area import TierArea

log = logging.getLogger("kvshm.mover")  # the mover's log: these lines are its own

_BACKOFF_S, _BACKOFF_MAX_S = 1.0, 8.0


class TierLink:
    """The connection of one mover to ``tier``; ``regions`` are the (address, length) spans
    to register on every connect, in order; ``stops``: the process's stop signals, handed to
    the kernel while a connect runs. ``tend`` once a round drives it."""

    def __init__(self, tier: LowerTier, area: TierArea, regions: Sequence[tuple[int, int]],
                 stops: StopSignals | None = None) -> None:
        self.tier = tier
        self.area = area
        self._regions = regions
        self._stops = stops
        self.connected = False
        self._down_until = 0.0  # monotonic time before which no call is tried
        self._is_down = False
        self._backoff = _BACKOFF_S
        # The connect thread's: whether it runs, and what came of it ("" or why it failed;
        # None: nothing to take). The loop reads them only once ``_running`` is False, and
        # ``_lock`` orders the end of a connect against ``close``.
        self._running = False
        self._outcome: str | BaseException | None = None
        self._lock = threading.Lock()
        self._closing = False

    def usable(self) -> bool:
        """Whether the tier may be called now: connected and not in a backoff."""
        return self.connected and time.monotonic() >= self._down_until

    def tend(self) -> None:
        """Once a round: start a connect when one is due, take its outcome once it ended,
        or probe a tier that is down once its backoff ends. Raises what a connect raised
        (``LowerTierUnavailableError``: the backend can never work here)."""
        if self.connected:
            self.probe()
        elif self._running:
            return
        elif self._outcome is not None:
            self._kernel_stops(False)
            why, self._outcome = self._outcome, None
            if isinstance(why, BaseException):
                raise why
            if why:
                self._down(None, why)
            else:
                self.connected, self._is_down, self._backoff = True, False, _BACKOFF_S
                self.area.add("reconnects")
                self.area.set_state("connected")
                log.info("connected to %s", self.tier.description)
        elif time.monotonic() >= self._down_until and self._kernel_stops(True):
            self._running = True
            threading.Thread(target=self._connect, name="kvshm-mover-connect",
                             daemon=True).start()  # a stopping mover never waits for it

    def _kernel_stops(self, on: bool) -> bool:
        """While a connect runs, SIGTERM and SIGINT end the process by the kernel's default
        action: Mooncake's setup may hold the GIL for minutes (a master that takes connections
        but does not answer), and then no handler of ours runs. Dying then is safe: engines
        trust no tier that is not connected, the mover's lock falls with the process, and no
        block is half-moved. Only the main thread may (a mover run elsewhere keeps its
        signals). False: a stop came before, so no connect starts and the loop stops."""
        if self._stops is None or threading.current_thread() is not threading.main_thread():
            return True
        self._stops.to_kernel(on)  # (runs a handler still pending first)
        if on and self._stops.received:
            self._stops.to_kernel(False)
            return False
        return True

    def _connect(self) -> None:
        """The connect thread. A store that cannot be reached answers False (the backend
        makes sure of that without waiting long), and the loop backs off."""
        why: str | BaseException = ""
        try:
            if not self.tier.connect():
                why = "cannot connect"
            elif not all(self.tier.register(addr, n) for addr, n in self._regions):
                self.tier.close()
                why = "cannot register the segment's memory"
        except BaseException as e:  # for the loop to raise
            why = e
        with self._lock:
            if self._closing and not why:  # the mover stopped meanwhile, leaving it to us
                self.tier.close()
            self._outcome = why
            self._running = False

    def close(self) -> bool:
        """The mover stops: whether it may close the tier itself (False: a connect still
        runs, and closes what it opened when it ends)."""
        with self._lock:
            self._closing = True
            return not self._running

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
