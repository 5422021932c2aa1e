"""The byte layout of a kvshm segment: what lies where, and the model-layout fingerprint.

This module owns every offset of the shared segment (where each region and record lies; the
fields of every record are defined once, in ``records.py``), so that the segment, the owner,
the clients and ``kvshm-inspect`` agree on them. It computes; it never maps memory and never
locks.

Segment (format version ``FORMAT_VERSION``)::

    header (4 KiB)        magic, version, geometry, offsets, owner record, counters, pinners
    client slots          max_clients x (slot record | holds | 4 rings | doorbell flags)
    writer registry       writer_records x WRITER_DTYPE: who copies for which scheduler
    block table           num_blocks x ENTRY_DTYPE (seq, state, key + checksum, writer, ...)
    key index             index_slots x INDEX_SLOT_DTYPE: open addressing, (crc32 tag, block)
    block checksums       only with ``Layout(checksums=True)``: (num_blocks, num_planes) u32
    data (2 MiB aligned)  num_planes planes, each (num_blocks, page_bytes[p]), 2 MiB aligned
"""
from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from kvshm.errors import InvalidArgumentError
from kvshm.shm.records import (  # noqa: F401  (re-exported: one definition, two names)
    COUNTER_NAMES,
    COUNTERS_DTYPE,
    ENTRY_BODY,
    ENTRY_DTYPE,
    GRANT_HEAD_DTYPE,
    HEADER,
    HEADER_DTYPE,
    INDEX_SLOT,
    INDEX_SLOT_DTYPE,
    OWNER,
    OWNER_BYTES,
    OWNER_DTYPE,
    PIN_DONE,
    PIN_FAILED,
    PIN_IDLE,
    PIN_RUNNING,
    PIN_WAITING,
    PINNER,
    PINNER_DTYPE,
    SERVED_DTYPE,
    SHARE_DTYPE,
    SLOT,
    SLOT_COUNTERS_DTYPE,
    SLOT_DTYPE,
    SLOT_STATE_NAMES,
    WRITER_DTYPE,
    HeaderRecord,
    OwnerRecord,
    PinnerRecord,
    SlotRecord,
    SlotState,
    field_dtype,
    field_names,
    field_offset,
    header_record,
)

MAGIC = b"KVSHM\x00\x00\x01"
FORMAT_VERSION = 11  # 2: 64-bit writer_req, keysum in every table entry; 3: block grants;
#                    4: grant rings of 1,024 blocks, a client's refusal of grants;
#                    5: doorbells and the tier area named for the segment's inode;
#                    6: offered (READY) grants claimed by their client, slot hold marks,
#                       a client's share of the cache (quotas);
#                    7: doorbells are futex words of the segment, no semaphores;
#                    8: a table entry names its block's tenant (quotas survive failover);
#                    9: a client holds a lock of its generation (LOCK_GEN_BASE)
#                   10: a copier registers with a shared lock of that generation
#                   11: a client's intent word in its grant ring (recalls)
HEADER_BYTES = 4096
DATA_ALIGN = 2 << 20
MAX_PLANES = 32
MAX_BLOCKS = 2**31 - 1  # block ids are int32 (the key index holds them so)
MAX_KEY_BYTES = 64
MAX_PINNERS = 32
LAYOUT_DESC_BYTES = 512

# Eviction policies a segment header may name (the index layer implements them).
POLICY_NAMES = ("lru", "arc")

# Block states, mirrored into the table so any process can read them.
# GRANTED: a free block the owner handed to one client's grant ring (writer, writer_gen, no
# key): only that client writes its data, and the owner publishes it when the client says so.
# A READY block may be *offered* instead (READY with a writer: still cached and readable, in
# one client's grant ring); that client CLAIMS it when it takes it for a store: CLAIMED is
# its key no longer readable and its data being replaced, the one state a client writes.
FREE, WRITING, READY, EVICTING, GRANTED, CLAIMED = 0, 1, 2, 3, 4, 5
STATE_NAMES = {FREE: "free", WRITING: "writing", READY: "ready", EVICTING: "evicting",
               GRANTED: "granted", CLAIMED: "claimed"}
INVALID = len(STATE_NAMES)  # ``state_counts``' bucket for a state byte no kvshm writes

