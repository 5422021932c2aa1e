"""The owner's batch writers leave the segment as the one-at-a-time writers would.

A store, a publish, an eviction or a touch of many keys is mirrored with the table's
``write_many``/``set_states``/``publish_many``/``set_last_uses`` and the LRU policy's
``insert_many``/``touch_many``. Each is checked against the scalar writer applied key by key
to a twin: the table byte for byte, the policy by its eviction order. The index must find
exactly the keys present after batches come and go, one key at a time or a batch at a time
(``insert_many``, ``remove_many``), and a cut down to some of them (``retain``) at every
step. Batches straddle ``VECTOR_MIN`` so both paths of each
writer run, and a tiny index makes collisions and wrap-around the rule.
"""
from __future__ import annotations

import contextlib
import struct
from itertools import count, islice
from typing import Iterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshm.owner.policy import LRUPolicy
from kvshm.shm import layout as L
from kvshm.shm.keyindex import KeyIndex, tags_of
from kvshm.shm.segment import Segment
from kvshm.shm.table import VECTOR_MIN, BlockTable

from conftest import SMALL_GEOMETRY, TEST_LAYOUT, unique_name

BLOCKS = 24  # a 64-slot index: keys of a batch often share a home slot or wrap around

# At most one key per block (the tests give each key a block of their own), still enough to
# straddle VECTOR_MIN.
assert VECTOR_MIN < BLOCKS
keys_st = st.lists(st.binary(min_size=1, max_size=L.MAX_KEY_BYTES), min_size=1,
                   max_size=BLOCKS, unique=True)


@contextlib.contextmanager
def twins() -> Iterator[tuple[tuple[BlockTable, KeyIndex], tuple[BlockTable, KeyIndex]]]:
    segs = [Segment.create(unique_name(), TEST_LAYOUT, BLOCKS, **SMALL_GEOMETRY)
            for _ in range(2)]
    views = []
    for s in segs:
        t = BlockTable(s.buf, s.geometry)
        views.append((t, KeyIndex(s.buf, s.geometry, t)))
    try:
        yield views[0], views[1]
    finally:
        for (t, _), s in zip(views, segs):
            t.close()
            s.close()
            Segment.unlink(s.name)


def _table_bytes(t: BlockTable) -> bytes:
    return bytes(t.buf[t.base:t.base + t.num_blocks * L.ENTRY_BYTES])


@settings(max_examples=60, deadline=None)
@given(keys=keys_st, state=st.sampled_from([L.FREE, L.WRITING, L.READY, L.GRANTED]),
       keyless=st.booleans(), writer=st.integers(-1, 200), gen=st.integers(0, 2**32 - 1),
       per_block_req=st.booleans(), req=st.integers(0, 2**64 - 1),
       last_use=st.integers(0, 2**64 - 1), stored_ns=st.integers(0, 2**64 - 1),
       tenant=st.integers(-1, 200), tenant_gen=st.integers(0, 2**32 - 1), data=st.data())
def test_write_many_stores_the_bytes_write_stores(keys, state, keyless, writer, gen,
                                                  per_block_req, req, last_use, stored_ns,
                                                  tenant, tenant_gen, data):
    blocks = data.draw(st.permutations(range(BLOCKS)))[:len(keys)]
    reqs = [(req + i) % 2**64 for i in range(len(keys))] if per_block_req else req
    with twins() as ((one, _), (many, _)):
        for t in (one, many):  # entries with something in them first: a rewrite must clear it
            t.write_many(range(BLOCKS), L.READY, [b"x" * L.MAX_KEY_BYTES] * BLOCKS, 3, 4, 5,
                         6, 7, tenant=8, tenant_gen=9)
        for i, b in enumerate(blocks):
            one.write(b, state, b"" if keyless else keys[i], writer, gen,
                      reqs[i] if per_block_req else req, last_use, stored_ns, tenant=tenant,
                      tenant_gen=tenant_gen)
        many.write_many(blocks, state, None if keyless else keys, writer, gen, reqs, last_use,
                        stored_ns, tenant=tenant, tenant_gen=tenant_gen)
        assert _table_bytes(many) == _table_bytes(one)
        assert all(many.read(b).key_ok for b in blocks)
        stored_by = (tenant, tenant_gen) if tenant >= 0 else None
        assert all(many.read(b).stored_by == stored_by for b in blocks)


@settings(max_examples=40, deadline=None)
@given(keys=keys_st, data=st.data())
def test_state_publish_and_last_use_batches_store_what_the_scalar_writers_store(keys, data):
    blocks = data.draw(st.permutations(range(BLOCKS)))[:len(keys)]
    with twins() as ((one, _), (many, _)):
        for t in (one, many):
            t.write_many(blocks, L.WRITING, keys, 2, 9, 11, 1)
        for b in blocks:
            one.set_state(b, L.EVICTING)
            one.publish(b, 77, 88)
            one.set_last_use(b, 99)
        many.set_states(blocks, L.EVICTING)
        many.publish_many(blocks, 77, 88)
        many.set_last_uses(blocks, 99)
        assert _table_bytes(many) == _table_bytes(one)


