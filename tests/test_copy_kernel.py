"""The CUDA handler's host-side pieces, tested without a GPU.

* ``IndexBuffers``: a pinned id buffer is reused only after the job that read it finished,
  grows by allocating, and never by waiting (a fake allocator and fake ``done`` flags stand in
  for pinned memory and CUDA events).
* ``choose_method``: which method a job gets, by page size, direction and what is usable.
* The CUDA handler's host path (``CudaTransferHandler.transfer_async``/``wait``/
  ``get_finished`` with every CUDA call a no-op, ``tools/bench_gather.py``'s stub): a job's
  launch gets exactly its ids, and a job that fails validation launches nothing.
* The Triton gather/scatter kernel itself, with the table and ids ``cuda_gather`` builds for
  it, run by Triton's interpreter on CPU tensors over random layouts (factor, K/V-first
  tensors, padded rows, odd page sizes) and checked against a per-block loop. It runs in a
  subprocess because the interpreter is chosen when the kernel module is imported. Skipped
  where Triton is not installed; on a GPU, tests/test_transfer.py runs it compiled.
"""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest

from kvshm.transfer.index_pool import KERNEL_BELOW, IndexBuffer, IndexBuffers, choose_method


# --- IndexBuffers ----------------------------------------------------------------------------
class FakeAlloc:
    def __init__(self):
        self.sizes: list[int] = []

    def __call__(self, words: int) -> IndexBuffer:
        self.sizes.append(words)
        return IndexBuffer(np.zeros(words, np.int64), device=f"buf{len(self.sizes)}")


def test_a_buffer_is_reused_only_once_its_reader_is_done():
    alloc = FakeAlloc()
    pool = IndexBuffers(alloc, min_words=16)
    a = pool.take(10)
    flag = {"a": False}
    pool.hold(a, lambda: flag["a"])
    b = pool.take(10)  # a's kernel may still read a: a new buffer, allocated, no waiting
    assert b is not a and alloc.sizes == [16, 16]
    pool.hold(b, lambda: True)
    c = pool.take(16)
    assert c is b  # b's reader finished
    pool.hold(c, lambda: False)
    flag["a"] = True
    assert pool.take(3) is a and alloc.sizes == [16, 16] and pool.allocated == 2


def test_a_job_larger_than_every_free_buffer_gets_a_bigger_one():
    alloc = FakeAlloc()
    pool = IndexBuffers(alloc, min_words=16)
    small = pool.take(5)
    pool.hold(small, lambda: True)
    big = pool.take(3000)
    assert big.host.size == 4096 and alloc.sizes == [16, 4096]
    pool.give_back(big)  # nothing was queued to read it (a failed launch)
    assert pool.take(4096) is big and pool.allocated == 1  # the small one was dropped


def test_many_jobs_in_flight_each_get_their_own_buffer():
    pool = IndexBuffers(FakeAlloc(), min_words=8)
    held = []
    for _ in range(20):
        b = pool.take(8)
        assert all(b is not h for h in held)
        pool.hold(b, lambda: False)
        held.append(b)
    assert pool.allocated == 20


# --- choose_method ---------------------------------------------------------------------------
ALL = dict(pinned=True, uva=True, triton=True, batch=True)


@pytest.mark.parametrize("kind", ["load", "store"])
def test_auto_takes_the_kernel_below_the_threshold_and_dma_from_it(kind):
    limit = KERNEL_BELOW[kind]
    assert choose_method("auto", kind, 16 << 10, 1000, **ALL) == "triton"
    assert choose_method("auto", kind, limit - 1, 1000, **ALL) == "triton"
    assert choose_method("auto", kind, limit, 1000, **ALL) == "dma"
    assert choose_method("auto", kind, 16 << 10, 1000, **ALL, kernel_below={kind: 0}) == "dma"


def test_auto_without_triton_or_uva_or_batch_falls_back_in_order():
    page = 16 << 10
    assert choose_method("auto", "load", page, 9, **{**ALL, "triton": False}) == "kernel"
    assert choose_method("auto", "load", page, 9, **{**ALL, "uva": False}) == "dma"
    assert choose_method("auto", "load", page, 9, **{**ALL, "uva": False, "batch": False}) \
        == "copy"


@pytest.mark.parametrize("method", ["auto", "batch", "kernel", "triton"])
def test_unpinned_planes_and_empty_jobs_always_copy(method):
    assert choose_method(method, "store", 4096, 8, **{**ALL, "pinned": False}) == "copy"
    assert choose_method(method, "store", 4096, 0, **ALL) == "copy"


