"""The engine's side of the lower tier: a manager whose lookup may answer "not yet".

This module owns ``TieredManager``, an ``OffloadingManager`` over a ``SharedManager`` that adds
one thing: a lookup that misses the segment asks the host's mover (through the tier area's want
ring of this client's slot) to fetch the missing keys from the lower tier, and answers "not
yet" — vLLM's "retry this lookup later" — instead of a miss, so no scheduler step waits on the
network. Every other call goes straight to the SharedManager. It never talks to the lower
tier, never blocks and never raises for anything the lower tier does.

Two ways to ask: ``lookup(keys)`` (a prefix; "not yet" is None, and the missing run is asked
for at once) and ``key_status(key)`` (vLLM's per-key lookup; "not yet" is RETRY, and the keys
are asked for together by ``flush_wants``, which the scheduler calls once per step).

When a lookup answers "not yet", and for how long (per first missing key):

* key absent from the segment, never asked for (or last asked ``retry_after`` s ago): the
  missing run (up to ``want_ahead`` keys) is posted to the mover — not yet.
* asked, and the mover has not handled the want yet — not yet, until ``max_wait`` seconds
  after the ask; then (the mover is stuck behind an unreachable store) a plain miss.
* the key is WRITING (the mover's fetch, or another engine's store, in flight) — not yet, also
  bounded by ``max_wait``; READY by now — None once more, and the next lookup hits.
  (``key_status`` says RETRY only for a key it asked for; another engine's store in flight is
  PENDING, as from the SharedManager.)
* asked and answered, still absent — the lower tier does not have it: a plain miss, and the
  key is not asked for again within ``retry_after`` s.
* no mover alive (or no tier area), or a mover not connected to its lower tier (connecting,
  or down for a backoff: it would only answer misses) — plain SharedManager semantics, at
  once. Whether the mover lives (its kernel lock, a system call) is checked at most every
  ``_ALIVE_EVERY_S`` seconds; the state it shows (a word of shared memory) on every call.

So a key absent everywhere costs one "not yet" and then misses; a key below costs one fetch.
A None answer gives back its lookup of the hits before it (``release``: a later lookup leases
them again; another request's lookup of them keeps its lease).
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from kvshm.client.manager import SharedManager
from kvshm.index.api import (
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    Running,
)
from kvshm.shm import layout as L
from kvshm.tier.area import TierArea

_ATTACH_EVERY_S = 1.0   # how often a client without a tier area looks for one again
_ALIVE_EVERY_S = 0.1    # how often a client checks that the mover lives, at most
_MAX_TRACKED = 16384    # asked-for keys remembered; older ones are forgotten first
_now = time.monotonic   # the clock (a module name, so that a test can stop it)


class TieredManager(OffloadingManager):
    """``SharedManager`` plus lower-tier fills on miss. Same thread rules as SharedManager."""

    def __init__(self, manager: SharedManager, *, max_wait: float = 2.0,
                 want_ahead: int = 64, retry_after: float = 5.0) -> None:
        self.manager = manager
        self.segment, self.index = manager.segment, manager.index
        self.slot, self.gen = manager.slot, manager.gen
        self.max_wait, self.want_ahead, self.retry_after = max_wait, want_ahead, retry_after
        self._area: TierArea | None = None
        self._live: TierArea | None = None  # the area while its mover was last seen alive
        self._next_check = 0.0
        self._asked: dict[bytes, tuple[int, float]] = {}  # key -> (want seq or 0, first seen)
        self._queued: dict[bytes, float] = {}  # key_status misses for flush_wants -> when
        self._waiting_on: tuple[int, bytes, int, bytes] | None = None  # see _still_waiting
        self.not_yet = 0  # lookups answered None (for tests and demos)

    # --- the lookup that may hit below ---------------------------------------------------
    def _tier(self) -> TierArea | None:
        """The tier area if its mover lives (as last checked: at most every _ALIVE_EVERY_S)
        and says it is connected to its lower tier: asking a mover that is not would only
        cost "not yet" rounds before the same miss."""
        now = _now()
        if now >= self._next_check:
            if self._area is None:
                self._area = TierArea.attach(self.segment)
            self._next_check = now + (_ALIVE_EVERY_S if self._area is not None
                                      else _ATTACH_EVERY_S)
            self._live = (self._area if self._area is not None and self._area.mover_alive()
                          else None)
        return self._live if self._live is not None and self._live.connected() else None

    def lookup(self, keys: Sequence[bytes]) -> int | None:  # type: ignore[override]
        """Prefix length of ready blocks, or None: retry later, a fetch may bring more."""
        if self._waiting_on is not None and self._still_waiting(keys):
            self.not_yet += 1
            return None
        self._waiting_on = None
        n = self.manager.lookup(keys)
        if n >= len(keys):
            return n
        area = self._tier()
        if area is None:
            return n
        key = keys[n]
        now = _now()
        seen = self._asked.get(key)
        _, state = self.manager.index.find(key)
        if state == L.READY or state == L.WRITING:
            if seen is None:
                seen = self._asked[key] = (0, now)
            if state == L.READY or now - seen[1] < self.max_wait:
                self._not_yet(keys, n)
                return None
            return n
        if (waiting := self._want_waits(area, seen, now)) is not None:
            if not waiting:
                return n
            self._not_yet(keys, n)
            return None
        ask = [k for k in keys[n:n + self.want_ahead]
               if (s := self._asked.get(k)) is None or now - s[1] >= self.retry_after
               or not s[0]]
        if not ask:
            return n
        self._record(ask, area.want(self.slot, ask), now)
        self._not_yet(keys, n)
        return None

    def _want_waits(self, area: TierArea, seen: tuple[int, float] | None,
                    now: float) -> bool | None:
        """For a key last asked for as ``seen``: None when no want of it is recent (ask
        again); else True while the mover has not handled it (not yet, for ``max_wait`` s)
        and False once it has, or stalls (the lower tier has nothing for it: a miss)."""
        if seen is None or not seen[0] or now - seen[1] >= self.retry_after:
            return None
        return not area.answered(self.slot, seen[0]) and now - seen[1] < self.max_wait

    def _record(self, keys: list[bytes], seq: int, now: float) -> None:
        if len(self._asked) > _MAX_TRACKED:
            for old in list(self._asked)[:_MAX_TRACKED // 2]:
                del self._asked[old]
        for k in keys:
            self._asked.pop(k, None)
            self._asked[k] = (seq, now)

    def _not_yet(self, keys: Sequence[bytes], n: int) -> None:
        if n:
            self.manager.release(list(keys[:n]))
        self.not_yet += 1
        self._waiting_on = (len(keys), keys[0], n, keys[n])  # lookup calls us with n < len

    def _still_waiting(self, keys: Sequence[bytes]) -> bool:
        """Fast path for a scheduler re-asking the same prefix: while the key the last "not
        yet" waited on is still WRITING (its fetch in flight), answer again without a new
        lookup of the whole prefix. Anything else (READY, gone, another prefix) re-runs it."""
        size, first, n, key = self._waiting_on  # type: ignore[misc]
        if len(keys) != size or keys[0] != first or keys[n] != key:
            return False
        seen = self._asked.get(key)
        return (seen is not None and _now() - seen[1] < self.max_wait and
                self.manager.index.find(key)[1] == L.WRITING)

    # --- vLLM's per-key lookup -------------------------------------------------------------
    def key_status(self, key: bytes) -> LookupResult:
        """The SharedManager's answer (a HIT takes a lease), or RETRY for a key the lower tier
        may bring: absent and queued for the next ``flush_wants`` (at most ``want_ahead`` keys
        a step; the rest are misses until then), asked and not answered yet, or asked and
        being fetched (WRITING) — each bounded by ``max_wait`` like ``lookup``'s None."""
        status = self.manager.key_status(key)
        if status is LookupResult.HIT:
            return status
        now = _now()
        if key in self._queued:
            return LookupResult.RETRY if now - self._queued[key] < self.max_wait else status
        seen = self._asked.get(key)
        if status is LookupResult.PENDING:  # our fetch in flight, or someone else's store
            return (LookupResult.RETRY if seen is not None and seen[0] and
                    now - seen[1] < self.max_wait else status)
        area = self._tier()
        if area is None:
            return status
        if (waiting := self._want_waits(area, seen, now)) is not None:
            return LookupResult.RETRY if waiting else status
        if len(self._queued) >= self.want_ahead:
            return status
        self._queued[key] = now
        return LookupResult.RETRY

    def flush_wants(self) -> None:
        """Ask the mover for the keys ``key_status`` queued, in one want (once per step)."""
        if not self._queued:
            return
        keys = list(self._queued)
        self._queued.clear()
        if (area := self._tier()) is not None:  # else: no mover, they are plain misses
            self._record(keys, area.want(self.slot, keys), _now())

    # --- everything else is the SharedManager's -------------------------------------------

    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        return self.manager.prepare_load(keys)

    def touch(self, keys: Sequence[bytes], how: bytes | None = None, *,
              running: Running | None = None) -> None:
        self.manager.touch(keys, how, running=running)

    def complete_load(self, keys: Sequence[bytes]) -> None:
        self.manager.complete_load(keys)

    def prepare_store(self, keys: Iterable[bytes], *,
                      running: Running | None = None) -> PrepareStoreOutput | None:
        return self.manager.prepare_store(keys, running=running)

    def complete_store(self, keys: Sequence[bytes], success: bool = True, *,
                       running: Running | None = None) -> None:
        self.manager.complete_store(keys, success, running=running)
        if success and keys and (area := self._tier()) is not None:
            area.kick()  # write-through starts now, not at the mover's next events poll

    def release(self, keys: Sequence[bytes] | None = None) -> None:
        self.manager.release(keys)

    def add_bytes(self, loaded: int = 0, stored: int = 0) -> None:
        self.manager.add_bytes(loaded, stored)

    def held_blocks(self) -> int:
        return self.manager.held_blocks()

    def take_events(self) -> list[OffloadingEvent]:
        return self.manager.take_events()

    def shutdown(self) -> None:
        if self._area is not None:
            self._area.close()
            self._area = None
        self.manager.shutdown()

    def __enter__(self) -> TieredManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def connect_tiered(name: str, layout: L.Layout | None = None, **kw: object) -> TieredManager:
    """``kvshm.connect(name, layout, **kw)`` wrapped in a ``TieredManager`` (its defaults)."""
    from kvshm.client.connect import connect
    return TieredManager(connect(name, layout, **kw))  # type: ignore[arg-type]
