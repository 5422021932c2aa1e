#!/usr/bin/env python3
"""Fault-injection soak: random traffic from many clients while an injector kills and freezes them.

Two kinds of client process share one segment for a bounded time:

* traffic clients (--clients) store, look up, load and verify checksummed blocks; half their
  stores and some of their touches name a running request (vLLM 0.33's provisional ranks),
  which a touch now and then ends;
* reconnectors (--reconnectors) loop connect() -> a lookup (verifying any load) and a small
  checksummed store -> shutdown(), so slots are claimed and given back all the time;
* hostile clients (--hostile, ``tools/soak_hostile.py``) flood the cache with unique keys, or
  scribble on what they own (slot record, holds, rings, grant ring counts, want ring) and
  leave, with or without a goodbye. With them a mover serves the segment (over an empty
  lower tier) and the reconnectors look up through a ``TieredManager``, so that they take
  the slots, and the want rings, the hostile clients left. What happens to a hostile client
  is its own business; the soak counts its actions.

Every load is verified against the content its key determines, so a block that was published
before its bytes were complete, reused while read, or handed to the wrong key is caught.

At random moments an injector, run by the harness (the parent process):

* SIGKILLs a random client (traffic or reconnector) and starts a new one in its place;
* SIGSTOPs a random client for a random while (--max-freeze), then SIGCONTs it, or now and
  then SIGKILLs it while frozen; a frozen client must not stall the owner or anyone else;
* with --kill-owner, SIGKILLs the owner (a client starts the next one).

Meanwhile a wedge detector watches that the owner's ``frames`` counter advances while some
client runs unfrozen, and that every running unfrozen client keeps completing operations (or
reconnect cycles); a stall longer than --wedge-seconds counts as a wedge, and the stalled
client's Python stacks are dumped to stderr. A client that does not stop when told to counts
as a wedge too. Any kvshm error a client sees is a client error: a survivor (of the owner's
death, of its peers' deaths or freezes, or of its own freeze) may see delays, never errors.

At the end, once every client is gone, the harness waits (with a deadline) for the owner to
reclaim what the dead held, runs the same invariant checks as ``kvshm-inspect verify``, and
checks that every client slot is FREE again.

Exit status 0 only if: no corrupted load, no leaked block, no leaked slot, no wedge, no client
error, no client crash (a client that died without being killed), no owner death the injector
did not cause (``failovers`` beyond its owner kills), no mover crash or busy loop (a mover
using more than half a CPU over a wedge window), ``verify`` clean.

Examples:
  python tools/soak.py                          # 60 s, 4 clients + 1 reconnector, kills+freezes
  python tools/soak.py --seconds 30 --kill-owner --json
  python tools/soak.py --seconds 20 --inject early-ready   # self-test: must FAIL
  python tools/soak.py --seconds 60 --kill-owner --hostile 2 --json
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import multiprocessing as mp
import os
import random
import signal
import sys
import time
import traceback
import uuid
import zlib
from dataclasses import dataclass, field

import numpy as np
import soak_hostile

from kvshm.client.connect import connect
from kvshm.errors import KvshmError
from kvshm.index.access import RANKED, SEEN
from kvshm.index.api import LookupResult, Running
from kvshm.inspect.snapshot import verify
from kvshm.logs import owner_log_path
from kvshm.shm import layout as L
from kvshm.shm import slots
from kvshm.shm.layout import Layout
from kvshm.shm.segment import Segment
from kvshm.shm.table import BlockTable
from kvshm.tier.client import TieredManager

LAYOUT = Layout((4096, 2048), 16, "soak")
INJECTIONS = ("early-ready",)
STATS = ("ops", "stores", "loads", "loaded_blocks", "corrupt", "refused", "reconnects",
         "errors")
REPORT_EVERY_S = 0.25  # a client reports progress at least this often while it progresses
ERROR_SAMPLES = 5  # tracebacks kept in the report


def content(key: bytes, plane: int, nbytes: int) -> np.ndarray:
    return np.random.default_rng(zlib.crc32(key + bytes([plane]))).integers(
        0, 256, nbytes, np.uint8)


class Reporter:
    """A client's side of its pipe to the harness: progress, corrupt loads, errors."""

    def __init__(self, conn):
        self.conn = conn
        self.stats = dict.fromkeys(STATS, 0)
        self.last = time.monotonic()

    def send(self, msg: tuple) -> None:
        try:
            self.conn.send(msg)
        except (BrokenPipeError, EOFError, OSError):
            pass

    def progress(self, force: bool = False) -> None:
        now = time.monotonic()
        if force or self.stats["ops"] % 50 == 0 or now - self.last > REPORT_EVERY_S:
            self.last = now
            self.send(("stats", dict(self.stats)))

    def error(self, exc: BaseException) -> None:
        self.stats["errors"] += 1
        tb = traceback.format_exc() if self.stats["errors"] <= 3 else ""
        self.send(("error", type(exc).__name__, str(exc), tb))

    def verify_load(self, planes, keys, blocks) -> None:
        for k, b in zip(keys, blocks):
            if any(not np.array_equal(plane[b], content(k, p, plane.shape[1]))
                   for p, plane in enumerate(planes)):
                self.stats["corrupt"] += 1
                self.send(("corrupt", k.decode(), b))