def test_a_named_method_is_kept_at_every_size_where_it_can_run():
    for page in (16 << 10, 64 << 20):
        assert choose_method("triton", "store", page, 5, **ALL) == "triton"
        assert choose_method("kernel", "load", page, 5, **ALL) == "kernel"
        assert choose_method("batch", "load", page, 5, **ALL) == "batch"
        assert choose_method("copy", "load", page, 5, **ALL) == "copy"
    assert choose_method("triton", "load", 4096, 5, **{**ALL, "uva": False}) == "dma"


# --- the launcher -----------------------------------------------------------------------------
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_cached_launch_is_taken_only_while_no_launch_hook_listens():
    from kvshm.transfer.triton_copy import _hooked

    class Chain:  # Triton 3.4+ always has a hook chain; an empty one calls nothing
        def __init__(self, calls):
            self.calls = calls
    assert not _hooked(None, None) and not _hooked(Chain([]), Chain([]))
    assert _hooked(Chain([print]), None) and _hooked(None, print) and _hooked(Chain([]), print)


# --- the event calls the handler makes --------------------------------------------------------
def test_event_calls_are_the_base_classs_c_methods_in_record_wait_sync_elapsed_order():
    """The handler calls torch's event base-class methods directly, skipping the Python
    wrappers of ``torch.cuda.Event``; a base whose methods are Python functions (or a class
    with no such base) gives the class's own. Callables that are not functions stand for C
    methods here."""
    import functools
    pytest.importorskip("torch")
    from kvshm.transfer.cuda_copy import _event_calls
    names = ("record", "wait", "synchronize", "elapsed_time")
    c_base = type("CBase", (), {n: functools.partial(str, n) for n in names})
    wrapped = type("Event", (c_base,), {n: (lambda self, *a: None) for n in names})
    assert [f() for f in _event_calls(wrapped)] == list(names)
    plain = type("Plain", (), {n: (lambda self, *a: None) for n in names})
    assert _event_calls(type("Sub", (plain,), {})) == tuple(getattr(plain, n) for n in names)