# Byte offsets of kernel-released (OFD) locks taken on the segment's file descriptor.
# They lock bytes of the file *descriptor range*, not data: the kernel drops them when the
# holder dies, which is how liveness is decided without PID files.
LOCK_OWNER = 0
LOCK_INIT = 1
LOCK_PIN_TURN = 2
LOCK_CHECKSUM_FAILURES = 3  # serialises read-add-store of the checksum_failures counter
LOCK_CLIENT_BASE = 64
# + record: held by the registrant of a writer record, which only says who copies for whom
# (kvshm.shm.writers). Past the client slots' bytes (LOCK_CLIENT_BASE + slot) and the
# job-channel workers' (LOCK_CLIENT_BASE + 1024 + slot).
LOCK_WRITER_BASE = LOCK_CLIENT_BASE + 2048
# + slot: held by the owner while it serves a client in that slot (past the writers' bytes,
# at most 8 per slot of 1024). A slot is claimed only while nobody holds it: a client that
# left FREE in its state and died cannot hand its slot on before the owner let go of it.
LOCK_SERVED_BASE = LOCK_WRITER_BASE + 8 * 1024
# + (slot << 32) + gen: held by the client of that slot and generation while it lives, beside
# its slot's byte. The generation word of its slot record is the client's to write; this
# lock is not: it alone says whether the stores of a (slot, gen) have a living writer, also
# once a next client holds the slot (``slots.generation_held``).
LOCK_GEN_BASE = 1 << 20
# + (slot << 32) + gen: a shared (read) lock held by every process that copies for the client
# of that slot and generation (kvshm.shm.writers). Any number hold it at once, so a copier
# can always register; an owner keeps a dead generation's unfinished stores while it is held.
LOCK_COPIER_BASE = 1 << 50

# --- header ------------------------------------------------------------------------------
# The records' fields (names, types, offsets, who writes what) are records.py's; layout
# places them. They are re-exported here, so ``layout.HEADER`` and the rest keep working.

# sha256 (first 16 bytes) of the header after the magic: a field edited after creation, even
# one whose change the 2 MiB rounding of total_size would hide, is caught at attach.
OFF_HEADER_SUM = 104
assert HEADER.size <= OFF_HEADER_SUM


def header_sum(head: bytes) -> bytes:
    """The checksum stored at ``OFF_HEADER_SUM`` for packed header ``head``."""
    return hashlib.sha256(head[8:HEADER.size]).digest()[:16]


OFF_LAYOUT_DESC = 128  # utf-8 JSON of the layout, NUL padded, for error messages
OFF_PAGE_BYTES = OFF_LAYOUT_DESC + LAYOUT_DESC_BYTES  # MAX_PLANES x u64
OFF_OWNER = OFF_PAGE_BYTES + 8 * MAX_PLANES  # owner record (OWNER_DTYPE)
OFF_POLICY = OFF_OWNER + OWNER_BYTES  # eviction policy name, 16 bytes: every owner uses it
OFF_OWNER_BELL = OFF_OWNER + 64  # owner doorbell: its futex word (own cache line)
OFF_NEWCOMER = OFF_OWNER_BELL + 8  # set by a client that just activated its slot
OFF_COUNTERS = OFF_OWNER_BELL + 64  # COUNTERS_DTYPE
OFF_PINNERS = OFF_COUNTERS + COUNTERS_DTYPE.itemsize  # MAX_PINNERS x PINNER_DTYPE
assert OWNER_DTYPE.itemsize <= OWNER_BYTES and OFF_OWNER % 8 == 0 and OFF_COUNTERS % 8 == 0
assert OFF_PINNERS % 8 == 0 and OFF_PINNERS + PINNER.size * MAX_PINNERS <= HEADER_BYTES

# --- client slot -------------------------------------------------------------------------
# The slot record is records.SLOT_DTYPE; its offsets, for word stores:
SLOT_OFF_STATE, SLOT_OFF_PID, SLOT_OFF_GEN, SLOT_OFF_ATTACHED, SLOT_OFF_NAME = (
    field_offset(SLOT_DTYPE, n) for n in ("state", "pid", "gen", "attached_ns", "name"))
SLOT_NAME_BYTES = field_dtype(SLOT_DTYPE, "name").itemsize
SLOT_COUNTERS = field_names(SLOT_COUNTERS_DTYPE)  # u64 each, client-written
SLOT_OFF_COUNTERS = 64
assert SLOT_DTYPE.itemsize <= SLOT_OFF_COUNTERS
# The served record (SERVED_DTYPE): owner-written words that make requests exactly-once.
# The slot's hold mark: u64, written only by the slot's client, above every hold entry in
# use (0: none): raised before the entry it first covers is written, lowered only once the
# entries above it are empty (-1) again. Whoever reads a slot's holds reads the entries
# below it only (a claim, an eviction): holds are taken from the low end, so this is a few
# cache lines, not the whole array.
SLOT_OFF_HOLD_MARK = 120
SLOT_OFF_SERVED = 128
SLOT_OFF_SHARE = 184  # records.SHARE_DTYPE: the client's quota, and what the owner counts
SLOT_HEAD_BYTES = 256
assert SLOT_OFF_COUNTERS + 8 * len(SLOT_COUNTERS) <= SLOT_OFF_HOLD_MARK < SLOT_OFF_SERVED
assert SLOT_OFF_SERVED + SERVED_DTYPE.itemsize <= SLOT_OFF_SHARE
assert SLOT_OFF_SHARE + SHARE_DTYPE.itemsize <= SLOT_HEAD_BYTES
RING_NAMES = ("request", "reply", "peer_in", "peer_out")
# The grant ring of a client slot (after its holds): block ids the owner hands the client
# ahead of its stores, so that a store needs no round trip; its counts are GRANT_HEAD_DTYPE.
GRANT_CAPACITY = 1024
GRANT_HEAD_BYTES = GRANT_HEAD_DTYPE.itemsize
BELL_NAMES = ("reply", "peer_in", "peer_out")

