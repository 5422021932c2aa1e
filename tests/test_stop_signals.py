"""The daemons an operator runs stop as daemons should: ``kvshm serve`` and ``kvshm mover``,
sent SIGTERM (a process manager) or SIGINT (Ctrl-C), exit 0 and say so in one line, with no
traceback (it would land in the log and read as a crash).

Each test runs the real command in its own process, waits until it says it serves (its
signal handlers are in place by then), signals it, and reads everything it printed after.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import TEST_LAYOUT, stop_owner
from kvshm.shm import layout as L
from kvshm.shm.segment import Segment

ROOT = Path(__file__).resolve().parents[1]

# A mover needs a lower tier: this one is the in-memory fake, swapped in for Mooncake's
# client before the real 'kvshm mover' command line is parsed and run.
MOVER = """\
import sys
sys.path.insert(0, {tests!r})
import kvshm.tier.mooncake as mc
from tier_fake import FakeStore, FakeTier
mc.MooncakeTier = lambda config: FakeTier(FakeStore())
from kvshm.cli import main
sys.exit(main(["mover", sys.argv[1], "--master", "127.0.0.1:1", "--metadata", "http://x"]))
"""


class Stderr:
    """A child's stderr read line by line with a deadline. It reads the pipe's fd itself:
    a buffered file would take several lines in one read, and a select() on its fd would
    then wait for a line that already sits in the file's buffer."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.rest = b""  # read from the pipe, after the last line handed out

    def until(self, marker: str, timeout: float = 60.0) -> list[str]:
        """Lines up to and including the first that contains ``marker``."""
        lines: list[str] = []
        deadline = time.monotonic() + timeout
        while not lines or marker not in lines[-1]:
            if b"\n" in self.rest:
                line, self.rest = self.rest.split(b"\n", 1)
                lines.append(line.decode())
                continue
            left = deadline - time.monotonic()
            assert left > 0 and self.proc.poll() is None, f"no {marker!r} in: {lines}"
            fd = self.proc.stderr.fileno()
            if select.select([fd], [], [], left)[0]:
                chunk = os.read(fd, 65536)
                assert chunk, f"stderr closed before {marker!r}: {lines}"
                self.rest += chunk
        return lines

    def stop_with(self, sig: signal.Signals) -> tuple[int, list[str]]:
        """Signal the child; its exit status and what it printed to stderr afterwards."""
        self.proc.send_signal(sig)
        _, err = self.proc.communicate(timeout=60)
        return self.proc.returncode, (self.rest + err).decode().splitlines()


def wait_asleep(seg: Segment, offset: int, timeout: float = 60.0) -> None:
    """Until the doorbell whose sleeper flag is at ``offset`` has its consumer asleep on its
    semaphore (the flag is raised just before the wait): a signal then interrupts that wait."""
    flag = seg.buf[offset:offset + 8].cast("Q")
    try:
        deadline = time.monotonic() + timeout
        while not flag[0]:
            assert time.monotonic() < deadline, "the consumer never went to sleep"
            time.sleep(0.001)  # polling another process's flag, bounded by the deadline
    finally:
        flag.release()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_kvshm_serve_stops_on_a_signal_with_exit_0_and_one_line(sig, seg_name, tmp_path):
    seg = Segment.create(seg_name, TEST_LAYOUT, 8, max_clients=2)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_RUNTIME_DIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "kvshm.cli", "serve", seg_name],
                            env=env, stderr=subprocess.PIPE)
    try:
        err = Stderr(proc)
        err.until(f"owner of {seg_name}")
        wait_asleep(seg, L.OFF_OWNER_BELL)
        rc, after = err.stop_with(sig)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        seg.close()
    assert rc == 0 and len(after) == 1, (rc, after)
    assert sig.name in after[0] and "Traceback" not in after[0], after


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_kvshm_mover_stops_on_a_signal_with_exit_0_and_one_line(sig, seg_name, tmp_path):
    seg = Segment.create(seg_name, TEST_LAYOUT, 8, max_clients=4)
    env = {**os.environ, "PYTHONPATH": str(ROOT), "XDG_RUNTIME_DIR": str(tmp_path)}
    proc = subprocess.Popen(
        [sys.executable, "-c", MOVER.format(tests=str(ROOT / "tests")), seg_name],
        env=env, stderr=subprocess.PIPE)
    try:
        # its lower tier's connection is logged from another thread, before or after the
        # mover says it serves: wait for both, so that every line after the signal is the
        # mover's answer to it
        err = Stderr(proc)
        seen = err.until("connected to")
        if not any(f"mover of segment {seg_name!r}" in line for line in seen):
            err.until(f"mover of segment {seg_name!r}")
        rc, after = err.stop_with(sig)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        stop_owner(seg.owner_record()[0])  # the owner the mover's connect started
        seg.close()
    assert rc == 0 and len(after) == 1, (rc, after)
    assert sig.name in after[0] and "Traceback" not in after[0], after
