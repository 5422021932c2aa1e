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
        [sys.executable, "-m", "kvshm.owner", seg.name, "--detach", "--hold", "--idle-exit", "30"],
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


_FORK_HOLDS_THE_PIPE = """
import os, subprocess, sys, time
real = subprocess.Popen
class Popen(real):
    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        if os.fork() == 0:  # a fork of the client (a multiprocessing worker, say) that
            time.sleep(600)  # keeps every fd it inherited, the launcher's stdin pipe too
            os._exit(0)
subprocess.Popen = Popen
from kvshm.client.connect import connect
mgr = connect(sys.argv[1])
print("connected", flush=True)
mgr.shutdown()
os.killpg(0, 9)  # the fork too (the test runs us in a group of our own)
"""


def test_a_fork_of_the_client_holding_the_launchers_stdin_does_not_hang_the_connect(seg):
    proc = subprocess.Popen([sys.executable, "-c", _FORK_HOLDS_THE_PIPE, seg.name], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=120)  # the fork sleeps 600 s: a hang fails here
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    assert out.split() == ["connected"], err[-3000:]


def test_detach_from_a_shell_never_waits_for_or_reads_the_callers_stdin(seg):
    """``python -m kvshm.owner NAME --detach`` in a pipeline: the launcher prints the pid and
    exits, whatever its stdin (a pipe left open here), and reads none of it."""
    launcher = subprocess.Popen(
        [sys.executable, "-m", "kvshm.owner", seg.name, "--detach", "--idle-exit", "30"],
        env=ENV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        launcher.stdin.write(b"the caller's own input\n")
        launcher.stdin.flush()
        owner = int(launcher.stdout.readline())
        assert launcher.wait(60) == 0  # with its stdin still open
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        launcher.stdout.close()
        launcher.stdin.close()
    stop_owner(owner)


def test_detach_with_bad_arguments_fails_at_once_and_forks_nothing():
    out = subprocess.run([sys.executable, "-m", "kvshm.owner", "--detach"], env=ENV,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == "" and "usage:" in out.stderr


_CONNECT = """
import sys
from kvshm.client.connect import connect
mgr = connect(sys.argv[1])
print(mgr.segment.owner_alive(), flush=True)
mgr.shutdown()
"""


@pytest.mark.parametrize("signal_name", ["KILL", "STOP"])
def test_a_launcher_that_dies_or_stalls_before_the_pid_leaves_its_owner_serving(seg,
                                                                                signal_name):
    """The client watches the segment, not only the launcher: the owner the launcher forked
    takes the segment, and the connect goes on with it (a stalled launcher is killed)."""
    env = {**ENV, "KVSHM_CRASH_AT": "owner.launch.before_pid",
           "KVSHM_CRASH_SIGNAL": signal_name}
    out = subprocess.run([sys.executable, "-c", _CONNECT, seg.name], env=env,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True"]


def test_an_owner_killed_as_it_starts_sends_its_client_on_to_the_next_one(seg):
    """The launcher dies before it names the owner, and the owner, once it took the segment,
    is killed (as a soak's owner killer does): the client that started it starts another
    and goes on, rather than failing its call with OwnerUnavailableError."""
    import signal
    import threading
    env = {**ENV, "KVSHM_CRASH_AT": "owner.launch.before_pid", "KVSHM_CRASH_SIGNAL": "KILL"}
    killed: list[int] = []

    def kill_the_first_owner() -> None:
        deadline = time.monotonic() + 60
        while not killed and time.monotonic() < deadline:
            pid = seg.owner_record()[0]
            if pid:
                os.kill(pid, signal.SIGKILL)
                killed.append(pid)
            time.sleep(0.001)  # polling the owner record; the assertion is on the client

    killer = threading.Thread(target=kill_the_first_owner)
    killer.start()
    out = subprocess.run([sys.executable, "-c", _CONNECT, seg.name], env=env,
                         capture_output=True, text=True, timeout=120)
    killer.join()
    assert killed and out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["True"]
    assert seg.owner_record()[0] not in (0, killed[0])