@settings(max_examples=80, deadline=None)
@given(batches=st.lists(st.tuples(keys_st, st.integers(0, 2**16)), min_size=1, max_size=6),
       data=st.data())
def test_the_index_finds_exactly_the_keys_present_after_batches_come_and_go(batches, data):
    with twins() as ((t, ix), _):
        present: dict[bytes, int] = {}
        for batch, _seed in batches:
            new = [k for k in batch if k not in present][:BLOCKS - len(present)]
            free = sorted(set(range(BLOCKS)) - set(present.values()))
            blocks = data.draw(st.permutations(free))[:len(new)]
            t.write_many(blocks, L.READY, new)  # the index verifies candidates against these
            if data.draw(st.booleans()):
                ix.insert_many(blocks, tags_of(new))
            else:
                for k, b in zip(new, blocks):
                    ix.insert(k, b)
            present.update(zip(new, blocks))
            gone = data.draw(st.lists(st.sampled_from(sorted(present)), unique=True)
                             if present else st.just([]))
            if data.draw(st.booleans()):
                ix.remove_many([present.pop(k) for k in gone], tags_of(gone))
            else:
                for k in gone:
                    ix.remove(k, present.pop(k))
            for k, b in present.items():
                assert ix.find(k) == (b, L.READY) and ix.probe(k) >= 0
            for k in gone:
                assert ix.find(k) == (-1, -1)
            used = ix._slots[:, 1] >= 0
            assert sorted(ix._slots[used, 1].tolist()) == sorted(present.values())


@settings(max_examples=80, deadline=None)
@given(keys=keys_st, data=st.data())
def test_cutting_the_index_down_keeps_every_kept_key_findable_at_every_step(keys, data):
    """A takeover cuts its predecessor's index down to the offers it keeps (``retain``):
    the next takeover reads them there, so a death at any step in between must leave each
    findable, and at the end the index holds those and nothing else."""
    with twins() as ((t, ix), _):
        blocks = data.draw(st.permutations(range(BLOCKS)))[:len(keys)]
        t.write_many(blocks, L.READY, keys)
        ix.insert_many(blocks, tags_of(keys))
        kept = data.draw(st.lists(st.sampled_from(range(len(keys))), unique=True))
        kept_keys, kept_blocks = [keys[i] for i in kept], [blocks[i] for i in kept]

        def each_kept_key_found() -> None:
            for k, b in zip(kept_keys, kept_blocks):
                assert ix.find(k) == (b, L.READY)

        delete = ix._delete_at
        ix._delete_at = lambda i: (delete(i), each_kept_key_found())
        ix.retain(kept_blocks, tags_of(kept_keys))
        each_kept_key_found()
        used = ix._slots[:, 1] >= 0
        assert sorted(ix._slots[used, 1].tolist()) == sorted(kept_blocks)


@settings(max_examples=60, deadline=None)
@given(stored=keys_st, touched=st.lists(st.integers(0, 4 * VECTOR_MIN), max_size=24))
def test_lru_batches_order_keys_as_one_by_one_inserts_and_touches_do(stored, touched):
    one, many = LRUPolicy(64), LRUPolicy(64)
    for k in stored:
        one.insert(k)
    many.insert_many(stored)
    keys = [stored[i % len(stored)] for i in touched] + [b"never-stored"]
    for k in keys:
        one.touch(k, True)
    many.touch_many(keys, [True] * len(keys))
    assert many.order() == one.order()
    assert many.evict(len(stored), lambda k: True) == one.evict(len(stored), lambda k: True)


def test_a_batch_with_a_bad_value_raises_before_any_entry_changes():
    with twins() as ((t, _), _):
        for n in (3, VECTOR_MIN + 3):  # both paths
            before = _table_bytes(t)
            reqs = [0] * (n - 1) + [2**64]  # the last one does not fit its field
            with pytest.raises((OverflowError, struct.error)):
                t.write_many(range(n), L.WRITING, [b"k%d" % i for i in range(n)], 1, 2, reqs)
            assert _table_bytes(t) == before


def test_cutting_the_index_down_leaves_one_slot_of_a_key_an_owner_died_moving():
    """An owner killed inside a backward shift leaves the entry it moved in two slots. A
    takeover that kept both left one naming the block after the key's removal, for a key
    it no longer holds: only the slot a probe reaches first stays."""
    with twins() as ((t, ix), _):
        moved, kept = _keys_with_home(ix, 5, 2)
        t.write_many([1, 2], L.READY, [moved, kept])
        ix.insert_many([1, 2], tags_of([moved, kept]))  # slots 5 and 6, both homed at 5
        q = ix._slot64
        q[5] = q[6]  # removing ``moved``: ``kept`` copied back, its old slot not yet emptied
        ix.retain([2], tags_of([kept]))
        assert ix._slots[:, 1].tolist().count(2) == 1 and ix.find(kept) == (2, L.READY)
        ix.remove(kept, 2)
        assert (ix._slots[:, 1] < 0).all()


def _keys_with_home(ix: KeyIndex, home: int, n: int) -> list[bytes]:
    """``n`` keys whose home slot in ``ix`` is ``home``."""
    keys = (b"k%d" % i for i in count())
    return list(islice((k for k in keys if tags_of([k])[0] & ix.mask == home), n))
