"""How a record dtype is read: its field names, types and offsets, and ``struct`` formats.

This module owns the helpers that derive from a numpy structured dtype what readers and
writers of a shared record need (field offsets for word stores, the ``struct`` format of a
run of fields, a sub-record); it defines no record itself (``records.py`` does) and never
maps memory.
"""
from __future__ import annotations

import struct

import numpy as np

# The one table from a field's numpy type to its ``struct`` code (and to the word size of
# the aligned store that writes it, ``words.py``).
_STRUCT_CODES = {"u1": "B", "i2": "h", "u2": "H", "i4": "i", "u4": "I", "i8": "q", "u8": "Q"}


def field_names(dtype: np.dtype) -> tuple[str, ...]:
    """The field names of record ``dtype``, in order."""
    assert dtype.names is not None, f"{dtype} is not a record dtype"
    return dtype.names


def field_dtype(dtype: np.dtype, name: str) -> np.dtype:
    """The type of field ``name`` of record ``dtype``."""
    assert dtype.fields is not None, f"{dtype} is not a record dtype"
    return dtype.fields[name][0]


def field_offset(dtype: np.dtype, name: str) -> int:
    """Byte offset of field ``name`` inside a record of ``dtype``."""
    assert dtype.fields is not None, f"{dtype} is not a record dtype"
    return int(dtype.fields[name][1])


def _end(dtype: np.dtype, name: str) -> int:
    """Byte offset just past field ``name`` of record ``dtype``."""
    return field_offset(dtype, name) + field_dtype(dtype, name).itemsize


def struct_format(dtype: np.dtype, names: tuple[str, ...] | None = None) -> str:
    """The ``struct`` format of the consecutive fields ``names`` (all by default) of a record
    dtype; fails if they leave a gap between them."""
    names = names or field_names(dtype)
    codes = "".join(f"{dt.itemsize}s" if dt.kind in "SV" else _STRUCT_CODES[dt.str[1:]]
                    for dt in (field_dtype(dtype, n) for n in names))
    fmt = "<" + codes
    first = field_offset(dtype, names[0])
    assert struct.calcsize(fmt) == _end(dtype, names[-1]) - first, f"gap in {names}"
    return fmt


def sub_dtype(dtype: np.dtype, names: tuple[str, ...]) -> np.dtype:
    """The fields ``names`` of ``dtype`` as a record of their own, starting at the first."""
    base = field_offset(dtype, names[0])
    return np.dtype({"names": list(names), "formats": [field_dtype(dtype, n) for n in names],
                     "offsets": [field_offset(dtype, n) - base for n in names],
                     "itemsize": _end(dtype, names[-1]) - base})


def offsets_are(dtype: np.dtype, **expected: int) -> None:
    """Assert that the fields of ``dtype`` lie at the ``expected`` offsets (a layout pin)."""
    for name, off in expected.items():
        assert field_offset(dtype, name) == off, (name, field_offset(dtype, name), off)