def store(mgr, planes, keys, inject: str | None, success: bool,
          running: Running | None = None) -> bool:
    """prepare_store, write each granted block's checksummed content, complete_store (both
    naming ``running``, if given)."""
    out = mgr.prepare_store(keys, running=running)
    if out is None:
        return False
    if inject == "early-ready":  # the bug the soak must catch: publish, then write
        mgr.complete_store(out.keys_to_store, running=running)
    for k, b in zip(out.keys_to_store, out.block_ids):
        for p, plane in enumerate(planes):
            plane[b] = content(k, p, plane.shape[1])
    if inject != "early-ready":
        mgr.complete_store(out.keys_to_store, success=success, running=running)
    return True


def load(mgr, planes, keys, rep: Reporter, per_key: bool = False) -> None:
    """lookup (``per_key``: key by key until the first miss, as vLLM's scheduler asks, so
    a prefix loaded before is leased whole); prepare_load, verify and complete_load the
    hits."""
    if per_key:
        n = 0
        while n < len(keys) and mgr.key_status(keys[n]) is LookupResult.HIT:
            n += 1
    else:
        n = mgr.lookup(keys) or 0  # a TieredManager's None: not yet (a retry), no hit now
    if n:
        blocks = mgr.prepare_load(keys[:n])
        rep.verify_load(planes, keys[:n], blocks)
        mgr.complete_load(keys[:n])
        rep.stats["loads"] += 1
        rep.stats["loaded_blocks"] += n


def client(role: str, name: str, conn, seed: int, nkeys: int, inject: str | None,
           tiered: bool = False, actions: tuple[str, ...] = ()) -> None:
    """One client process until told to stop (or killed). Any kvshm error it sees is
    reported and counted; any other exception is reported and ends it (a crash).
    ``tiered``: a reconnector looks up through a TieredManager; ``actions``: a hostile
    client's."""
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # the wedge detector's dump
    rep = Reporter(conn)
    try:
        rep.send(("hello", os.getpid()))
        if role == "hostile":
            soak_hostile.Hostile(name, conn, seed, actions, LAYOUT, rep).run()
        elif role == "client":
            traffic(name, conn, seed, nkeys, inject, rep)
        else:
            reconnector(name, conn, seed, nkeys, inject, rep, tiered)
        rep.progress(force=True)
    except BaseException as exc:
        rep.send(("crash", type(exc).__name__, str(exc), traceback.format_exc()))
        raise


