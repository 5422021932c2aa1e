"""Every record of the segment, in one notation: one numpy structured dtype each.

This module owns the field names, types and byte offsets of every shared record — the header,
the owner record, the header counters, the pin-progress records, the client slot record, a
slot's served record, share and grant-ring counts, a block-table entry, a key-index slot and
a writer registration — as numpy structured dtypes (little-endian, no implicit padding),
with the NamedTuple that readers get (how a dtype is read is ``dtypes.py``'s). Every field
says who writes it and what invariant it keeps. Where a record sits in the segment is
``layout.py``'s business; this module computes nothing else and never maps memory.
"""
from __future__ import annotations

import enum
import struct
from typing import NamedTuple

import numpy as np

from kvshm.shm.dtypes import (  # noqa: F401  (re-exported with the records they read)
    field_dtype,
    field_names,
    field_offset,
    offsets_are,
    struct_format,
    sub_dtype,
)

# --- header (offset 0): written once by the creator, under LOCK_INIT ---------------------
# An attacher trusts none of it until header.check() has cross-checked it (geometry, layout
# fingerprint, header checksum); the magic is stored last, so a reader that sees it sees
# every other field complete.
HEADER_DTYPE = np.dtype([
    ("magic", "S8"),               # creator, last of all: MAGIC once the header is complete
    ("version", "<u4"),            # creator: FORMAT_VERSION; another version is refused
    ("header_bytes", "<u4"),       # creator: HEADER_BYTES; anything else is damage
    ("total_size", "<u8"),         # creator: the file size; must equal fstat and geometry
    ("created_ns", "<u8"),         # creator: time.time_ns(), for people only
    ("num_blocks", "<u8"),         # creator: blocks in the table and in every plane
    ("tokens_per_block", "<u4"),   # creator: must equal the layout description's
    ("num_planes", "<u4"),         # creator: must equal the layout's number of planes
    ("max_clients", "<u4"),        # creator: client slots (geometry, checksummed)
    ("ring_capacity", "<u4"),      # creator: data bytes of each slot ring (checksummed)
    ("hold_capacity", "<u4"),      # creator: hold entries per slot (checksummed)
    ("index_slots", "<u8"),        # creator: key index size; must equal the geometry's
    ("fingerprint", "S32"),        # creator: sha256 of the layout description it stores
], align=False)
assert HEADER_DTYPE.itemsize == 100
offsets_are(HEADER_DTYPE, version=8, total_size=16, num_blocks=32, tokens_per_block=40,
         index_slots=60, fingerprint=68)
HEADER = struct.Struct(struct_format(HEADER_DTYPE))


class HeaderRecord(NamedTuple):
    magic: bytes
    version: int
    header_bytes: int
    total_size: int
    created_ns: int
    num_blocks: int
    tokens_per_block: int
    num_planes: int
    max_clients: int
    ring_capacity: int
    hold_capacity: int
    index_slots: int
    fingerprint: bytes


assert HeaderRecord._fields == HEADER_DTYPE.names


def header_record(head: bytes) -> HeaderRecord:
    """The header record at the start of ``head`` (at least ``HEADER.size`` bytes)."""
    return HeaderRecord._make(HEADER.unpack_from(head))


# --- owner record: written only by the process holding LOCK_OWNER ------------------------
# Each field is one aligned word store (never struct.pack_into, which zero-fills first), so a
# reader sees every field old or new, never torn and never a transient 0 epoch.
OWNER_DTYPE = np.dtype([
    ("pid", "<u4"),       # owner: its pid while it owns, 0 once it let go; for people and
    #                       for "who owns?" messages, never for liveness (LOCK_OWNER is)
    ("epoch", "<u4"),     # owner: ``next_epoch`` of the previous one on taking ownership;
    #                       only ever compared for equality: a changed epoch means another
    #                       owner ran (served records, replies); 0: no owner has run yet
    ("since_ns", "<u8"),  # owner: time.time_ns() when it took (or let go of) ownership
    ("tick", "<u8"),      # owner: the eviction clock, saved so the next owner continues it
], align=False)
assert OWNER_DTYPE.itemsize == 24
offsets_are(OWNER_DTYPE, pid=0, epoch=4, since_ns=8, tick=16)
OWNER = struct.Struct(struct_format(OWNER_DTYPE))
OWNER_BYTES = 32  # room reserved in the header


