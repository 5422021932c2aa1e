"""The soak's hostile clients (``tools/soak.py --hostile N``) and the mover they meet.

A hostile client is a real kvshm client that abuses what it legitimately owns, beside the
honest clients: it connects, then either floods the cache with unique keys, or scribbles on
what it may write (its own slot record, its holds, its request and reply rings, its grant
ring's counts, its want ring in the tier area) and pokes the owner, lingers a moment with
lookups, and leaves: with a goodbye, or by exiting without one. Whatever the owner or its own
library answers it afterwards is its problem; the soak checks that the owner, the mover and
every honest client never notice anything but a slower cache.

It never writes block data it was not given: after a scribble it stores nothing more on
that connection (its own library would trust the words it scribbled, and writing blocks is
something no metadata check can stop). Flooding stores go through the library on a clean
connection only.

Besides, it may scribble its doorbell words (its reply doorbell, and the owner's, which
every client rings), hold the header's newcomer flag up, or leave its counters at the top of
their range (its request ids, its slot's generation past 32 bits, where the next client of
the slot counts on from it).

The mover (``mover_main``) serves the segment over an empty in-memory lower tier: it is here
to read the want rings the hostile clients scribble; nothing is ever fetched or spilled.
"""
from __future__ import annotations

import os
import random
import signal
import threading
import time
from collections.abc import Sequence

from proc_clock import sched_ns

from kvshm.client.connect import connect
from kvshm.errors import KvshmError
from kvshm.shm import layout as L
from kvshm.shm import slots, words
from kvshm.tier.api import Code, LowerTier

ACTIONS = ("flood", "slot", "holds", "request_ring", "reply_ring", "grant_counts", "want_ring",
           "doorbell", "newcomer", "counter_limits")
FLOOD_STORES = 50  # stores of unique keys per flooding connection, at most
U64 = (1 << 64) - 1


def _word(rng: random.Random) -> int:
    """A value a scribbler would leave in a u64 word."""
    return rng.choice([0, 1, U64, U64 - 1, 1 << 63, 1 << 62, rng.getrandbits(64),
                       rng.randrange(1 << 20)])


