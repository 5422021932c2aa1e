"""The segment header: written once by the creator, checked by every attacher.

This module owns what the 4 KiB header says about the segment (magic, format version,
geometry, layout description and fingerprint, the header checksum) and the rule that an
attacher derives sizes and offsets only from fields that are fingerprinted or checksummed
and cross-checked against each other: any disagreement is refused with an error that names
the field, never mapped. It reads through ``pread`` (never a mapping sized by unchecked
fields, which could SIGBUS past the end of the file) and never locks or waits.
"""
from __future__ import annotations

import hashlib
import os

import numpy as np

from kvshm.errors import (
    FormatVersionError,
    InvalidArgumentError,
    LayoutMismatchError,
    NotAKvshmSegmentError,
)
from kvshm.shm import layout as L
from kvshm.shm.layout import Geometry, Layout


def check(name: str, fd: int, head: bytes, size: int,
          expected: Layout | None) -> tuple[Layout, Geometry, int]:
    """(layout, geometry, created_ns) of a finished header ``head`` of a ``size``-byte file."""
    h = L.header_record(head)
    version, hbytes, total, created = h.version, h.header_bytes, h.total_size, h.created_ns
    nblocks, tpb, nplanes, fp = h.num_blocks, h.tokens_per_block, h.num_planes, h.fingerprint
    if version != L.FORMAT_VERSION:
        raise FormatVersionError(
            f"segment {name!r} has format version {version}, this kvshm reads version "
            f"{L.FORMAT_VERSION}; use a matching kvshm, or remove the segment")

    def damaged(what: str) -> NotAKvshmSegmentError:
        return NotAKvshmSegmentError(
            f"segment {name!r} is damaged: {what}; remove it with "
            f"'kvshm-inspect rm {name}' and create it again")

    if hbytes != L.HEADER_BYTES:
        raise damaged(f"header_bytes is {hbytes}, expected {L.HEADER_BYTES}")
    if total != size:
        raise damaged(f"it is {size} bytes but its header says total_size {total}")
    # Everything below is read through pread, never through a mapping sized by fields
    # not yet cross-checked (a mapping past the end of the file would SIGBUS).
    desc = os.pread(fd, L.LAYOUT_DESC_BYTES, L.OFF_LAYOUT_DESC).rstrip(b"\0")
    if hashlib.sha256(desc).digest() != fp:  # covers the layout's checksums option
        raise damaged("the layout description does not match the header's layout "
                      "fingerprint")
    try:
        found = Layout.from_description(desc.decode())
    except (ValueError, KeyError, TypeError) as e:  # JSON/UTF-8 errors are ValueErrors
        raise damaged(f"layout description unreadable ({e!r})") from None
    if found.fingerprint() != fp:
        raise damaged("the layout description is not in canonical form")
    if nplanes != len(found.page_bytes):
        raise damaged(f"num_planes is {nplanes} but the layout has "
                      f"{len(found.page_bytes)} planes")
    pages = os.pread(fd, 8 * L.MAX_PLANES, L.OFF_PAGE_BYTES)
    if pages != L.plane_pages(found.page_bytes):
        raise damaged("the page_bytes array disagrees with the layout's page sizes")
    if tpb != found.tokens_per_block:
        raise damaged(f"tokens_per_block is {tpb} but the layout says "
                      f"{found.tokens_per_block}")
    try:
        geo = Geometry(nblocks, found.page_bytes, h.max_clients, h.ring_capacity,
                       h.hold_capacity, found.checksums)
    except InvalidArgumentError as e:  # names the field that is out of range
        raise damaged(f"header field out of range ({e})") from None
    if geo.total_bytes != total:
        raise damaged(f"total_size {total} disagrees with the geometry (num_blocks, "
                      f"max_clients, ring_capacity, hold_capacity give "
                      f"{geo.total_bytes})")
    if geo.index_slots != h.index_slots:
        raise damaged(f"index_slots is {h.index_slots}, the geometry gives {geo.index_slots}")
    if os.pread(fd, 16, L.OFF_HEADER_SUM) != L.header_sum(head):
        raise damaged("the header fields (num_blocks, max_clients, ring_capacity, "
                      "hold_capacity, ...) disagree with the header checksum")
    if expected is not None and expected.fingerprint() != fp:
        raise LayoutMismatchError(
            f"segment {name!r} holds layout {found.describe()} but this process has "
            f"{expected.describe()}; use another segment name for this model, or make "
            "the layouts (model, page sizes, tokens per block, checksums) agree")
    return found, geo, created


def write(b: memoryview, g: Geometry, lay: Layout, created_ns: int, policy: str) -> None:
    """Fill a new segment's header, hold arrays and key index; the magic goes last."""
    b[L.OFF_POLICY:L.OFF_POLICY + len(policy)] = policy.encode()
    b[L.OFF_LAYOUT_DESC:L.OFF_LAYOUT_DESC + len(lay.describe())] = lay.describe().encode()
    b[L.OFF_PAGE_BYTES:L.OFF_PAGE_BYTES + 8 * L.MAX_PLANES] = L.plane_pages(lay.page_bytes)
    # The block table needs no writes: fallocate zero-filled it (state FREE, seq 0).
    # Hold arrays do: 0 would read as "pins block 0".
    for slot in range(g.max_clients):
        off = g.slot_offset(slot) + g.hold_offset
        np.frombuffer(b, np.int32, g.hold_capacity, off)[:] = -1
    idx = g.index_offset
    empty = L.INDEX_SLOT.pack(0, -1)
    b[idx:idx + g.index_slots * 8] = empty * g.index_slots
    # Magic last: an attacher that sees it sees a complete header.
    fields = L.HeaderRecord(
        magic=b"\0" * 8, version=L.FORMAT_VERSION, header_bytes=L.HEADER_BYTES,
        total_size=g.total_bytes, created_ns=created_ns, num_blocks=g.num_blocks,
        tokens_per_block=lay.tokens_per_block, num_planes=len(lay.page_bytes),
        max_clients=g.max_clients, ring_capacity=g.ring_capacity,
        hold_capacity=g.hold_capacity, index_slots=g.index_slots,
        fingerprint=lay.fingerprint())
    L.HEADER.pack_into(b, 0, *fields)  # nobody reads it before the magic below
    b[L.OFF_HEADER_SUM:L.OFF_HEADER_SUM + 16] = L.header_sum(bytes(b[:L.HEADER.size]))
    b[0:8] = L.MAGIC