def traffic(name: str, conn, seed: int, nkeys: int, inject: str | None,
            rep: Reporter) -> None:
    """An engine-like client: one connection, random operations."""
    rng = random.Random(seed)
    keys = [b"soak-%05d" % i for i in range(nkeys)]
    try:
        mgr = connect(name, LAYOUT)
    except KvshmError as exc:
        rep.error(exc)
        return
    planes = mgr.segment.planes()
    stats = rep.stats
    request, tokens = 1, 0  # the running request some operations name, its next position
    while not conn.poll():
        op = rng.random()
        ks = rng.sample(keys, rng.randint(1, 6))
        stats["ops"] += 1
        running = None
        if rng.random() < 0.5:
            running = Running(request, {k: tokens + 16 * i for i, k in enumerate(ks)})
            tokens += 16 * len(ks)
        try:
            if op < 0.35:
                if store(mgr, planes, ks, inject, success=rng.random() > 0.05,
                         running=running):
                    stats["stores"] += 1
                else:
                    stats["refused"] += 1
            elif op < 0.6:
                load(mgr, planes, ks, rep)
            elif op < 0.8:  # a prefix, the same keys in the same order every time
                start = rng.randrange(0, nkeys, 8)
                load(mgr, planes, keys[start:start + rng.randint(8, 16)], rep, per_key=True)
            elif op < 0.85:
                mgr.touch(ks, bytes([RANKED]) * len(ks) if running else None,
                          running=running)
            elif op < 0.9:  # the request finishes: its keys take fresh ranks
                mgr.touch(ks, bytes([SEEN]) * len(ks), running=Running(request, done=True))
                request, tokens = request + 1, 0
            else:
                mgr.release()
        except KvshmError as exc:
            rep.error(exc)
        rep.progress()
    mgr.shutdown()


def reconnector(name: str, conn, seed: int, nkeys: int, inject: str | None,
                rep: Reporter, tiered: bool = False) -> None:
    """connect -> lookup (verifying any load) and a small store -> shutdown, in a loop
    (``tiered``: lookups through a TieredManager, which asks the mover on a miss)."""
    rng = random.Random(seed)
    keys = [b"soak-%05d" % i for i in range(nkeys)]
    stats = rep.stats
    while not conn.poll():
        stats["ops"] += 1
        try:
            mgr = connect(name, LAYOUT)
        except KvshmError as exc:
            rep.error(exc)
            rep.progress()
            continue
        if tiered:
            mgr = TieredManager(mgr)
        try:
            planes = mgr.segment.planes()
            load(mgr, planes, rng.sample(keys, rng.randint(1, 4)), rep)
            if store(mgr, planes, rng.sample(keys, rng.randint(1, 2)), inject, success=True):
                stats["stores"] += 1
            else:
                stats["refused"] += 1
        except KvshmError as exc:
            rep.error(exc)
        finally:
            planes = None  # no view of the mapping outlives the connection
            mgr.shutdown()
        stats["reconnects"] += 1
        rep.progress()


def slot_detail(seg, taken: list[int]) -> list[dict]:
    """What the soak reports of slots left taken: each one's record."""
    out = []
    for i in taken:
        rec = slots.record(seg, i)
        out.append(dict(slot=i, state=L.SLOT_STATE_NAMES.get(rec.state, rec.state),
                        pid=rec.pid, gen=rec.gen, name=rec.name.rstrip(b"\0").decode()))
    return out


@dataclass
class Proc:
    role: str
    process: mp.Process
    conn: object
    progress_at: float  # when it last made progress (or started, or was thawed)
    ops: int = -1
    frozen_until: float | None = None
    kill_when_thawed: bool = False
    stalled: bool = False  # in a wedge episode already counted
    ready: bool = False  # said hello: its SIGUSR1 stack dump is armed
    stats: dict = field(default_factory=dict)


