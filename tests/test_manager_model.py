"""Model-based test of LocalManager: random operation sequences against a simple reference
model, with the invariants checked after every step.

The model tracks, per key: absent / writing (and by which writer) / ready, its block id, and
its load pins. After every step: the block table and key index (read through a SEPARATE
attach) agree with the model, no block is both free and in use, pinned and writing keys are
still cached, and the cache never holds more keys than blocks. For LRU the exact victims are
predicted too; for ARC only their legitimacy (the policy's order is tested in test_policy).
"""
from __future__ import annotations

import uuid
import zlib
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (RuleBasedStateMachine, invariant, precondition, rule,
                                 run_state_machine_as_test)

from kvshm.shm import layout as L
from kvshm.index.api import LookupResult, OffloadingEvent
from kvshm.errors import BlockStateError, UnknownKeyError
from kvshm.shm.layout import Layout
from kvshm.owner.manager import LOCAL_WRITER, LocalManager
from kvshm.shm.segment import Segment
from kvshm.shm.keyindex import KeyIndex
from kvshm.shm.table import BlockTable

NUM_BLOCKS = 8
# Chosen so that their home slots in the 16-slot key index collide (4 keys at slot 15, 3 at
# slot 0 — probing wraps around —, 3 at 7, 2 at 8): probing and backward-shift deletion get
# exercised, not just direct hits. test_key_alphabet_collides_in_the_index guards this.
KEYS = [b"k015", b"k022", b"k043", b"k074", b"k010", b"k027", b"k038", b"k001", b"k029",
        b"k036", b"k004", b"k033"]
KEY_HOMES = {15: 4, 0: 3, 7: 3, 8: 2}
KEY_ARRAY = np.frombuffer(b"".join(KEYS), np.uint8).reshape(len(KEYS), -1)
LAYOUT = Layout((64,), 16, "model-test")
WRITERS = [LOCAL_WRITER, (1, 1, 7), (2, 5, 9)]
SETTINGS = settings(max_examples=50, stateful_step_count=40, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])

key_lists = st.lists(st.sampled_from(KEYS), max_size=5)
store_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=6)
writers = st.sampled_from(WRITERS)


