"""The co-located engines demo checks every option before it starts anything: a bad value is
one line on stderr and exit 2, never a traceback or a run that "succeeds" with nonsense; and
Ctrl-C stops it with one line, its engines gone and the cache it created removed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from kvshm.shm.segment import Segment

from conftest import unique_name
from test_demo import DEMO, demo, one_line_error, processes_naming

BAD = {  # option values -> what the one line must name
    "engines-0": (["--engines", "0"], "--engines"),
    "engines-negative": (["--engines", "-1"], "--engines"),
    "engines-not-a-number": (["--engines", "x"], "--engines"),
    "too-many-engines": (["--engines", "100000"], "--engines"),
    "conversations-0": (["--conversations", "0"], "--conversations"),
    "turns-0": (["--turns", "0"], "--turns"),
    "system-prompts-0": (["--system-prompts", "0"], "--system-prompts"),
    "reply-tokens-0": (["--reply-tokens", "0"], "--reply-tokens"),
    "block-tokens-0": (["--block-tokens", "0"], "--block-tokens"),
    "block-size-factor-0": (["--block-size-factor", "0"], "--block-size-factor"),
    "token-bytes-0": (["--token-bytes", "0"], "--token-bytes"),
    "device-blocks-0": (["--device-blocks", "0"], "--device-blocks"),
    "device-blocks-too-few": (["--device-blocks", "3"], "--device-blocks"),
    "max-running-0": (["--max-running", "0"], "--max-running"),
    "seed-negative": (["--seed", "-1"], "--seed"),
    "cache-mib-negative": (["--cache-mib", "-1"], "--cache-mib"),
    "cache-mib-too-small": (["--cache-mib", "0.01"], "--cache-mib"),
    "cache-mib-nan": (["--cache-mib", "nan"], "--cache-mib"),
    "cache-name-slash": (["--cache", "a/b"], "--cache"),
    "cache-name-empty": (["--cache", ""], "--cache"),
    "cache-name-too-long": (["--cache", "x" * 200], "--cache"),
    "unknown-option": (["--no-such-option", "2"], "--no-such-option"),
}


@pytest.mark.parametrize("args,names", BAD.values(), ids=BAD.keys())
def test_a_bad_option_is_one_line_and_exit_2(args, names):
    name = unique_name()
    err = one_line_error(demo("--cache", name, *args))  # a later --cache wins
    assert names in err and err.startswith("colocated_engines.py: error: "), err
    assert [e for e in os.listdir("/dev/shm") if name in e] == []  # nothing was created


def test_device_cuda_without_cuda_is_one_line_and_exit_2():
    import torch
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA: --device cuda is valid here")
    err = one_line_error(demo("--device", "cuda"))
    assert "--device cuda" in err and "--device cpu" in err, err


def test_ctrl_c_stops_the_demo_with_one_line_and_leaves_nothing():
    """Ctrl-C reaches the whole foreground process group (the demo, its engines and their
    workers), as a terminal sends it; the demo was printing a 24-line traceback."""
    name = unique_name()
    proc = subprocess.Popen([sys.executable, str(DEMO), "--cache", name, "--device", "cpu",
                             "--turns", "19"], start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not engines_connected(name, 3):  # the engines serve: it is mid-run
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()
            time.sleep(0.05)  # polling the segment's client slots, bounded by the deadline
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        Segment.unlink(name)
    lines = err.strip().splitlines()
    assert proc.returncode == 130 and len(lines) == 1, (proc.returncode, err[-3000:])
    assert "interrupted" in lines[0] and "Traceback" not in err, err
    assert not os.path.exists(f"/dev/shm/kvshm-{name}")  # the cache it created went
    # Owners the engines were starting as they were stopped find the segment gone and exit.
    deadline = time.monotonic() + 60
    while left := processes_naming(name):
        assert time.monotonic() < deadline, [open(f"/proc/{p}/cmdline", "rb").read()
                                             for p in left]
        time.sleep(0.05)  # polling for their exit, bounded by the deadline


def engines_connected(name: str, n: int) -> bool:
    """Whether segment ``name`` exists and at least ``n`` clients are attached to it."""
    try:
        seg = Segment.attach(name)
    except Exception:  # not created yet, or mid-creation
        return False
    try:
        return len(seg.clients_alive()) >= n
    finally:
        seg.close()