class Soak:
    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.name = f"soak-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.ctx = mp.get_context("spawn")
        self.rng = random.Random(args.seed)
        self.procs: dict[int, Proc] = {}
        self.final: list[dict] = []  # last stats of every finished incarnation
        self.corrupt: list[tuple] = []
        self.errors = 0
        self.error_samples: list[str] = []
        self.kills = {"clients": 0, "frozen_clients": 0, "owner": 0}
        self.freezes = 0
        self.incarnation = 0
        self.crashes = 0
        self.wedges: list[dict] = []
        self.frames = (-1, time.monotonic())  # (owner frames counter, when it last moved)
        self.owner_stalled = False
        self.hostile_final: list[dict] = []  # last stats of every hostile incarnation
        self.hostile_crashes = 0  # hostile clients that died of an exception: informational
        self.mover = soak_hostile.MoverWatch(self.ctx, self.name, args.wedge_seconds,
                                             self.wedge) if args.hostile else None

    # --- client processes -----------------------------------------------------------------
    def role(self, idx: int) -> str:
        a = self.args
        return ("client" if idx < a.clients else "reconnector"
                if idx < a.clients + a.reconnectors else "hostile")

    def start_client(self, idx: int) -> None:
        role = self.role(idx)
        parent, child = self.ctx.Pipe()
        self.incarnation += 1
        p = self.ctx.Process(target=client, daemon=True, args=(
            role, self.name, child, self.args.seed * 1000 + self.incarnation, self.args.keys,
            self.args.inject, self.mover is not None, tuple(self.args.hostile_actions)))
        p.start()
        child.close()
        self.procs[idx] = Proc(role, p, parent, time.monotonic())

    def drain(self, idx: int) -> None:
        pr = self.procs[idx]
        try:
            while pr.conn.poll():
                kind, *rest = pr.conn.recv()
                if kind == "stats":
                    pr.stats = rest[0]
                    if rest[0]["ops"] != pr.ops:
                        pr.ops, pr.progress_at, pr.stalled = rest[0]["ops"], time.monotonic(), False
                elif kind == "hello":
                    pr.ready = True
                elif kind == "crash" and pr.role == "hostile":
                    self.hostile_crashes += 1  # its own scribbles' doing: informational
                elif kind == "corrupt":
                    self.corrupt.append(tuple(rest))
                elif kind == "error":
                    self.errors += 1
                    if len(self.error_samples) < ERROR_SAMPLES:
                        self.error_samples.append(f"{pr.role}: {rest[0]}: {rest[1]}\n{rest[2]}")
                elif kind == "crash" and len(self.error_samples) < ERROR_SAMPLES:
                    self.error_samples.append(f"{pr.role} crashed: {rest[0]}: {rest[1]}\n{rest[2]}")
        except (EOFError, OSError):
            pass

    def retire(self, idx: int) -> None:
        self.drain(idx)
        pr = self.procs[idx]
        if pr.stats:
            (self.hostile_final if pr.role == "hostile" else self.final).append(pr.stats)
        pr.conn.close()

    def kill_and_restart(self, idx: int, frozen: bool = False) -> None:
        pr = self.procs[idx]
        if pr.process.exitcode is not None:  # it died on its own: a client must never crash
            self.crashes += pr.role != "hostile"  # (a hostile one may leave as it likes)
        else:
            os.kill(pr.process.pid, signal.SIGKILL)
            self.kills["frozen_clients" if frozen else "clients"] += 1
        pr.process.join()
        self.retire(idx)
        self.start_client(idx)

    # --- injector -------------------------------------------------------------------------
    def inject_fault(self, seg: Segment) -> None:
        a = self.args
        if a.kill_owner and self.rng.random() < 0.25:
            pid = seg.owner_record()[0]
            if pid and seg.owner_alive():
                try:
                    os.kill(pid, signal.SIGKILL)
                    self.kills["owner"] += 1
                except ProcessLookupError:  # that owner died already (a successor rebuilds)
                    pass
            return
        running = [i for i, pr in self.procs.items() if pr.frozen_until is None]
        if not running:
            return
        idx = self.rng.choice(running)
        pr = self.procs[idx]
        if a.max_freeze > 0 and self.rng.random() < 0.4 and pr.process.exitcode is None:
            os.kill(pr.process.pid, signal.SIGSTOP)
            self.freezes += 1
            pr.frozen_until = time.monotonic() + self.rng.uniform(
                min(0.05, a.max_freeze), a.max_freeze)
            pr.kill_when_thawed = self.rng.random() < 0.25
            return
        self.kill_and_restart(idx)

    def thaw(self, now: float, everyone: bool = False) -> None:
        for idx, pr in list(self.procs.items()):
            if pr.frozen_until is None or (pr.frozen_until > now and not everyone):
                continue
            pr.frozen_until = None
            if pr.kill_when_thawed and not everyone:
                self.kill_and_restart(idx, frozen=True)
            else:
                try:
                    os.kill(pr.process.pid, signal.SIGCONT)
                except ProcessLookupError:  # it left on its own as it was frozen, and
                    pass  # starting a client reaped it: respawn (hostile) or the checks see it
                pr.progress_at, pr.stalled = time.monotonic(), False

    def respawn(self) -> None:
        """Hostile clients leave when they like (often without a goodbye): start another."""
        for idx, pr in list(self.procs.items()):
            if pr.role == "hostile" and pr.frozen_until is None and \
                    pr.process.exitcode is not None:
                pr.process.join()
                self.retire(idx)
                self.start_client(idx)

    # --- wedge detector -------------------------------------------------------------------
    def wedge(self, what: str, **detail) -> None:
        self.wedges.append(dict(what=what, **detail))
        print(f"soak: WEDGE {what} {detail}", file=sys.stderr, flush=True)

    def watch(self, seg: Segment, now: float) -> None:
        limit = self.args.wedge_seconds
        frames = seg.counter("frames")
        if frames != self.frames[0]:
            self.frames, self.owner_stalled = (frames, now), False
        running = [i for i, pr in self.procs.items()
                   if pr.frozen_until is None and pr.process.exitcode is None]
        if not running:
            self.frames = (frames, now)
        elif now - self.frames[1] > limit and not self.owner_stalled:
            self.owner_stalled = True
            pid = seg.owner_record()[0]
            self.wedge("owner frames counter stalled", seconds=round(now - self.frames[1], 1),
                       owner_pid=pid, owner_alive=seg.owner_alive(), frames=frames)
        for i in running:
            pr = self.procs[i]
            if pr.role == "hostile":  # may wait on what it broke: its own business
                continue
            if now - pr.progress_at > limit and not pr.stalled:
                pr.stalled = True
                self.wedge(f"{pr.role} made no progress", seconds=round(now - pr.progress_at, 1),
                           pid=pr.process.pid, ops=pr.ops)
                self.dump(pr)

    @staticmethod
    def dump(pr: Proc) -> None:
        if not pr.ready:  # SIGUSR1 would kill it before faulthandler is registered
            return
        try:
            os.kill(pr.process.pid, signal.SIGUSR1)  # its faulthandler prints its stacks
        except ProcessLookupError:
            pass

    # --- run ------------------------------------------------------------------------------
    def run(self) -> dict:
        a = self.args
        # Client slots for everyone and the probe, and no more: a few blocks are then
        # granted to each storing client (stocking.grant_target), so small stores take the
        # grant path and large ones the round trip.
        Segment.create(self.name, LAYOUT, a.blocks, ring_capacity=64 << 10, hold_capacity=256,
                       max_clients=a.clients + a.reconnectors + 2 * a.hostile + 2 +
                       (self.mover is not None)).close()
        seg = Segment.attach(self.name)
        try:
            if self.mover is not None:
                self.mover.start()
            for i in range(a.clients + a.reconnectors + a.hostile):
                self.start_client(i)
            start = time.monotonic()
            end = start + a.seconds
            self.frames = (seg.counter("frames"), start)
            next_fault = start + self.rng.uniform(0.2, 1.0)
            while (now := time.monotonic()) < end:
                for i in self.procs:
                    self.drain(i)
                self.thaw(now)
                if now >= next_fault:
                    self.inject_fault(seg)
                    next_fault = time.monotonic() + self.rng.uniform(0.2, 1.0)
                self.respawn()
                if self.mover is not None:
                    self.mover.watch()
                self.watch(seg, time.monotonic())
                time.sleep(0.02)  # supervisor tick; the clients never wait on it
            self.stop_all()
            if self.mover is not None:
                self.mover.stop()
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
            for pr in self.procs.values():
                if pr.process.is_alive():
                    pr.process.kill()
            if self.mover is not None:
                self.mover.kill()

    def stop_all(self) -> None:
        """Thaw the frozen, tell everyone to stop; one that does not within the wedge
        limit is a wedge (its stacks are dumped, then it is killed)."""
        self.thaw(time.monotonic(), everyone=True)
        for pr in self.procs.values():
            try:
                pr.conn.send("stop")
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + self.args.wedge_seconds
        for i, pr in self.procs.items():
            while pr.process.exitcode is None and time.monotonic() < deadline:
                self.drain(i)
                pr.process.join(0.1)
            if pr.process.exitcode is None:
                if pr.role != "hostile":  # (a hostile one may wait on what it broke)
                    self.wedge(f"{pr.role} did not stop", pid=pr.process.pid, ops=pr.ops)
                    self.dump(pr)
                    pr.process.join(1.0)  # let its faulthandler finish writing
                pr.process.kill()
                pr.process.join()
            elif pr.process.exitcode != 0 and pr.role != "hostile":
                self.crashes += 1
            self.retire(i)

    def check(self, seg: Segment) -> dict:
        g = seg.geometry
        # Let an owner reclaim what the dead held: a fresh client makes sure one runs.
        probe = connect(self.name)
        table = BlockTable(seg.buf, g)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            writing = sum(table.read(b).state in (L.WRITING, L.GRANTED)
                          for b in range(g.num_blocks))  # unfinished stores and grants
            dead = [i for i in range(g.max_clients)
                    if i != probe.slot and slots.record(seg, i).state != L.SlotState.FREE]
            if not writing and not dead:
                break
            time.sleep(0.05)  # polling the owner's reclaim, bounded by the deadline
        violations = verify(seg)
        table.close()
        probe.shutdown()
        # Every client is gone now: every slot must come back FREE (the owner clears them).
        deadline = time.monotonic() + 10
        while True:
            leaked = [i for i in range(g.max_clients)
                      if slots.record(seg, i).state != L.SlotState.FREE]
            if not leaked or time.monotonic() > deadline:
                break
            time.sleep(0.05)  # polling the owner's reclaim, bounded by the deadline
        leaked_detail = slot_detail(seg, leaked)
        totals = {k: sum(s.get(k, 0) for s in self.final) for k in STATS}
        totals.pop("errors")
        acts: dict[str, int] = {}
        for st in self.hostile_final:
            for k, v in st.items():
                if k.startswith("act_"):
                    acts[k[4:]] = acts.get(k[4:], 0) + v
        failovers = seg.counter("failovers")
        hostile = {
            "clients": self.args.hostile, "action_set": list(self.args.hostile_actions),
            "actions": sum(v for k, v in acts.items() if k in soak_hostile.ACTIONS),
            "by_kind": acts, "crashes": self.hostile_crashes,
            "incarnations": len(self.hostile_final)}
        report = {
            "seconds": self.args.seconds, "clients": self.args.clients,
            "reconnectors": self.args.reconnectors, "blocks": self.args.blocks,
            "inject": self.args.inject, "seed": self.args.seed,
            "kills": self.kills, "freezes": self.freezes,
            "failovers": failovers,
            # owners that died holding the segment without the injector's kill: a client's
            "owner_deaths_not_killed": max(0, failovers - self.kills["owner"]),
            "reclaimed_clients": seg.counter("reclaimed_clients"),
            "reclaimed_blocks": seg.counter("reclaimed_blocks"),
            "frames": seg.counter("frames"),
            **totals, "corrupt_loads": len(self.corrupt), "leaked_blocks": writing,
            "dead_slots_left": len(dead), "leaked_slots": len(leaked),
            "wedges": len(self.wedges), "client_errors": self.errors,
            "client_crashes": self.crashes, "violations": violations,
            "wedge_detail": self.wedges, "leaked_slot_detail": leaked_detail,
            "corrupt_detail": self.corrupt[:10], "error_samples": self.error_samples,
            "hostile": hostile,
            "mover": self.mover.report() if self.mover is not None else None,
        }
        report["ok"] = not (self.corrupt or writing or dead or leaked or violations
                            or self.crashes or self.errors or self.wedges
                            or report["owner_deaths_not_killed"]
                            or (self.mover is not None and self.mover.crashes))
        try:  # the owners' log goes with the segment: keep what a failure needs of it
            with open(owner_log_path(self.name), errors="replace") as f:
                lines = f.read().splitlines()
        except OSError:
            lines = []
        report["owner_log_tracebacks"] = sum("Traceback" in line for line in lines)
        if not report["ok"] or report["owner_log_tracebacks"]:
            report["owner_log_tail"] = lines[-60:]
        return report


