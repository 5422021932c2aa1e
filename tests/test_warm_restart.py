"""Warm restart: when every process of a segment died, the next ones find every ready block.

The first generation (a client and the owner it started) is SIGKILLed with a store half
done; a new client attaching the same segment starts a new owner that rebuilds the index
from the block table: every ready block is a hit and loads byte for byte, and the
half-written blocks are free again.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal

from kvshm.shm import layout as L
from kvshm.client.connect import connect
from kvshm.shm.table import BlockTable

import procs
from conftest import TEST_LAYOUT, stop_owner

CTX = mp.get_context("spawn")
READY = [b"warm-ready-%02d" % i for i in range(6)]
WRITING = [b"warm-writing-%02d" % i for i in range(3)]


def _first_generation(name: str) -> dict:
    parent, child = CTX.Pipe()
    p = CTX.Process(target=procs.store_then_hang, daemon=True,
                    args=(name, child, TEST_LAYOUT, 12, READY, WRITING))
    p.start()
    info = parent.recv()
    os.kill(p.pid, signal.SIGKILL)
    os.kill(info["owner"], signal.SIGKILL)
    p.join()
    stop_owner(info["owner"])
    return info


def test_ready_blocks_survive_the_death_of_every_process(seg_name):
    _first_generation(seg_name)
    mgr = connect(seg_name, TEST_LAYOUT)
    try:
        assert mgr.lookup(READY) == len(READY)
        blocks = mgr.prepare_load(READY)
        planes = mgr.segment.planes()
        assert all(procs.check(planes, b, k) for b, k in zip(blocks, READY))
        mgr.complete_load(READY)
    finally:
        pid = mgr.segment.owner_record()[0]
        mgr.shutdown()
        stop_owner(pid)


def test_half_written_blocks_are_freed_by_the_next_owner(seg_name):
    info = _first_generation(seg_name)
    mgr = connect(seg_name, TEST_LAYOUT)
    try:
        assert mgr.lookup(WRITING[:1]) == 0
        table = BlockTable(mgr.segment.buf, mgr.segment.geometry)
        assert [table.read(b).state for b in info["writing"]] == [L.FREE] * len(WRITING)
        table.close()
        # The freed blocks are usable: all 12 - 6 = 6 free blocks can be stored into.
        assert len(mgr.prepare_store([b"new-%d" % i for i in range(6)]).keys_to_store) == 6
        assert mgr.segment.counter("failovers") >= 1
    finally:
        pid = mgr.segment.owner_record()[0]
        mgr.shutdown()
        stop_owner(pid)


def _copy_key(seg, src: int, dst: int) -> None:
    """Damage: copy entry ``src``'s key, length and key checksum over entry ``dst``'s, so
    that ``dst`` is self-consistent (its checksum verifies) and holds another block's key."""
    table = BlockTable(seg.buf, seg.geometry)
    for field in ("keylen", "keysum", "key"):
        table.fields[field][dst] = table.fields[field][src]
    table.close()


def test_a_key_two_ready_entries_hold_is_a_miss_after_a_takeover(seg_name, tmp_path,
                                                                 monkeypatch):
    # Only damage puts one key in two entries. Here the older entry (the one a rebuild
    # adopts first) gets the newer one's key: whichever copy a new owner kept, it could
    # serve another key's bytes under that key. Every copy is dropped (a miss), counted
    # in the header and logged, and what verify reported before is still known after.
    from kvshm.inspect.snapshot import verify
    from kvshm.logs import owner_log_path
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))  # the owners we start log here
    older, newer, other = b"dup-older", b"dup-newer", b"dup-other"
    mgr = connect(seg_name, TEST_LAYOUT, num_blocks=12)
    try:
        for k in (older, newer, other):  # one by one: older is the least recently used
            assert procs.store(mgr, [k]) == [k]
        seg = mgr.segment
        b_older, b_newer = (mgr.index.find(k)[0] for k in (older, newer))
        _copy_key(seg, b_newer, b_older)
        assert any("both hold key" in v for v in verify(seg))
        stop_owner(seg.owner_record()[0])
        parent, child = CTX.Pipe()
        p = CTX.Process(target=procs.load_and_verify, daemon=True,
                        args=(seg_name, child, [newer]))
        p.start()  # its connect starts the next owner, which rebuilds the index
        got = parent.recv()
        p.join()
        assert got["hits"] == 0, f"a damaged copy was served: {got}"
        assert mgr.lookup([other]) == 1  # what no damage touched is kept
        assert seg.counter("duplicate_keys") == 1
        assert verify(seg) == []
        with open(owner_log_path(seg_name)) as f:
            assert f"duplicate key {newer.hex()[:16]}" in f.read()
    finally:
        pid = mgr.segment.owner_record()[0]
        mgr.shutdown()
        stop_owner(pid)
