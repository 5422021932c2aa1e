"""The co-located engines demo, run as a user runs it: a subprocess with ``--json``.

It must show real cross-engine hits (blocks stored by one engine process and loaded by
another), verify every loaded block, produce the model's replies, and leave nothing behind:
no segment or semaphore in /dev/shm and no owner process (``--keep`` leaves the segment only).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvshm.shm.segment import Segment

from conftest import unique_name

DEMO = Path(__file__).resolve().parents[1] / "examples" / "colocated_engines.py"
SMALL = ["--engines", "2", "--conversations", "3", "--turns", "3", "--system-prompts", "1",
         "--system-tokens", "64", "--user-tokens", "16", "--reply-tokens", "16",
         "--token-bytes", "64", "--device-blocks", "32", "--cache-mib", "1", "--device", "cpu"]


def processes_naming(name: str) -> list[int]:
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if name.encode() in f.read():
                    out.append(int(pid))
        except OSError:
            pass
    return out


def demo(*args: str) -> subprocess.CompletedProcess:
    """The demo as a user runs it (``--json``, the small workload, then ``args``)."""
    return subprocess.run([sys.executable, str(DEMO), "--json", *SMALL, *args],
                          capture_output=True, text=True, timeout=300)


def run_demo(*args: str) -> dict:
    proc = demo(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """A refused run's stderr: exactly one line, and no traceback."""
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return lines[0]


# A 10-block device pool with 4 requests per engine: running requests get preempted while
# their stores are in flight; what they stored is loaded (and verified) by the other engine.
PREEMPTING = ["--conversations", "6", "--system-tokens", "32", "--reply-tokens", "24",
              "--device-blocks", "10", "--max-running", "4"]


@pytest.mark.parametrize("extra", [[], ["--inline-workers", "--block-size-factor", "2"],
                                   PREEMPTING],
                         ids=["worker-processes", "inline-workers-factor-2", "preemptions"])
def test_demo_shares_blocks_across_engines_verifies_them_and_cleans_up(extra):
    name = unique_name()
    r = run_demo("--cache", name, *extra)
    t = r["total"]
    assert t["preemptions"] > 0 or extra is not PREEMPTING
    assert r["cross_engine_blocks"] > 0
    # every loaded block is verified (a request preempted after its load loads again)
    assert t["blocks_verified"] >= t["kvshm_blocks_own"] + t["kvshm_blocks_other"] > 0
    assert t["blocks_mismatched"] == 0 and t["loads_failed"] == 0
    assert r["wrong_outputs"] == 0
    assert t["bytes_loaded"] > 0 and t["bytes_stored"] > 0
    assert t["device_hit_tokens"] + t["kvshm_hit_tokens"] + t["recomputed_tokens"] == \
        t["prompt_tokens"]
    assert [e for e in os.listdir("/dev/shm") if name in e] == []
    assert processes_naming(name) == []


def test_demo_keep_leaves_the_cache_for_inspection_and_no_process():
    name = unique_name()
    try:
        r = run_demo("--cache", name, "--keep", "--turns", "2", "--inline-workers")
        assert r["kept"] and r["caches"] == [name]
        assert processes_naming(name) == []
        seg = Segment.attach(name)
        try:
            assert not seg.owner_alive()
            assert seg.counter("store_blocks") > 0
        finally:
            seg.close()
    finally:
        Segment.unlink(name)


def test_rerunning_a_kept_demo_fails_cleanly_and_keeps_the_cache():
    """The README's ``--keep --cache demo`` line, run again (with or without ``--keep``), must
    neither remove the cache the first run kept nor end in a traceback."""
    name = unique_name()
    try:
        run_demo("--cache", name, "--keep", "--turns", "2", "--inline-workers")
        seg = Segment.attach(name)
        try:
            stored = seg.counter("store_blocks")
            assert stored > 0
        finally:
            seg.close()
        again = [demo("--cache", name, "--keep", "--turns", "2", "--inline-workers"),
                 demo("--cache", name, "--turns", "2", "--inline-workers")]
        seg = Segment.attach(name)  # still there, with what the first run stored
        try:
            assert seg.counter("store_blocks") == stored
        finally:
            seg.close()
        for proc in again:
            err = one_line_error(proc)
            assert name in err and f"kvshm-inspect rm {name}" in err
    finally:
        Segment.unlink(name)


