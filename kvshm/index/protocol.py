"""The frames that travel on kvshm's control rings, encoded with msgspec.

This module owns the message types (one tagged union per direction) and their reusable
encoder/decoders. Frames are msgpack arrays (``array_like``) so a 32-key request costs about
a microsecond to encode and decode. It never touches shared memory or manager state.

Every request carries ``req``, the client's request number (u64, increasing per slot
generation); every reply echoes it and carries the epoch of the owner that wrote it.
``req == 0`` marks a one-way request (no reply): ``Touch`` and ``Publish`` only. A
``PrepareStore`` too large for one frame travels as several frames with the same ``req``
(``part`` 0, 1, ...; all but the last with ``more``): the owner executes it once, whole, when
the last part arrives, and answers in parts the same way. Other requests that are too large
are split by the client into independent requests. Why a request is executed at most once
whatever dies is told in ``client/owner_link.py``.

``Touch``, ``PrepareStore`` and ``Publish`` may name the running request their keys belong to
(``api.Running``, vLLM 0.33's provisional LRU rank): ``request`` (the client's number for it,
0: none) and ``positions`` (one token position per key, -1: none). A ``Touch`` that names a
request without positions says that it finished. Both fields are trailing and optional, so a
frame without them decodes as before, and an owner without them ignores them.
"""
from __future__ import annotations

import msgspec

from kvshm import errors
from kvshm.index.api import Running
from kvshm.shm import layout as L
from kvshm.shm.ring import Ring


# Frozen, and every subclass says so again: type checkers do not inherit the option.
class _Msg(msgspec.Struct, tag=True, array_like=True, frozen=True):
    pass


# --- client -> owner ---------------------------------------------------------------------
class Hello(_Msg, frozen=True):
    req: int
    slot: int
    gen: int
    pid: int
    events: bool = False


class PrepareStore(_Msg, frozen=True):  # one atomic operation, however many frames it takes
    req: int
    keys: list[bytes]
    more: bool = False  # more parts of this request follow
    part: int = 0  # index of this part
    request: int = 0  # the running request of the keys (see above), 0: none
    positions: list[int] | None = None  # of this part's keys


class CompleteStore(_Msg, frozen=True):
    req: int
    keys: list[bytes]
    success: bool = True
    of_req: int = 0  # only the keys granted by this earlier request (an undo), if non-zero


class Touch(_Msg, frozen=True):
    req: int
    keys: list[bytes]
    how: bytes | None = None  # one kvshm.owner.policy access kind per key; None: plain touch
    request: int = 0
    positions: list[int] | None = None


class Publish(_Msg, frozen=True):  # one-way (req 0): the stores of blocks taken from the grant ring
    req: int
    keys: list[bytes]
    blocks: list[int]  # the granted block each key was written to, same order
    success: bool = True  # False: the copies failed, free the blocks
    request: int = 0
    positions: list[int] | None = None
    # Offers taken and not claimed because a request used them since they were offered: the
    # owner caches them again (they were never written).
    returned: list[int] = []


class TakeEvents(_Msg, frozen=True):
    req: int


class Bye(_Msg, frozen=True):
    req: int


Request = Hello | PrepareStore | CompleteStore | Touch | Publish | TakeEvents | Bye


# --- owner -> client ---------------------------------------------------------------------
class Ok(_Msg, frozen=True):
    req: int
    epoch: int
    value: int = 0


class Prepared(_Msg, frozen=True):
    req: int
    epoch: int
    keys: list[bytes]
    blocks: list[int]
    evicted: list[bytes]
    more: bool = False  # more parts of this reply follow
    part: int = 0  # 0 starts a reply afresh (a successor's replay restarts a partial one)
    replayed: bool = False  # answered from the record by a successor: evictions are unknown


class NoRoom(_Msg, frozen=True):
    req: int
    epoch: int


class Events(_Msg, frozen=True):
    req: int
    epoch: int
    removed: list[bool]  # per event, in the order they happened
    keys: list[list[bytes]]


class Retry(_Msg, frozen=True):
    """The request was provably not executed (its parts were lost with a dead owner):
    send it again under a new request id."""
    req: int
    epoch: int


class Error(_Msg, frozen=True):
    req: int
    epoch: int
    kind: str  # name of a class in kvshm.errors
    message: str


Reply = Ok | Prepared | NoRoom | Events | Retry | Error


def keys_per_part(ring_capacity: int) -> int:
    """Keys one ``PrepareStore`` part or ``Prepared`` reply part carries (a reply part
    carries a block id per key too): its frame fits a ring of ``ring_capacity`` bytes."""
    return max(1, (Ring.max_payload(ring_capacity) - 64) // (L.MAX_KEY_BYTES + 16))


def running_fields(running: Running | None, keys: list[bytes]) -> dict:
    """The ``request``/``positions`` fields that carry ``running`` for ``keys``."""
    if running is None:
        return {}
    pos = None if running.done else [running.positions.get(k, -1) for k in keys]
    return {"request": running.request, "positions": pos}


def running_of(msg: Touch | PrepareStore | Publish) -> Running | None:
    """The running request a frame (or a whole multi-part request) names; its values are
    checked by the manager."""
    if not msg.request:
        return None
    keys, positions = msg.keys, msg.positions
    if positions is None:
        return Running(msg.request, done=isinstance(msg, Touch))
    if len(positions) != len(keys):
        raise errors.InvalidArgumentError(
            f"{len(positions)} token positions for {len(keys)} keys")
    return Running(msg.request, {k: p for k, p in zip(keys, positions) if p != -1})


request_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_encoder = request_encoder
reply_decoder = msgspec.msgpack.Decoder(Reply)


def error_reply(req: int, epoch: int, exc: BaseException) -> Error:
    kind = type(exc).__name__ if isinstance(exc, errors.KvshmError) else "ProtocolError"
    return Error(req, epoch, kind, str(exc) or kind)


def raise_error(reply: Error) -> None:
    """Re-raise an owner's error in the client as the same typed exception."""
    cls = getattr(errors, reply.kind, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.KvshmError)):
        cls = errors.ProtocolError
    raise cls(reply.message)