# --- the CUDA handler's host path, CUDA stubbed -------------------------------------------------
def _bench_gather():
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools",
                        "bench_gather.py")
    spec = importlib.util.spec_from_file_location("bench_gather_for_tests", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(params=[1, 2], ids=["factor1", "factor2"])
def stubbed(request):
    h, launches, stack = _bench_gather().stub_handler(16, 64, factor=request.param)
    yield h, launches, request.param
    h.shutdown()
    stack.close()


@pytest.mark.parametrize("kind", ["store", "load"])
def test_a_job_launches_once_with_exactly_its_ids(stubbed, kind):
    from kvshm.transfer.spec import TransferSpec
    h, launches, f = stubbed
    rng = np.random.default_rng(1)
    for j in range(3):  # buffers are reused between jobs: stale ids must not leak
        seg = rng.permutation(16)[:5 - j]
        dev = rng.permutation(16 * f)[:seg.size * f - (f - 1)]  # skips the first sub-block
        assert h.transfer_async(j, TransferSpec(kind, dev, seg))
        h.wait([j])
        n, ids = launches[-1]
        sub = (np.repeat(seg, f) * f + np.tile(np.arange(f), seg.size))[f - 1:]
        want = [dev, sub // f] + ([sub % f] if f > 1 else [])
        assert n == dev.size and np.array_equal(ids[:n * len(want)], np.concatenate(want))
        assert [(r.job_id, r.success, r.kind) for r in h.get_finished()] == [(j, True, kind)]
    assert len(launches) == 3


@pytest.mark.parametrize("kind,dev,seg,match", [
    ("store", [0, 1], [3, 99], "out of range"), ("load", [0, -1], [3, 4], "out of range"),
    ("load", [0, 0], [1, 2], "more than once"), ("store", [0, 1], [2, 2], "more than once"),
    ("store", [0, 1, 2], [1], "do not fit"), ("load", [0.5, 1], [1, 2], "sequence of ints")])
def test_a_job_that_fails_validation_launches_nothing(stubbed, kind, dev, seg, match):
    from kvshm.errors import InvalidArgumentError
    from kvshm.transfer.spec import TransferSpec
    h, launches, f = stubbed
    dev = [d * f + k for d in dev for k in range(f)]  # each block's sub-blocks
    with pytest.raises(InvalidArgumentError, match=match):
        h.transfer_async(7, TransferSpec(kind, dev, seg))
    assert not launches and h.get_finished() == []
    h.transfer_async(7, TransferSpec(kind, [], []))  # the id was never taken
    assert [r.job_id for r in h.get_finished()] == [7]


# --- the kernel, interpreted ------------------------------------------------------------------
def _interpreted_check(seeds: int) -> None:
    """Random layouts and jobs through triton_copy.launch; runs under TRITON_INTERPRET=1."""
    import torch

    from kvshm.transfer import triton_copy
    from kvshm.transfer.cuda_gather import pair_table, word_layout, write_ids
    from kvshm.transfer.spec import TransferSpec, build_geometry, plan_transfer
    for seed in range(seeds):
        rng = np.random.default_rng(seed)
        f = int(rng.integers(1, 4))
        kv = [bool(x) for x in rng.integers(0, 2, int(rng.integers(1, 3)))]
        word = int(rng.choice([1, 2, 4, 8]))  # element bytes: odd pages exercise 1-byte words
        inner = [int(rng.integers(1, 12)) * word for _ in kv]
        n_dev, n_seg = int(rng.integers(4, 14)), int(rng.integers(2, 6))
        pad = int(rng.choice([0, 16, 3]))
        devs = [torch.from_numpy(rng.integers(0, 256, ((2, n_dev, i) if k else (n_dev, i)),
                                              dtype=np.uint8)) for k, i in zip(kv, inner)]
        rows = [f * i for k, i in zip(kv, inner) for _ in range(2 if k else 1)]
        buf = torch.from_numpy(rng.integers(0, 256, sum(n_seg * (r + pad) for r in rows) + 64,
                                            dtype=np.uint8))
        planes, off = [], 0
        for r in rows:
            planes.append(torch.as_strided(buf, (n_seg, r), (r + pad, 1), off))
            off += n_seg * (r + pad)
        geo = build_geometry(devs, planes, f, kv)
        m = int(rng.integers(1, min(n_seg, n_dev // f) + 1))
        seg_ids = rng.permutation(n_seg)[:m]
        skip = int(rng.integers(0, f))
        dev_ids = rng.permutation(n_dev)[:m * f - skip]
        for kind in ("store", "load"):
            plan = plan_transfer(TransferSpec(kind, dev_ids, seg_ids), geo)
            pairs = [(p.device.clone(), p.plane.clone()) for p in geo.pairs]
            want = []
            for (d0, p0), p in zip(pairs, geo.pairs):
                d0, p0, pg = d0.clone(), p0.clone(), p.page_bytes
                for d, r, s in zip(plan.device_ids, plan.segment_rows, plan.segment_subs):
                    if kind == "store":
                        p0[r, s * pg:(s + 1) * pg] = d0[d]
                    else:
                        d0[d] = p0[r, s * pg:(s + 1) * pg]
                want.append((d0, p0))
            elem, align = word_layout(geo)
            base = torch.zeros(16, dtype={4: torch.int32, 2: torch.int16, 1: torch.uint8}[elem])
            table = torch.from_numpy(pair_table(geo, base.data_ptr(), elem))
            ids = np.zeros(3 * plan.n, np.int64)
            write_ids(ids, plan, f > 1)
            fast = triton_copy.launch(base, torch.from_numpy(ids), table, plan.n, len(geo.pairs),
                                      max(p.page_bytes for p in geo.pairs) // elem,
                                      store=kind == "store", has_sub=f > 1, align=align,
                                      block=16, piece_words=32)
            for (d0, p0), p in zip(want, geo.pairs):
                assert torch.equal(p.device, d0) and torch.equal(p.plane, p0), (seed, kind)
            fast(plan.n, torch.from_numpy(ids), 0)  # the same job again: the bytes stay right
            for (d0, p0), p in zip(want, geo.pairs):
                assert torch.equal(p.device, d0) and torch.equal(p.plane, p0), (seed, kind)


@pytest.mark.procs  # runs a child process
@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton")
def test_the_copy_kernel_matches_a_per_block_loop_on_random_layouts():
    here = os.path.dirname(os.path.abspath(__file__))
    code = (f"import sys; sys.path[:0] = [{here!r}, {os.path.dirname(here)!r}]; "
            f"import test_copy_kernel as t; t._interpreted_check(30)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
