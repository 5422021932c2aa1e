"""Every error kvshm raises, as one typed hierarchy.

This module owns the exception classes and nothing else. Each message must say what happened
and what the user should do; ``docs/errors.md`` catalogues them. It must never import any
other kvshm module.
"""
from __future__ import annotations


class KvshmError(Exception):
    """Base class of every error kvshm raises on purpose."""


# --- segment -----------------------------------------------------------------------------
class SegmentNotFoundError(KvshmError):
    """No kvshm segment of that name exists (attach without create)."""


class SegmentExistsError(KvshmError):
    """A segment of that name already exists and exclusive creation was asked for."""


class NotAKvshmSegmentError(KvshmError):
    """The shared-memory object exists but is not a kvshm segment (bad magic or too small)."""


class CreationStalledError(KvshmError, TimeoutError):
    """A live process holds the segment's creation lock but has stopped making progress."""


class FormatVersionError(KvshmError):
    """The segment was written by an incompatible kvshm format version."""


class LayoutMismatchError(KvshmError):
    """The segment holds a different model layout than the attaching process expects."""


class InsufficientSpaceError(KvshmError):
    """/dev/shm (or the cgroup) has too little room for the segment."""


class SegmentPermissionError(KvshmError):
    """The process may not open the segment (mode/owner) or create it."""


# --- arguments and manager semantics -----------------------------------------------------
class InvalidArgumentError(KvshmError, ValueError):
    """A caller passed a value kvshm can never accept (negative size, key too long, ...)."""


class UnknownKeyError(KvshmError, KeyError):
    """An operation named a key that is not in the cache (or not ready / not held)."""

    def __str__(self) -> str:  # KeyError quotes its argument; we want the message as written
        return str(self.args[0]) if self.args else ""


class BlockStateError(KvshmError):
    """An operation does not fit the block's state (double complete, complete without prepare)."""


class CacheFullError(KvshmError):
    """Base of the "no room" errors; catch it to handle any of them. A cache with no block
    free or evictable is no error: ``prepare_store`` returns None."""


class HoldsExhaustedError(CacheFullError):
    """A client holds ``hold_capacity`` blocks (leases + load pins) and asked for another."""


# --- control ring and owner --------------------------------------------------------------
class RingFullError(KvshmError, TimeoutError):
    """The peer did not drain the ring within the timeout (backpressure)."""


class FrameTooLargeError(KvshmError):
    """A frame is larger than the ring can ever hold."""


class ProtocolError(KvshmError):
    """A frame could not be decoded or is not a valid request/reply."""


class ClientQuarantinedError(ProtocolError):
    """The owner stopped serving this client for good (it found the client's rings or grant
    counts corrupt): no call of it will be answered. Shut the manager down and connect again."""


class RequestDroppedError(ProtocolError):
    """A request was in progress when several owners in a row died: it was dropped, not
    executed, so that it cannot take every successor down. The call may be retried; if it
    fails again the same way, the request itself kills owners (report it)."""


class OwnerUnavailableError(KvshmError):
    """No owner process is serving the segment and none could be started."""


class ClientSlotsExhaustedError(KvshmError):
    """Every client slot in the segment is held by a live process."""


class ReplyTimeoutError(KvshmError, TimeoutError):
    """The owner did not answer within the timeout."""


class CounterLimitError(KvshmError):
    """A counter that must never wrap reached the end of its range (a connection's request
    ids): the connection that owns it must be made anew."""


# --- data path ---------------------------------------------------------------------------
class TransferError(KvshmError):
    """A block copy could not be submitted or failed."""


class PinningError(KvshmError):
    """Registering the segment with CUDA failed (copies continue unpinned)."""


# --- lower tier --------------------------------------------------------------------------
class MoverRunningError(KvshmError):
    """Another live process is the segment's mover (one per host and segment): nothing to do."""


class LowerTierUnavailableError(KvshmError):
    """The lower tier's client cannot be used at all: its package (or a system library it
    loads) is missing, or its configuration is invalid. Raised where a mover starts, never
    to an engine: a lower tier that is merely down is a miss, not an error."""
