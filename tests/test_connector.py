"""Scheduler connector + in-process worker: hashing, lookup/load/store, preemption, completion.

Every flow runs the real data path: a CPU transfer handler copies between "device" tensors and
the segment's planes, and every loaded block is compared byte for byte with the KV the
deterministic model gives for its tokens and positions. Flows run over a LocalManager and over
a SharedManager (with its owner process); the cross-process test stores in one engine process
and loads in another.
"""
from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Iterator

import numpy as np
import pytest
from lazy import torch  # imported at its first use, not when the suite is collected

from kvshm.client.connect import connect
from kvshm.client.manager import SharedManager
from kvshm.engine.connector import SchedulerConnector
from kvshm.engine.hashing import ROOT, block_hashes, offload_key
from kvshm.shm.layout import Layout
from kvshm.owner.manager import LocalManager
from kvshm.shm.segment import Segment
from kvshm.transfer.factory import make_handler
from kvshm.engine.worker import WorkerConnector

import procs
from conftest import KIND_PARAMS, SMALL_GEOMETRY
from test_shared import spawn
from torch_children import CTX  # the engines use torch

BT = 16                 # tokens per device block
TOKEN_BYTES = 256       # KV bytes per token per plane
PAGE = BT * TOKEN_BYTES


def layout(factor: int) -> Layout:
    return Layout((PAGE * factor, PAGE * factor), BT * factor, f"conn-test-f{factor}")


