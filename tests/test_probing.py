"""The key index's compiled loops make exactly the Python loops' slots, and neither loops
forever on a damaged index; a host without a compiler keeps the Python loops.

The library is built once per test session (conftest's ``pytest_configure``), so the unit
tests here start no process; the fallback is tested in a child process with its own cache.
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshm.shm import probing
from kvshm.shm.probing import EMPTY

needs_native = pytest.mark.skipif(not probing.load(), reason="no C compiler on this host")
MASK = 31  # 32 slots, at most 16 used: clusters and wrap-arounds are the rule


def fresh() -> np.ndarray:
    return np.full(MASK + 1, EMPTY, np.uint64)


def both(q_c: np.ndarray, q_py: np.ndarray, op: str, tags: list[int], blocks: list[int]):
    """``op`` through the compiled loops on ``q_c`` and the Python ones on ``q_py``."""
    getattr(probing, op)(q_c.data, q_c.ctypes.data, MASK, tags, blocks)
    getattr(probing, op + "_py")(q_py.data, MASK, tags, blocks)


# A run of batches: each inserts new blocks (a tag each) or removes some present and some
# absent ones, as the owner's stores and evictions do.
runs = st.lists(st.tuples(st.booleans(), st.lists(st.integers(0, 2**32 - 1), min_size=1,
                                                   max_size=6), st.integers(0, 2**16)),
                min_size=1, max_size=40)


@needs_native
@settings(max_examples=300, deadline=None)
@given(runs)
def test_compiled_loops_leave_the_slots_the_python_loops_leave(run):
    q_c, q_py = fresh(), fresh()
    present: dict[int, int] = {}  # block -> tag
    next_block = 0
    for is_insert, tags, seed in run:
        rng = np.random.default_rng(seed)
        if is_insert:
            tags = tags[:16 - len(present)]
            blocks = list(range(next_block, next_block + len(tags)))
            next_block += len(tags)
            present.update(zip(blocks, tags))
        else:
            chosen = [b for b in present if rng.random() < 0.5]
            blocks = chosen + [next_block + 7]  # and one absent
            tags = [present.pop(b) for b in chosen] + [tags[0]]
        both(q_c, q_py, "insert" if is_insert else "remove", tags, blocks)
        np.testing.assert_array_equal(q_c, q_py)


@needs_native
def test_every_remaining_key_is_found_from_its_home_after_removals():
    q = fresh()
    tags = [3 + 32 * i for i in range(10)] + [31, 63]  # one cluster from 3, one wrapping
    blocks = list(range(len(tags)))
    probing.insert(q.data, q.ctypes.data, MASK, tags, blocks)
    probing.remove(q.data, q.ctypes.data, MASK, tags[::3], blocks[::3])
    for tag, block in zip(tags, blocks):
        i, seen = tag & MASK, []
        while q[i] < EMPTY:
            seen.append(int(q[i]) >> 32)
            i = (i + 1) & MASK
        assert (block in seen) == (block % 3 != 0)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_an_insert_of_a_negative_block_raises_before_any_slot_changes(compiled):
    if compiled and not probing.load():
        pytest.skip("no C compiler on this host")
    q = fresh()
    op = probing.insert if compiled else (lambda q, a, m, t, b: probing.insert_py(q, m, t, b))
    with pytest.raises(ValueError):
        op(q.data, q.ctypes.data, MASK, [1, 2], [0, -1])
    assert (q == EMPTY).all()


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_a_full_index_fails_an_insert_and_ends_a_removal_instead_of_looping(compiled):
    if compiled and not probing.load():
        pytest.skip("no C compiler on this host")
    q = np.array([i | i << 32 for i in range(MASK + 1)], np.uint64)  # damaged: no empty slot
    before = q.copy()
    if compiled:
        ins, rem = probing.insert, probing.remove
    else:
        def ins(q, a, m, t, b):
            probing.insert_py(q, m, t, b)

        def rem(q, a, m, t, b):
            probing.remove_py(q, m, t, b)
    with pytest.raises(RuntimeError, match="no empty slot"):
        ins(q.data, q.ctypes.data, MASK, [5], [99])
    rem(q.data, q.ctypes.data, MASK, [5], [99])  # absent: nothing
    np.testing.assert_array_equal(q, before)
    rem(q.data, q.ctypes.data, MASK, [5], [5])  # present: its slot empties, the rest shift
    assert (q == EMPTY).sum() == 1


def test_tags_and_blocks_of_different_lengths_are_refused():
    q = fresh()
    for op in (probing.insert, probing.remove):
        with pytest.raises(ValueError, match="2 blocks with 1 tags"):
            op(q.data, q.ctypes.data, MASK, [1], [0, 1])
    assert (q == EMPTY).all()


CHILD = """
import sys
from kvshm.owner.manager import LocalManager
from kvshm.shm import probing
from kvshm.shm.segment import Segment
from conftest import SMALL_GEOMETRY, TEST_BLOCKS, TEST_LAYOUT
seg = Segment.create(sys.argv[1], TEST_LAYOUT, TEST_BLOCKS, **SMALL_GEOMETRY)
try:
    mgr = LocalManager(seg)
    print("compiled", probing.LIBRARY.fns is not None)
    keys = [b"key-%d" % i for i in range(3 * TEST_BLOCKS)]
    for i in range(0, len(keys), 4):  # three times the cache: evictions all along
        mgr.prepare_store(keys[i:i + 4])
        mgr.complete_store(keys[i:i + 4])
    cached = [k for k in keys if mgr.lookup([k]) == 1]
    print("cached", len(cached), cached == keys[-len(cached):])
    mgr.shutdown()
