"""Child-process bodies for multi-process tests (importable by spawned interpreters).

Each function runs in its own process, talks to the test through a ``Connection`` and never
sleeps to synchronise: it reports what it did and then blocks on the pipe until told to go on
(or until the test SIGKILLs it).
"""
from __future__ import annotations

import os
import random
import zlib

import numpy as np

from kvshm.client import connect


def fill(planes: list[np.ndarray], block: int, key: bytes) -> None:
    """Write ``key``'s deterministic content into ``block`` of every plane."""
    for p, plane in enumerate(planes):
        seed = zlib.crc32(key + bytes([p]))
        plane[block] = np.random.default_rng(seed).integers(0, 256, plane.shape[1], np.uint8)


def check(planes: list[np.ndarray], block: int, key: bytes) -> bool:
    for p, plane in enumerate(planes):
        seed = zlib.crc32(key + bytes([p]))
        want = np.random.default_rng(seed).integers(0, 256, plane.shape[1], np.uint8)
        if not np.array_equal(plane[block], want):
            return False
    return True


def store(mgr, keys: list[bytes]) -> list[bytes]:
    """prepare_store + write + complete_store; returns the keys actually written."""
    out = mgr.prepare_store(keys)
    if out is None:
        return []
    planes = mgr.segment.planes()
    for k, b in zip(out.keys_to_store, out.block_ids):
        fill(planes, b, k)
    mgr.complete_store(out.keys_to_store)
    return out.keys_to_store


def hold_and_wait(name: str, conn, ready_keys: list[bytes], writing_keys: list[bytes]) -> None:
    """Lease ``ready_keys``, start (never finish) a store of ``writing_keys``, report, block."""
    mgr = connect(name)
    leased = mgr.lookup(ready_keys)
    pinned = mgr.prepare_load(ready_keys[:1]) if ready_keys else []
    out = mgr.prepare_store(writing_keys) if writing_keys else None
    conn.send({"slot": mgr.slot, "leased": leased, "pinned": pinned,
               "writing": out.block_ids if out else []})
    conn.recv()  # the test kills us while we wait here


def load_and_verify(name: str, conn, keys: list[bytes]) -> None:
    """Connect, look ``keys`` up, load them and check their bytes; report the result."""
    mgr = connect(name)
    hits = mgr.lookup(keys)
    ok = 0
    if hits:
        blocks = mgr.prepare_load(keys[:hits])
        planes = mgr.segment.planes()
        ok = sum(check(planes, b, k) for b, k in zip(blocks, keys[:hits]))
        mgr.complete_load(keys[:hits])
    conn.send({"hits": hits, "verified": ok, "slot": mgr.slot})
    mgr.shutdown()


def connect_and_report(name: str, conn) -> None:
    mgr = connect(name)
    conn.send({"slot": mgr.slot, "owner": mgr.segment.owner_record()[:2]})
    conn.recv()
    mgr.shutdown()


def random_traffic(name: str, conn, seed: int, ops: int, nkeys: int) -> None:
    """Random stores/loads/lookups/touches over a shared key space, verifying every load."""
    rng = random.Random(seed)
    mgr = connect(name)
    planes = mgr.segment.planes()
    keys = [b"key-%04d" % i for i in range(nkeys)]
    stats = {"stores": 0, "loads": 0, "corrupt": 0, "refused": 0}
    for _ in range(ops):
        op = rng.random()
        ks = rng.sample(keys, rng.randint(1, 4))
        if op < 0.4:
            out = mgr.prepare_store(ks)
            if out is None:
                stats["refused"] += 1
                continue
            for k, b in zip(out.keys_to_store, out.block_ids):
                fill(planes, b, k)
            mgr.complete_store(out.keys_to_store, success=rng.random() > 0.1)
            stats["stores"] += 1
        elif op < 0.8:
            n = mgr.lookup(ks)
            if n:
                blocks = mgr.prepare_load(ks[:n])
                stats["corrupt"] += sum(not check(planes, b, k) for b, k in zip(blocks, ks[:n]))
                mgr.complete_load(ks[:n])
                stats["loads"] += 1
        elif op < 0.9:
            mgr.touch(ks)
        else:
            mgr.release()
    mgr.release()
    conn.send(stats)
    mgr.shutdown()


def pid() -> int:
    return os.getpid()


def store_then_hang(name: str, conn, layout, num_blocks: int, ready: list[bytes],
                    writing: list[bytes]) -> None:
    """Create/attach ``name``, store ``ready`` completely and ``writing`` half-way, report."""
    mgr = connect(name, layout, num_blocks=num_blocks, ring_capacity=8192, hold_capacity=64)
    store(mgr, ready)
    out = mgr.prepare_store(writing)
    conn.send({"owner": mgr.segment.owner_record()[0], "writing": out.block_ids})
    conn.recv()  # SIGKILLed here, with its owner