class Hostile:
    """One hostile client process: ``run`` loops over connections until told to stop."""

    def __init__(self, name: str, conn, seed: int, actions: Sequence[str], layout, rep) -> None:
        self.name, self.conn, self.layout, self.rep = name, conn, layout, rep
        self.rng = random.Random(seed)
        self.actions = list(actions)
        self.stats = rep.stats
        self.flooded = 0

    def count(self, what: str, n: int = 1) -> None:
        self.stats[f"act_{what}"] = self.stats.get(f"act_{what}", 0) + n

    def run(self) -> None:
        while not self.conn.poll():
            self.stats["ops"] += 1
            try:
                mgr = connect(self.name, self.layout, timeout=5.0)
            except KvshmError:
                self.count("connect_refused")
                self.rep.progress()
                continue
            action = self.rng.choice(self.actions)
            try:
                if action == "flood":
                    self.count("flood")
                    self.flood(mgr)
                else:
                    getattr(self, action)(mgr)
                    self.count(action)
                    self.poke(mgr)
            except Exception:
                self.count("own_errors")
            self.rep.progress(force=True)
            if self.rng.random() < 0.2:  # gone without a goodbye: the owner reclaims it
                self.conn.send(("stats", dict(self.stats)))
                os._exit(0)
            try:
                mgr.shutdown()
            except Exception:
                self.count("own_errors")

    # --- abuse of the cache ------------------------------------------------------------
    def flood(self, mgr) -> None:
        """Store unique keys as fast as the owner takes them (nobody ever reads them)."""
        planes = mgr.segment.planes()
        for _ in range(FLOOD_STORES):
            if self.conn.poll():
                break
            keys = [b"flood-%d-%d" % (os.getpid(), self.flooded + i) for i in range(8)]
            self.flooded += len(keys)
            out = mgr.prepare_store(keys)
            if out is None:
                continue
            for b in out.block_ids:
                for plane in planes:
                    plane[b] = 0x5A
            mgr.complete_store(out.keys_to_store)
            self.count("flood_keys", len(out.keys_to_store))
        planes = None

    # --- scribbles on what the client owns -----------------------------------------------
    def slot(self, mgr) -> None:
        """Its slot record: pid, name, attach time, generation or state."""
        seg, rng = mgr.segment, self.rng
        field = rng.choice(["pid", "name", "attached_ns", "gen", "state"])
        value: int | bytes
        if field == "name":
            value = bytes(rng.getrandbits(8) for _ in range(L.SLOT_NAME_BYTES))
        elif field in ("pid", "state"):
            value = rng.choice([0, 1, 2, 3, 7, 0xFFFFFFFF, rng.getrandbits(32)])
        elif field == "gen":  # (past a table entry's 32-bit writer_gen too: counter_limits)
            value = rng.choice([mgr.gen - 1, mgr.gen + 1, 0, rng.getrandbits(31)])
        else:
            value = _word(rng)
        words.store_fields(seg.buf, seg.geometry.slot_offset(mgr.slot), L.SLOT_DTYPE,
                           **{field: value})

    def holds(self, mgr) -> None:
        """Its hold entries (leases and pins) and their mark: any values."""
        seg, rng = mgr.segment, self.rng
        h = slots.holds(seg, mgr.slot)
        for _ in range(rng.randint(1, 16)):
            h[rng.randrange(len(h))] = rng.choice([-2, -1, 0, 1 << 30, -(1 << 31),
                                                   rng.randrange(seg.geometry.num_blocks),
                                                   L.lease_code(rng.randrange(1 << 20))])
        slots.hold_mark(seg, mgr.slot)[0] = rng.choice([0, len(h), len(h) + 1, U64,
                                                        rng.randrange(len(h) + 1)])

    def _ring(self, mgr, name: str) -> None:
        view = slots.ring_view(mgr.segment, mgr.slot, name)
        rng = self.rng
        if rng.random() < 0.3:  # frame bytes
            at = 192 + rng.randrange(len(view) - 192 - 8)
            view[at:at + 8] = rng.getrandbits(64).to_bytes(8, "little")
        else:  # a header word: magic, capacity, tail or head
            w = view.cast("Q")
            w[rng.choice([0, 1, 8, 16])] = _word(rng)
            w.release()

    def request_ring(self, mgr) -> None:
        self._ring(mgr, "request")

    def reply_ring(self, mgr) -> None:
        self._ring(mgr, "reply")

    def grant_counts(self, mgr) -> None:
        """Its grant ring's counts (the owner's ``granted``, its own ``taken``) and ids."""
        head, ids = slots.grants(mgr.segment, mgr.slot)
        rng = self.rng
        for name in rng.sample(["granted", "taken"], rng.randint(1, 2)):
            head[name] = rng.choice([_word(rng), head["granted"] + rng.randint(1, 64),
                                     max(0, head["taken"] - rng.randint(1, 64))])
        if rng.random() < 0.3:
            ids[rng.randrange(len(ids))] = rng.choice([-1, 1 << 30, rng.getrandbits(31)])

    def want_ring(self, mgr) -> None:
        """Its want ring in the tier area: wants for keys nobody has, then any words."""
        from kvshm.tier.area import TierArea
        area = TierArea.attach(mgr.segment)
        if area is None:
            return
        try:
            rng = self.rng
            area.want(mgr.slot, [b"wanted-%d" % rng.getrandbits(32) for _ in range(4)])
            ring = area._rings[mgr.slot]  # the tail is ours; the done word any client's
            for name in rng.sample(["tail", "done"], rng.randint(1, 2)):
                ring[name] = rng.choice([U64, 1 << 62, ring["tail"] + rng.randint(1, 1000),
                                         ring["done"] + rng.randint(1, 1000), 0])
            area.kick()
        finally:
            area.close()

    def doorbell(self, mgr) -> None:
        """Its reply doorbell's futex word, or the owner's (every client rings it): any
        value, as a scribbler leaves it."""
        seg, rng = mgr.segment, self.rng
        if rng.random() < 0.5:
            word = slots.bell_view(seg, mgr.slot, "reply").cast("I")
        else:
            word = seg.buf[L.OFF_OWNER_BELL:L.OFF_OWNER_BELL + 4].cast("I")
        word[0] = rng.choice([0, 1, 2, 0xFFFFFFFF, rng.getrandbits(32)])
        word.release()

    def newcomer(self, mgr) -> None:
        """Hold the header's newcomer flag at 1 for a while."""
        flag = mgr.segment.buf[L.OFF_NEWCOMER:L.OFF_NEWCOMER + 8].cast("Q")
        end = time.monotonic() + self.rng.uniform(0.1, 1.0)
        while time.monotonic() < end and not self.conn.poll():
            flag[0] = 1
        flag.release()

    def counter_limits(self, mgr) -> None:
        """Its request ids, or its slot's generation, at the top of their range."""
        if self.rng.random() < 0.5:
            mgr._link._req = U64 - self.rng.randint(0, 2)
        else:
            seg = mgr.segment
            words.store_fields(seg.buf, seg.geometry.slot_offset(mgr.slot), L.SLOT_DTYPE,
                               gen=self.rng.choice([U64 - 1, U64, 1 << 32,
                                                    self.rng.getrandbits(64)]))

    # --- after a scribble ----------------------------------------------------------------
    def poke(self, mgr) -> None:
        """Make the owner look at us (a round trip), then linger with lookups only."""
        keys = [b"soak-%05d" % self.rng.randrange(120) for _ in range(4)]
        try:
            mgr.take_events()
        except Exception:
            self.count("own_errors")
        end = time.monotonic() + self.rng.uniform(0, 0.1)
        while time.monotonic() < end and not self.conn.poll():
            try:
                mgr.lookup(keys)
            except Exception:
                self.count("own_errors")
                break