EPOCH_MAX = 2**32 - 1  # what the record's epoch word holds


def next_epoch(epoch: int) -> int:
    """The epoch of the owner after one of ``epoch``: +1, and after ``EPOCH_MAX`` 1 again
    (never 0, "no owner yet"). Consecutive owners always differ, which is all that is
    compared; two owners 2**32 - 1 takeovers apart share one, which no client lives to see."""
    return epoch % EPOCH_MAX + 1


class OwnerRecord(NamedTuple):
    pid: int
    epoch: int
    since_ns: int
    tick: int


assert OwnerRecord._fields == OWNER_DTYPE.names

# --- header counters: u64 words, written only by the owner (single writer) ----------------
# Stored one aligned word at a time and wrapping at 2**64; any process reads them.
COUNTER_NAMES = (
    "stores", "store_blocks", "store_failed_blocks", "prepare_store_refused", "evictions",
    "touches", "errors", "failovers", "reclaimed_clients",
    "reclaimed_blocks", "frames",
    # Blocks of dead clients kept back while a process copying for them still lived.
    "quarantined_blocks",
    # Counters of clients that have left, folded in by the owner so totals survive them.
    "gone_lookups", "gone_hits", "gone_loads", "gone_load_blocks", "gone_bytes_in",
    "gone_bytes_out",
    # The exception to the single writer: loads refused because a block's plane no longer
    # matched its checksum (kvshm.shm.checksums). Any copying process adds to it, holding
    # lock byte LOCK_CHECKSUM_FAILURES; zero on a segment without checksums.
    "checksum_failures",
    # Blocks granted to clients ahead of their stores (kvshm.owner.grants); owner-written.
    "granted_blocks",
    # CPU time (thread clock, ns) the owner spent on passes that served frames, the grant
    # refills after them included; its idle waits and spins are not in it. Owner-written.
    "owner_busy_ns",
    # Of granted_blocks, those offered while still cached (READY until their client claims
    # them) instead of evicted for the grant; owner-written.
    "offered_blocks",
    # Keys a rebuild found in more than one block-table entry (only damage does that):
    # every copy was dropped, so the key is a miss. Owner-written (or gc's).
    "duplicate_keys",
    # Times the owner's wait ended because something seemed to wait and its next pass then
    # found no frame to serve and no client to adopt: 0 unless a client's words lie (a
    # newcomer flag or ring position raised for nothing). Owner-written.
    "idle_wakeups",
    # Stores served by a PrepareStore round trip, because the storing client's grant ring
    # could not cover them (every store of a client without grants; a client's first, before
    # it is stocked; one larger than what its ring holds). Growing about as fast as "stores"
    # means the grants run dry: the cache is too small to stock every storing client (a
    # quarter of it is shared out), or the owner is behind. Owner-written, once per store
    # however many parts it takes; a successor's replay does not count it again.
    "round_trip_stores",
    # Blocks the owner took back from the grant rings of clients that had stopped taking
    # them (idle for a while, holding more than their share while others lacked it:
    # ``owner/stocking.py``); owner-written.
    "recalled_blocks",
    # Recalls given up because the client was taking those very blocks (its intent word
    # reached them): the blocks stay its own. Owner-written.
    "recalls_refused",
)
MAX_COUNTERS = 32  # words reserved: new counters fit without moving the pinners
COUNTERS_DTYPE = np.dtype({"names": list(COUNTER_NAMES), "formats": ["<u8"] * len(COUNTER_NAMES),
                           "offsets": [8 * i for i in range(len(COUNTER_NAMES))],
                           "itemsize": 8 * MAX_COUNTERS})
assert COUNTERS_DTYPE.itemsize == 256 and len(COUNTER_NAMES) <= MAX_COUNTERS

