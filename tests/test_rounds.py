"""The block table's compiled write round makes exactly numpy's stores, and never one
outside the table.

The library is built once per test session (conftest's ``pytest_configure``).
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshm.shm import rounds

pytestmark = pytest.mark.skipif(not rounds.load(), reason="no C compiler on this host")
BLOCKS, STRIDE, OFF, SIZE = 12, 32, 8, 20


def numpy_round(table: np.ndarray, blocks: list[int], bodies: bytes) -> None:
    """What ``BlockTable`` does without the compiled loop: open, copy, close."""
    seqs = table[:, :4].view(np.uint32)[:, 0]
    b = np.asarray(blocks, np.intp)
    odd = seqs[b] | 1
    seqs[b] = odd
    table[b, OFF:OFF + SIZE] = np.frombuffer(bodies, np.uint8).reshape(len(b), SIZE)
    seqs[b] = odd + np.uint32(1)


def compiled_round(table: np.ndarray, blocks: list[int], bodies: bytes) -> None:
    assert rounds.write(table.ctypes.data, BLOCKS, STRIDE, blocks, OFF, bodies)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, BLOCKS - 1), unique=True, max_size=BLOCKS),
       st.integers(0, 2**32 - 1))
def test_the_compiled_round_leaves_the_bytes_numpys_round_leaves(blocks, seed):
    rng = np.random.default_rng(seed)
    start = rng.integers(0, 256, (BLOCKS, STRIDE), dtype=np.uint8)
    start[:, :4].view(np.uint32)[:, 0] = rng.integers(0, 2**32, BLOCKS, dtype=np.uint32)
    bodies = rng.integers(0, 256, len(blocks) * SIZE, dtype=np.uint8).tobytes()
    a, b = start.copy(), start.copy()
    numpy_round(a, blocks, bodies)
    compiled_round(b, blocks, bodies)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("bad", [-1, BLOCKS, 2**31 - 1])
def test_a_block_past_the_table_is_refused_before_any_store(bad):
    table = np.zeros((BLOCKS, STRIDE), np.uint8)
    with pytest.raises(IndexError):
        rounds.write(table.ctypes.data, BLOCKS, STRIDE, [0, bad], OFF, bytes(2 * SIZE))
    assert not table.any()


def test_bodies_that_do_not_fit_their_blocks_are_refused():
    table = np.zeros((BLOCKS, STRIDE), np.uint8)
    for bodies in (bytes(2 * SIZE + 1), bytes(2 * (STRIDE - OFF + 1))):
        with pytest.raises(ValueError):
            rounds.write(table.ctypes.data, BLOCKS, STRIDE, [0, 1], OFF, bodies)
    assert not table.any()


def test_a_block_named_twice_in_a_round_ends_closed():
    """Ids are distinct by contract; one named twice anyway must not be left odd, which
    readers take for a write under way and retry on until it is next written."""
    table = np.zeros((BLOCKS, STRIDE), np.uint8)
    table[2, 0] = 6
    rounds.write(table.ctypes.data, BLOCKS, STRIDE, [2, 2], OFF, bytes(range(2 * SIZE)))
    assert table[2, :4].view(np.uint32)[0] % 2 == 0


COPY = "memcpy(table + block[k] * stride + off, body + k * size, (size_t)size);"
CHECKED_COPY = """{ if (!(*(uint32_t *)(table + block[k] * stride) & 1u)) BAD++;
      memcpy(table + block[k] * stride + off, body + k * size, (size_t)size); }"""


@pytest.mark.procs  # (builds a variant of the library: starts the compiler)
def test_every_body_is_copied_while_its_entry_is_odd(tmp_path, monkeypatch):
    """Readers retry an odd entry and trust an even one: equal end states are not enough,
    each body must change only between its entry's opening and its closing."""
    import ctypes

    from kvshm.shm.native import CLibrary
    assert rounds._SOURCE.count(COPY) == 1
    source = rounds._SOURCE.replace(COPY, CHECKED_COPY).replace(
        "int64_t kvshm_table_round", "static int64_t BAD;\n"
        "int64_t kvshm_bad(void) { return BAD; }\nint64_t kvshm_table_round")
    checked = CLibrary("rounds-checked", "checked round", source, {
        "kvshm_table_round": rounds.LIBRARY.functions["kvshm_table_round"],
        "kvshm_bad": (ctypes.c_int64, [])}, lambda fns: True)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert checked.load() and checked.fns is not None
    monkeypatch.setattr(rounds.LIBRARY, "fns", checked.fns)
    table = np.zeros((BLOCKS, STRIDE), np.uint8)
    for blocks in ([3], [0, 5, 11], list(range(BLOCKS))):
        compiled_round(table, blocks, bytes(len(blocks) * SIZE))
    assert checked.fns["kvshm_bad"]() == 0
    assert not (table[:, :4].view(np.uint32)[:, 0] % 2).any()


def assert_write_many_refuses(n: int, bad: int) -> None:
    """``write_many`` of ``n`` blocks, the last ``bad``, on a table of 24: IndexError, and not
    a byte of the segment changed."""
    from conftest import SMALL_GEOMETRY, TEST_LAYOUT, unique_name

    from kvshm.shm import layout as L
    from kvshm.shm.segment import Segment
    from kvshm.shm.table import BlockTable
    name = unique_name()
    seg = Segment.create(name, TEST_LAYOUT, 24, **SMALL_GEOMETRY)
    try:
        table = BlockTable(seg.buf, seg.geometry)
        before = bytes(seg.buf)
        with pytest.raises(IndexError):
            table.write_many([*range(n - 1), bad], L.READY, [b"k%d" % i for i in range(n)])
        assert bytes(seg.buf) == before
        table.close()
    finally:
        seg.close()
        Segment.unlink(name)


@pytest.mark.parametrize("n", [8, 17])  # the per-entry path and the numpy round
@pytest.mark.parametrize("bad", [-1, 24])
def test_write_many_without_the_compiled_round_refuses_a_block_past_the_table(
        n, bad, monkeypatch):
    """Every path of ``write_many`` refuses an id past the table before any store (numpy
    wrapped a negative id to the last entry; the per-entry path wrote into the header)."""
    monkeypatch.setattr(rounds.LIBRARY, "fns", None)
    assert_write_many_refuses(n, bad)


@pytest.mark.parametrize("n", [8, 17])
@pytest.mark.parametrize("bad", [-1, 24, 2**31])
def test_write_many_with_the_compiled_round_refuses_a_block_past_the_table(n, bad):
    """The compiled round is ``write_many``'s only check on its path: an id past the table,
    negative, or past any int32 is refused as IndexError before any store."""
    assert_write_many_refuses(n, bad)