# --- the mover ---------------------------------------------------------------------------
class EmptyTier(LowerTier):
    """A lower tier that has nothing and keeps nothing."""
    description = "soak: an empty in-memory tier"

    def connect(self) -> bool:
        return True

    def register(self, address: int, length: int) -> bool:
        return True

    def exists(self, keys: Sequence[str]) -> list[Code]:
        return [Code.NOT_FOUND] * len(keys)

    def put(self, keys, buffers) -> list[Code]:
        return [Code.OK] * len(keys)

    def get(self, keys, buffers) -> list[int]:
        return [int(Code.NOT_FOUND)] * len(keys)

    def close(self) -> None:
        pass


def mover_main(name: str) -> None:
    """The segment's mover until SIGTERM (fetch only, over ``EmptyTier``)."""
    from kvshm.tier.mover import Mover
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    mover = Mover(name, EmptyTier(), spill=False)
    try:
        mover.run(stop)
    finally:
        mover.close()


def cpu_seconds(pid: int) -> float:
    """CPU time of process ``pid`` so far, in seconds (0 when it is gone)."""
    return sched_ns(pid)[0] / 1e9


class MoverWatch:
    """The soak's side of the mover process: started with the clients, restarted if it dies
    (a crash: nothing a client does may kill it), watched for busy loops (more than half a
    CPU over a wedge window, a mover with nothing to fetch and nothing to spill), stopped
    before the final checks (its goodbye frees its slot)."""

    def __init__(self, ctx, name: str, window_s: float, wedge) -> None:
        self.ctx, self.name, self.window_s, self.wedge = ctx, name, window_s, wedge
        self.process = None
        self.crashes = self.busy = 0
        self.cpu = 0.0  # CPU seconds of the mover processes that are gone
        self.max_share = 0.0  # the largest CPU share over a window
        self._mark = (0.0, time.monotonic())

    def start(self) -> None:
        self.process = self.ctx.Process(target=mover_main, args=(self.name,), daemon=True)
        self.process.start()
        self._mark = (0.0, time.monotonic())

    def watch(self) -> None:
        p = self.process
        if p.exitcode is not None:
            self.crashes += 1
            self.wedge("the mover died", exitcode=p.exitcode)
            self.start()
            return
        now, cpu = time.monotonic(), cpu_seconds(p.pid)
        if now - self._mark[1] >= self.window_s:
            share = (cpu - self._mark[0]) / (now - self._mark[1])
            self.max_share = max(self.max_share, share)
            if share > 0.5:
                self.busy += 1
                self.wedge("the mover busy-loops", cpu_share=round(share, 2), pid=p.pid)
            self._mark = (cpu, now)

    def stop(self) -> None:
        p = self.process
        if p.exitcode is None:
            self.cpu += cpu_seconds(p.pid)
            os.kill(p.pid, signal.SIGTERM)
            p.join(self.window_s)
        if p.exitcode is None:
            self.wedge("the mover did not stop", pid=p.pid)
            p.kill()
            p.join()

    def kill(self) -> None:
        if self.process is not None and self.process.is_alive():
            self.process.kill()

    def report(self) -> dict:
        return {"crashes": self.crashes, "busy_windows": self.busy,
                "max_cpu_share": round(self.max_share, 3), "cpu_s": round(self.cpu, 2)}


if __name__ == "__main__":  # a library: say what it is and who runs it
    import os.path
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from library_help import explain
    explain("soak_hostile.py", __doc__, instead="tools/soak.py")
