"""The manager interface every kvshm manager implements, with vLLM's v1 offload semantics.

This module owns the abstract ``OffloadingManager`` and the values it passes around. It holds
no state and no implementation; ``manager.LocalManager`` (in-process, authoritative) and
``client.SharedManager`` (a proxy to the owner process) implement it and share one test suite.
Keys are opaque bytes of 1..64 bytes (vLLM's offload key: 32-byte block hash + 4-byte group).
"""
from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from kvshm.errors import InvalidArgumentError


class LookupResult(enum.Enum):
    """Per-key lookup answer (vLLM 0.32's ``LookupResult``)."""
    MISS = "miss"
    HIT = "hit"
    PENDING = "pending"  # present, but its store has not completed
    RETRY = "retry"  # absent, but a lower tier may bring it: ask again (TieredManager only)


@dataclass
class PrepareStoreOutput:
    """What ``prepare_store`` decided: which keys to write where, and what it evicted."""
    keys_to_store: list[bytes]
    block_ids: list[int]  # segment block of each key in keys_to_store, same order
    evicted_keys: list[bytes] = field(default_factory=list)


@dataclass
class OffloadingEvent:
    """A change of the cache's content: keys stored (``removed=False``) or evicted."""
    keys: list[bytes]
    removed: bool
    medium: str = "CPU"


@dataclass(frozen=True)
class Running:
    """The running request that some keys belong to, for vLLM 0.33's provisional LRU rank:
    its keys share one rank, taken when the request first needs it, tails before heads.

    ``request`` is the caller's number for it (1..2**64-1, never reused by this client),
    ``positions`` the token position of each key that has one. ``done`` (``touch`` only: a
    store refuses it): the request finished, forget its rank after this call (a later call
    with the same number takes a new one).
    """
    request: int
    positions: Mapping[bytes, int] = field(default_factory=dict)
    done: bool = False

    def for_store(self) -> Running:
        """This request, as a store may name it: ``InvalidArgumentError`` if it is done (a
        store's frame cannot carry both its keys' positions and an end)."""
        if self.done:
            raise InvalidArgumentError(
                "a store cannot end a running request (done=True); end it with touch")
        return self


class OffloadingManager(ABC):
    """Bookkeeping of the shared CPU tier: which keys are cached where, readiness, pins.

    ``release`` and ``add_bytes`` are optional (default bodies, as vLLM's abstract class
    does for optional methods): callers always call them, managers override what applies.
    """

    @abstractmethod
    def lookup(self, keys: Sequence[bytes]) -> int:
        """Length of the longest prefix of ``keys`` that is cached and ready."""

    @abstractmethod
    def key_status(self, key: bytes) -> LookupResult:
        """Whether one key is a hit, a miss, or present with its store still in flight (a
        ``TieredManager`` may also answer RETRY)."""

    @abstractmethod
    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        """Pin ``keys`` against eviction and return their block ids (same order).

        Every key must be cached and ready (else ``UnknownKeyError``/``BlockStateError`` and
        nothing is pinned). Each call must be matched by one ``complete_load``.
        """

    @abstractmethod
    def touch(self, keys: Sequence[bytes], how: bytes | None = None, *,
              running: Running | None = None) -> None:
        """Mark ``keys`` recently used; the first key ends up most recent. Unknown keys ignored.

        ``how`` (one ``kvshm.owner.policy`` access kind per key) applies a finished request's
        classified accesses instead, as vLLM's ``on_request_finished`` does; its ``RANKED``
        keys take ``running``'s provisional rank (LRU)."""

    @abstractmethod
    def complete_load(self, keys: Sequence[bytes]) -> None:
        """Release the pins ``prepare_load`` took."""

    @abstractmethod
    def prepare_store(self, keys: Sequence[bytes], *,
                      running: Running | None = None) -> PrepareStoreOutput | None:
        """Allocate blocks for the keys not yet cached, evicting if needed.

        Returns None (and changes nothing) when not enough blocks can be freed. Keys offered
        in the same call are never chosen as victims; eviction is all-or-nothing. With
        ``running``, a new key with a position takes that request's provisional rank (LRU).
        """

    @abstractmethod
    def complete_store(self, keys: Sequence[bytes], success: bool = True, *,
                       running: Running | None = None) -> None:
        """Publish the written blocks (``success``) or free them (failure).

        Keys already ready are left untouched, so a repeated call is harmless. ``running``
        matters only where a key enters the index at its completion (a client's granted
        blocks): it ranks there as ``prepare_store`` would have ranked it.
        """

    # Not abstract: an optional hook, a no-op unless a manager has leases to drop.
    def release(self, keys: Sequence[bytes] | None = None) -> None:  # noqa: B027
        """Give back one lookup of each of ``keys`` (all leases if None); pins are unaffected.

        Only a manager whose ``lookup`` leases its hits has anything to drop; the default
        does nothing. Leases are counted: each lookup or ``key_status`` that reported a key as
        a hit is given back by one ``release`` naming it, or taken by one ``prepare_load``
        naming it, and the key stays leased until all are (two requests that hit one key
        each keep it until they are done with it).
        """

    # Not abstract: an optional hook, a no-op unless a manager keeps byte counters.
    def add_bytes(self, loaded: int = 0, stored: int = 0) -> None:  # noqa: B027
        """Count bytes this process's transfers moved (``loaded`` out of the cache into a
        device, ``stored`` into it). A manager with per-client counters (kvshm-inspect's
        ``bytes_in``/``bytes_out``) records them; the default does nothing."""

    @abstractmethod
    def take_events(self) -> Iterable[OffloadingEvent]:
        """Drain the store/evict events recorded since the last call (if events are enabled)."""

    @abstractmethod
    def shutdown(self) -> None:
        """Release everything this manager holds."""
