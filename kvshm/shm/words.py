"""Aligned word stores into shared memory, field by field of a named record.

This module owns the one way kvshm stores a field other processes read: a single aligned
8-, 4-, 2- or 1-byte copy through a ``memoryview`` cast, which CPython performs as one
fixed-size memcpy (one machine store, single-copy atomic when aligned), so a reader sees
the old or the new value, never a torn or transiently zero one. Never ``struct.pack_into``
on a shared field: it zero-fills the field before writing it. It orders nothing (see
``fence.py``), never locks and never maps memory itself.
"""
from __future__ import annotations

from typing import Any

import numpy as np

_CODES = {1: "B", 2: "H", 4: "I", 8: "Q"}


def store(buf: memoryview, off: int, value: int, size: int = 8) -> None:
    """Store unsigned ``value`` as one aligned ``size``-byte word at ``buf[off]``."""
    assert off % size == 0, f"unaligned {size}-byte store at {off}"
    with buf[off:off + size].cast(_CODES[size]) as w:
        w[0] = value


def store_fields(buf: memoryview, off: int, dtype: np.dtype, **values: Any) -> None:
    """Store the named integer fields of record ``dtype`` at ``buf[off]``, one word each,
    in the dtype's field order (bytes fields are copied as they are)."""
    for name in dtype.names:
        if name in values:
            dt, at = dtype.fields[name][:2]
            if dt.kind == "S":
                buf[off + at:off + at + dt.itemsize] = values[name].ljust(dt.itemsize, b"\0")
            else:
                store(buf, off + at, values[name], dt.itemsize)