# --- pin-progress records: each written only by the process that took it (pins.py) -------
PINNER_DTYPE = np.dtype([
    ("pid", "<u4"),          # pinner: its pid; a record of a dead pid may be taken over
    ("state", "<u4"),        # pinner: PIN_*; IDLE/DONE/FAILED records may be taken over
    ("done_bytes", "<u8"),   # pinner: bytes registered so far, never above total_bytes
    ("total_bytes", "<u8"),  # pinner: bytes it registers in all
    ("updated_ns", "<u8"),   # pinner: time.time_ns() of its last update, for people
], align=False)
assert PINNER_DTYPE.itemsize == 32
offsets_are(PINNER_DTYPE, pid=0, state=4, done_bytes=8, total_bytes=16, updated_ns=24)
PINNER = struct.Struct(struct_format(PINNER_DTYPE))
PIN_IDLE, PIN_WAITING, PIN_RUNNING, PIN_DONE, PIN_FAILED = range(5)


class PinnerRecord(NamedTuple):
    pid: int
    state: int
    done_bytes: int
    total_bytes: int
    updated_ns: int


assert PinnerRecord._fields == PINNER_DTYPE.names


# --- client slot record (offset 0 of each slot) ------------------------------------------
class SlotState(enum.IntEnum):
    """What a client slot is (distinct from the block states of the table)."""

    FREE = 0     # nobody's: may be claimed (by whoever then holds its lock)
    CLIENT = 1   # a manager client's; the owner reads its rings and alone frees it
    CHANNEL = 2  # a job channel between a scheduler and a worker; no owner reads it
    LEAVING = 3  # a client saying goodbye (owner-written): not claimable, and its copy
    #              workers already see its generation dead, before the owner frees its stores


SLOT_STATE_NAMES = {SlotState.FREE: "free", SlotState.CLIENT: "client",
                    SlotState.CHANNEL: "channel", SlotState.LEAVING: "leaving"}

# Every field is stored as one aligned word (never struct.pack_into, which zero-fills first),
# so a reader sees each field old or new, never torn or transiently 0.
SLOT_DTYPE = np.dtype([
    ("state", "<u4"),        # SlotState. FREE -> CLIENT/CHANNEL by the claimant holding the
    #                          slot lock, stored last; CLIENT -> FREE only by the owner (or
    #                          gc holding the owner lock); CHANNEL -> FREE by its holder,
    #                          or by the owner once the holder is dead
    ("pid", "<u4"),          # claimant: its pid, for people; 0 once cleared
    ("gen", "<u8"),          # claimant, before the state: ``next_gen`` of the last one, so
    #                          (slot, gen) names one client (until 2**32 - 1 claims later);
    #                          its lock (``slots.gen_lock``), not this word, says it lives
    ("attached_ns", "<u8"),  # claimant: time.time_ns() at activation
    ("name", "S32"),         # claimant: its program name, NUL padded, for people
    ("events", "<u8"),       # claimant, before the state: 1 if it takes events, so that every
    #                          owner records them for it from adoption on (its hello says so
    #                          again, but a successor's first frames may come before it)
], align=False)
assert SLOT_DTYPE.itemsize == 64
offsets_are(SLOT_DTYPE, state=0, pid=4, gen=8, attached_ns=16, name=24, events=56)
SLOT = struct.Struct(struct_format(SLOT_DTYPE))


GEN_MAX = 2**32 - 1  # what a block table entry's ``writer_gen`` word holds


def next_gen(gen: int) -> int:
    """The generation of a slot's next claimant after one of ``gen``: +1, and after
    ``GEN_MAX`` 1 again (0 is no client's), whatever the word held: the last claimant wrote
    it, and a generation must fit every record that names its writer."""
    return gen % GEN_MAX + 1


class SlotRecord(NamedTuple):
    state: int
    pid: int
    gen: int
    attached_ns: int
    name: bytes
    events: int


assert SlotRecord._fields == SLOT_DTYPE.names


# --- a client's own counters (in each client slot): written only by that client ----------
# Stored one aligned word at a time; the owner folds them into the header's ``gone_*``
# counters when the client leaves, and kvshm-inspect adds them up.
SLOT_COUNTERS_DTYPE = np.dtype({"names": [
    "lookups",      # keys its lookups examined (the hits and the first miss)
    "hits",         # keys its lookups reported as hits
    "loads",        # its prepare_load calls
    "load_blocks",  # blocks they pinned
    "bytes_in",     # bytes its transfers loaded (as its connector reports them)
    "bytes_out",    # bytes its transfers stored
], "formats": ["<u8"] * 6, "offsets": [8 * i for i in range(6)]})

