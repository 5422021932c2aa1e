#!/usr/bin/env python3
"""Fault-injection soak: random traffic from many clients while an injector SIGKILLs them.

M client processes store, look up, load and verify checksummed blocks in one segment for a
bounded time. An injector SIGKILLs random clients (and, with --kill-owner, the owner) at
random moments and restarts them. Every load is verified against the content its key
determines, so a block that was published before its bytes were complete, reused while read,
or handed to the wrong key is caught. At the end the harness waits for the owner to reclaim
what the dead held and runs the same invariant checks as ``kvshm-inspect verify``.

Exit status 0 only if: no corrupted load, no leaked block, ``verify`` clean.

Examples:
  python tools/soak.py                          # 60 s, 4 clients, client kills
  python tools/soak.py --seconds 30 --kill-owner --json
  python tools/soak.py --seconds 20 --inject early-ready   # self-test: must FAIL
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import time
import uuid
import zlib

import numpy as np

from kvshm import layout as L
from kvshm.client import connect
from kvshm.layout import Layout
from kvshm.segment import Segment
from kvshm.snapshot import verify
from kvshm.table import BlockTable

LAYOUT = Layout((4096, 2048), 16, "soak")
INJECTIONS = ("early-ready",)


def content(key: bytes, plane: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(key + bytes([plane]))).integers(
        0, 256, nbytes, np.uint8)


def client(name: str, conn, seed: int, nkeys: int, inject: str | None) -> None:
    """One engine-like client: random operations until told to stop (or killed)."""
    rng = random.Random(seed)
    mgr = connect(name, LAYOUT)
    planes = mgr.segment.planes()
    keys = [b"soak-%05d" % i for i in range(nkeys)]
    stats = dict(ops=0, stores=0, loads=0, loaded_blocks=0, corrupt=0, refused=0)
    conn.send(("hello", os.getpid()))
    while not conn.poll():
        op = rng.random()
        ks = rng.sample(keys, rng.randint(1, 6))
        stats["ops"] += 1
        if op < 0.35:
            out = mgr.prepare_store(ks)
            if out is None:
                stats["refused"] += 1
                continue
            if inject == "early-ready":  # the bug the soak must catch: publish, then write
                mgr.complete_store(out.keys_to_store)
            for k, b in zip(out.keys_to_store, out.block_ids):
                for p, plane in enumerate(planes):
                    plane[b] = content(k, p, plane.shape[1])
            if inject != "early-ready":
                mgr.complete_store(out.keys_to_store, success=rng.random() > 0.05)
            stats["stores"] += 1
        elif op < 0.8:
            n = mgr.lookup(ks)
            if n:
                blocks = mgr.prepare_load(ks[:n])
                for k, b in zip(ks[:n], blocks):
                    if any(not np.array_equal(plane[b], content(k, p, plane.shape[1]))
                           for p, plane in enumerate(planes)):
                        stats["corrupt"] += 1
                        conn.send(("corrupt", k.decode(), b))
                mgr.complete_load(ks[:n])
                stats["loads"] += 1
                stats["loaded_blocks"] += n
        elif op < 0.9:
            mgr.touch(ks)
        else:
            mgr.release()
        if stats["ops"] % 50 == 0:
            conn.send(("stats", dict(stats)))
    conn.send(("stats", dict(stats)))
    mgr.shutdown()


class Soak:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.name = f"soak-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.ctx = mp.get_context("spawn")
        self.rng = random.Random(args.seed)
        self.procs: dict[int, tuple[mp.Process, object]] = {}
        self.final: list[dict] = []  # last stats of every finished incarnation
        self.live_stats: dict[int, dict] = {}
        self.corrupt: list[tuple] = []
        self.kills = {"clients": 0, "owner": 0}
        self.incarnation = 0
        self.crashes = 0

    def start_client(self, idx: int) -> None:
        parent, child = self.ctx.Pipe()
        self.incarnation += 1
        p = self.ctx.Process(target=client, daemon=True, args=(
            self.name, child, self.args.seed * 1000 + self.incarnation, self.args.keys,
            self.args.inject))
        p.start()
        self.procs[idx] = (p, parent)

    def drain(self, idx: int) -> None:
        _, conn = self.procs[idx]
        try:
            while conn.poll():
                kind, *rest = conn.recv()
                if kind == "stats":
                    self.live_stats[idx] = rest[0]
                elif kind == "corrupt":
                    self.corrupt.append(tuple(rest))
        except (EOFError, OSError):
            pass

    def retire(self, idx: int) -> None:
        self.drain(idx)
        if idx in self.live_stats:
            self.final.append(self.live_stats.pop(idx))

    def run(self) -> dict:
        a = self.args
        Segment.create(self.name, LAYOUT, a.blocks, ring_capacity=64 << 10,
                       hold_capacity=256).close()
        seg = Segment.attach(self.name)
        try:
            for i in range(a.clients):
                self.start_client(i)
            end = time.monotonic() + a.seconds
            next_kill = time.monotonic() + self.rng.uniform(0.2, 1.0)
            while time.monotonic() < end:
                for i in self.procs:
                    self.drain(i)
                if time.monotonic() >= next_kill:
                    self.inject_fault(seg)
                    next_kill = time.monotonic() + self.rng.uniform(0.2, 1.0)
                time.sleep(0.02)  # supervisor tick; the clients never wait on it
            for i, (p, conn) in self.procs.items():
                conn.send("stop")
            for i, (p, _) in self.procs.items():
                p.join(30)
                if p.exitcode not in (0, None):
                    self.crashes += 1
                self.retire(i)
            return self.check(seg)
        finally:
            pid = seg.owner_record()[0]
            seg.close()
            Segment.unlink(self.name)
            if pid:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            for p, _ in self.procs.values():
                if p.is_alive():
                    p.kill()

    def inject_fault(self, seg: Segment) -> None:
        if self.args.kill_owner and self.rng.random() < 0.25:
            pid = seg.owner_record()[0]
            if pid and seg.owner_alive():
                os.kill(pid, signal.SIGKILL)
                self.kills["owner"] += 1
            return
        idx = self.rng.randrange(self.args.clients)
        p, _ = self.procs[idx]
        if p.exitcode is not None:  # it died on its own: a client must never crash
            self.crashes += 1
        else:
            os.kill(p.pid, signal.SIGKILL)
        p.join()
        self.retire(idx)
        self.kills["clients"] += 1
        self.start_client(idx)

    def check(self, seg: Segment) -> dict:
        # Let an owner reclaim what the dead held: a fresh client makes sure one runs.
        probe = connect(self.name)
        table = BlockTable(seg.buf, seg.geometry)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            writing = sum(table.read(b).state == L.WRITING for b in range(seg.geometry.num_blocks))
            dead = [i for i in range(seg.geometry.max_clients)
                    if i != probe.slot and L.SLOT.unpack_from(
                        seg.buf, seg.geometry.slot_offset(i))[0] != 0]
            if not writing and not dead:
                break
            time.sleep(0.05)  # polling the owner's reclaim, bounded by the deadline
        violations = verify(seg)
        table.close()
        probe.shutdown()
        totals = {k: sum(s.get(k, 0) for s in self.final)
                  for k in ("ops", "stores", "loads", "loaded_blocks", "corrupt", "refused")}
        report = {
            "seconds": self.args.seconds, "clients": self.args.clients,
            "blocks": self.args.blocks, "inject": self.args.inject,
            "kills": self.kills, "failovers": seg.counter("failovers"),
            "reclaimed_clients": seg.counter("reclaimed_clients"),
            "reclaimed_blocks": seg.counter("reclaimed_blocks"),
            **totals, "corrupt_loads": len(self.corrupt), "leaked_blocks": writing,
            "dead_slots_left": len(dead), "client_crashes": self.crashes,
            "violations": violations,
        }
        report["ok"] = not (self.corrupt or writing or dead or violations or self.crashes)
        return report


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0, help="traffic duration (default 60)")
    ap.add_argument("--clients", type=int, default=4, help="client processes (default 4)")
    ap.add_argument("--blocks", type=int, default=48, help="segment blocks (default 48)")
    ap.add_argument("--keys", type=int, default=120, help="distinct keys (default 120)")
    ap.add_argument("--kill-owner", action="store_true", help="also SIGKILL the owner")
    ap.add_argument("--inject", choices=INJECTIONS, default=None,
                    help="self-test: inject a known bug into the clients; the soak must fail")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json", action="store_true", help="print only one JSON report")
    args = ap.parse_args(argv)
    report = Soak(args).run()
    if args.json:
        print(json.dumps(report))
    else:
        print(f"soak {'PASS' if report['ok'] else 'FAIL'}: {report['seconds']:g}s "
              f"{report['clients']} clients, {report['ops']} ops, {report['loaded_blocks']} "
              f"blocks loaded+verified, kills {report['kills']}, failovers "
              f"{report['failovers']}, corrupt {report['corrupt_loads']}, leaked "
              f"{report['leaked_blocks']}, crashed clients {report['client_crashes']}, "
              f"violations {len(report['violations'])}")
        print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
