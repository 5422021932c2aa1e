"""Aligned word stores into shared memory, field by field of a named record.

This module owns the one way kvshm stores a field other processes read: a single aligned
8-, 4-, 2- or 1-byte copy through a ``memoryview`` cast, which CPython performs as one
fixed-size memcpy (one machine store, single-copy atomic when aligned), so a reader sees
the old or the new value, never a torn or transiently zero one. Never ``struct.pack_into``
on a shared field: it zero-fills the field before writing it. It orders nothing (see
``fence.py``), never locks and never maps memory itself.
"""
from __future__ import annotations

from typing import Any, Literal

import numpy as np

from kvshm.shm.records import field_dtype, field_names, field_offset

_CODES: dict[int, Literal["B", "H", "I", "Q"]] = {1: "B", 2: "H", 4: "I", 8: "Q"}


def store(buf: memoryview, off: int, value: int, size: int = 8) -> None:
    """Store unsigned ``value`` as one aligned ``size``-byte word at ``buf[off]``."""
    assert off % size == 0, f"unaligned {size}-byte store at {off}"
    with buf[off:off + size].cast(_CODES[size]) as w:
        w[0] = value


def store_fields(buf: memoryview, off: int, dtype: np.dtype, **values: Any) -> None:
    """Store the named integer fields of record ``dtype`` at ``buf[off]``, one word each,
    in the dtype's field order (bytes fields are copied as they are)."""
    for name in field_names(dtype):
        if name in values:
            dt, at = field_dtype(dtype, name), field_offset(dtype, name)
            if dt.kind == "S":
                buf[off + at:off + at + dt.itemsize] = values[name].ljust(dt.itemsize, b"\0")
            else:  # a signed field's value as the unsigned word of the same bits
                store(buf, off + at, values[name] & ((1 << 8 * dt.itemsize) - 1), dt.itemsize)


class WordView:
    """A record of u64 fields in shared memory, read and stored by field name, each access
    one aligned 8-byte load or store (``view["consumed"]``, ``view["taken"] = n``).

    Cheaper than a numpy structured scalar (which builds a numpy scalar per read) and than a
    u64 array indexed by number, and it names every word it touches.
    """

    __slots__ = ("_w", "_at")

    def __init__(self, buf: memoryview, off: int, dtype: np.dtype) -> None:
        names = field_names(dtype)
        assert off % 8 == 0 and all(field_dtype(dtype, n) == np.dtype("<u8") and
                                    field_offset(dtype, n) % 8 == 0 for n in names)
        self._w = buf[off:off + dtype.itemsize].cast("Q")
        self._at = {n: field_offset(dtype, n) // 8 for n in names}

    def __getitem__(self, name: str) -> int:
        return self._w[self._at[name]]

    def __setitem__(self, name: str, value: int) -> None:
        self._w[self._at[name]] = value

    def clear(self) -> None:
        """Store 0 in every field, one word at a time."""
        for i in self._at.values():
            self._w[i] = 0

    def release(self) -> None:
        self._w.release()