def test_a_demo_on_a_name_in_use_leaves_the_cache_and_its_clients_alone():
    """Another demo (here: a live client of the segment) keeps its cache and its owner when
    a second demo is started on the same name."""
    import kvshm
    from conftest import TEST_LAYOUT, stop_owner
    name = unique_name()
    mgr = kvshm.connect(name, TEST_LAYOUT, num_blocks=8)
    pid = mgr.segment.owner_record()[0]
    try:
        out = mgr.prepare_store([b"k0", b"k1"])
        mgr.complete_store(out.keys_to_store)
        second = demo("--cache", name)
        assert os.path.exists(f"/dev/shm/kvshm-{name}")
        assert mgr.lookup([b"k0", b"k1"]) == 2  # the segment and its owner still serve us
        mgr.release()
        assert name in one_line_error(second)
    finally:
        mgr.shutdown()
        stop_owner(pid)
        Segment.unlink(name)


def _cuda() -> bool:
    import torch
    return torch.cuda.is_available()


@pytest.mark.skipif(not os.path.exists("/dev/nvidiactl") or not _cuda(), reason="needs CUDA")
def test_demo_on_cuda_ends_without_cuda_ipc_warnings():
    """Each engine shares its CUDA KV tensors with its worker process; the worker must
    release them before the engine exits, or torch warns at the engine's exit ("Producer
    process has been terminated before all shared CUDA tensors released", once per engine)."""
    proc = demo("--cache", unique_name(), "--device", "cuda")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Producer process has been terminated" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.skipif(not os.path.exists("/dev/nvidiactl") or not _cuda(), reason="needs CUDA")
def test_demo_on_cuda_copies_from_pinned_memory():
    """Every engine's worker pins the segment before its copies need it; unpinned, the CUDA
    handler warns once per process that it copies from pageable memory."""
    proc = demo("--cache", unique_name(), "--device", "cuda")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not pinned" not in proc.stderr, proc.stderr[-3000:]


@pytest.mark.skipif(not os.path.exists("/dev/nvidiactl") or not _cuda(), reason="needs CUDA")
def test_demo_on_cuda_leaves_nothing_in_dev_shm():
    """An engine shares CUDA memory with its worker; at exit the CUDA driver leaves a
    ``cuda.shm.*`` file in /dev/shm for such a process unless its context was reset."""
    before = set(os.listdir("/dev/shm"))
    proc = demo("--cache", unique_name(), "--device", "cuda")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not set(os.listdir("/dev/shm")) - before


def test_a_worker_whose_handler_cannot_be_made_gives_its_pin_back(monkeypatch):
    """The pin starts before the handler that would own it; if making the handler fails,
    nothing else would ever unregister it."""
    monkeypatch.syspath_prepend(str(Path(DEMO).parent))
    import mini_engine

    import kvshm.transfer.pinning as pinning

    class Pin:
        unregistered = False

        def unregister(self) -> None:
            Pin.unregistered = True

    class Cuda:
        class device:
            type = "cuda"

    class Seg:
        pin_turn = None

        def data_address(self):
            return 4096, 4096

        def torch_planes(self):
            return []

    def refuse(*args, **kwargs):
        raise RuntimeError("no handler")

    monkeypatch.setattr(pinning, "pin_in_background", lambda *a, **k: Pin())
    monkeypatch.setattr(mini_engine.kvshm, "make_handler", refuse)
    with pytest.raises(RuntimeError, match="no handler"):
        mini_engine.make_copier([Cuda()], Seg(), 1)
    assert Pin.unregistered
