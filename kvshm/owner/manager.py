"""The authoritative index of one segment: ``LocalManager``.

This module applies vLLM's v1 offload semantics (lookups, loads, stores, touches, events) to
the index it composes, each part owning its state: ``Entries`` (keys, blocks, free list,
unfinished stores, mirrored into the segment's block table and key index), the eviction
``policy`` and the ``Evictor``, the blocks ``Grants`` hand clients ahead of their stores,
``RunningRanks`` of running requests, and ``Outcomes`` (events and counters). It rebuilds the
index from the table when it takes a segment over (``rebuild.py``). Exactly one
LocalManager exists per segment: it holds the segment's owner lock. The owner process wraps
it; single-process users may use it directly. It never copies block data.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

from kvshm.errors import (
    BlockStateError,
    InvalidArgumentError,
    KvshmError,
    OwnerUnavailableError,
    UnknownKeyError,
)
from kvshm.index.access import ACCESS_KINDS, MISSED, RANKED
from kvshm.index.api import (
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    Running,
)
from kvshm.owner.entries import Client, Entries
from kvshm.owner.eviction import Evictor, Held
from kvshm.owner.grants import Grants
from kvshm.owner.outcomes import Outcomes
from kvshm.owner.policy import make_policy
from kvshm.owner.quotas import Quotas
from kvshm.owner.rebuild import rebuild
from kvshm.owner.running import RunningRanks
from kvshm.shm import keys as K
from kvshm.shm import layout as L
from kvshm.shm import locks, probing, rounds, writers
from kvshm.shm.keyindex import KeyIndex
from kvshm.shm.records import next_epoch
from kvshm.shm.segment import Segment
from kvshm.shm.table import BlockTable

Writer = tuple[int, int, int]  # (client slot, client generation, request id)
LOCAL_WRITER: Writer = (-1, 0, 0)


def build_loops() -> None:
    """The index's and the table's loops compiled (built once per host, else Python). Call
    it before taking the owner lock: a build can take seconds, or hang until its limit."""
    probing.load()
    rounds.load()


class LocalManager(OffloadingManager):
    """In-process manager over a segment. Thread-unsafe: one caller (the owner loop).

    ``held(requester_slot)`` returns the blocks that clients hold against a store of that
    requester (leases and pins live in the clients' slots); those are never evicted.
    ``writer_alive`` decides, in a rebuild, whether a half-finished store's client lives;
    a process registered to copy for it (``kvshm.shm.writers``) keeps it too, whoever
    rebuilds (an owner, or ``kvshm-inspect gc``).
    """

    def __init__(self, segment: Segment, policy: str | None = None, *,
                 enable_events: bool = False, held: Held | None = None,
                 writer_alive: Callable[[int, int], bool] | None = None):
        build_loops()  # before the lock: a would-be owner whose build hangs, or that is
        #                stopped in it, holds no segment meanwhile
        if not locks.try_lock(segment.fd, L.LOCK_OWNER):
            raise OwnerUnavailableError(
                f"segment {segment.name!r} already has an owner (pid "
                f"{segment.owner_record()[0]}); use kvshm.connect() to share it")
        self.segment = segment
        self.table = BlockTable(segment.buf, segment.geometry)
        self.index = KeyIndex(segment.buf, segment.geometry, self.table)
        self.policy = make_policy(policy or segment.policy, segment.geometry.num_blocks)
        pid, epoch, _, tick = segment.owner_record()
        self.epoch = next_epoch(epoch)
        self.entries = Entries(self.policy, self.table, self.index, tick)
        self.outcomes = Outcomes(segment, enable_events)
        self.quotas = Quotas(self.entries, segment.geometry.num_blocks)
        self.evictor = Evictor(self.entries, self.outcomes, held, self.quotas)
        self.running = RunningRanks(self.policy)  # provisional ranks of running requests
        self.grants = Grants(self.entries, self.evictor, self.running, self.outcomes, segment)
        # Dead writers (slot, gen) whose stores wait for their registered copying processes.
        self.quarantined: set[Client] = set()
        client_alive = writer_alive or (lambda slot, gen: False)
        self.recovered = rebuild(self.entries, self.grants, lambda slot, gen: client_alive(
            slot, gen) or writers.alive(segment, slot, gen))
        segment.write_owner_record(os.getpid(), self.epoch, time.time_ns(), self.entries.tick)
        if pid:  # the last owner died holding the segment (a clean exit writes pid 0)
            segment.counter_add("failovers")

    @property
    def tick(self) -> int:
        """The eviction clock (saved in the owner record for the next owner)."""
        return self.entries.tick

    # --- reads --------------------------------------------------------------------------
    def lookup(self, keys: Sequence[bytes]) -> int:
        """See ``OffloadingManager.lookup``. Bad input is refused with InvalidArgumentError
        (``keys.key_seq``/``check_key``): items are checked where lookup examines them
        (the first miss, anything unhashable), so a list of bytes costs no extra pass."""
        if type(keys) is not list and type(keys) is not tuple:
            keys = K.key_seq(keys)
        n, entries = 0, self.entries.by_key
        try:
            for k in keys:
                e = entries.get(k)
                if e is None or not e.ready:
                    break
                n += 1
        except TypeError:  # an unhashable item (bytearray, list): refuse it by name
            for k in keys:
                K.check_key(k)
            raise
        if n < len(keys):
            K.check_key(keys[n])  # a str/int/None item is a caller's mistake, not a miss
        return n

    def key_status(self, key: bytes) -> LookupResult:
        if type(key) is not bytes:
            K.check_key(key)
        e = self.entries.get(key)
        return LookupResult.MISS if e is None else \
            LookupResult.HIT if e.ready else LookupResult.PENDING

    def block_of(self, key: bytes) -> int | None:
        e = self.entries.get(key)
        return None if e is None else e.block

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def num_free(self) -> int:
        return len(self.entries.free)

    # --- loads --------------------------------------------------------------------------
    def prepare_load(self, keys: Sequence[bytes]) -> list[int]:
        if type(keys) is not list and type(keys) is not tuple:
            keys = K.key_seq(keys)
        for k in keys:
            K.check_key(k)
        entries = [self.entries.require_ready(k) for k in keys]
        for e in entries:
            e.pins += 1
            self.table.set_pins(e.block, e.pins)
        return [e.block for e in entries]

    def complete_load(self, keys: Sequence[bytes]) -> None:
        if type(keys) is not list and type(keys) is not tuple:
            keys = K.key_seq(keys)
        need: dict[bytes, int] = {}
        for k in keys:
            K.check_key(k)
            e = self.entries.get(k)
            if e is None:
                raise UnknownKeyError(f"complete_load of key {k.hex()[:16]}… which is not cached")
            need[k] = need.get(k, 0) + 1
            if e.pins < need[k]:
                raise BlockStateError(
                    f"complete_load of key {k.hex()[:16]}… without a matching prepare_load")
        for k, n in need.items():
            e = self.entries.by_key[k]
            e.pins -= n
            self.table.set_pins(e.block, e.pins)

    def touch(self, keys: Sequence[bytes], how: bytes | None = None, *,
              running: Running | None = None, client: tuple[int, int] = LOCAL_WRITER[:2]
              ) -> None:
        if type(keys) is not list and type(keys) is not tuple:
            keys = K.key_seq(keys)
        K.check_keys(keys)
        if how is not None and (len(how) != len(keys) or any(h not in ACCESS_KINDS for h in how)):
            raise InvalidArgumentError("touch: 'how' needs one access kind per key")
        rank_of = self.running.rank_of(running, client)
        if rank_of is not None and how is not None and RANKED in how:
            rank_of(None)  # vLLM: a request takes its rank at its first access, cached or not
        tick = self.entries.tick = self.entries.tick + 1
        entries = self.entries.by_key
        if how is None:  # last to first: the prefix head ends up most recent
            found = [(k, e) for k in keys[::-1] if (e := entries.get(k)) is not None]
            self.policy.touch_many([k for k, _ in found], [e.ready for _, e in found])
            self.table.set_last_uses([e.block for _, e in found], tick)
        else:
            used = []
            for i in range(len(keys) - 1, -1, -1):
                k, h = keys[i], how[i]
                self.policy.access(k, h, rank_of(k) if h == RANKED and rank_of else None)
                e = entries.get(k)  # a store miss (ghost) has no entry
                if e is not None and h < MISSED:
                    used.append(e.block)
            self.table.set_last_uses(used, tick)
        self.running.end(running, client)

    # --- stores -------------------------------------------------------------------------
    def prepare_store(self, keys: Sequence[bytes], writer: Writer = LOCAL_WRITER, *,
                      running: Running | None = None) -> PrepareStoreOutput | None:
        if type(keys) is not list and type(keys) is not tuple:
            keys = K.key_seq(keys)
        K.check_keys(keys)
        if not 0 <= writer[2] < 2**64:  # checked before anything changes (entry: u64)
            raise InvalidArgumentError(f"request id {writer[2]} is outside 0..2**64-1")
        rank_of = self.running.rank_of(running and running.for_store(), writer[:2])
        entries = self.entries
        new = list(dict.fromkeys(k for k in keys if k not in entries))
        need = len(new) - len(entries.free)
        evicted: list[bytes] = []
        if need > 0:
            victims = self.evictor.evict(need, set(keys), writer[0], writer[:2])
            if victims is None:
                self.segment.counter_add("prepare_store_refused")
                return None
            evicted = victims
        entries.tick += 1
        slot, gen, req = writer
        blocks = entries.take_free(len(new))
        self.table.write_many(blocks, L.WRITING, new, slot, gen, req, entries.tick, tenant=slot,
                              tenant_gen=gen)
        entries.adopt_many(blocks, new, (slot, gen), rank_of)
        return PrepareStoreOutput(new, blocks, evicted)

    def pending_of(self, writer: Writer, request: int | None = None) -> list[tuple[bytes, int]]:
        """(key, block) of ``writer``'s unfinished stores, optionally of one request only."""
        out = []
        for k in self.entries.pending.get(writer[:2], ()):
            b = self.entries.by_key[k].block
            e = self.table.read(b) if request is not None else None
            # A torn read (only damage can cause one: we are the entry's only writer, and the
            # rebuild settled what a dead owner left) cannot name its request; the key is this
            # writer's either way, so granting it again to the same writer is harmless while
            # leaving it out would strand the store until the writer goes.
            if e is None or e.torn or e.writer_req == request:
                out.append((k, b))
        return out

    def complete_store(self, keys: Sequence[bytes], success: bool = True,
                       writer: Writer = LOCAL_WRITER, *, running: Running | None = None
                       ) -> None:
        """Publish (or free) this writer's stores of ``keys``; keys already ready are left.

        Keys that are unknown or belong to another writer do not hold back the others: the
        valid ones are applied first, then the first problem is raised, so one lost key
        never strands the rest of a batch in WRITING.
        """
        if type(keys) is not list and type(keys) is not tuple:
            keys = K.key_seq(keys)
        me = writer[:2]
        todo: list[bytes] = []
        problem: KvshmError | None = None
        K.check_keys(keys)
        if running is not None:
            running.for_store()  # (its ranks were applied by prepare_store)
        entries = self.entries
        for k in keys:
            e = entries.get(k)
            if e is None:
                problem = problem or UnknownKeyError(
                    f"complete_store of key {k.hex()[:16]}… which is not cached (never "
                    "prepared, or freed after its writer or the owner died)")
            elif not e.ready:
                if e.writer == me:
                    todo.append(k)
                else:
                    problem = problem or BlockStateError(
                        f"complete_store of key {k.hex()[:16]}… whose store belongs to "
                        "another writer")
        done, blocks = [], []
        if not success:
            self._drop(list(dict.fromkeys(todo)))
        for k in dict.fromkeys(todo) if success else ():
            e = entries.by_key[k]
            entries.unpend(k, e)
            e.ready = True
            done.append(k)
            blocks.append(e.block)
        self.table.publish_many(blocks, entries.tick, time.time_ns())
        for k in done if self.grants.deferred else ():
            self.grants.resolve(k)  # a completed grant store of k waited for this one
        self.outcomes.stored(done, success, len(todo))
        if problem is not None:
            raise problem

    def reclaim_writer(self, slot: int, gen: int) -> int:
        """Free every unfinished store of a writer that died. Returns the block count.

        Not while a process registered to copy for that writer generation lives (its late
        copy would land in whoever gets the blocks next): the stores are then quarantined,
        and a later call frees them once the last such process is gone.
        """
        w = (slot, gen)
        if w not in self.quarantined:  # a retry for a quarantined writer finds nothing
            self.running.drop_client(slot, gen)  # (a scan of every running request)
            self.quotas.drop(w)  # what it stored stays cached, nobody's to protect
        # Quarantine: keep the blocks while a registered copier of (slot, gen) lives
        held = len(self.entries.pending.get(w, ())) + len(self.grants.blocks.get(w, ()))
        alive = held and writers.alive(self.segment, slot, gen)
        if alive and w not in self.quarantined:  # (once: a dead claimer's offers stay put)
            held -= self.grants.end_unclaimed(w)  # never written into: ended now
        if alive and held:
            if w not in self.quarantined:
                self.quarantined.add(w)
                self.segment.counter_add("quarantined_blocks", held)
            return 0
        self.quarantined.discard(w)
        keys = list(self.entries.pending.get(w, ()))
        self._drop(keys)  # also takes them out of the writer index
        return len(keys) + self.grants.free(w)

    # The owner's periodic retry of quarantined (and rebuilt orphan) stores
    def reclaim_dead_writers(self, client_alive: Callable[[int, int], bool]) -> int:
        """``reclaim_writer`` for every pending writer whose client is gone: quarantined ones
        (known dead: their slot may serve a next client since), and those whose slot's
        ``client_alive`` says so (a rebuild kept them for a registered copier). Returns the
        blocks freed."""
        return sum(self.reclaim_writer(slot, gen)
                   for slot, gen in {*self.entries.pending, *self.grants.blocks}
                   if slot >= 0 and ((slot, gen) in self.quarantined
                                     or not client_alive(slot, gen)))

    def _drop(self, keys: list[bytes]) -> None:
        """Forget unfinished stores of ``keys`` (failed or reclaimed) and free their blocks;
        a completed store deferred behind one of them is resolved."""
        gone = self.entries.drop_many(keys)
        if self.grants.deferred:
            for k, e in zip(keys, gone):
                if not e.ready and k in self.grants.deferred:
                    self.grants.resolve(k)

    # --- events and shutdown ------------------------------------------------------------
    def take_events(self) -> list[OffloadingEvent]:
        return self.outcomes.take()

    def shutdown(self, dead_pid: int = 0) -> None:
        """Give up ownership; the table keeps the cache for the next owner. ``dead_pid``: an
        owner that died before us, left in the record for the next owner to count (a
        temporary owner such as ``kvshm-inspect gc`` is no failover). The record is written
        before the lock is given back: an owner starting after that writes its own."""
        if self.segment is None:
            return
        self.segment.write_owner_record(dead_pid, self.epoch, time.time_ns(), self.tick)
        locks.unlock(self.segment.fd, L.LOCK_OWNER)
        self.segment = None  # type: ignore[assignment]
