"""Block-table entries never expose a torn key, whatever dies mid-write.

An owner SIGKILLed while it rewrites an entry leaves the sequence number odd and the body
half copied. The next owner settles such an entry and keeps it only if the key checksum
stored with the key still verifies: a READY entry whose key was cut short must be freed, not
published (else a lookup of the cut-short key is served another key's bytes). Also: reads of
an entry left odd are bounded, writer request ids are 64-bit, and freed blocks are reused
oldest-freed first.

Crashes are real: a spawned child owns the segment with ``KVSHM_CRASH_AT`` set and SIGKILLs
itself inside ``BlockTable.write``; the test then takes over as the next owner.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import struct

import pytest

from kvshm.shm import layout as L
from kvshm.inspect.cli import main as inspect_main
from kvshm.owner.manager import LocalManager
from kvshm.shm.segment import Segment
from kvshm.shm.keyindex import KeyIndex
from kvshm.shm.table import VECTOR_MIN, BlockTable

import procs

CTX = mp.get_context("spawn")
JOIN_S = 120  # a guard against a hung child, not synchronisation
KEYS = [b"shared-prefix-block-%02d" % i for i in range(6)]


def _store(m: LocalManager, seg: Segment, keys: list[bytes]) -> list[int]:
    out = m.prepare_store(keys)
    planes = seg.planes()
    for k, b in zip(out.keys_to_store, out.block_ids):
        procs.fill(planes, b, k)
    m.complete_store(out.keys_to_store)
    return out.block_ids


def _seq(seg: Segment, block: int) -> int:
    return struct.unpack_from("<I", seg.buf, seg.geometry.entry_offset(block))[0]


def _hits_with_right_bytes(m: LocalManager, seg: Segment, keys: list[bytes]) -> list[bytes]:
    """Keys of ``keys`` that hit and load their own bytes."""
    planes, good = seg.planes(), []
    for k in keys:
        if m.lookup([k]) == 1:
            b = m.prepare_load([k])[0]
            if procs.check(planes, b, k):
                good.append(k)
            m.complete_load([k])
    return good


def _in_child(fn, *args):
    pool = CTX.Pool(1)
    try:
        return pool.apply_async(fn, args).get(JOIN_S)
    finally:
        pool.terminate()
        pool.join()


def _killed_at(point: str, target, *args) -> None:
    """Run ``target(*args)`` in a child armed to SIGKILL itself at crash ``point``."""
    os.environ["KVSHM_CRASH_AT"] = point
    try:
        p = CTX.Process(target=target, args=args)
        p.start()
    finally:
        del os.environ["KVSHM_CRASH_AT"]
    p.join(JOIN_S)
    assert p.exitcode == -signal.SIGKILL


# --- an owner killed mid-rewrite ---------------------------------------------------------
def _own_fill_then_evict(name: str, keys: list[bytes], extra: bytes) -> None:
    """Own ``name``, store ``keys`` (filling it), then store ``extra``: the eviction of the
    least recently stored key rewrites its READY entry, where KVSHM_CRASH_AT kills us."""
    seg = Segment.attach(name)
    m = LocalManager(seg, "lru")
    _store(m, seg, keys)
    m.prepare_store([extra])
    raise AssertionError("the crash point did not fire")


@pytest.mark.procs
def test_owner_killed_mid_rewrite_of_a_ready_entry_publishes_no_torn_key(make_segment):
    seg = make_segment(num_blocks=len(KEYS), policy="lru")
    # len(KEYS) writes of WRITING entries, then the victim's rewrite to FREE.
    _killed_at(f"table.write.odd:{len(KEYS) + 1}", _own_fill_then_evict, seg.name, KEYS,
               b"newcomer")
    table = BlockTable(seg.buf, seg.geometry)
    torn = table.read(0)  # KEYS[0], the victim, was stored first into block 0
    assert _seq(seg, 0) & 1 and torn.torn and torn.state == L.READY
    assert torn.key != KEYS[0]  # the precondition: a READY entry with a half-rewritten key
    m = LocalManager(seg, "lru")
    try:
        assert m.recovered["torn"] == 1
        assert m.lookup([KEYS[0]]) == 0 and m.lookup([torn.key]) == 0
        assert KeyIndex(seg.buf, seg.geometry, table).find(torn.key) == (-1, -1)
        assert _hits_with_right_bytes(m, seg, KEYS) == KEYS[1:]
    finally:
        m.shutdown()
        table.close()


def test_rebuild_does_not_publish_a_ready_entry_whose_key_tail_was_zeroed(make_segment):
    seg = make_segment(num_blocks=8, policy="lru")
    m = LocalManager(seg, "lru")
    blocks = _store(m, seg, KEYS)
    m.shutdown()
    # What pack_into's zero-fill leaves when its owner dies rewriting KEYS[2]'s READY entry
    # with the same key: everything in place but the key's tail, sequence number odd.
    off = seg.geometry.entry_offset(blocks[2]) + L.ENTRY_KEY_OFFSET
    cut = len(b"shared-p")
    seg.buf[off + cut:off + L.MAX_KEY_BYTES] = bytes(L.MAX_KEY_BYTES - cut)
    seq_off = seg.geometry.entry_offset(blocks[2])
    struct.pack_into("<I", seg.buf, seq_off, _seq(seg, blocks[2]) | 1)
    torn_key = KEYS[2][:cut] + bytes(len(KEYS[2]) - cut)
    m = LocalManager(seg, "lru")
    try:
        assert m.lookup([KEYS[2]]) == 0 and m.lookup([torn_key]) == 0
        assert _hits_with_right_bytes(m, seg, KEYS) == KEYS[:2] + KEYS[3:]
        assert m.num_free == 8 - 5
    finally:
        m.shutdown()


N = VECTOR_MIN  # a batch this large is written by the batch writer
BATCH = [b"batch-of-vllm-sized-offload-keys-%03d" % i for i in range(3 * N)]  # 36 bytes


def _own_fill_then_evict_a_batch(name: str) -> None:
    """Own ``name`` (2N blocks), store 2N keys in two batches, then N more: the eviction of
    the N oldest rewrites their entries in one batch, where KVSHM_CRASH_AT kills us."""
    seg = Segment.attach(name)
    m = LocalManager(seg, "lru")
    _store(m, seg, BATCH[:N])
    _store(m, seg, BATCH[N:2 * N])
    m.prepare_store(BATCH[2 * N:])
    raise AssertionError("the crash point did not fire")


@pytest.mark.procs
def test_owner_killed_mid_batch_rewrite_publishes_no_torn_key(make_segment):
    seg = make_segment(num_blocks=2 * N, policy="lru")
    # two stores, then the victims' rewrite
    _killed_at("table.write_many.odd:3", _own_fill_then_evict_a_batch, seg.name)
    table = BlockTable(seg.buf, seg.geometry)
    assert all(_seq(seg, b) & 1 for b in range(N))  # BATCH[:N], in blocks 0..N-1: all odd
    half = N // 2
    torn = table.read(half)  # the first half freed, then the next one's key half rewritten
    assert torn.state == L.READY and torn.key not in BATCH
    m = LocalManager(seg, "lru")
    try:
        assert m.recovered["torn"] == N - half  # every row whose round it left open
        assert m.lookup([torn.key]) == 0
        assert KeyIndex(seg.buf, seg.geometry, table).find(torn.key) == (-1, -1)
        # The rows not yet rewritten go too: from its entry alone, a row whose copy stopped
        # after its state byte (a new state over an intact old key) cannot be told apart
        # from one the copy never reached. A miss, never a key over other bytes.
        assert _hits_with_right_bytes(m, seg, BATCH[:2 * N]) == BATCH[N:2 * N]
        assert m.num_free == N
    finally:
        m.shutdown()
        table.close()


# --- the key checksum ----------------------------------------------------------------------
def _damage_checksum(seg: Segment, block: int) -> None:
    off = seg.geometry.entry_offset(block) + L.field_offset(L.ENTRY_DTYPE, "keysum")
    seg.buf[off] ^= 0xFF


def test_rebuild_frees_an_entry_whose_key_checksum_is_wrong(make_segment):
    seg = make_segment(num_blocks=8, policy="lru")
    m = LocalManager(seg, "lru")
    blocks = _store(m, seg, KEYS)
    m.shutdown()
    _damage_checksum(seg, blocks[4])
    m = LocalManager(seg, "lru")
    try:
        assert m.recovered["torn"] == 1 and m.recovered["ready"] == len(KEYS) - 1
        assert m.lookup([KEYS[4]]) == 0
        table = BlockTable(seg.buf, seg.geometry)
        assert table.read(blocks[4]).state == L.FREE
        table.close()
    finally:
        m.shutdown()


def test_inspect_verify_reports_a_wrong_key_checksum(make_segment, capsys):
    import json
    seg = make_segment(num_blocks=8, policy="lru")
    m = LocalManager(seg, "lru")
    blocks = _store(m, seg, KEYS)
    m.shutdown()
    assert inspect_main(["verify", seg.name]) == 0
    capsys.readouterr()
    _damage_checksum(seg, blocks[1])
    assert inspect_main(["verify", seg.name, "--json"]) == 1
    found = json.loads(capsys.readouterr().out)["violations"]
    assert [v for v in found if "checksum" in v and f"block {blocks[1]} " in v], found


# --- bounded reads -------------------------------------------------------------------------
def _read_odd_entry(name: str) -> tuple[bool, int]:
    seg = Segment.attach(name)
    table = BlockTable(seg.buf, seg.geometry)
    off = seg.geometry.entry_offset(1)
    struct.pack_into("<I", seg.buf, off, struct.unpack_from("<I", seg.buf, off)[0] | 1)
    e = table.read(1)
    table.close()
    seg.close()
    return e.torn, e.seq


@pytest.mark.procs
def test_read_of_an_entry_left_odd_returns_it_as_torn(make_segment):
    seg = make_segment(num_blocks=2)
    # In a child: a read that spins forever fails the test instead of hanging the suite.
    torn, seq = _in_child(_read_odd_entry, seg.name)
    assert torn is True and seq & 1


# --- 64-bit writer request ids -------------------------------------------------------------
def test_writer_request_id_above_2_32_round_trips_through_the_entry(make_segment):
    seg = make_segment(num_blocks=4)
    m = LocalManager(seg, "lru")
    req = 2**32 + 7
    try:
        out = m.prepare_store([KEYS[0]], writer=(3, 5, req))
        table = BlockTable(seg.buf, seg.geometry)
        assert table.read(out.block_ids[0]).writer_req == req
        table.close()
        assert m.pending_of((3, 5, 0), request=req) == [(KEYS[0], out.block_ids[0])]
        assert m.pending_of((3, 5, 0), request=7) == []
    finally:
        m.shutdown()


# --- the free list -------------------------------------------------------------------------
def test_freed_blocks_are_reused_oldest_freed_first(new_manager):
    m, _ = new_manager(num_blocks=6)
    a, b, c, d = KEYS[:4]
    assert m.prepare_store([a, b, c, d]).block_ids == [0, 1, 2, 3]  # 4 and 5 stay free
    for key in (b, d, a):  # freed in this order: blocks 1, 3, 0
        m.complete_store([key], success=False)
    out = m.prepare_store(KEYS[4:] + [b"late-1", b"late-2", b"late-3"])
    assert out.block_ids == [4, 5, 1, 3, 0]


def test_rebuild_of_a_key_two_entries_hold_trusts_no_copy_as_ready(make_segment):
    # Only a damaged table holds one key twice, and either copy may be the damaged one: a
    # ready copy may hold another key's bytes, so it is freed; the one store of a key stays
    # pending (its writer writes that block); two stores of one key are both held for their
    # writer (it may still copy into either) and neither is ever published under the key.
    seg = make_segment(num_blocks=8, policy="lru")
    table = BlockTable(seg.buf, seg.geometry)
    table.write(5, L.WRITING, KEYS[0], writer=0, writer_gen=1, writer_req=3)
    table.write(6, L.READY, KEYS[0])
    table.write(7, L.WRITING, KEYS[1], writer=0, writer_gen=1, writer_req=3)
    table.write(2, L.WRITING, KEYS[1], writer=0, writer_gen=1, writer_req=4)
    table.close()
    m = LocalManager(seg, "lru", writer_alive=lambda slot, gen: True)
    try:
        assert m.block_of(KEYS[0]) == 5 and m.lookup([KEYS[0]]) == 0  # pending: a miss
        assert m.block_of(KEYS[1]) is None
        assert m.num_free == 8 - 3 and 6 in m.entries.free  # 5 pending, 2 and 7 held
        assert seg.counter("duplicate_keys") == 2
        m.complete_store([KEYS[0]], writer=(0, 1, 3))
        assert m.block_of(KEYS[0]) == 5 and m.lookup([KEYS[0]]) == 1
        assert m.reclaim_writer(0, 1) == 2  # the writer gone, its held blocks come back
        assert m.num_free == 8 - 1
    finally:
        m.shutdown()