# A hold entry is -1 (empty), a block id (a load pin) or lease_code(block) (a lookup lease).
# Leases protect a block from *other* clients' evictions; pins from everyone's.
# Both helpers work on ints and on numpy arrays of hold entries alike.
def lease_code(block: Any) -> Any:
    """The hold entry of a lease on ``block``; its own inverse (``lease_code`` of a lease
    code is the leased block)."""
    return -2 - block


def held_block(code: Any) -> Any:
    """The block an occupied hold entry refers to (pin or lease); elementwise on arrays."""
    if isinstance(code, np.ndarray):
        return np.where(code >= 0, code, lease_code(code))
    return code if code >= 0 else lease_code(code)


# --- block table -------------------------------------------------------------------------
# One ENTRY_DTYPE record per block (records.py says who writes each field and why).
ENTRY_BYTES = ENTRY_DTYPE.itemsize
ENTRY_KEY_OFFSET = field_offset(ENTRY_DTYPE, "key")
assert field_dtype(ENTRY_DTYPE, "key").itemsize == MAX_KEY_BYTES and ENTRY_BYTES % 8 == 0
assert field_names(ENTRY_DTYPE)[0] == "seq"  # the seqlock word is word 0 of the entry


# --- writer registry ---------------------------------------------------------------------
# One WRITER_DTYPE record per registration of a process that copies blocks for a scheduler.
WRITER_BYTES = WRITER_DTYPE.itemsize


def writer_records(max_clients: int) -> int:
    """Registry records of a segment: room for 8 copying processes per client slot."""
    return max(64, 8 * max_clients)


def _round_up(n: int, align: int) -> int:
    return (n + align - 1) // align * align


@dataclass(frozen=True)
class Layout:
    """What a segment's blocks mean: the model identity and the byte size of each plane.

    A plane is one canonical KV tensor's share of a block (vLLM's ``(num_blocks, page_bytes)``
    int8 tensors; a TP rank or a K/V half is a plane). Two processes may share a segment only
    if their layouts are equal, which the fingerprint checks.

    ``checksums=True`` reserves a crc32 per block and plane (``kvshm.shm.checksums``). It is
    part of the description (and so of the fingerprint) only when true: a layout without it
    keeps the description and fingerprint it always had.
    """

    page_bytes: tuple[int, ...]
    tokens_per_block: int
    model: str = ""
    extra: dict[str, Any] = field(default_factory=dict, hash=False, compare=True)
    checksums: bool = False

    def __post_init__(self) -> None:
        if type(self.checksums) is not bool:
            raise InvalidArgumentError(f"checksums must be True or False, got {self.checksums!r}")
        pages = tuple(int(p) for p in self.page_bytes)
        object.__setattr__(self, "page_bytes", pages)
        if not 1 <= len(pages) <= MAX_PLANES:
            raise InvalidArgumentError(
                f"a layout needs 1..{MAX_PLANES} planes, got {len(pages)}")
        if any(p <= 0 for p in pages):
            raise InvalidArgumentError(f"plane page sizes must be positive, got {pages}")
        if self.tokens_per_block <= 0:
            raise InvalidArgumentError(
                f"tokens_per_block must be positive, got {self.tokens_per_block}")
        if len(self.describe().encode()) > LAYOUT_DESC_BYTES:
            raise InvalidArgumentError(
                f"layout description exceeds {LAYOUT_DESC_BYTES} bytes; shorten model/extra")

    @property
    def block_bytes(self) -> int:
        """Bytes one block occupies across all planes."""
        return sum(self.page_bytes)

    def describe(self) -> str:
        """Canonical JSON of the layout (what the fingerprint hashes)."""
        d = {"model": self.model, "page_bytes": list(self.page_bytes),
             "tokens_per_block": self.tokens_per_block, "extra": self.extra}
        if self.checksums:
            d["checksums"] = True
        return json.dumps(d, sort_keys=True, separators=(",", ":"))

    def fingerprint(self) -> bytes:
        return hashlib.sha256(self.describe().encode()).digest()

    @classmethod
    def from_description(cls, text: str) -> Layout:
        d = json.loads(text)
        return cls(tuple(d["page_bytes"]), d["tokens_per_block"], d.get("model", ""),
                   d.get("extra", {}), d.get("checksums", False))


