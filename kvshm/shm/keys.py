"""What a cache key is: ``bytes`` of 1..``MAX_KEY_BYTES``, and the checks every manager call
makes of the keys it is given.

This module owns key validation for every manager (the owner's ``LocalManager``, a client's
``SharedManager``): a wrong key is refused with an ``InvalidArgumentError`` that says what to
pass instead, never stored under a form its caller will not look up. It never touches shared
memory.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvshm.errors import InvalidArgumentError
from kvshm.shm.layout import MAX_KEY_BYTES


def check_key(key: bytes) -> None:
    """Refuse anything but ``bytes`` of 1..MAX_KEY_BYTES (a ``bytearray`` or ``memoryview``
    is refused, not converted: it would be stored under a copy the caller never looks up)."""
    if type(key) is bytes and 0 < len(key) <= MAX_KEY_BYTES:
        return  # the hot path: one type check and one length check
    if not isinstance(key, bytes) or not 1 <= len(key) <= MAX_KEY_BYTES:
        hint = "; pass bytes(key)" if isinstance(key, (bytearray, memoryview)) else ""
        raise InvalidArgumentError(
            f"keys are 1..{MAX_KEY_BYTES} bytes, of type bytes (vLLM offload keys are 36); got "
            f"{type(key).__name__} of length {len(key) if hasattr(key, '__len__') else '?'}"
            f"{hint}")


def check_keys(keys: Sequence[bytes]) -> None:
    """``check_key`` of every key, with the hot path inlined (one type and one length test
    per key: a call per key costs more than both); the first bad one raises."""
    for k in keys:
        if type(k) is not bytes or not 0 < len(k) <= MAX_KEY_BYTES:
            check_key(k)


def key_seq(keys: Any) -> Sequence[bytes]:
    """The ``keys`` argument of a manager call as a list or tuple.

    Hot paths test ``type(keys) is list or tuple`` first (a call saved). Other
    iterables (generators, ranges, dict views) are materialised once, so a call that walks
    the keys twice (validate, then act) sees them all. A single key, a str, None or a
    number is refused: it is a caller's mistake, not a sequence of keys. Items are checked
    by ``check_key`` where the call uses them.
    """
    if type(keys) is list or type(keys) is tuple:
        return keys
    if keys is None or isinstance(keys, (str, bytes, bytearray, memoryview, int, float,
                                         set, frozenset)) or not hasattr(keys, "__iter__"):
        hint = " (one key? wrap it in a list)" if isinstance(
            keys, (bytes, bytearray, memoryview)) else ""
        raise InvalidArgumentError(
            f"keys must be a sequence (list or tuple) of bytes keys; got "
            f"{type(keys).__name__}{hint}")
    return list(keys)


def key_array(keys: Sequence[bytes]) -> np.ndarray | None:
    """Equal-length bytes keys as an (n, len) uint8 array, for a client's vectorised lookups
    and proofs; None if they are not that."""
    klen = len(keys[0])
    joined = b"".join(keys)
    if len(joined) != len(keys) * klen or not all(type(k) is bytes and len(k) == klen
                                                  for k in keys):
        return None
    return np.frombuffer(joined, np.uint8).reshape(len(keys), klen)
