"""What the owner's index reports of its changes: events for clients, counters for people.

This module owns the record of outcomes every part of the index produces: a completed store
(published or failed) and an eviction, as vLLM's ``OffloadingEvent`` list that
``take_events`` hands out (kept only when events are enabled) and as the segment's counters.
It decides nothing and changes no entry.
"""
from __future__ import annotations

from kvshm.index.api import OffloadingEvent
from kvshm.shm.segment import Segment


class Outcomes:
    """Events (when ``enabled``) and counters of one segment's index."""

    def __init__(self, segment: Segment, enabled: bool) -> None:
        self.segment = segment
        self.enabled = enabled
        self._events: list[OffloadingEvent] = []  # in order, until take()

    def stored(self, done: list[bytes], success: bool, failed: int) -> None:
        """A completion: ``done`` keys published (success), or ``failed`` blocks freed."""
        if success:
            self.segment.counter_add("stores")
            self.segment.counter_add("store_blocks", len(done))
            if self.enabled and done:
                self._events.append(OffloadingEvent(done, removed=False))
        else:
            self.segment.counter_add("store_failed_blocks", failed)

    def evicted(self, victims: list[bytes]) -> None:
        self.segment.counter_add("evictions", len(victims))
        if self.enabled:
            self._events.append(OffloadingEvent(victims, removed=True))

    def take(self) -> list[OffloadingEvent]:
        """The events since the last call, oldest first."""
        ev, self._events = self._events, []
        return ev