# --- a client's share of the cache (in each client slot) ----------------------------------
# Quotas are off unless a client asks for one: then the owner keeps the blocks it stored
# within ``quota`` (its own go first when it is over) and never lets another client's stores
# evict them while it is within it.
SHARE_DTYPE = np.dtype([
    ("quota", "<u8"),   # the client, at activation, before its state: blocks it may keep
    #                     cached (0: no quota). Its own word: the owner cuts it to what the
    #                     quotas adopted before it left, and then writes back what it applies
    ("cached", "<u8"),  # the owner: blocks this client stored that are cached now (a count
    #                     of the owner's memory, refreshed after each pass; for people)
], align=False)
assert SHARE_DTYPE.itemsize == 16

# --- served record (in each client slot): written only by the owner ----------------------
# The words that make a client's requests exactly-once (the protocol is told in
# ``client/owner_link.py``). Each is one aligned u64 store, so a client reads each old or
# new; ``consumed`` is stored before a request has any effect, ``answered`` after its whole
# reply is on the reply ring.
SERVED_DTYPE = np.dtype([
    ("epoch", "<u8"),        # owner: epoch of the owner that last wrote this record
    ("consumed", "<u8"),     # owner: last request id an owner began to execute
    ("answered", "<u8"),     # owner: last request id whose whole reply is on the reply ring
    ("attempts", "<u8"),     # owner: owners that began ``consumed`` or ``one_way``
    ("one_way", "<u8"),      # owner: 1 + request ring position of the last one-way frame begun
    ("quarantined", "<u8"),  # owner: 1 once an owner stopped serving this generation (for good)
    ("stranded", "<u8"),     # owner: blocks named by Publish frames dropped after owners died
    #                          applying them: still this client's, freed when it goes
], align=False)
assert SERVED_DTYPE.itemsize == 56

# --- grant-ring counts (in each client slot, before its ``GRANT_CAPACITY`` block ids) ------
# A single-producer single-consumer ring: the owner writes ids and then ``granted``, the
# client reads ids below it and then stores ``taken``. Counts are u64 and never wrap; an id
# sits at ``count % GRANT_CAPACITY``. The two counts sit on their own cache lines. The owner
# may take back the ids the client has not taken (a recall): it lowers ``granted`` and then
# reads ``intent``, while a taking client stores ``intent`` and then reads ``granted`` again,
# each fenced in between, so that at least one sees the other (``stocking.recall``).
GRANT_HEAD_DTYPE = np.dtype({
    "names": ["granted", "taken", "refused", "intent"],
    "formats": ["<u8", "<u8", "<u8", "<u8"],
    # granted: owner, blocks ever pushed (ids first, then this count, fenced); lowered only
    #   by a recall, and raised again if intent or taken is above it (an owner that died in
    #   between: its successor hands the run from it over again)
    # taken: the client, blocks ever taken; <= granted unless the client scribbled
    # refused: the client at activation, before any request: 1 = never stock this client
    # intent: the client, the count it is taking up to, stored (and fenced) before it reads
    #   granted again and takes; >= taken unless the client scribbled
    "offsets": [0, 64, 72, 80],
    "itemsize": 128})

