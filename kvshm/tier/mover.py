"""The mover: the one process per host that moves blocks between its segment and the lower tier.

This module owns the mover's loop. The mover is an ordinary kvshm client of the segment (a
``SharedManager`` subscribed to events) plus the only ``LowerTier`` client on the host:

* **fill** (lower tier -> segment), first in every round: drain the engines' wants (tier
  area), drop keys the segment has, ask the tier which exist, ``prepare_store`` those (the
  keys are WRITING: engines' lookups answer "not yet"), publish the wants as answered, fetch
  each value straight into its block (header into the mover's buffer, pages into the planes),
  check length, header and each page's checksum, then ``complete_store`` the good ones
  (``success=False`` frees the rest). A block becomes READY only after that check.
* **spill** (segment -> lower tier), write-through: every store event of the segment (any
  engine's completed store) queues its keys; a round leases and pins up to ``batch`` of them
  (``key_status`` + ``prepare_load``), writes their headers, puts header + pages straight from
  the segment, and unpins. Keys the mover fetched itself are not put back.

Faults never reach an engine: while the lower tier is not connected (``link.py``: connecting
in a thread of its own, or down after an RPC failure, for a backoff) wants are answered at
once (misses) and store events are dropped (counted). Every
outcome is a counter in the tier area (``kvshm-inspect show``). The mover never waits for an
engine and never holds a pin across rounds.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from itertools import islice

import numpy as np

from kvshm import signals
from kvshm.client.manager import SharedManager
from kvshm.crashpoints import crash_point
from kvshm.errors import InvalidArgumentError, KvshmError, MoverRunningError, SegmentNotFoundError
from kvshm.index.api import LookupResult
from kvshm.shm.checksums import BlockSums
from kvshm.shm.segment import Segment
from kvshm.tier import api
from kvshm.tier.api import Code, LowerTier
from kvshm.tier.area import TierArea
from kvshm.tier.link import TierLink

log = logging.getLogger("kvshm.mover")

_REMEMBER = 1 << 16          # keys fetched/put recently, not spilled (again)
_QUEUE_MAX = 1 << 16         # store events waiting for their put; beyond: dropped
_IDLE_EVENTS_S = 0.05        # take_events period while no store happens
_WANTS_PER_ROUND = 1024      # wanted keys one fill round handles (gets go in batches)


class Mover:
    """Serve segment ``name`` against ``tier``. ``step()`` does one round; ``run()`` loops."""

    def __init__(self, name: str, tier: LowerTier, *, spill: bool = True, batch: int = 64,
                 poll_s: float = 0.005, stops: signals.StopSignals | None = None) -> None:
        if isinstance(batch, bool) or not isinstance(batch, int) or batch < 1:
            # Refused before anything is taken: a batch of 0 would fail the first store.
            raise InvalidArgumentError(f"batch must be an int of at least 1 (blocks per "
                                       f"put/get call), got {batch!r}")
        self.seg = Segment.attach(name)
        try:
            self.area = TierArea.create(self.seg)
        except BaseException:
            self.seg.close()
            raise
        if not self.area.try_lock_mover():
            self.area.close()
            self.seg.close()
            raise MoverRunningError(f"another mover serves segment {name!r}")
        # At once, and before our pid: engines must not trust a dead mover's "connected".
        self.area.set_state("connecting")
        # The mover lock goes with the area: on failure the next mover may start.
        try:
            # No grants: a fill must show as WRITING in the index while it runs, so that
            # engines asking meanwhile hear "not yet" (a store from grants is invisible until
            # published). One mapping: the manager closes it.
            self.mgr = SharedManager(self.seg, events=True, grants=False)
        except BaseException:
            self.seg.close()
            self.area.close()
            raise
        try:
            self._start(tier, spill, batch, poll_s, stops)
        except BaseException:
            self.mgr.shutdown()  # and the segment's mapping with it
            self.area.close()
            raise

    def _start(self, tier: LowerTier, spill: bool, batch: int, poll_s: float,
               stops: signals.StopSignals | None) -> None:
        self.tier, self.spill, self.batch, self.poll_s = tier, spill, batch, poll_s
        g = self.seg.geometry
        self.fp = self.seg.layout.fingerprint()
        self.planes = self.seg.planes()
        # Blocks one spill round pins: a lookup refuses leases past half the hold table.
        self._spill_max = max(1, min(4 * batch, g.hold_capacity // 4))
        self.page = list(g.page_bytes)
        self.block_bytes = sum(self.page)
        self.hdr = api.header_bytes(len(self.page))
        self.sums = BlockSums(self.seg) if g.checksums else None
        self.algo = api.default_algo()
        self._hbuf = mmap.mmap(-1, max(4096, self.hdr * batch * 2))  # 2 halves, registered
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvshm-mover-sums")
        self._haddr = ctypes.addressof(ctypes.c_char.from_buffer(self._hbuf))
        self._hview = memoryview(self._hbuf)
        self._queue: dict[bytes, None] = {}  # store events waiting for their put, in order
        self._skip: OrderedDict[bytes, None] = OrderedDict()  # fetched or put: not again
        self.link = TierLink(tier, self.area,
                             [self.seg.data_address(), (self._haddr, len(self._hbuf))], stops)
        self._next_events = 0.0
        self.area.set_mover(os.getpid(), tier.description)

    # --- one round ------------------------------------------------------------------------
    def step(self) -> int:
        """Tend the link, fill the wants, then spill one batch. Returns how many keys it
        handled."""
        self.link.tend()  # outside the try: a backend that can never work ends the mover
        try:
            return self._fill() + self._spill()
        except KvshmError as e:  # the owner's answer to a bad state: log, go on
            log.warning("mover round failed: %s", e)
            return 0

    def _remember(self, keys: Sequence[bytes]) -> None:
        for k in keys:
            self._skip[k] = None
            self._skip.move_to_end(k)
        while len(self._skip) > _REMEMBER:
            self._skip.popitem(last=False)

    def _buffers(self, blocks: Sequence[int], half: int) -> list[list[tuple[int, int]]]:
        """Per block: its header slot in half ``half`` of the header buffer, then its pages."""
        h0 = self._haddr + half * self.batch * self.hdr
        return [[(h0 + i * self.hdr, self.hdr)] +
                [(int(p.ctypes.data) + b * n, n) for p, n in zip(self.planes, self.page)]
                for i, b in enumerate(blocks)]

    def _chunks(self, keys: list[bytes], blocks: list[int]) -> list[tuple[list[bytes], list[int]]]:
        """``keys`` and their ``blocks`` in calls of ``batch`` (one header-buffer half each)."""
        bt = self.batch
        return [(keys[i:i + bt], blocks[i:i + bt]) for i in range(0, len(keys), bt)]

    def _header(self, half: int, i: int) -> memoryview:
        o = (half * self.batch + i) * self.hdr
        return self._hview[o:o + self.hdr]

    def _fill(self) -> int:
        keys, done = self.area.drain(_WANTS_PER_ROUND)
        try:
            return self._fetch(keys, done) if keys else 0
        finally:  # every ring read is answered, whatever came of it: none wakes us again
            self.area.publish(done)

    def _fetch(self, keys: list[bytes], done: dict[int, int]) -> int:
        find = self.mgr.index.find
        keys = list(dict.fromkeys(k for k in keys if find(k)[1] < 0))
        if not keys or not self.link.usable():
            self.area.publish(done)
            return len(keys)
        codes = self.tier.exists([api.tier_key(self.fp, k) for k in keys])
        self.link.codes(codes)
        there = [k for k, c in zip(keys, codes) if c == Code.OK]
        self.area.add("get_misses", sum(1 for c in codes if c == Code.NOT_FOUND))
        self.area.add("get_failed", sum(1 for c in codes if c not in (Code.OK, Code.NOT_FOUND)))
        out = self.mgr.prepare_store(there) if there else None
        if there and out is None:
            self.area.add("get_no_room", len(there))
        self.area.publish(done)  # the fetched keys are WRITING now: lookups say "not yet"
        crash_point("mover.fill.after_prepare")
        if not out or not out.keys_to_store:
            return len(keys)
        ks, bs = out.keys_to_store, out.block_ids
        try:
            good, bad = self._get_all(ks, bs)
        except BaseException:  # none may stay WRITING, out of the cache, while we live
            self._free(ks)
            raise
        crash_point("mover.fill.after_get")
        self._remember(ks)
        published = False
        try:
            if good:
                if self.sums is not None:  # the segment checks loads: give it the sums
                    where = dict(zip(ks, bs))
                    self.sums.store(np.array([where[k] for k in good]),
                                    list(range(len(self.page))))
                self.area.add("gets", len(good))  # counted first: whoever sees READY sees it
                self.area.add("get_bytes", len(good) * self.block_bytes)
                self.mgr.complete_store(good, True)
            published = True
        finally:  # also when publishing raised: it may have published some, or none
            # (freeing a key that is READY is a no-op)
            self._free(bad if published else bad + good)
        return len(keys)

    def _get_all(self, ks: list[bytes], bs: list[int]) -> tuple[list[bytes], list[bytes]]:
        """Fetch ``ks`` into blocks ``bs`` and check them: (good keys, bad keys)."""
        good: list[bytes] = []
        bad: list[bytes] = []
        verifying = None
        try:
            # Two stages: chunk i+1 travels while the helper thread checks chunk i (zlib and
            # the transfer both release the GIL), in alternate halves of the header buffer.
            for c, (ck, cb) in enumerate(self._chunks(ks, bs)):
                got = list(self.tier.get([api.tier_key(self.fp, k) for k in ck],
                                         self._buffers(cb, c % 2)))[:len(ck)]
                # an answer short of the keys asked: the keys past it failed (never left
                # out of both good and bad, WRITING while we live)
                got += [Code.OTHER] * (len(ck) - len(got))
                self.link.codes([g if g < 0 else 0 for g in got])
                if verifying is not None:
                    verifying.result()
                    verifying = None
                verifying = self._pool.submit(self._check_chunk, c % 2, ck, cb, got, good,
                                              bad)
        finally:  # nothing may still read the blocks once we return (or free them)
            if verifying is not None:
                verifying.result()
        return good, bad

    def _free(self, keys: list[bytes]) -> None:
        if keys:
            self.mgr.complete_store(keys, False)

    def _check_chunk(self, half: int, ks: list[bytes], bs: list[int], got: list[int],
                     good: list[bytes], bad: list[bytes]) -> None:
        """Helper thread: sort one fetched chunk into good and bad (never READY) keys."""
        for i, (k, b, n) in enumerate(zip(ks, bs, got)):
            if n == self.hdr + self.block_bytes:
                why = api.check_value(self._header(half, i), self.fp, k,
                                      [p[b] for p in self.planes])
                if why is not None:  # wrong bytes would poison every engine on the host
                    self.area.add("get_rejected")
                    log.warning("fetched block %s… rejected: %s", k.hex()[:16], why)
            else:
                why = f"code {n}" if n < 0 else f"{n} bytes"
                self.area.add("get_misses" if n == Code.NOT_FOUND else "get_failed")
            (good if why is None else bad).append(k)

    def _events(self) -> None:
        now = time.monotonic()
        if now < self._next_events and not self.area.take_kick():
            return
        events = self.mgr.take_events()
        self._next_events = now + (self.poll_s if events else _IDLE_EVENTS_S)
        for ev in events:
            if ev.removed or not self.spill:
                continue
            for k in ev.keys:
                if k in self._skip or k in self._queue:
                    self.area.add("put_skipped", k in self._skip)
                    continue
                if len(self._queue) >= _QUEUE_MAX:
                    self.area.add("put_dropped")
                    continue
                self._queue[k] = None

    def _spill(self) -> int:
        self._events()
        if not self._queue:
            return 0
        if not self.link.usable():
            self.area.add("put_dropped", len(self._queue))
            self._queue.clear()
            return 0
        take = list(islice(self._queue, self._spill_max))
        for k in take:
            del self._queue[k]
        hit = [k for k in take if self.mgr.key_status(k) == LookupResult.HIT]
        self.area.add("put_skipped", len(take) - len(hit))
        if not hit:
            return len(take)
        try:
            blocks = self.mgr.prepare_load(hit)
        except KvshmError:  # evicted between the lease and the pin: nothing to put
            self.mgr.release(hit)
            self.area.add("put_skipped", len(hit))
            return len(take)
        crash_point("mover.spill.after_pin")
        chunks = self._chunks(hit, blocks)
        codes: list[Code] = []
        try:
            # Two stages: the helper thread sums chunk i+1 while chunk i travels.
            self._headers(0, *chunks[0])
            for c, (ck, cb) in enumerate(chunks):
                nxt = (self._pool.submit(self._headers, (c + 1) % 2, *chunks[c + 1])
                       if c + 1 < len(chunks) else None)
                codes += self.tier.put([api.tier_key(self.fp, k) for k in ck],
                                       self._buffers(cb, c % 2))
                if nxt is not None:
                    nxt.result()
        finally:
            self.mgr.complete_load(hit)
        self.link.codes(codes)
        ok = sum(1 for c in codes if c == Code.OK)
        self.area.add("puts", ok)
        self.area.add("put_bytes", ok * self.block_bytes)
        space = sum(1 for c in codes if c == Code.NO_SPACE)
        self.area.add("put_refused_space", space)
        self.area.add("put_failed", len(hit) - ok - space)
        self._remember([k for k, c in zip(hit, codes) if c == Code.OK])
        return len(take)

    def _headers(self, half: int, ks: list[bytes], bs: list[int]) -> None:
        # A checksummed segment already holds each page's crc32 (its writers computed it):
        # those travel with the block, so a spill costs no pass over the data.
        sums = self.sums.sums if self.sums is not None else None
        for i, (k, b) in enumerate(zip(ks, bs)):
            api.pack_header(self._header(half, i), self.fp, k, [p[b] for p in self.planes],
                            self.algo, None if sums is None else sums[b])

    # --- loop -----------------------------------------------------------------------------
    def run(self, stop: threading.Event) -> None:
        """Rounds until ``stop`` is set or the segment is removed."""
        name = self.seg.name
        try:
            bell = self.area.bell()
        except SegmentNotFoundError:
            log.info("segment %r was removed; the mover exits", name)
            return
        while not stop.is_set():
            if self.step():
                continue
            if self.seg.removed():  # (a segment created since under its name has its own)
                log.info("segment %r was removed; the mover exits", name)
                return
            wait = max(0.0, self._next_events - time.monotonic()) if self.spill else 0.05
            bell.wait(min(wait, _IDLE_EVENTS_S), self._woken)  # a signal ends it early

    def _woken(self) -> bool:
        return self.area.pending() or self.area.kicked()

    def close(self) -> None:
        self._pool.shutdown()
        self.area.set_state("stopped")
        self.area.skip_all()
        try:
            if self.link.close():  # else a connect in flight closes what it opened
                self.tier.close()
        finally:
            self.mgr.shutdown()
            self._hview.release()
            self.area.close()

