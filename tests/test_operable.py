"""An owner an operator can run: its log file, its log level, rm after the last client left,
and which owner changes count as failovers."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
import time
from pathlib import Path

from conftest import TEST_LAYOUT, unique_name
from kvshm.client.connect import connect
from kvshm.owner.manager import LocalManager
from kvshm.inspect.cli import main
from kvshm.shm.segment import Segment

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


def test_owner_log_file_show_and_rm_waits_for_idle_owner(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    name = unique_name()
    log = tmp_path / f"kvshm-{name}-owner.log"
    mgr = connect(name, TEST_LAYOUT, num_blocks=8)
    try:
        deadline = time.monotonic() + 10
        while "owner of" not in (log.read_text() if log.exists() else ""):
            assert time.monotonic() < deadline, "the owner logged nothing"
            time.sleep(0.05)
        assert stat.S_IMODE(log.stat().st_mode) == 0o600
        assert main(["show", name]) == 0
        assert f"owner log {log}" in capsys.readouterr().out
    finally:
        mgr.shutdown()
    t = time.monotonic()
    rc = main(["rm", name, "--wait", "30"])
    out, err = capsys.readouterr()
    assert rc == 0 and out == f"removed {name}\n", err
    assert "waiting for the owner's idle exit" in err and time.monotonic() - t < 30
    assert "exiting" in log.read_text()


def test_rm_wait_zero_refuses_at_once(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    name = unique_name()
    connect(name, TEST_LAYOUT, num_blocks=8).shutdown()
    try:
        assert main(["rm", name, "--wait", "0"]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "the owner" in err and "--force" in err, err
        assert main(["rm", name, "--force"]) == 0
    finally:
        Segment.unlink(name)


def test_gc_and_clean_exits_are_not_failovers(capsys):
    name = unique_name()
    seg = Segment.create(name, TEST_LAYOUT, 8, max_clients=2, ring_capacity=4096,
                         hold_capacity=16)
    try:
        LocalManager(seg).shutdown()
        LocalManager(seg).shutdown()  # a clean exit before: no failover
        assert seg.counter("failovers") == 0
        pid, epoch, since, tick = seg.owner_record()
        seg.write_owner_record(999999, epoch, since, tick)  # as if it died holding it
        assert main(["gc", name]) == 0
        assert seg.counter("failovers") == 0 and seg.owner_record()[0] == 999999
        m = LocalManager(seg)  # the next real owner counts that death, once
        assert seg.counter("failovers") == 1 and m.epoch == epoch + 2
        m.shutdown()
    finally:
        seg.close()
        Segment.unlink(name)


def test_log_level_is_checked_and_case_insensitive():
    for cmd in (["-m", "kvshm.cli", "serve"], ["-m", "kvshm.owner"]):
        p = subprocess.run([sys.executable, *cmd, "x", "--log-level", "foo"], env=ENV,
                           capture_output=True, text=True, timeout=60)
        assert p.returncode == 2 and "invalid choice: 'FOO'" in p.stderr, p.stderr
        assert "Traceback" not in p.stderr
    p = subprocess.run([sys.executable, "-m", "kvshm.owner", unique_name(),
                        "--log-level", "debug"], env=ENV, capture_output=True, text=True,
                       timeout=60)
    assert p.returncode == 2 and "no kvshm segment named" in p.stderr, p.stderr
