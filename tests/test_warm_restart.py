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
