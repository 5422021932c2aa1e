"""The frames that travel on kvshm's control rings, encoded with msgspec.

This module owns the message types (one tagged union per direction) and their reusable
encoder/decoders. Frames are msgpack arrays (``array_like``) so a 32-key request costs about
a microsecond to encode and decode. It never touches shared memory or manager state.

Every request carries ``req``, the client's request number; the reply echoes it. ``req == 0``
marks a one-way request (no reply). ``replay`` marks a request resent after an owner died
having consumed it without answering; the owner then answers from what it already did.
"""
from __future__ import annotations

from typing import Union

import msgspec

from . import errors


class _Msg(msgspec.Struct, tag=True, array_like=True, frozen=True):
    pass


# --- client -> owner ---------------------------------------------------------------------
class Hello(_Msg):
    req: int
    slot: int
    gen: int
    pid: int
    events: bool = False


class Lookup(_Msg):  # owner-side lookup; clients normally read the segment instead
    req: int
    keys: list[bytes]


class PrepareStore(_Msg):
    req: int
    keys: list[bytes]
    replay: bool = False


class CompleteStore(_Msg):
    req: int
    keys: list[bytes]
    success: bool = True


class Touch(_Msg):
    req: int
    keys: list[bytes]


class TakeEvents(_Msg):
    req: int


class Bye(_Msg):
    req: int


Request = Union[Hello, Lookup, PrepareStore, CompleteStore, Touch, TakeEvents, Bye]


# --- owner -> client ---------------------------------------------------------------------
class Ok(_Msg):
    req: int
    value: int = 0


class Prepared(_Msg):
    req: int
    keys: list[bytes]
    blocks: list[int]
    evicted: list[bytes]


class NoRoom(_Msg):
    req: int


class Events(_Msg):
    req: int
    removed: list[bool]  # per event, in the order they happened
    keys: list[list[bytes]]


class Error(_Msg):
    req: int
    kind: str  # name of a class in kvshm.errors
    message: str


Reply = Union[Ok, Prepared, NoRoom, Events, Error]

request_encoder = msgspec.msgpack.Encoder()
request_decoder = msgspec.msgpack.Decoder(Request)
reply_encoder = request_encoder
reply_decoder = msgspec.msgpack.Decoder(Reply)


def error_reply(req: int, exc: BaseException) -> Error:
    kind = type(exc).__name__ if isinstance(exc, errors.KvshmError) else "ProtocolError"
    return Error(req, kind, str(exc) or kind)


def raise_error(reply: Error) -> None:
    """Re-raise an owner's error in the client as the same typed exception."""
    cls = getattr(errors, reply.kind, None)
    if not (isinstance(cls, type) and issubclass(cls, errors.KvshmError)):
        cls = errors.ProtocolError
    raise cls(reply.message)