# --- block-table entry (one per block): written by the owner ------------------------------
# Any process reads an entry without a lock, under its seqlock word. The owner writes every
# entry, with one exception: a READY block the owner *offered* to a client (writer >= 0, in
# that client's grant ring) is written by that client alone, once, to claim it (seq round,
# state CLAIMED), or to give the claim back (CLAIMED -> READY); the owner leaves an offered
# entry alone (but for its last_use word) until the client publishes it or dies. Who writes
# each field, and what it guarantees:
ENTRY_DTYPE = np.dtype([
    # seqlock word, written alone as one aligned 32-bit store: odd while the owner changes
    # the entry. A dead owner can leave it odd; only the next owner's rebuild settles it.
    ("seq", "<u4"),
    # FREE/WRITING/READY/EVICTING/GRANTED/CLAIMED (layout.py). Changed by a lone byte store
    # in a seqlock round or with the body; a reader trusts it only under an even, unchanged
    # seq. Only READY is readable.
    ("state", "u1"),
    # length of the key, 0 for FREE. Written only with the key, in one body copy.
    ("keylen", "u1"),
    # client slot storing into the block (WRITING), granted it (GRANTED), offered it (READY)
    # or claimed it (CLAIMED); -1 for none (a READY block nobody was offered).
    ("writer", "<i2"),
    # generation of that slot when the store was granted (a reused slot is another writer).
    ("writer_gen", "<u4"),
    # key_checksum(key): written with the key, in the same body copy, never on its own.
    # A rebuild (and verify) recomputes it: a mismatch means the key bytes were left half
    # rewritten (or damaged), and the block is freed instead of published.
    ("keysum", "<u4"),
    # WRITING: the writer's request id (client request counters are unbounded: 64 bits).
    # GRANTED, offered READY, CLAIMED: the block's position in its client's grant ring
    # (``Entry.grant_pos``), which tells a successor whether the ring's ``granted`` count
    # ever handed it over.
    ("writer_req", "<u8"),
    # eviction clock at the last touch: a lone aligned 64-bit store (readers may see old or
    # new, both fine); the rebuild orders ready blocks by it.
    ("last_use", "<u8"),
    # wall clock when the store completed (publish), for inspection only.
    ("stored_ns", "<u8"),
    # load pins the owner counts on the block: a lone aligned 64-bit store.
    ("pins", "<u8"),
    # the key, zero padded; written only in the body copy, with keylen and keysum.
    ("key", "S64"),
    # 1 + the client slot whose store the block holds (READY; WRITING: the writer, whose
    # store it will be), 0 for nobody's: that client's quota counts the block. Written in
    # every body copy (so never stale), and kept by the word stores that make a block READY
    # or offer it: a successor owner counts each client's share from it, so quotas protect
    # what was stored before it took over.
    ("tenant", "<u2"),
    ("spare", "V2"),  # nobody: zero
    # generation of that slot when it stored the block (a reused slot is another client).
    ("tenant_gen", "<u4"),
    # offered READY, CLAIMED: the eviction clock when the owner offered the block (in the
    # same round as the writer fields). A last_use past it means a request used the block
    # since: its client returns the offer instead of claiming it. Stale otherwise.
    ("offered_at", "<u8"),
], align=False)
assert ENTRY_DTYPE.itemsize == 128
# Every field sits at a multiple of its own size: the 64-bit words can be stored through
# aligned memoryview casts, the seq word likewise (and the batch writers view rows as words).
assert all(field_offset(ENTRY_DTYPE, n) % field_dtype(ENTRY_DTYPE, n).itemsize == 0
           for n in field_names(ENTRY_DTYPE) if field_dtype(ENTRY_DTYPE, n).kind in "iu")
# The body (every field from state to the tenant's) is copied in with one slice assignment.
ENTRY_BODY = ("state", "keylen", "writer", "writer_gen", "keysum", "writer_req", "last_use",
              "stored_ns", "pins", "key", "tenant", "spare", "tenant_gen")

# --- key-index slot (open addressing, a power of two of them): written only by the owner --
INDEX_SLOT_DTYPE = np.dtype([
    ("tag", "<u4"),    # owner: crc32 of the key, a cheap filter before the table's key compare
    ("block", "<i4"),  # owner: the key's block, -1 for an empty slot (a lone 4-byte store)
], align=False)
INDEX_SLOT = struct.Struct(struct_format(INDEX_SLOT_DTYPE))

# --- writer records (one per registration of a process copying for a scheduler's slot) ----
# Only the registrant writes a record, and only while it holds lock byte LOCK_WRITER_BASE +
# record; a record whose lock is free is dead whatever it says (the kernel drops the lock
# with the process). Records say who copies for whom, for people and tests; they decide
# nothing (a registration is the generation's copier lock, LOCK_COPIER_BASE), and a
# registration that finds them all taken goes without one.
WRITER_DTYPE = np.dtype([
    ("slot", "<i4"),      # registrant: the scheduler's manager slot; -1 once unregistered
    ("pid", "<u4"),       # registrant: its pid, for kvshm-inspect only, never liveness
    ("gen", "<u8"),       # registrant: that slot's client generation it copies for
    ("since_ns", "<u8"),  # registrant: time.time_ns() at registration, for kvshm-inspect
    ("spare", "V8"),      # nobody: zero
], align=False)
assert WRITER_DTYPE.itemsize == 32
