"""The lower-tier interface: what a mover needs from a cluster-wide KV store.

This module owns ``LowerTier`` (the abstract backend), its typed per-key results, and the
value format of a block in the lower tier (a header with the layout fingerprint, the key's
checksum and one length + checksum (xxh3-64 or crc32) per plane, followed by the planes'
pages). It never talks to a network, never touches a segment and never imports a
backend's package (``xxhash`` is loaded lazily, where present).

A backend moves bytes between registered memory (the segment's data region, the mover's
header buffers) and its store, keyed by strings. Every call answers per key and never raises
for a store that is down, slow, full or restarted: those are codes (``Code``) the mover counts
and turns into misses. Raising is for programming errors and for ``connect`` finding the
backend unusable (``LowerTierUnavailableError``).
"""
from __future__ import annotations

import enum
import functools
import struct
import zlib
from abc import ABC, abstractmethod
from collections.abc import Sequence

from kvshm.shm.checksums import page_sum


class Code(enum.IntEnum):
    """One key's outcome. Values are Mooncake's where it has one (they are what the logs
    show); a backend maps its own codes onto these."""
    OK = 0
    NOT_FOUND = -704
    NO_SPACE = -200
    LEASE_HELD = -706
    TRANSFER_FAILED = -800
    RPC_FAILED = -900
    OTHER = -1

    @classmethod
    def of(cls, rc: int) -> Code:
        try:
            return cls(rc)
        except ValueError:
            return cls.OTHER


class LowerTier(ABC):
    """A cluster-wide store of blocks, used by exactly one mover per host.

    Buffers are ``(address, length)`` pairs in memory given to ``register`` first. A value is
    stored from, and fetched into, a list of buffers (the header, then one page per plane):
    the segment's planes are separate arrays, so one block is several pieces.
    """

    description: str = "lower tier"

    @abstractmethod
    def connect(self) -> bool:
        """Join the store. False (logged) when it cannot be reached now; the mover retries.
        Runs in the mover's connect thread, so the loop goes on while it waits without the
        GIL; for a store that cannot be reached it should answer soon. A wait that holds the
        GIL stops the loop too (Mooncake's setup with a master that takes connections but
        does not answer: up to ~10 min); a stop signal then ends the mover at once, as the
        kernel's default action (``link.py``).
        Raises ``LowerTierUnavailableError`` when it can never work (missing package)."""

    @abstractmethod
    def register(self, address: int, length: int) -> bool:
        """Make ``length`` bytes at ``address`` usable as a transfer buffer."""

    @abstractmethod
    def exists(self, keys: Sequence[str]) -> list[Code]:
        """Per key: OK (present), NOT_FOUND, or a failure code."""

    @abstractmethod
    def put(self, keys: Sequence[str], buffers: Sequence[Sequence[tuple[int, int]]]) -> list[Code]:
        """Store each key's value gathered from its buffers."""

    @abstractmethod
    def get(self, keys: Sequence[str], buffers: Sequence[Sequence[tuple[int, int]]]) -> list[int]:
        """Fetch each key's value scattered into its buffers: per key the bytes read (>= 0)
        or a negative ``Code`` value. A value of another length than the buffers is not OK."""

    @abstractmethod
    def close(self) -> None:
        """Leave the store (this host's share of it goes too)."""


# --- the value of one block in the lower tier ----------------------------------------------
VALUE_MAGIC = b"KVT1"
VALUE_VERSION = 1
SUM_CRC32, SUM_XXH3 = 1, 2  # which checksum a header carries (its ``algo`` byte)
# magic, version, planes, crc32(key), fingerprint[:8], checksum algo
_FIXED = struct.Struct("<4sHHI8sB7x")
_PLANE = struct.Struct("<IIQ")  # page length, reserved, checksum of the page


@functools.cache  # once per process: the header of every block asks
def _xxh3():
    try:
        from xxhash import xxh3_64_intdigest
    except ImportError:
        return None
    return xxh3_64_intdigest


def default_algo() -> int:
    """xxh3-64 when the ``xxhash`` package is there (part of the ``mooncake`` extra: ~15 GB/s
    on one core here, crc32 ~3 GB/s), else crc32 (``kvshm.shm.checksums.page_sum``)."""
    return SUM_XXH3 if _xxh3() is not None else SUM_CRC32


def _summer(algo: int):
    if algo == SUM_CRC32:
        return page_sum
    if algo == SUM_XXH3:
        return _xxh3()
    return None


def header_bytes(num_planes: int) -> int:
    """Bytes of a value's header: rounded up to 64 so every page starts aligned."""
    return -(-(_FIXED.size + _PLANE.size * num_planes) // 64) * 64


def tier_key(fingerprint: bytes, key: bytes) -> str:
    """The lower-tier key of segment key ``key`` under layout ``fingerprint``: engines of
    different models or layouts never see each other's blocks."""
    return f"kvshm1-{fingerprint[:16].hex()}-{key.hex()}"  # 128 bits tell layouts apart


def pack_header(out: memoryview, fingerprint: bytes, key: bytes, pages: Sequence,
                algo: int = SUM_CRC32, sums: Sequence[int] | None = None) -> None:
    """Write the header of a block whose plane pages are ``pages`` into ``out``, with each
    page's checksum by ``algo``. ``sums``: the pages' crc32 when the segment already keeps
    them (``Layout(checksums=True)``); then the header says crc32 and no page is read."""
    if sums is not None:
        algo = SUM_CRC32
    f = _summer(algo)
    _FIXED.pack_into(out, 0, VALUE_MAGIC, VALUE_VERSION, len(pages), zlib.crc32(key),
                     fingerprint[:8], algo)
    for i, page in enumerate(pages):
        _PLANE.pack_into(out, _FIXED.size + i * _PLANE.size, len(page), 0,
                         f(page) if sums is None else int(sums[i]))


def check_value(header: memoryview, fingerprint: bytes, key: bytes, pages: Sequence) -> str | None:
    """Why the fetched block (``header`` + ``pages``) is not ``key``'s, or None if it is."""
    magic, version, n, key_sum, fp, algo = _FIXED.unpack_from(header, 0)
    if magic != VALUE_MAGIC or version != VALUE_VERSION:
        return f"header magic/version {magic!r}/{version}"
    if n != len(pages) or fp != fingerprint[:8] or key_sum != zlib.crc32(key):
        return "header names another layout or key"
    f = _summer(algo)
    if f is None:
        return (f"checksum algorithm {algo} unavailable here (the writer had xxhash: pip "
                "install 'kvshm[mooncake]' on every host)")
    for i, page in enumerate(pages):
        length, _, want = _PLANE.unpack_from(header, _FIXED.size + i * _PLANE.size)
        if length != len(page):
            return f"plane {i} length {length} != {len(page)}"
        if want != f(page):
            return f"plane {i} checksum mismatch"
    return None
