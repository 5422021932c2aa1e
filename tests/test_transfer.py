"""Transfer handlers: data equality for every layout variant, ordering, completion, refusal.

Every behavioural test runs on each target in ``TARGETS``: the CPU-thread handler always, and
the CUDA handler (with each copy method) when a GPU is present — skipped cleanly otherwise.
Expected bytes come from ``reference``, a per-block loop written independently of kvshm's
expansion and coalescing code.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import subprocess
import sys
import threading

import numpy as np
import pytest
from lazy import torch  # imported at its first use, not when the suite is collected
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvshm.errors import InvalidArgumentError, TransferError
from kvshm.transfer.factory import make_handler
from kvshm.transfer.spec import BlockPlan, TransferSpec, coalesce, expand_block_ids

# A string condition is evaluated when a test runs, so collecting this file imports no torch.
CUDA = pytest.mark.skipif("not torch.cuda.is_available()", reason="needs a CUDA GPU")
# On CUDA a first copy may compile its kernel, which starts the compiler: not a unit test.
TARGETS = ["cpu"] + [pytest.param(f"cuda-{m}", marks=[CUDA, pytest.mark.procs])
                     for m in ("auto", "copy", "batch", "kernel", "triton", "unpinned")]


# --- rig ---------------------------------------------------------------------------------
def random_bytes(n: int, seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8))


class Rig:
    """Builds device tensors and page-aligned planes for one target, and cleans up after."""

    def __init__(self, target: str):
        self.device = "cpu" if target == "cpu" else "cuda"
        self.method = target.split("-", 1)[1] if "-" in target else None
        self.handlers, self.regions, self.seed = [], [], 0

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = torch.float16 if dtype is None else dtype  # (a default would import torch)
        self.seed += 1
        n = int(np.prod(shape)) * torch.empty(0, dtype=dtype).element_size()
        return random_bytes(n, self.seed).view(dtype).reshape(shape).to(self.device)

    def planes(self, rows: int, row_bytes: list[int], pad: int = 0) -> list[torch.Tensor]:
        """Planes carved out of one anonymous mapping, rows ``pad`` bytes apart; filled."""
        sizes = [rows * (rb + pad) for rb in row_bytes]
        mm = mmap.mmap(-1, sum(sizes))
        buf = torch.frombuffer(mm, dtype=torch.uint8)
        self.seed += 1
        buf.copy_(random_bytes(buf.numel(), self.seed))
        out, off = [], 0
        for rb, size in zip(row_bytes, sizes):
            out.append(torch.as_strided(buf, (rows, rb), (rb + pad, 1), off))
            off += size
        if self.device == "cuda" and self.method != "unpinned":
            from kvshm.transfer.pinning import pin_region
            region = pin_region(buf.data_ptr(), buf.numel())
            assert region is not None, "the test could not pin its planes"
            self.regions.append(region)
        return out

    def handler(self, devs, planes, **kw):
        if self.device == "cuda" and self.method != "unpinned":
            kw.setdefault("method", self.method)
        try:
            h = make_handler(devs, planes, **kw)
        except TransferError as e:
            if "cuMemcpyBatchAsync" in str(e) or "needs Triton" in str(e):
                pytest.skip(str(e))
            raise
        self.handlers.append(h)
        return h

    def close(self) -> None:
        for h in self.handlers:
            h.shutdown()
        for r in self.regions:
            r.unregister()


@pytest.fixture(params=TARGETS)
def rig(request):
    r = Rig(request.param)
    yield r
    r.close()


def halves(devs: list[torch.Tensor], kvfirst: list[bool] | None = None) -> list[np.ndarray]:
    """Canonical (num_blocks, page_bytes) byte rows of every device tensor, K/V split."""
    out = []
    for t, kv in zip(devs, kvfirst or [False] * len(devs)):
        for h in ([t[0], t[1]] if kv else [t]):
            out.append(h.contiguous().cpu().view(torch.uint8).reshape(h.shape[0], -1).numpy())
    return out


def snapshot(devs, planes, kvfirst=None):
    return halves(devs, kvfirst), [p.numpy().copy() for p in planes]


def reference(kind, dev_rows, plane_rows, dev_ids, seg_ids, factor):
    """Expected (device rows, plane rows) after the job, one block at a time."""
    dev_rows = [d.copy() for d in dev_rows]
    plane_rows = [p.copy() for p in plane_rows]
    subs = [(b, j) for b in seg_ids for j in range(factor)]
    subs = subs[len(subs) - len(dev_ids):]  # the skip drops the first sub-blocks
    for d, (b, j) in zip(dev_ids, subs):
        for dr, pr in zip(dev_rows, plane_rows):
            page = dr.shape[1]
            if kind == "store":
                pr[b, j * page:(j + 1) * page] = dr[d]
            else:
                dr[d] = pr[b, j * page:(j + 1) * page]
    return dev_rows, plane_rows


def run(h, job_id, kind, dev_ids, seg_ids):
    assert h.transfer_async(job_id, TransferSpec(kind, dev_ids, seg_ids))
    h.wait([job_id])


def check(kind, devs, planes, before, dev_ids, seg_ids, factor, kvfirst=None):
    want_dev, want_planes = reference(kind, *before, dev_ids, seg_ids, factor)
    got_dev, got_planes = snapshot(devs, planes, kvfirst)
    for w, g in zip(want_dev + want_planes, got_dev + got_planes):
        np.testing.assert_array_equal(g, w)


KINDS = ["store", "load"]


# --- data equality -----------------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
def test_single_plane_factor_1_copies_exact_bytes(rig, kind):
    devs = [rig.tensor((16, 4, 32))]
    planes = rig.planes(12, [256])
    h = rig.handler(devs, planes)
    before = snapshot(devs, planes)
    dev_ids, seg_ids = [3, 9, 4, 15, 0], [11, 2, 3, 7, 0]
    run(h, 1, kind, dev_ids, seg_ids)
    check(kind, devs, planes, before, dev_ids, seg_ids, 1)


@pytest.mark.parametrize("kind", KINDS)
def test_several_planes_of_different_dtypes_and_page_sizes(rig, kind):
    devs = [rig.tensor((10, 8, 16), torch.float16), rig.tensor((10, 3, 8), torch.bfloat16),
            rig.tensor((10, 40), torch.float32), rig.tensor((10, 5, 7), torch.int8)]
    planes = rig.planes(9, [256, 48, 160, 35])
    h = rig.handler(devs, planes)
    before = snapshot(devs, planes)
    dev_ids, seg_ids = [1, 2, 3, 9, 0], [8, 0, 1, 4, 5]
    run(h, 1, kind, dev_ids, seg_ids)
    check(kind, devs, planes, before, dev_ids, seg_ids, 1)


@pytest.mark.parametrize("kind", KINDS)
def test_block_size_factor_3_packs_three_device_blocks_per_segment_block(rig, kind):
    devs = [rig.tensor((20, 2, 16)), rig.tensor((20, 24), torch.float32)]
    planes = rig.planes(6, [3 * 64, 3 * 96])
    h = rig.handler(devs, planes, block_size_factor=3)
    before = snapshot(devs, planes)
    dev_ids, seg_ids = [4, 5, 6, 17, 0, 11], [5, 1]
    run(h, 1, kind, dev_ids, seg_ids)
    check(kind, devs, planes, before, dev_ids, seg_ids, 3)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("skip", [1, 2])
def test_skip_leaves_the_first_sub_blocks_of_the_first_segment_block_alone(rig, kind, skip):
    devs = [rig.tensor((20, 2, 16))]
    planes = rig.planes(6, [3 * 64])
    h = rig.handler(devs, planes, block_size_factor=3)
    before = snapshot(devs, planes)
    seg_ids = [2, 4, 0]
    dev_ids = [7, 8, 9, 10, 11, 12, 13, 14, 15][skip:]
    run(h, 1, kind, dev_ids, seg_ids)
    check(kind, devs, planes, before, dev_ids, seg_ids, 3)
    if kind == "store":  # the skipped sub-blocks of segment block 2 kept their bytes
        np.testing.assert_array_equal(planes[0].numpy()[2, :skip * 64], before[1][0][2, :skip * 64])


@pytest.mark.parametrize("kind", KINDS)
def test_kv_first_tensor_is_two_planes_k_then_v(rig, kind):
    devs = [rig.tensor((2, 12, 4, 8))]
    planes = rig.planes(8, [64, 64])
    h = rig.handler(devs, planes, kv_dim_before_num_blocks=[True])
    before = snapshot(devs, planes, [True])
    dev_ids, seg_ids = [11, 0, 5], [1, 7, 2]
    run(h, 1, kind, dev_ids, seg_ids)
    check(kind, devs, planes, before, dev_ids, seg_ids, 1, [True])


@pytest.mark.parametrize("kind", KINDS)
def test_mixed_kv_first_and_plain_tensors_with_factor_and_skip(rig, kind):
    devs = [rig.tensor((2, 30, 2, 8)), rig.tensor((30, 4, 4), torch.float32),
            rig.tensor((2, 30, 3, 4), torch.bfloat16)]
    kv = [True, False, True]
    planes = rig.planes(7, [3 * 32, 3 * 32, 3 * 64, 3 * 24, 3 * 24])
    h = rig.handler(devs, planes, block_size_factor=3, kv_dim_before_num_blocks=kv)
    before = snapshot(devs, planes, kv)
    seg_ids = [6, 0, 3]
    dev_ids = [20, 21, 22, 23, 24, 2, 9]  # 9 sub-blocks - 7 = skip 2
    run(h, 1, kind, dev_ids, seg_ids)
    check(kind, devs, planes, before, dev_ids, seg_ids, 3, kv)


@pytest.mark.parametrize("kind", KINDS)
def test_padded_plane_rows_are_respected(rig, kind):
    devs = [rig.tensor((20, 2, 16))]
    planes = rig.planes(6, [2 * 64], pad=4096 - 128)
    h = rig.handler(devs, planes, block_size_factor=2)
    before = snapshot(devs, planes)
    dev_ids, seg_ids = [0, 1, 2, 3, 4, 5], [1, 2, 3]  # contiguous ids, non-contiguous rows
    run(h, 1, kind, dev_ids, seg_ids)
    check(kind, devs, planes, before, dev_ids, seg_ids, 2)


@pytest.mark.parametrize("kind", KINDS)
def test_source_is_unchanged(rig, kind):
    devs = [rig.tensor((16, 64))]
    planes = rig.planes(16, [128])
    h = rig.handler(devs, planes)
    before_dev, before_planes = snapshot(devs, planes)
    run(h, 1, kind, list(range(0, 16, 2)), list(range(8, 16)))
    after_dev, after_planes = snapshot(devs, planes)
    src_before, src_after = (before_dev, after_dev) if kind == "store" else (before_planes,
                                                                             after_planes)
    np.testing.assert_array_equal(src_after[0], src_before[0])


@pytest.mark.parametrize("kind", KINDS)
def test_blocks_outside_the_job_are_unchanged(rig, kind):
    devs = [rig.tensor((16, 64))]
    planes = rig.planes(16, [128])
    h = rig.handler(devs, planes)
    before_dev, before_planes = snapshot(devs, planes)
    dev_ids, seg_ids = [1, 5, 6], [9, 3, 4]
    run(h, 1, kind, dev_ids, seg_ids)
    after_dev, after_planes = snapshot(devs, planes)
    if kind == "store":
        keep = [b for b in range(16) if b not in seg_ids]
        np.testing.assert_array_equal(after_planes[0][keep], before_planes[0][keep])
    else:
        keep = [b for b in range(16) if b not in dev_ids]
        np.testing.assert_array_equal(after_dev[0][keep], before_dev[0][keep])


def test_planes_on_posix_shared_memory_are_written_through(rig):
    posix_ipc = pytest.importorskip("posix_ipc")
    import uuid
    shm = posix_ipc.SharedMemory(f"/kvshm-test-{uuid.uuid4().hex[:12]}", posix_ipc.O_CREX,
                                 size=8 * 256)
    try:
        mm = mmap.mmap(shm.fd, shm.size)
        plane = torch.frombuffer(mm, dtype=torch.uint8).view(8, 256)
        devs = [rig.tensor((8, 128))]
        h = rig.handler(devs, [plane])
        run(h, 1, "store", [2, 7], [5, 0])
        other = mmap.mmap(shm.fd, shm.size)  # a second mapping, as another process would see it
        seen = np.frombuffer(other, np.uint8).reshape(8, 256)
        np.testing.assert_array_equal(seen[5], halves(devs)[0][2])
        np.testing.assert_array_equal(seen[0], halves(devs)[0][7])
        devs[0].zero_()
        run(h, 2, "load", [3], [5])
        np.testing.assert_array_equal(halves(devs)[0][3], seen[5])
        del seen
        other.close()
    finally:
        shm.close_fd()
        shm.unlink()


def test_empty_job_completes_with_zero_bytes(rig):
    h = rig.handler([rig.tensor((4, 64))], rig.planes(4, [128]))
    run(h, 7, "store", [], [])
    assert [(r.job_id, r.success, r.nbytes) for r in h.get_finished()] == [(7, True, 0)]


# --- completion and ordering -------------------------------------------------------------
def test_results_are_fifo_within_each_direction(rig):
    devs = [rig.tensor((64, 1024))]
    planes = rig.planes(64, [2048])
    h = rig.handler(devs, planes)
    order = {"store": [], "load": []}
    for j in range(6):  # big jobs first: a later, smaller job must not overtake
        n = 12 - 2 * j
        h.transfer_async(100 + j, TransferSpec("store", list(range(n)), list(range(n))))
        order["store"].append(100 + j)
        h.transfer_async(200 + j, TransferSpec("load", list(range(32, 32 + n)),
                                                list(range(32, 32 + n))))
        order["load"].append(200 + j)
    h.wait(order["store"] + order["load"])
    results = h.get_finished()
    for kind in KINDS:
        assert [r.job_id for r in results if r.kind == kind] == order[kind]


def test_wait_returns_only_after_the_data_is_in_place(rig):
    devs = [rig.tensor((256, 8192))]
    planes = rig.planes(256, [16384])
    h = rig.handler(devs, planes)
    ids = list(np.random.default_rng(3).permutation(256))
    h.transfer_async(1, TransferSpec("store", ids, list(range(256))))
    h.wait([1])
    np.testing.assert_array_equal(planes[0].numpy(), halves(devs)[0][ids])


def test_wait_on_unknown_or_reported_jobs_returns(rig):
    h = rig.handler([rig.tensor((4, 64))], rig.planes(4, [128]))
    h.wait([12345])
    run(h, 1, "store", [0], [0])
    assert len(h.get_finished()) == 1
    h.wait([1, 12345])


def test_each_result_is_reported_once_with_bytes_and_kind(rig):
    devs = [rig.tensor((8, 64)), rig.tensor((2, 8, 16), torch.float32)]
    h = rig.handler(devs, rig.planes(8, [128, 64, 64]), kv_dim_before_num_blocks=[False, True])
    run(h, 1, "store", [0, 1, 2], [3, 4, 5])
    run(h, 2, "load", [6], [3])
    results = sorted(h.get_finished(), key=lambda r: r.job_id)
    assert [(r.job_id, r.success, r.nbytes, r.kind) for r in results] == \
        [(1, True, 3 * 256, "store"), (2, True, 256, "load")]
    assert all(r.seconds >= 0 for r in results)
    assert h.get_finished() == []


# --- refusal and failure -----------------------------------------------------------------
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("dev_ids,seg_ids,what", [
    ([0, 16], [1, 2], "device_block_ids[1] = 16"),
    ([0, 1], [1, 8], "segment_block_ids[1] = 8"),
    ([-1, 1], [1, 2], "device_block_ids[0] = -1"),
])
def test_out_of_range_ids_are_refused_before_any_byte_moves(rig, kind, dev_ids, seg_ids, what):
    devs = [rig.tensor((16, 64))]
    planes = rig.planes(8, [128])
    h = rig.handler(devs, planes)
    before = snapshot(devs, planes)
    with pytest.raises(InvalidArgumentError, match=what.replace("[", r"\[").replace("]", r"\]")):
        h.transfer_async(1, TransferSpec(kind, dev_ids, seg_ids))
    after = snapshot(devs, planes)
    for b, a in zip(before[0] + before[1], after[0] + after[1]):
        np.testing.assert_array_equal(a, b)
    assert h.get_finished() == []
    run(h, 1, kind, [0], [0])  # the refused id was not taken
    assert [r.success for r in h.get_finished()] == [True]


@pytest.mark.parametrize("dev_ids,seg_ids", [
    ([0, 1, 2, 3], [0]),           # 4 device blocks cannot fit 1 segment block of 3
    ([0], [0, 1]),                 # skip 5 >= factor
    ([0, 1, 2], []),
])
def test_counts_that_do_not_fit_the_factor_are_refused(rig, dev_ids, seg_ids):
    h = rig.handler([rig.tensor((8, 64))], rig.planes(4, [3 * 128]), block_size_factor=3)
    with pytest.raises(InvalidArgumentError, match="do not fit"):
        h.transfer_async(1, TransferSpec("store", dev_ids, seg_ids))


@pytest.mark.parametrize("kind,dev_ids,seg_ids", [
    ("store", [0, 1], [2, 2]), ("load", [3, 3], [0, 1])])
def test_a_destination_named_twice_is_refused(rig, kind, dev_ids, seg_ids):
    h = rig.handler([rig.tensor((8, 64))], rig.planes(4, [128]))
    with pytest.raises(InvalidArgumentError, match="more than once"):
        h.transfer_async(1, TransferSpec(kind, dev_ids, seg_ids))


def test_non_integer_ids_are_refused(rig):
    h = rig.handler([rig.tensor((8, 64))], rig.planes(4, [128]))
    with pytest.raises(InvalidArgumentError, match="flat sequence of ints"):
        h.transfer_async(1, TransferSpec("store", [0.0, 1.5], [0, 1]))


def test_an_unknown_kind_is_refused():
    with pytest.raises(InvalidArgumentError, match="'store'"):
        TransferSpec("copy", [0], [0])


def test_a_failed_copy_reports_failure_and_the_handler_keeps_working(rig, monkeypatch):
    devs = [rig.tensor((8, 64))]
    planes = rig.planes(4, [128])
    h = rig.handler(devs, planes)
    real, calls = h._copy, []

    def flaky(*args):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected copy failure")
        return real(*args)

    monkeypatch.setattr(h, "_copy", flaky)
    h.transfer_async(1, TransferSpec("store", [0], [0]))
    before = snapshot(devs, planes)
    run(h, 2, "store", [5], [1])
    h.wait([1])
    results = {r.job_id: r for r in h.get_finished()}
    assert (results[1].success, results[1].nbytes) == (False, 0)
    assert results[2].success
    check("store", devs, planes, before, [5], [1], 1)


@pytest.mark.parametrize("kind", KINDS)
def test_an_inline_copy_is_done_in_the_callers_thread_before_submit_returns(kind):
    """``inline`` (what kvshm's vLLM worker uses for a CPU KV cache): the copy runs inside
    ``transfer_async``, in the caller's thread; a failing one is reported, never raised."""
    devs = [random_bytes(8 * 128, 5).view(torch.float16).reshape(8, 64)]
    planes = [random_bytes(8 * 128, 6).reshape(8, 128)]
    h = make_handler(devs, planes, inline=(kind,))
    real, threads = h._copy, []
    h._copy = lambda job: (threads.append(threading.get_ident()), real(job))[1]
    try:
        before = snapshot(devs, planes)
        assert h.transfer_async(1, TransferSpec(kind, [2, 3], [5, 1]))
        assert threads == [threading.get_ident()]
        check(kind, devs, planes, before, [2, 3], [5, 1], 1)  # in place, with no wait
        assert [(r.job_id, r.success, r.nbytes) for r in h.get_finished()] == [(1, True, 256)]
        h._copy = lambda job: (_ for _ in ()).throw(RuntimeError("injected copy failure"))
        assert h.transfer_async(2, TransferSpec(kind, [0], [0]))
        h.wait([2])
        assert [(r.job_id, r.success) for r in h.get_finished()] == [(2, False)]
    finally:
        h.shutdown()
    with pytest.raises(InvalidArgumentError, match="inline"):
        make_handler(devs, planes, inline=("both",))


def test_a_job_id_still_in_flight_is_refused():
    devs, planes = [torch.zeros(8, 64, dtype=torch.float16)], [torch.zeros(4, 128, dtype=torch.uint8)]
    h = make_handler(devs, planes)
    gate, real = threading.Event(), h._copy
    h._copy = lambda job: (gate.wait(), real(job))[1]
    try:
        h.transfer_async(1, TransferSpec("store", [0], [0]))
        with pytest.raises(InvalidArgumentError, match="still in flight"):
            h.transfer_async(1, TransferSpec("load", [1], [1]))
    finally:
        gate.set()
        h.shutdown()


def test_shutdown_drains_queued_jobs_and_is_idempotent(rig):
    devs = [rig.tensor((32, 1024))]
    planes = rig.planes(32, [2048])
    h = rig.handler(devs, planes)
    before = snapshot(devs, planes)
    for j in range(4):
        h.transfer_async(j, TransferSpec("store", list(range(8 * j, 8 * j + 8)),
                                         list(range(8 * j, 8 * j + 8))))
    h.shutdown()
    h.shutdown()
    assert sorted(r.job_id for r in h.get_finished() if r.success) == [0, 1, 2, 3]
    check("store", devs, planes, before, list(range(32)), list(range(32)), 1)
    with pytest.raises(TransferError, match="shut down"):
        h.transfer_async(9, TransferSpec("store", [0], [0]))


# --- geometry ----------------------------------------------------------------------------
def u8(*shape: int):
    return torch.zeros(*shape, dtype=torch.uint8)


# Each case's tensors are made when it runs (a lambda), not when this file is collected.
@pytest.mark.parametrize("tensors,kw,match", [
    (lambda: ([torch.zeros(4, 64)], []), {}, "0 planes given for 1"),
    (lambda: ([torch.zeros(4, 64)], [u8(4, 100)]), {}, "expected 256"),
    (lambda: ([torch.zeros(4, 64)], [torch.zeros(4, 64)]), {}, "uint8/int8"),
    (lambda: ([torch.zeros(3, 4, 64)], [u8(4, 256)] * 2),
     {"kv_dim_before_num_blocks": [True]}, r"expected \(2, num_blocks"),
    (lambda: ([torch.zeros(4, 64)], [u8(4, 256)]),
     {"kv_dim_before_num_blocks": [True, False]}, "one flag per tensor"),
    (lambda: ([torch.zeros(4, 64)], [u8(4, 256)]), {"block_size_factor": 0}, "block_size_factor"),
    (lambda: ([torch.zeros(4, 64), torch.zeros(5, 64)], [u8(4, 256)] * 2), {},
     "same number of blocks"),
    (lambda: ([torch.zeros(64, 4).t()], [u8(4, 256)]), {}, "contiguous"),
])
def test_planes_that_do_not_fit_the_device_tensors_are_refused(tensors, kw, match):
    devs, planes = tensors()
    with pytest.raises(InvalidArgumentError, match=match):
        make_handler(devs, planes, **kw)


def test_make_handler_gives_the_cpu_handler_for_cpu_tensors():
    from kvshm.transfer.cpu_copy import CpuTransferHandler
    h = make_handler([torch.zeros(4, 8)], [torch.zeros(4, 32, dtype=torch.uint8)])
    assert isinstance(h, CpuTransferHandler)
    h.shutdown()


@pytest.mark.procs
def test_importing_kvshm_transfer_does_not_import_torch():
    code = ("import sys, kvshm.transfer.spec, kvshm.transfer.factory; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.procs  # runs a child process
def test_the_interface_imports_no_handler_and_the_factory_none_eagerly():
    """spec is what the handlers import: importing a handler from it would be a cycle."""
    code = ("import sys, kvshm.transfer.spec, kvshm.transfer.factory; "
            "bad = [m for m in sys.modules if m.startswith('kvshm.transfer.') and "
            "m.split('.')[-1] in ('cpu_copy', 'cuda_copy', 'triton_copy', 'cuda_gather')]; "
            "assert not bad and 'triton' not in sys.modules, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


# --- block maps --------------------------------------------------------------------------
def test_expand_block_ids_matches_vllm():
    assert expand_block_ids(np.array([0, 1, 3]), 4).tolist() == \
        [0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 14, 15]
    assert expand_block_ids(np.array([2, 5]), 3, skip=2).tolist() == [8, 15, 16, 17]


@pytest.mark.parametrize("blocks", [8, 4096, 70_000])  # marks, uint16 radix sort, int64 sort
@pytest.mark.parametrize("kind", KINDS)
def test_a_duplicate_destination_is_found_whatever_the_segment_size(blocks, kind):
    from kvshm.transfer.spec import build_geometry, plan_transfer
    geo = build_geometry([torch.zeros(blocks, 1, dtype=torch.uint8)],
                         [torch.zeros(blocks, 1, dtype=torch.uint8)])
    ids = [blocks - 1, 3, 0, 5]
    plan = plan_transfer(TransferSpec(kind, ids, ids[::-1]), geo)
    assert plan.device_ids.tolist() == ids and plan.segment_rows.tolist() == ids[::-1]
    dup = [blocks - 1, 3, blocks - 1, 5]
    spec = TransferSpec(kind, dup, ids) if kind == "load" else TransferSpec(kind, ids, dup)
    with pytest.raises(InvalidArgumentError, match=f"destination {blocks - 1} more than once"):
        plan_transfer(spec, geo)


def _plan(dev, sub, f):
    sub = np.array(sub)
    return BlockPlan("store", np.array(dev), sub // f, sub % f)


def test_adjacent_blocks_coalesce_into_one_run():
    starts, counts = coalesce(_plan([4, 5, 6, 9], [3, 4, 5, 6], 2), 2, True, True)
    assert (starts.tolist(), counts.tolist()) == ([0, 3], [3, 1])


def test_runs_break_at_padded_segment_rows_and_strided_device_rows():
    plan = _plan([4, 5, 6, 7], [3, 4, 5, 6], 2)
    assert coalesce(plan, 2, True, False)[1].tolist() == [1, 2, 1]
    assert coalesce(plan, 2, False, True)[1].tolist() == [1, 1, 1, 1]


# --- CPU specifics -------------------------------------------------------------------------
def test_a_job_split_over_helper_threads_copies_the_same_bytes():
    rig = Rig("cpu")
    devs = [rig.tensor((300, 256))]
    planes = rig.planes(300, [512])
    h = make_handler(devs, planes, threads=3, split_min_bytes=0, split_min_run=0)
    before = snapshot(devs, planes)
    ids = np.random.default_rng(1).permutation(300)
    run(h, 1, "store", ids[:250], ids[50:])
    h.shutdown()
    check("store", devs, planes, before, ids[:250], ids[50:], 1)


@pytest.mark.parametrize("copier", ["vm", "memmove"])
def test_both_cpu_copiers_copy_the_same_bytes(copier):
    rig = Rig("cpu")
    devs = [rig.tensor((40, 96))]
    planes = rig.planes(40, [192])
    h = make_handler(devs, planes, copier=copier)
    before = snapshot(devs, planes)
    ids = np.random.default_rng(2).permutation(40)
    run(h, 1, "load", ids[:30], ids[10:])
    h.shutdown()
    check("load", devs, planes, before, ids[:30], ids[10:], 1)


def test_vm_copier_cuts_long_runs_and_groups_calls():
    from kvshm.transfer import cpu_copy
    src = np.arange(50_000, dtype=np.uint8)
    dst = np.zeros_like(src)
    base_s, base_d = src.ctypes.data, dst.ctypes.data
    starts = np.array([0, 20_000, 30_000, 30_100])
    nbytes = np.array([20_000, 10_000, 100, 19_900])
    cpu_copy._vm_runs(base_d + starts, base_s + starts, nbytes, max_bytes=4096)
    np.testing.assert_array_equal(dst, src)
    dst[:] = 0  # more runs than one call may carry (IOV_MAX)
    perm = np.random.default_rng(0).permutation(5000) * 8
    cpu_copy._vm_runs(base_d + perm, base_s + perm[::-1].copy(), np.full(5000, 8))
    np.testing.assert_array_equal(dst.reshape(-1, 8)[perm // 8], src.reshape(-1, 8)[perm[::-1] // 8])


def test_cpu_handler_falls_back_to_memmove_where_process_vm_readv_is_refused(monkeypatch):
    from kvshm.transfer import cpu_copy

    def refuse(*args):
        ctypes.set_errno(errno.EPERM)
        return -1

    monkeypatch.setattr(cpu_copy, "_vm_readv", refuse)
    monkeypatch.setattr(cpu_copy, "_vm_usable", True)
    rig = Rig("cpu")
    devs = [rig.tensor((8, 64))]
    planes = rig.planes(8, [128])
    h = make_handler(devs, planes, copier="vm")
    before = snapshot(devs, planes)
    run(h, 1, "store", [1, 2, 3], [7, 0, 4])
    h.shutdown()
    assert [r.success for r in h.get_finished()] == [True] and not cpu_copy._vm_usable
    check("store", devs, planes, before, [1, 2, 3], [7, 0, 4], 1)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_any_layout_and_job_matches_the_reference(data):
    f = data.draw(st.integers(1, 4), "factor")
    kv = data.draw(st.lists(st.booleans(), min_size=1, max_size=3), "kv_first")
    inner = data.draw(st.lists(st.integers(1, 40), min_size=len(kv), max_size=len(kv)), "inner")
    n_dev, n_seg = data.draw(st.integers(1, 24), "n_dev"), data.draw(st.integers(1, 10), "n_seg")
    pad = data.draw(st.sampled_from([0, 8]), "pad")
    rig = Rig("cpu")
    devs = [rig.tensor((2, n_dev, i) if k else (n_dev, i)) for k, i in zip(kv, inner)]
    rows = [2 * f * i for k, i in zip(kv, inner) for _ in range(2 if k else 1)]
    planes = rig.planes(n_seg, rows, pad=pad)
    m = data.draw(st.integers(0, min(n_seg, -(-n_dev // f))), "segment blocks")
    seg_ids = data.draw(st.permutations(range(n_seg)), "seg")[:m]
    skip = data.draw(st.integers(0, f - 1), "skip") if m else 0
    dev_ids = data.draw(st.permutations(range(n_dev)), "dev")[:max(0, m * f - skip)]
    assume(len(dev_ids) == m * f - skip)  # enough device blocks for this many segment blocks
    kind = data.draw(st.sampled_from(KINDS), "kind")
    h = make_handler(devs, planes, block_size_factor=f, kv_dim_before_num_blocks=kv,
                     threads=data.draw(st.integers(1, 2)), split_min_bytes=0, split_min_run=0,
                     copier=data.draw(st.sampled_from(["vm", "memmove"]), "copier"))
    before = snapshot(devs, planes, kv)
    run(h, 1, kind, dev_ids, seg_ids)
    h.shutdown()
    check(kind, devs, planes, before, dev_ids, seg_ids, f, kv)


# --- CUDA specifics ------------------------------------------------------------------------
@CUDA
def test_a_store_waits_for_the_compute_stream_that_wrote_the_kv():
    rig = Rig("cuda-auto")
    devs = [torch.zeros(8, 1 << 16, dtype=torch.uint8, device="cuda")]
    planes = rig.planes(8, [1 << 16])
    h = rig.handler(devs, planes)
    torch.cuda._sleep(200_000_000)  # keep the compute stream busy ...
    devs[0].fill_(7)               # ... so this write lands long after the store is queued
    run(h, 1, "store", list(range(8)), list(range(8)))
    assert bool((planes[0] == 7).all())
    rig.close()


@CUDA
def test_the_handler_releases_the_pin_it_was_given_at_shutdown():
    from kvshm.transfer.pinning import pin_in_background
    rig = Rig("cuda-unpinned")
    planes = rig.planes(8, [256])
    base = planes[0]
    pin = pin_in_background(base.data_ptr(), 8 * 256)
    h = make_handler([rig.tensor((8, 128))], planes, pin=pin)
    pin.wait()
    assert pin.pinned
    run(h, 1, "store", [0, 1], [2, 3])
    h.shutdown()
    assert not pin.pinned and not base.is_pinned()


class _PinInProgress:
    """A background pin that has not finished: what a copy sees in an engine's first steps."""
    done = pinned = False

    def unregister(self) -> None:
        pass


@CUDA
def test_a_copy_while_the_segment_is_still_being_pinned_warns_nothing(caplog):
    rig = Rig("cuda-unpinned")
    planes = rig.planes(8, [256])
    h = make_handler([rig.tensor((8, 128))], planes, pin=_PinInProgress())
    with caplog.at_level("WARNING", logger="kvshm"):
        run(h, 1, "store", [0, 1], [2, 3])
    h.shutdown()
    assert not [r for r in caplog.records if "not pinned" in r.getMessage()]


@CUDA
def test_a_copy_once_pinning_ended_unpinned_warns_once(caplog):
    pin = _PinInProgress()
    pin.done = True  # it finished without pinning (refused, or failed and logged)
    rig = Rig("cuda-unpinned")
    planes = rig.planes(8, [256])
    h = make_handler([rig.tensor((8, 128))], planes, pin=pin)
    with caplog.at_level("WARNING", logger="kvshm"):
        run(h, 1, "store", [0, 1], [2, 3])
        run(h, 2, "store", [2, 3], [4, 5])
    h.shutdown()
    assert len([r for r in caplog.records if "not pinned" in r.getMessage()]) == 1


def test_explicit_skip_allows_a_job_that_ends_inside_its_last_segment_block():
    """vLLM loads may start and end mid-chunk: 4 device blocks from sub-blocks 1..4 of 2x3."""
    torch = pytest.importorskip("torch")
    from kvshm.transfer.factory import make_handler
    from kvshm.transfer.spec import TransferSpec
    dev = torch.zeros(8, 16, dtype=torch.uint8)
    plane = torch.arange(4 * 48, dtype=torch.int64).remainder(251).to(torch.uint8).reshape(4, 48)
    h = make_handler([dev], [plane], block_size_factor=3)
    try:
        assert h.transfer_async(1, TransferSpec("load", [5, 6, 7, 0], [2, 3], skip=1))
        h.wait([1])
        subs = plane.reshape(12, 16)
        for d, s in zip([5, 6, 7, 0], [7, 8, 9, 10]):
            assert torch.equal(dev[d], subs[s])
        assert not dev[1:5].any()
    finally:
        h.shutdown()


def test_skip_that_leaves_a_whole_segment_block_unused_is_refused():
    torch = pytest.importorskip("torch")
    from kvshm.errors import InvalidArgumentError
    from kvshm.transfer.factory import make_handler
    from kvshm.transfer.spec import TransferSpec
    h = make_handler([torch.zeros(8, 16, dtype=torch.uint8)],
                     [torch.zeros(4, 48, dtype=torch.uint8)], block_size_factor=3)
    try:
        with pytest.raises(InvalidArgumentError):
            h.transfer_async(1, TransferSpec("load", [0, 1], [0, 1], skip=0))
    finally:
        h.shutdown()


@pytest.mark.parametrize("kind", KINDS)
def test_a_plan_keeps_the_ids_it_checked_whatever_the_caller_does_to_its_arrays(kind):
    """A caller that reuses its id arrays (for the next job, or from another thread) once
    the job is issued changes nothing of it: the ids checked are the ids copied, so no
    rewritten id can send the copy outside either side's blocks."""
    from kvshm.transfer.spec import build_geometry, plan_transfer
    geo = build_geometry([torch.zeros(8, 1, dtype=torch.uint8)],
                         [torch.zeros(8, 1, dtype=torch.uint8)])
    dev, seg = np.arange(4, dtype=np.int64), np.arange(4, 8, dtype=np.int64)
    plan = plan_transfer(TransferSpec(kind, dev, seg), geo)
    dev[:], seg[:] = 10**9, -1
    assert plan.device_ids.tolist() == [0, 1, 2, 3]
    assert plan.segment_rows.tolist() == [4, 5, 6, 7]
