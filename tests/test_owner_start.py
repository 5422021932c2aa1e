"""How a client starts an owner: detached, watched, whatever the client's process is like.

A client that finds no owner runs ``python -m kvshm.owner NAME --detach``: that launcher
forks the owner off, prints its pid, and exits once the client watches the owner (a pidfd,
or the pid where pidfds are refused). These tests start real clients in processes of their
own, with what engines have: many open files, a sandbox that refuses pidfds.
"""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TEST_LAYOUT, stop_owner
from kvshm.shm.segment import Segment

pytestmark = pytest.mark.procs

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def run_client(source: str, name: str) -> str:
    """Run ``source`` (with ``name`` as argv[1]) in a fresh interpreter; its stdout."""
    out = subprocess.run([sys.executable, "-c", source, name], env=ENV, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


@pytest.fixture
def seg(seg_name):
    s = Segment.create(seg_name, TEST_LAYOUT, 8, max_clients=4)
    yield s
    stop_owner(s.owner_record()[0])
    s.close()


_MANY_FILES = """
import os, resource, sys
from kvshm.client.connect import connect
soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4096), hard))
fds = [os.dup(0) for _ in range(1100)]  # as an engine with many sockets and files open
mgr = connect(sys.argv[1])
print(mgr.segment.owner_record()[0], max(fds))
mgr.shutdown()
"""


def test_a_client_with_more_than_1024_open_files_starts_an_owner(seg):
    import resource
    if resource.getrlimit(resource.RLIMIT_NOFILE)[1] < 1200:
        pytest.skip("the hard limit of open files is below 1200 here")
    owner, top_fd = map(int, run_client(_MANY_FILES, seg.name).split())
    assert top_fd >= 1100 and owner > 0 and seg.owner_alive()


_NO_PIDFDS = """
import errno, os, sys
def refused(pid, flags=0):
    raise PermissionError(errno.EPERM, "Operation not permitted")
os.pidfd_open = refused  # as a container whose seccomp profile predates pidfds
from kvshm.client.connect import connect
mgr = connect(sys.argv[1])
owner = mgr._link.owner_proc
assert owner is not None and owner.pid == mgr.segment.owner_record()[0]
assert not owner.exited()
owner.terminate()
owner.wait(30)
assert owner.exited()
print("stopped", owner.pid)
mgr.shutdown()
"""


def test_a_client_refused_pidfds_starts_and_watches_its_owner_by_pid(seg):
    assert run_client(_NO_PIDFDS, seg.name).split()[0] == "stopped"


def _ppid(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_the_launcher_stays_the_owners_parent_until_its_reader_lets_go(seg):
    """The owner's pid cannot be reused while the client opens its pidfd: its parent, the
    launcher, lives (and so would hold its zombie) until the client closes its stdin."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "kvshm.owner", seg.name, "--detach", "--idle-exit", "30"],
        env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        owner = int(launcher.stdout.readline())
        deadline = time.monotonic() + 60
        while not seg.owner_alive():  # the owner has started and taken the segment
            assert time.monotonic() < deadline, "the owner never took the segment"
            time.sleep(0.005)  # polling another process's lock, bounded by the deadline
        assert launcher.poll() is None and _ppid(owner) == launcher.pid
        launcher.stdin.close()
        assert launcher.wait(60) == 0
        assert _ppid(owner) != launcher.pid and os.getsid(owner) == owner
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        launcher.stdout.close()
    stop_owner(owner)
