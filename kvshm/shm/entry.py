"""One block-table entry: where its fields lie, and the copy of it a reader gets.

This module owns the byte and word offsets of an entry's fields (derived from
``records.ENTRY_DTYPE``, which says who writes each field and why), the packed body the
table copies in with one slice assignment, and ``Entry``, the consistent copy
``BlockTable.read`` returns. The seqlock that makes a copy consistent is ``table.py``'s.
"""
from __future__ import annotations

import struct
import zlib
from typing import NamedTuple

from kvshm.shm import layout as L
from kvshm.shm.records import (
    ENTRY_BODY,
    ENTRY_DTYPE,
    field_names,
    field_offset,
    struct_format,
)

# The entry body (records.ENTRY_BODY: every field from state to the tenant's, the key zero
# padded to MAX_KEY_BYTES). It is packed into a private bytes object and copied into the
# segment with one slice assignment (a memcpy: no zero-fill, no transient value a reader or
# a successor could mistake).
BODY = struct.Struct(struct_format(ENTRY_DTYPE, ENTRY_BODY))
BODY_OFF = field_offset(ENTRY_DTYPE, "state")
KEY_OFF = L.ENTRY_KEY_OFFSET
STATE_OFF = field_offset(ENTRY_DTYPE, "state")
KEYLEN_OFF = field_offset(ENTRY_DTYPE, "keylen")
WRITER_OFF = field_offset(ENTRY_DTYPE, "writer")
LAST_USE_WORD = field_offset(ENTRY_DTYPE, "last_use") // 8
STORED_NS_WORD = field_offset(ENTRY_DTYPE, "stored_ns") // 8
PINS_WORD = field_offset(ENTRY_DTYPE, "pins") // 8
WORDS32 = L.ENTRY_BYTES // 4
WORDS64 = L.ENTRY_BYTES // 8
assert BODY_OFF == 4 and BODY_OFF + BODY.size == field_offset(ENTRY_DTYPE, "offered_at")
assert STORED_NS_WORD == LAST_USE_WORD + 1  # publish stores them as adjacent words


def key_checksum(key: bytes) -> int:
    """The ``keysum`` of an entry holding ``key``: crc32 over the key length and the key.

    It covers only what a rewrite of the same block never changes without changing the key
    (not state, seq, clocks or pins), so word stores to those leave it valid.
    """
    if len(key) <= L.MAX_KEY_BYTES:
        return zlib.crc32(key, _LENGTH_CRC[len(key)])
    return zlib.crc32(key, zlib.crc32(bytes((len(key),))))


_LENGTH_CRC = tuple(zlib.crc32(bytes((n,))) for n in range(L.MAX_KEY_BYTES + 1))
EMPTY_KEYSUM = key_checksum(b"")
# A key's checksum is its crc32 (the key index's tag) xor a constant of its length: crc32 is
# affine, and the checksum only prefixes the length byte. A batch writer that indexes the
# keys it writes computes one crc32 per key for both (``table.write_many``'s ``tags``).
KEYSUM_XOR = [key_checksum(bytes(n)) ^ zlib.crc32(bytes(n))
                   for n in range(L.MAX_KEY_BYTES + 1)]
assert all(key_checksum(k) == zlib.crc32(k) ^ KEYSUM_XOR[len(k)]
           for k in (b"\x01", b"k" * 36, bytes(range(L.MAX_KEY_BYTES))))


class Entry(NamedTuple):
    """A consistent copy of one block's entry (``records.ENTRY_DTYPE`` says what each field
    means), as ``BlockTable.read`` returns it."""
    seq: int
    state: int
    key: bytes
    writer: int  # client slot writing the block (or granted it), -1 for none
    writer_gen: int
    writer_req: int  # WRITING: the writer's request id; GRANTED: see ``grant_pos``
    last_use: int
    stored_ns: int
    pins: int
    keysum: int = 0  # the checksum stored with the key (``key_checksum``)
    torn: bool = False  # read() gave up: the seq stayed odd (or kept moving); do not trust
    tenant: int = -1  # client slot whose store the block holds (its quota counts it), or -1
    tenant_gen: int = 0

    @property
    def grant_pos(self) -> int:
        """A GRANTED block's position in its client's grant ring (stored in writer_req)."""
        return self.writer_req

    @property
    def stored_by(self) -> tuple[int, int] | None:
        """(slot, gen) of the client whose store the block holds, or None: nobody's."""
        return (self.tenant, self.tenant_gen) if self.tenant >= 0 else None

    @property
    def key_ok(self) -> bool:
        """The key and its length are the ones written together with ``keysum``."""
        return key_checksum(self.key) == self.keysum


# BlockTable.write packs and decode() unpacks the body positionally, in this order: a
# reordering of records.ENTRY_DTYPE must fail here, at import, not scramble fields silently.
assert ENTRY_BODY == ("state", "keylen", "writer", "writer_gen", "keysum", "writer_req",
                      "last_use", "stored_ns", "pins", "key", "tenant", "spare", "tenant_gen")
assert field_names(ENTRY_DTYPE)[:len(ENTRY_BODY) + 1] == ("seq", *ENTRY_BODY)


def decode(seq: int, f: tuple, torn: bool) -> Entry:
    """The ``Entry`` of a body ``BODY`` unpacked (``f``) under sequence number ``seq``."""
    state, keylen, writer, gen, keysum, req, last_use, stored_ns, pins, key, tenant, _, \
        tenant_gen = f
    return Entry(seq, state, key[:keylen], writer, gen, req, last_use, stored_ns, pins,
                 keysum, torn, tenant - 1, tenant_gen)