finally:
    seg.close()
    Segment.unlink(sys.argv[1])
"""


@pytest.mark.procs
def test_a_manager_on_a_host_without_a_compiler_indexes_with_the_python_loops(tmp_path):
    from conftest import TEST_BLOCKS, unique_name
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "CC": "false",
           "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    out = subprocess.run([sys.executable, "-c", CHILD, unique_name()], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[:2] == [
        "compiled False", f"cached {TEST_BLOCKS} True"]



@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
@pytest.mark.parametrize("kind", ["list", "int64", "int32"])
def test_ids_as_numpy_arrays_or_numpy_ints_index_as_python_ints_do(compiled, kind,
                                                                     monkeypatch):
    if compiled and not probing.load():
        pytest.skip("no C compiler on this host")
    if not compiled:
        monkeypatch.setattr(probing.LIBRARY, "fns", None)
    tags, blocks = [7, 39], [5, 6]
    if kind != "list":
        dtype = np.int64 if kind == "int64" else np.int32
        tags, blocks = np.array(tags, np.uint32), np.array(blocks, dtype)
    q = fresh()
    probing.insert(q.data, q.ctypes.data, MASK, tags, blocks)
    assert [int(v) >> 32 for v in q[[7, 8]]] == [5, 6]
    probing.remove(q.data, q.ctypes.data, MASK, tags[:1], blocks[:1])
    assert [int(v) >> 32 for v in q[[7, 8]]] == [6, 0xFFFFFFFF]
    probing.insert(q.data, q.ctypes.data, MASK, tags[:0], blocks[:0])  # nothing


# --- the order of the stores, which lock-free readers see one by one ----------------------
PUT = """static inline void put(uint64_t *q, uint64_t i, uint64_t v) {
    __atomic_store_n(&q[i], v, __ATOMIC_RELEASE);
}"""
LOGGED_PUT = """static uint64_t LOG[2 * 4096]; static int64_t NLOG;
static inline void put(uint64_t *q, uint64_t i, uint64_t v) {
    if (NLOG < 4096) { LOG[2 * NLOG] = i; LOG[2 * NLOG + 1] = v; NLOG++; }
    __atomic_store_n(&q[i], v, __ATOMIC_RELEASE);
}
int64_t kvshm_log_take(uint64_t *out) {
    int64_t n = NLOG;
    for (int64_t k = 0; k < 2 * n; k++) out[k] = LOG[k];
    NLOG = 0;
    return n;
}"""


class Recorded:
    """Slots whose every store is recorded, for the Python loops."""

    def __init__(self, q: np.ndarray):
        self.q, self.stores = q, []

    def __getitem__(self, i: int) -> int:
        return int(self.q[i])

    def __setitem__(self, i: int, v: int) -> None:
        self.stores.append((i, v))
        self.q[i] = v


@pytest.mark.procs  # (builds a variant of the library: starts the compiler)
@pytest.mark.skipif(not probing.load(), reason="no C compiler on this host")
def test_compiled_loops_make_the_python_loops_stores_in_the_same_order(tmp_path, monkeypatch):
    """Readers in other processes see the slots between stores, and an owner killed between
    two leaves what a takeover repairs: equal end states are not enough, every intermediate
    state must be one the Python loops also show (an entry copied before its slot empties)."""
    import ctypes

    from kvshm.shm.native import CLibrary
    assert probing._SOURCE.count(PUT) == 1
    sig = probing._SIGNATURE
    logged = CLibrary("index-logged", "logged loops", probing._SOURCE.replace(PUT, LOGGED_PUT),
                      {"kvshm_index_insert": sig, "kvshm_index_remove": sig,
                       "kvshm_log_take": (ctypes.c_int64, [ctypes.c_void_p])},
                      lambda fns: True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert logged.load()
    assert logged.fns is not None
    monkeypatch.setattr(probing.LIBRARY, "fns", logged.fns)
    out = np.zeros(2 * 4096, np.uint64)
    rng = np.random.default_rng(7)
    for _ in range(300):
        q_c, q_py = fresh(), fresh()
        present: dict[int, int] = {}
        for step in range(30):
            if rng.random() < 0.5 and len(present) < 16:
                blocks = [100 * step + i for i in range(rng.integers(1, 17 - len(present)))]
                tags = rng.integers(0, 2**32, len(blocks)).tolist()
                present.update(zip(blocks, tags))
                op, op_py = probing.insert, probing.insert_py
            else:
                blocks = [b for b in present if rng.random() < 0.5]
                tags = [present.pop(b) for b in blocks]
                op, op_py = probing.remove, probing.remove_py
            op(q_c.data, q_c.ctypes.data, MASK, tags, blocks)
            n = logged.fns["kvshm_log_take"](out.ctypes.data)
            rec = Recorded(q_py)
            op_py(rec, MASK, tags, blocks)
            assert list(zip(out[0:2 * n:2].tolist(), out[1:2 * n:2].tolist())) == rec.stores


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "python"])
def test_a_removal_of_a_negative_block_removes_nothing(compiled, monkeypatch):
    """Even from a damaged index whose slots name blocks past 2**31 (a negative id read as
    u32 would match one)."""
    if compiled and not probing.load():
        pytest.skip("no C compiler on this host")
    if not compiled:
        monkeypatch.setattr(probing.LIBRARY, "fns", None)
    q = fresh()
    q[5] = 5 | 0xFFFFFFFE << 32
    before = q.copy()
    probing.remove(q.data, q.ctypes.data, MASK, [5], [-2])
    np.testing.assert_array_equal(q, before)