def kv(tokens, start: int, plane: int) -> np.ndarray:
    """The model: KV bytes of ``tokens`` at positions ``start...``, a function of both only."""
    t = np.asarray(tokens, np.uint64)
    pos = np.arange(start, start + len(t), dtype=np.uint64)
    x = t * np.uint64(0x9E3779B97F4A7C15) ^ pos * np.uint64(0xC2B2AE3D27D4EB4F)
    x = x ^ np.uint64(plane + 1) * np.uint64(0x165667B19E3779F9)
    x = x[:, None] + np.arange(TOKEN_BYTES // 8, dtype=np.uint64) * np.uint64(0x94D049BB133111EB)
    x ^= x >> np.uint64(31)
    x *= np.uint64(0xBF58476D1CE4E5B9)
    x ^= x >> np.uint64(29)
    return x.view(np.uint8).reshape(len(t), TOKEN_BYTES)


class Rig:
    """One engine: device tensors, its connector and an in-process worker."""

    def __init__(self, manager, segment: Segment, factor: int = 1, device_blocks: int = 32,
                 num_workers: int = 1):
        self.dev = [torch.zeros(device_blocks, PAGE, dtype=torch.uint8) for _ in range(2)]
        self.handler = make_handler(self.dev, segment.torch_planes(), block_size_factor=factor)
        self.worker = WorkerConnector(self.handler)
        self.conn = SchedulerConnector(manager, device_block_tokens=BT,
                                       block_size_factor=factor, num_workers=num_workers)

    def compute(self, tokens, blocks, first_block: int = 0) -> None:
        for i in range(first_block, len(tokens) // BT):
            for p, d in enumerate(self.dev):
                d[blocks[i]].numpy()[:] = kv(tokens[i * BT:(i + 1) * BT], i * BT, p).ravel()

    def matches(self, tokens, blocks, first_block: int, end_block: int) -> bool:
        return all(np.array_equal(d[blocks[i]].numpy(),
                                  kv(tokens[i * BT:(i + 1) * BT], i * BT, p).ravel())
                   for i in range(first_block, end_block) for p, d in enumerate(self.dev))

    def run(self, jobs):
        """Run every job to the end (flushes first) and report the completions."""
        self.worker.flush(jobs.flush)
        self.worker.submit(jobs.loads + jobs.stores)
        self.worker.flush([j.job_id for j in jobs.loads + jobs.stores])
        return self.conn.jobs_finished(self.worker.poll())

    def store_prompt(self, req: str, tokens, blocks):
        hashes = block_hashes(tokens, BT)
        assert self.conn.get_num_new_matched_tokens(req, hashes, 0) >= 0
        self.conn.update_state_after_alloc(req, blocks, 0)
        self.compute(tokens, blocks)
        jobs = self.conn.build_jobs({req: (len(tokens), blocks)})
        done = self.run(jobs)
        self.conn.request_finished(req)
        return jobs, done

    def close(self) -> None:
        self.handler.shutdown()


def prompt(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(0, 50_000, n).tolist()


@pytest.fixture(params=KIND_PARAMS)
def make(request, seg_name):
    """``make(factor=1, num_blocks=16) -> (manager, segment)`` of the parametrised kind."""
    made = []

    def new(factor: int = 1, num_blocks: int = 16):
        if request.param == "local":
            seg = Segment.create(seg_name, layout(factor), num_blocks, **SMALL_GEOMETRY)
            mgr = LocalManager(seg)
            made.append((mgr, seg, None))
        else:
            mgr = connect(seg_name, layout(factor), num_blocks=num_blocks, **SMALL_GEOMETRY)
            seg = mgr.segment
            made.append((mgr, None, seg.owner_record()[0]))
        return mgr, seg

    yield new
    for mgr, seg, owner in made:
        mgr.shutdown()
        if seg is not None:
            seg.close()
        if owner:
            kill(owner)


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


@contextlib.contextmanager
def shared_client(name: str, layout_: Layout, **kw) -> Iterator[SharedManager]:
    """A client of segment ``name`` (created with ``layout_`` and ``kw``), and afterwards no
    client and no owner of it."""
    mgr = connect(name, layout_, **kw)
    try:
        yield mgr
    finally:
        owner = mgr.segment.owner_record()[0]
        mgr.shutdown()
        kill(owner)


# --- hashing -----------------------------------------------------------------------------
def test_block_hashes_chain_over_the_prefix():
    toks = prompt(1, 50)
    h = block_hashes(toks, BT)
    assert len(h) == 3 and all(len(x) == 32 for x in h)  # the partial tail is not hashed
    other = block_hashes(prompt(2, 16) + toks[16:48], BT)
    assert other[1:] != h[1:3] and other[1] != h[1]  # same tokens, different prefix
    assert block_hashes(toks[16:48], BT, parent=h[0]) == h[1:]
    assert block_hashes(toks, BT, extra=b"lora-7") != h
    assert block_hashes(np.array(toks), BT) == h


def test_offload_key_is_hash_and_big_endian_group():
    h = block_hashes(prompt(3, 16), BT)[0]
    assert offload_key(h) == h + b"\0\0\0\0" and offload_key(h, 258)[-4:] == b"\0\0\x01\x02"
    assert h != ROOT


# --- flows ---------------------------------------------------------------------------------
def test_stored_prefix_is_found_loaded_and_verifies(make):
    mgr, seg = make()
    rig = Rig(mgr, seg)
    toks = prompt(4, 5 * BT + 3)
    jobs, done = rig.store_prompt("a", toks, list(range(6)))
    assert [len(j.spec.segment_block_ids) for j in jobs.stores] == [5]
    assert [d.success for d in done.done] == [True]
    # Request b shares 4 blocks then diverges; its device cache holds the first block.
    toks_b = toks[:4 * BT] + prompt(5, 40)
    hashes = block_hashes(toks_b, BT)
    assert rig.conn.get_num_new_matched_tokens("b", hashes, BT) == 3 * BT
    blocks = list(range(10, 17))
    assert rig.conn.update_state_after_alloc("b", blocks, 3 * BT) == 3 * BT
    jobs = rig.conn.build_jobs({})
    (load,) = jobs.loads
    assert list(load.spec.device_block_ids) == blocks[1:4]
    done = rig.run(jobs)
    assert [(d.kind, d.success) for d in done.done] == [("load", True)]
    assert rig.matches(toks_b, blocks, 1, 4)
    assert rig.conn.request_finished("b") is False
    rig.close()


def test_only_whole_blocks_beyond_the_computed_prefix_count(make):
    mgr, seg = make()
    rig = Rig(mgr, seg)
    toks = prompt(6, 3 * BT)
    rig.store_prompt("a", toks, [0, 1, 2])
    h = block_hashes(toks, BT)
    assert rig.conn.get_num_new_matched_tokens("b", h, 3 * BT) == 0
    assert rig.conn.get_num_new_matched_tokens("c", h, 2 * BT) == BT
    assert rig.conn.get_num_new_matched_tokens("d", block_hashes(prompt(7, 48), BT), 0) == 0
    for r in "bcd":
        rig.conn.update_state_after_alloc(r, [], 0)  # drops the lookup's leases
        assert rig.conn.request_finished(r) is False
    rig.close()


@pytest.mark.parametrize("factor", [2, 3])
def test_block_size_factor_keys_stores_and_skip(make, factor):
    mgr, seg = make(factor=factor)
    rig = Rig(mgr, seg, factor=factor)
    toks = prompt(8, 3 * factor * BT + 5)
    jobs, _ = rig.store_prompt("a", toks, list(range(3 * factor + 1)))
    (store,) = jobs.stores
    assert list(store.spec.device_block_ids) == list(range(3 * factor))
    assert len(store.spec.segment_block_ids) == 3
    h = block_hashes(toks, BT)
    assert mgr.lookup([offload_key(h[i * factor + factor - 1]) for i in range(3)]) == 3
    # The device cache holds one device block: the load skips it inside offloaded block 0.
    n = rig.conn.get_num_new_matched_tokens("b", h, BT)
    assert n == 3 * factor * BT - BT
    blocks = list(range(20, 20 + 3 * factor))
    assert rig.conn.update_state_after_alloc("b", blocks, n) == n
    jobs = rig.conn.build_jobs({})
    assert list(jobs.loads[0].spec.device_block_ids) == blocks[1:]
    rig.run(jobs)
    assert rig.matches(toks, blocks, 1, 3 * factor)
    assert not rig.dev[0][blocks[0]].any()  # skipped, not overwritten
    rig.close()


def test_decode_blocks_are_stored_as_hashes_grow(make):
    mgr, seg = make()
    rig = Rig(mgr, seg)
    toks = prompt(9, 2 * BT)
    hashes = block_hashes(toks, BT)
    rig.conn.get_num_new_matched_tokens("a", hashes, 0)
    rig.conn.update_state_after_alloc("a", [0, 1, 2], 0)
    rig.compute(toks, [0, 1, 2])
    assert len(rig.run(rig.conn.build_jobs({"a": (2 * BT, [0, 1, 2])})).done) == 1
    toks += prompt(10, BT)  # "generated" tokens fill block 2
    hashes += block_hashes(toks[2 * BT:], BT, parent=hashes[-1])
    rig.compute(toks, [0, 1, 2], first_block=2)
    jobs = rig.conn.build_jobs({"a": (3 * BT, [0, 1, 2])})
    assert [list(j.spec.device_block_ids) for j in jobs.stores] == [[2]]
    rig.run(jobs)
    assert mgr.lookup([offload_key(h) for h in block_hashes(toks, BT)]) == 3
    rig.close()


def test_full_cache_store_is_retried_next_step(make):
    mgr, seg = make(num_blocks=4)
    rig = Rig(mgr, seg)
    toks = prompt(11, 4 * BT)
    rig.store_prompt("a", toks, [0, 1, 2, 3])
    h = block_hashes(toks, BT)
    rig.conn.get_num_new_matched_tokens("b", h, 0)
    rig.conn.update_state_after_alloc("b", [4, 5, 6, 7], 4 * BT)  # pins all 4 blocks
    loads = rig.conn.build_jobs({})
    other = prompt(12, 2 * BT)
    rig.conn.get_num_new_matched_tokens("c", block_hashes(other, BT), 0)
    rig.conn.update_state_after_alloc("c", [8, 9], 0)
    rig.compute(other, [8, 9])
    jobs = rig.conn.build_jobs({"c": (2 * BT, [8, 9])})
    assert jobs.stores == [] and rig.conn.store_refused == 1
    rig.run(loads)  # complete_load unpins: now there is room
    jobs = rig.conn.build_jobs({"c": (2 * BT, [8, 9])})
    assert len(jobs.stores) == 1
    rig.run(jobs)
    assert mgr.lookup([offload_key(x) for x in block_hashes(other, BT)]) == 2
    rig.close()


def test_lost_hit_makes_the_engine_recompute(make):
    mgr, seg = make(num_blocks=4)
    rig = Rig(mgr, seg)
    toks = prompt(13, 4 * BT)
    rig.store_prompt("a", toks, [0, 1, 2, 3])
    n = rig.conn.get_num_new_matched_tokens("b", block_hashes(toks, BT), 0)
    assert n == 4 * BT
    # The hit vanishes before prepare_load (as when a dropped lease let it be evicted).
    _evict_everything(mgr, [b"evict-%030d" % i for i in range(4)])
    assert rig.conn.update_state_after_alloc("b", [4, 5, 6, 7], n) == 0
    assert rig.conn.build_jobs({}).loads == []
    rig.close()


def _evict_everything(mgr, keys) -> None:
    out = mgr.prepare_store(keys)
    assert out is not None and len(out.evicted_keys) == len(keys)
    mgr.complete_store(out.keys_to_store)


# --- preemption, request end, completion ------------------------------------------------
@pytest.mark.parametrize("how", ["preempted", "reused"])
def test_preemption_flushes_stores_before_blocks_are_reused(make, how):
    mgr, seg = make()
    rig = Rig(mgr, seg)
    toks = prompt(14, 6 * BT)
    blocks = list(range(6))
    rig.conn.get_num_new_matched_tokens("a", block_hashes(toks, BT), 0)
    rig.conn.update_state_after_alloc("a", blocks, 0)
    rig.compute(toks, blocks)
    jobs = rig.conn.build_jobs({"a": (6 * BT, blocks)})
    rig.worker.submit(jobs.stores)  # in flight
    # Next step: "a" is preempted and its blocks go to another request.
    nxt = rig.conn.build_jobs({}, **({"preempted": ["a"]} if how == "preempted"
                                      else {"reused": blocks[2:4]}))
    assert nxt.flush == {jobs.stores[0].job_id}
    rig.worker.flush(nxt.flush)
    for d in rig.dev:
        d[blocks] = 0xEE  # the new owner of the blocks overwrites them
    done = rig.conn.jobs_finished(rig.worker.poll())
    assert [d.success for d in done.done] == [True]
    # What was published is a's KV, not the new owner's bytes.
    h = block_hashes(toks, BT)
    assert rig.conn.get_num_new_matched_tokens("b", h, 0) == 6 * BT
    rig.conn.update_state_after_alloc("b", list(range(10, 16)), 6 * BT)
    rig.run(rig.conn.build_jobs({}))
    assert rig.matches(toks, list(range(10, 16)), 0, 6)
    rig.close()


def test_preempting_a_request_before_its_load_was_sent_cancels_the_load(make):
    mgr, seg = make(num_blocks=2)
    rig = Rig(mgr, seg)
    toks = prompt(21, 2 * BT)
    rig.store_prompt("a", toks, [0, 1])
    rig.conn.get_num_new_matched_tokens("b", block_hashes(toks, BT), 0)
    assert rig.conn.update_state_after_alloc("b", [2, 3], 2 * BT) == 2 * BT
    assert mgr.prepare_store([b"x1", b"x2"]) is None  # pinned by b's load
    jobs = rig.conn.build_jobs({}, preempted=["b"])
    assert jobs.loads == [] and jobs.flush == set()
    assert rig.conn.pending_jobs() == set() and rig.conn.request_finished("b") is False
    assert mgr.prepare_store([b"x1", b"x2"]) is not None  # the pins are gone
    rig.close()


def test_request_finished_with_stores_in_flight_keeps_its_blocks(make):
    mgr, seg = make()
    rig = Rig(mgr, seg)
    toks = prompt(15, 2 * BT)
    rig.conn.get_num_new_matched_tokens("a", block_hashes(toks, BT), 0)
    rig.conn.update_state_after_alloc("a", [0, 1], 0)
    rig.compute(toks, [0, 1])
    jobs = rig.conn.build_jobs({"a": (2 * BT, [0, 1])})
    rig.worker.submit(jobs.stores)
    assert rig.conn.request_finished("a") is True  # do not free blocks 0, 1 yet
    rig.worker.flush([jobs.stores[0].job_id])
    done = rig.conn.jobs_finished(rig.worker.poll())
    assert done.freeable == ["a"]
    assert rig.conn.request_finished("a") is False
    rig.close()


def test_job_completes_only_when_every_worker_reported(make):
    mgr, seg = make()
    rig = Rig(mgr, seg, num_workers=2)
    toks = prompt(16, 2 * BT)
    key = [offload_key(h) for h in block_hashes(toks, BT)]
    rig.conn.get_num_new_matched_tokens("a", block_hashes(toks, BT), 0)
    rig.conn.update_state_after_alloc("a", [0, 1], 0)
    rig.compute(toks, [0, 1])
    jobs = rig.conn.build_jobs({"a": (2 * BT, [0, 1])})
    job_id = jobs.stores[0].job_id
    assert rig.conn.jobs_finished([(job_id, True)]).done == []
    assert mgr.lookup(key) == 0  # not published after one of two workers
    assert rig.conn.request_finished("a") is True
    done = rig.conn.jobs_finished([(job_id, True)])
    assert [d.job_id for d in done.done] == [job_id] and done.freeable == ["a"]
    assert mgr.lookup(key) == 2
    rig.close()


def test_failed_store_on_any_worker_frees_its_blocks(make):
    mgr, seg = make(num_blocks=4)
    rig = Rig(mgr, seg, num_workers=2)
    toks = prompt(17, 4 * BT)
    rig.conn.get_num_new_matched_tokens("a", block_hashes(toks, BT), 0)
    rig.conn.update_state_after_alloc("a", [0, 1, 2, 3], 0)
    jobs = rig.conn.build_jobs({"a": (4 * BT, [0, 1, 2, 3])})
    job_id = jobs.stores[0].job_id
    done = rig.conn.jobs_finished([(job_id, True), (job_id, False)])
    assert [d.success for d in done.done] == [False]
    assert mgr.lookup([offload_key(h) for h in block_hashes(toks, BT)]) == 0
    out = mgr.prepare_store([b"after-%d" % i for i in range(4)])  # all 4 blocks are free
    assert out is not None and out.evicted_keys == []
    rig.close()


def test_failed_load_still_releases_its_pins(make):
    mgr, seg = make(num_blocks=2)
    rig = Rig(mgr, seg)
    toks = prompt(18, 2 * BT)
    rig.store_prompt("a", toks, [0, 1])
    rig.conn.get_num_new_matched_tokens("b", block_hashes(toks, BT), 0)
    rig.conn.update_state_after_alloc("b", [2, 3], 2 * BT)
    (load,) = rig.conn.build_jobs({}).loads
    assert mgr.prepare_store([b"x1", b"x2"]) is None  # pinned
    done = rig.conn.jobs_finished([(load.job_id, False)])
    assert [(d.kind, d.success) for d in done.done] == [("load", False)]
    getattr(mgr, "release", lambda: None)()
    assert mgr.prepare_store([b"x1", b"x2"]) is not None
    rig.close()


# --- across processes ----------------------------------------------------------------------
def _engine_a(name: str, conn, seed: int, n: int) -> None:
    """Another engine process: stores the KV of its prompt, reports, exits."""
    mgr = connect(name)
    rig = Rig(mgr, mgr.segment, device_blocks=16)
    toks = prompt(seed, n)
    _, done = rig.store_prompt("a", toks, list(range(n // BT)))
    conn.send([d.success for d in done.done])
    rig.close()
    mgr.shutdown()


@pytest.mark.procs
def test_prefix_stored_by_another_engine_process_is_loaded_and_verifies(seg_name):
    with shared_client(seg_name, layout(1), num_blocks=16, **SMALL_GEOMETRY) as mgr:
        parent, child = CTX.Pipe()
        p = CTX.Process(target=_engine_a, args=(seg_name, child, 19, 8 * BT), daemon=True)
        p.start()
        assert parent.recv() == [True]
        p.join()
        rig = Rig(mgr, mgr.segment)
        toks = prompt(19, 8 * BT) + prompt(20, 20)
        n = rig.conn.get_num_new_matched_tokens("b", block_hashes(toks, BT), 0)
        assert n == 8 * BT
        blocks = list(range(3, 13))
        rig.conn.update_state_after_alloc("b", blocks, n)
        done = rig.run(rig.conn.build_jobs({}))
        assert [d.success for d in done.done] == [True]
        assert rig.matches(toks, blocks, 0, 8)
        rig.close()


def a_full_cache_of_one_prompt(mgr, seed: int):
    """A rig over ``mgr``'s 4-block cache, which request "a" filled with one prompt: the rig,
    the prompt's tokens and its block hashes."""
    rig = Rig(mgr, mgr.segment)
    toks = prompt(seed, 4 * BT)
    rig.store_prompt("a", toks, [0, 1, 2, 3])
    return rig, toks, block_hashes(toks, BT)


@pytest.mark.procs
def test_a_hit_two_requests_share_stays_loadable_when_one_of_them_does_not_load(seg_name):
    # Requests b and c look up the same prefix in one step (one lease per key in the
    # client); b is not loaded, which releases its hits. Another engine then stores as many
    # blocks as the cache has: c's hits must still be loadable.
    with shared_client(seg_name, layout(1), num_blocks=4, **SMALL_GEOMETRY) as mgr:
        rig, toks, hashes = a_full_cache_of_one_prompt(mgr, 21)
        assert rig.conn.get_num_new_matched_tokens("b", hashes, 0) == 4 * BT
        assert rig.conn.get_num_new_matched_tokens("c", hashes, 0) == 4 * BT
        assert rig.conn.update_state_after_alloc("b", [], 0) == 0  # b loads nothing
        fresh = [b"other-engine-%02d" % i for i in range(4)]
        p, conn = spawn(procs.store_and_report, seg_name, fresh)
        stored = conn.recv()
        p.join()
        blocks = [4, 5, 6, 7]
        assert rig.conn.update_state_after_alloc("c", blocks, 4 * BT) == 4 * BT
        done = rig.run(rig.conn.build_jobs({}))
        assert [d.success for d in done.done] == [True]
        assert rig.matches(toks, blocks, 0, 4)
        assert stored == []  # c's leases left it no room
        rig.close()


@pytest.mark.procs
@pytest.mark.parametrize("factor", [1, 2])
def test_completed_jobs_count_their_bytes_in_the_client_counters(seg_name, factor):
    from kvshm.shm import layout as L
    from kvshm.shm import slots
    with shared_client(seg_name, layout(factor), num_blocks=16, **SMALL_GEOMETRY) as mgr:
        rig = Rig(mgr, mgr.segment, factor=factor)
        ctr = slots.counters(mgr.segment, mgr.slot)
        bytes_in, bytes_out = (L.SLOT_COUNTERS.index(n) for n in ("bytes_in", "bytes_out"))
        block = layout(factor).block_bytes
        toks = prompt(11, 3 * factor * BT)
        rig.store_prompt("a", toks, list(range(3 * factor)))
        assert (int(ctr[bytes_in]), int(ctr[bytes_out])) == (0, 3 * block)
        # A load that skips the one device block the device cache already holds.
        h = block_hashes(toks, BT)
        n = rig.conn.get_num_new_matched_tokens("b", h, BT)
        blocks = list(range(20, 20 + 3 * factor))
        assert rig.conn.update_state_after_alloc("b", blocks, n) == n
        assert [d.success for d in rig.run(rig.conn.build_jobs({})).done] == [True]
        assert int(ctr[bytes_in]) == (3 * factor - 1) * block // factor > 0
        assert int(ctr[bytes_out]) == 3 * block
        rig.close()


@pytest.mark.procs
def test_looking_a_request_up_again_with_a_new_hash_list_keeps_no_lease(seg_name):
    # A request looked up a second time with its hashes in another list object (same
    # content) dropped its derived keys before it gave back the first lookup's leases:
    # the release named no key, the leases outlived the request, and another engine
    # could never reuse those blocks while this scheduler lived.
    with shared_client(seg_name, layout(1), num_blocks=4, **SMALL_GEOMETRY) as mgr:
        rig, toks, hashes = a_full_cache_of_one_prompt(mgr, 22)
        assert rig.conn.get_num_new_matched_tokens("b", hashes, 0) == 4 * BT
        assert rig.conn.get_num_new_matched_tokens("b", list(hashes), 0) == 4 * BT
        assert rig.conn.request_finished("b") is False
        assert mgr.held_blocks() == 0
        p, conn = spawn(procs.store_and_report, seg_name, [b"other-%02d" % i for i in range(4)])
        stored = conn.recv()
        p.join()
        assert len(stored) == 4  # nothing of b's is held: the other engine found room
        rig.close()