def _actions(text: str) -> list[str]:
    names = [n for n in text.split(",") if n]
    bad = [n for n in names if n not in soak_hostile.ACTIONS]
    if bad or not names:
        raise argparse.ArgumentTypeError(
            f"unknown hostile actions {bad}; known: {', '.join(soak_hostile.ACTIONS)}")
    return names


def parser() -> argparse.ArgumentParser:
    """The command line: every option of a soak run, with its default."""
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seconds", type=float, default=60.0,
                    help="how long traffic and fault injection run (default 60)")
    ap.add_argument("--clients", type=int, default=4,
                    help="traffic client processes (default 4)")
    ap.add_argument("--reconnectors", type=int, default=1,
                    help="processes looping connect -> lookup/store -> shutdown (default 1)")
    ap.add_argument("--blocks", type=int, default=64,
                    help="blocks in the segment; few, so stores evict (default 64)")
    ap.add_argument("--keys", type=int, default=120,
                    help="distinct keys the clients draw from (default 120)")
    ap.add_argument("--kill-owner", action="store_true",
                    help="the injector also SIGKILLs the owner (a quarter of its faults)")
    ap.add_argument("--max-freeze", type=float, default=1.5, metavar="S",
                    help="longest SIGSTOP of a client, in seconds; 0 disables freezes "
                         "(default 1.5; a freeze lasts between 0.05 s and this)")
    ap.add_argument("--wedge-seconds", type=float, default=10.0, metavar="S",
                    help="a stall this long (owner frames counter, or a running unfrozen "
                         "client's progress) counts as a wedge (default 10)")
    ap.add_argument("--inject", choices=INJECTIONS, default=None,
                    help="self-test: inject a known bug into the clients; the soak must fail "
                         "(early-ready: publish a stored block before writing its bytes)")
    ap.add_argument("--seed", type=int, default=1,
                    help="seed of the injector's and the clients' random choices (default 1; "
                         "timing still varies between runs)")
    ap.add_argument("--hostile", type=int, default=0, metavar="N",
                    help="hostile client processes beside the honest ones, and a mover "
                         "(default 0; see tools/soak_hostile.py)")
    ap.add_argument("--hostile-actions", type=_actions, default=list(soak_hostile.ACTIONS),
                    metavar="A,B,...",
                    help="what hostile clients do, comma-separated (default: all of "
                         f"{','.join(soak_hostile.ACTIONS)})")
    ap.add_argument("--json", action="store_true",
                    help="print only one JSON report on stdout (diagnostics go to stderr)")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    report = Soak(args).run()
    if args.json:
        print(json.dumps(report))
    else:
        print(f"soak {'PASS' if report['ok'] else 'FAIL'}: {report['seconds']:g}s "
              f"{report['clients']} clients + {report['reconnectors']} reconnectors, "
              f"{report['ops']} ops, {report['reconnects']} reconnects, "
              f"{report['loaded_blocks']} blocks loaded+verified, kills {report['kills']}, "
              f"freezes {report['freezes']}, failovers {report['failovers']}, corrupt "
              f"{report['corrupt_loads']}, leaked blocks {report['leaked_blocks']}, leaked "
              f"slots {report['leaked_slots']}, wedges {report['wedges']}, client errors "
              f"{report['client_errors']}, crashed clients {report['client_crashes']}, "
              f"owner deaths not killed {report['owner_deaths_not_killed']}, hostile "
              f"actions {report['hostile']['actions']}, violations "
              f"{len(report['violations'])}")
        print(json.dumps(report, indent=1))
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