class ManagerMachine(RuleBasedStateMachine):
    POLICY = "lru"
    PREFIX = "kvshm-model"

    def __init__(self) -> None:
        super().__init__()
        self.name = f"{self.PREFIX}-{uuid.uuid4().hex[:8]}"
        self.seg = Segment.create(self.name, LAYOUT, NUM_BLOCKS, max_clients=1,
                                  ring_capacity=4096, hold_capacity=16, policy=self.POLICY)
        try:
            self.m = LocalManager(self.seg, self.POLICY, enable_events=True)
            self.obs = Segment.attach(self.name, LAYOUT)
            self.table = BlockTable(self.obs.buf, self.obs.geometry)
            self.index = KeyIndex(self.obs.buf, self.obs.geometry, self.table)
        except BaseException:  # teardown() only runs for a machine that was built
            self.seg.close()
            Segment.unlink(self.name)
            raise
        # the model
        self.state: dict[bytes, str] = {}  # "writing" | "ready"
        self.writer: dict[bytes, tuple[int, int]] = {}  # writing key -> (slot, gen)
        self.block: dict[bytes, int] = {}
        self.pins: dict[bytes, int] = {}
        self.order: OrderedDict[bytes, None] | None = OrderedDict()  # LRU first; None: unknown

    def teardown(self) -> None:
        try:
            self.m.shutdown()
            self.table.close()
            self.obs.close()
            self.seg.close()
        finally:
            Segment.unlink(self.name)

    # --- helpers ----------------------------------------------------------------------
    def ready(self) -> list[bytes]:
        return [k for k, s in self.state.items() if s == "ready"]

    def writing(self) -> list[bytes]:
        return [k for k, s in self.state.items() if s == "writing"]

    def pinned(self) -> list[bytes]:
        return [k for k, n in self.pins.items() if n]

    def forget(self, key: bytes) -> None:
        del self.state[key]
        del self.block[key]
        self.writer.pop(key, None)
        self.pins.pop(key, None)
        if self.order is not None:
            del self.order[key]

    def expect_no_events(self) -> None:
        assert list(self.m.take_events()) == []

    # --- loads ------------------------------------------------------------------------
    @rule(keys=key_lists)
    def lookup(self, keys):
        n = 0
        for k in keys:
            if self.state.get(k) != "ready":
                break
            n += 1
        assert self.m.lookup(keys) == n

    def _prepare_load(self, keys):
        bad = next((k for k in keys if self.state.get(k) != "ready"), None)
        if bad is None:
            assert self.m.prepare_load(keys) == [self.block[k] for k in keys]
            for k in keys:
                self.pins[k] = self.pins.get(k, 0) + 1
        else:
            err = UnknownKeyError if bad not in self.state else BlockStateError
            with pytest.raises(err):
                self.m.prepare_load(keys)

    @rule(keys=key_lists)
    def prepare_load_any(self, keys):
        self._prepare_load(keys)

    @precondition(lambda self: self.ready())
    @rule(data=st.data())
    def prepare_load_ready(self, data):
        self._prepare_load(data.draw(st.lists(st.sampled_from(self.ready()), min_size=1,
                                              max_size=4)))

    def _complete_load(self, keys):
        need: dict[bytes, int] = {}
        err = None
        for k in keys:
            if k not in self.state:
                err = UnknownKeyError
                break
            need[k] = need.get(k, 0) + 1
            if self.pins.get(k, 0) < need[k]:
                err = BlockStateError
                break
        if err is not None:
            with pytest.raises(err):
                self.m.complete_load(keys)
            return
        self.m.complete_load(keys)
        for k, n in need.items():
            self.pins[k] -= n
            if not self.pins[k]:
                del self.pins[k]

    @rule(keys=key_lists)
    def complete_load_any(self, keys):
        self._complete_load(keys)

    @precondition(lambda self: self.pinned())
    @rule(data=st.data())
    def complete_load_pinned(self, data):
        self._complete_load(data.draw(st.lists(st.sampled_from(self.pinned()), min_size=1,
                                               max_size=3)))

    @rule(keys=key_lists)
    def touch(self, keys):
        self.m.touch(keys)
        if self.order is not None:
            for k in reversed(keys):
                if k in self.state:
                    self.order.move_to_end(k)

    # --- stores -----------------------------------------------------------------------
    @rule(keys=store_lists, writer=writers)
    def prepare_store(self, keys, writer):
        self._prepare_store(keys, writer)

    @rule(keys=store_lists)
    def store(self, keys):
        """prepare_store + successful complete_store of what it allocated (the common path)."""
        out = self._prepare_store(keys, LOCAL_WRITER)
        if out is not None:
            self._complete_store(out.keys_to_store, True, LOCAL_WRITER)

    def _prepare_store(self, keys, writer):
        new = list(dict.fromkeys(k for k in keys if k not in self.state))
        need = len(new) - (NUM_BLOCKS - len(self.state))
        evictable = [k for k in (self.order or self.state)
                     if self.state[k] == "ready" and not self.pins.get(k) and k not in keys]
        before_blocks = set(self.block.values())
        out = self.m.prepare_store(keys, writer)
        if need > len(evictable):
            event("prepare_store refused")
            assert out is None
            self.expect_no_events()
            return None
        assert out is not None
        assert out.keys_to_store == new
        assert len(out.block_ids) == len(new) == len(set(out.block_ids))
        if need > 0:
            event("prepare_store evicted")
            assert len(out.evicted_keys) == len(set(out.evicted_keys)) == need
            assert set(out.evicted_keys) <= set(evictable)
            if self.order is not None and self.POLICY == "lru":
                assert out.evicted_keys == evictable[:need]
            freed = {self.block[k] for k in out.evicted_keys}
            assert list(self.m.take_events()) == [OffloadingEvent(out.evicted_keys, True)]
        else:
            assert out.evicted_keys == []
            freed = set()
            self.expect_no_events()
        assert not set(out.block_ids) & (before_blocks - freed)  # no block handed out twice
        for k in out.evicted_keys:
            self.forget(k)
        for k, b in zip(new, out.block_ids):
            self.state[k] = "writing"
            self.writer[k] = writer[:2]
            self.block[k] = b
            if self.order is not None:
                self.order[k] = None
        return out

    def _complete_store(self, keys, success, writer):
        """The writer's own stores among ``keys`` complete; the first unknown key or store
        of another writer is then raised (a lost key must not strand the rest)."""
        err = None
        for k in keys:
            if k not in self.state:
                err = err or UnknownKeyError
            elif self.state[k] == "writing" and self.writer[k] != writer[:2]:
                err = err or BlockStateError
        todo = list(dict.fromkeys(k for k in keys if self.state.get(k) == "writing"
                                  and self.writer[k] == writer[:2]))
        if err is not None:
            event(f"complete_store {err.__name__}")
            with pytest.raises(err):
                self.m.complete_store(keys, success, writer)
        else:
            self.m.complete_store(keys, success, writer)
        for k in todo:
            if success:
                self.state[k] = "ready"
                del self.writer[k]
            else:
                self.forget(k)
        if success and todo:
            assert list(self.m.take_events()) == [OffloadingEvent(todo, False)]
        else:
            self.expect_no_events()

    @rule(keys=key_lists, success=st.booleans(), writer=writers)
    def complete_store_any(self, keys, success, writer):
        self._complete_store(keys, success, writer)

    @precondition(lambda self: self.writing())
    @rule(data=st.data(), success=st.booleans())
    def complete_store_writing(self, data, success):
        first = data.draw(st.sampled_from(self.writing()))
        slot, gen = self.writer[first]
        writer = next(w for w in WRITERS if w[:2] == (slot, gen))
        keys = [first] + data.draw(st.lists(st.sampled_from(list(self.state)), max_size=3))
        self._complete_store(keys, success, writer)

    @rule(writer=st.sampled_from(WRITERS[1:]))
    def reclaim_writer(self, writer):
        mine = [k for k, w in self.writer.items() if w == writer[:2]]
        assert self.m.reclaim_writer(*writer[:2]) == len(mine)
        for k in mine:
            self.forget(k)
        self.expect_no_events()

    @rule()
    def restart_owner(self):
        """The owner goes away and a new one rebuilds from the table: ready blocks stay,
        unfinished stores are freed, pins (held by clients elsewhere) are forgotten."""
        self.m.shutdown()
        self.m = LocalManager(self.seg, self.POLICY, enable_events=True)
        assert self.m.recovered["ready"] == len(self.ready())
        assert self.m.recovered["freed"] == len(self.writing())
        for k in self.writing():
            self.forget(k)
        self.pins.clear()
        self.order = None  # rebuild orders by the table's last-use ticks: not modelled

    # --- invariants -------------------------------------------------------------------
    @invariant()
    def manager_agrees_with_model(self):
        status = {None: LookupResult.MISS, "writing": LookupResult.PENDING,
                  "ready": LookupResult.HIT}
        for k in KEYS:
            assert self.m.key_status(k) is status[self.state.get(k)], k
            assert self.m.block_of(k) == self.block.get(k)
        assert len(self.m) == len(self.state) <= NUM_BLOCKS
        assert self.m.num_free == NUM_BLOCKS - len(self.state)

    @invariant()
    def no_block_both_free_and_in_use(self):
        free = list(self.m.entries.free)
        used = [e.block for e in self.m.entries.by_key.values()]
        assert len(set(free)) == len(free)
        assert len(set(used)) == len(used)
        assert not set(free) & set(used)
        assert set(free) | set(used) == set(range(NUM_BLOCKS))

    @invariant()
    def writer_index_matches_the_entries(self):
        entries = self.m.entries.by_key
        by_writer = {(w, k) for w, ks in self.m.entries.pending.items() for k in ks}
        assert by_writer == {(e.writer, k) for k, e in entries.items() if e.writer is not None}
        assert all(e.ready == (e.writer is None) for e in entries.values())
        assert all(not e.pins or e.ready for e in entries.values())

    @invariant()
    def pinned_and_writing_keys_are_cached(self):
        for k in self.pinned():
            assert self.state.get(k) == "ready"
            assert self.m.key_status(k) is LookupResult.HIT
        for k in self.writing():
            assert self.m.key_status(k) is LookupResult.PENDING

    @invariant()
    def table_agrees_with_model(self):
        owner_of = {b: k for k, b in self.block.items()}
        states = {"writing": L.WRITING, "ready": L.READY}
        for b in range(NUM_BLOCKS):
            e = self.table.read(b)
            k = owner_of.get(b)
            if k is None:
                assert (e.state, e.key) == (L.FREE, b""), (b, e)
                continue
            assert (e.state, e.key) == (states[self.state[k]], k), (b, e)
            assert e.pins == self.pins.get(k, 0)
            if self.state[k] == "writing":
                assert (e.writer, e.writer_gen) == self.writer[k]
            else:
                assert e.writer == -1
        for k in KEYS:
            if k in self.state:
                assert self.index.find(k) == (self.block[k], states[self.state[k]])
            else:
                assert self.index.find(k) == (-1, -1)
        if hasattr(self.index, "find_prefix"):  # the clients' vectorised prefix lookup
            for keys in (KEYS, KEYS[::-1], [k for k in KEYS if k in self.state]):
                blocks, found = self.index.find_prefix(keys, KEY_ARRAY[[KEYS.index(k)
                                                                        for k in keys]])
                for k, b, st_ in zip(keys, blocks.tolist(), found.tolist()):
                    if k not in self.state:
                        assert st_ == -1, k
                        break  # a prefix lookup stops at its first miss
                    assert (b, st_) == (self.block[k], states[self.state[k]]), k


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_manager_matches_reference_model(policy, seg_prefix):
    machine = type(f"ManagerMachine_{policy}", (ManagerMachine,),
                   {"POLICY": policy, "PREFIX": seg_prefix})
    run_state_machine_as_test(machine, settings=SETTINGS)


def test_key_alphabet_collides_in_the_index():
    slots = L.Geometry(NUM_BLOCKS, LAYOUT.page_bytes, 1, 4096, 16).index_slots
    homes: dict[int, int] = {}
    for k in KEYS:
        h = zlib.crc32(k) & (slots - 1)
        homes[h] = homes.get(h, 0) + 1
    assert homes == KEY_HOMES
