"""How long the owner busy-polls before it sleeps on its doorbell: only while spinning pays.

A frame that arrives while the owner spins is served at once; one that arrives while it
sleeps costs a futex wake-up (tens of microseconds, more on a loaded host). Spinning
costs a core for as long as it lasts, so it pays only when the next frame comes within about
the time it would spin. ``SpinPolicy`` learns that from the owner's recent idle gaps (from
going idle to the next frame): when the median of the last ``HISTORY`` gaps is at most
``PAYS_S`` (a client in a burst of round trips), the owner spins for ``SPAN`` times that
median (at most ``SPIN_MAX_S``); otherwise (an engine that sends a few frames per scheduler step,
milliseconds apart) it sleeps at once.

It owns that decision only: it never waits, never touches shared memory and never reads a
clock itself (the owner passes its times in), so it is deterministic to test.
"""
from __future__ import annotations

from collections import deque

SPIN_MAX_S = 0.005  # the longest spin, for a client that sends back to back
PAYS_S = 0.001  # spin only when recent gaps were this short (a client in a burst)
SPAN = 16.0  # spin this many median gaps: a burst's slow tail too, not just its middle
HISTORY = 8  # idle gaps remembered


class SpinPolicy:
    """Spin budgets from the owner's recent idle gaps."""

    def __init__(self, max_s: float = SPIN_MAX_S, pays_s: float = PAYS_S,
                 history: int = HISTORY) -> None:
        self.max_s, self.pays_s = max_s, pays_s
        self._gaps: deque[float] = deque([pays_s], maxlen=history)  # a new owner spins

    def observe(self, gap_s: float) -> None:
        """The owner was idle ``gap_s`` seconds before its next frame."""
        self._gaps.append(gap_s)

    def expected_gap(self) -> float:
        """Median of the recent gaps (the upper one of an even count)."""
        return sorted(self._gaps)[len(self._gaps) // 2]

    def budget(self, idle_s: float) -> float:
        """Seconds to spin now, having been idle ``idle_s`` seconds already (0: sleep)."""
        gap = self.expected_gap()
        if gap > self.pays_s:
            return 0.0
        return max(0.0, min(self.max_s, SPAN * gap) - idle_s)