@dataclass(frozen=True)
class Geometry:
    """Sizes and offsets of every region, derived from the creation parameters."""

    num_blocks: int
    page_bytes: tuple[int, ...]
    max_clients: int
    ring_capacity: int
    hold_capacity: int
    checksums: bool = False  # Layout.checksums: the block-checksum region exists

    def __post_init__(self) -> None:
        if self.num_blocks <= 0 or self.num_blocks > MAX_BLOCKS:
            raise InvalidArgumentError(
                f"num_blocks must be in 1..2**31-1, got {self.num_blocks}")
        if not 1 <= self.max_clients <= 1024:
            raise InvalidArgumentError(f"max_clients must be in 1..1024, got {self.max_clients}")
        if self.ring_capacity < 4096 or self.ring_capacity % 8:
            raise InvalidArgumentError(
                f"ring_capacity must be a multiple of 8 and >= 4096, got {self.ring_capacity}")
        if self.hold_capacity < 16:
            raise InvalidArgumentError(f"hold_capacity must be >= 16, got {self.hold_capacity}")

    # Offsets are derived once per geometry (cached_property writes the instance dict
    # directly, which a frozen dataclass allows). The ring's header size lives with the
    # ring; the import is deferred so layout stays importable on its own.
    @cached_property
    def ring_region(self) -> int:
        from kvshm.shm.ring import Ring
        return _round_up(Ring.region_size(self.ring_capacity), 64)

    @cached_property
    def hold_offset(self) -> int:
        return SLOT_HEAD_BYTES

    @cached_property
    def grants_offset(self) -> int:
        return _round_up(SLOT_HEAD_BYTES + 4 * self.hold_capacity, 64)

    @cached_property
    def rings_offset(self) -> int:
        return _round_up(self.grants_offset + GRANT_HEAD_BYTES + 4 * GRANT_CAPACITY, 64)

    @cached_property
    def bells_offset(self) -> int:
        return self.rings_offset + len(RING_NAMES) * self.ring_region

    @cached_property
    def slot_bytes(self) -> int:
        return _round_up(self.bells_offset + 64 * len(BELL_NAMES), 4096)

    @cached_property
    def clients_offset(self) -> int:
        return HEADER_BYTES

    @cached_property
    def writers_offset(self) -> int:
        return self.clients_offset + self.max_clients * self.slot_bytes

    @cached_property
    def writer_records(self) -> int:
        return writer_records(self.max_clients)

    @cached_property
    def table_offset(self) -> int:
        return _round_up(self.writers_offset + self.writer_records * WRITER_BYTES, 4096)

    @cached_property
    def index_slots(self) -> int:
        n = 1
        while n < 2 * self.num_blocks:
            n <<= 1
        return n

    @cached_property
    def index_offset(self) -> int:
        return self.table_offset + self.num_blocks * ENTRY_BYTES

    @cached_property
    def sums_offset(self) -> int:
        """Start of the (num_blocks, num_planes) u32 checksum array (its end without one)."""
        return _round_up(self.index_offset + self.index_slots * INDEX_SLOT.size, 64)

    @cached_property
    def sums_bytes(self) -> int:
        return 4 * self.num_blocks * len(self.page_bytes) if self.checksums else 0

    @cached_property
    def data_offset(self) -> int:
        return _round_up(self.sums_offset + self.sums_bytes, DATA_ALIGN)

    @cached_property
    def _plane_offsets(self) -> tuple[int, ...]:
        offs, at = [], self.data_offset
        for page in self.page_bytes:
            offs.append(at)
            at = _round_up(at + self.num_blocks * page, DATA_ALIGN)
        return tuple(offs)

    def plane_offsets(self) -> list[int]:
        return list(self._plane_offsets)

    @cached_property
    def total_bytes(self) -> int:
        last = self.plane_offsets()[-1]
        return _round_up(last + self.num_blocks * self.page_bytes[-1], DATA_ALIGN)

    @cached_property
    def data_bytes(self) -> int:
        return self.total_bytes - self.data_offset

    def slot_offset(self, slot: int) -> int:
        return self.clients_offset + slot * self.slot_bytes

    def entry_offset(self, block: int) -> int:
        return self.table_offset + block * ENTRY_BYTES


def plane_pages(values: Sequence[int]) -> bytes:
    return struct.pack(f"<{MAX_PLANES}Q", *(list(values) + [0] * (MAX_PLANES - len(values))))
