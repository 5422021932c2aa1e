"""Byte sizes as people write them on command lines ("512M", "8G", "64KiB", "4096").

This module owns ``parse_size``, which ``kvshm mover`` and the tools share. It imports nothing
of kvshm and nothing outside the standard library.
"""
from __future__ import annotations

_UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes of ``text``: a number, optionally with K, M, G or T (powers of 1024; "KiB",
    "KB" and "kb" read the same). Raises ValueError, saying how to write one, for anything
    else."""
    t = text.strip().upper().removesuffix("IB").removesuffix("B")
    mult = _UNITS.get(t[-1:], 1)
    try:
        n = int(float(t[:-1] if mult > 1 else t) * mult)
    except (ValueError, OverflowError):  # not a number, or inf/nan
        raise ValueError(f"not a size: {text!r}; write a number of bytes, optionally with "
                         "K, M, G or T (powers of 1024), such as 4096, 512M or 8G") from None
    if n < 0:
        raise ValueError(f"a size cannot be negative: {text!r}")
    return n
