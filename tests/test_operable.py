"""An owner an operator can run: its log file, its log level, rm after the last client left,
and which owner changes count as failovers."""
from __future__ import annotations

import logging
import os
import stat
import subprocess
import sys
import time
import uuid
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
    rc = main(["rm", name, "--wait", "30", "--keep-log"])
    out, err = capsys.readouterr()
    assert rc == 0 and out == f"removed {name}\n", err
    assert "waiting for the owner's idle exit" in err and time.monotonic() - t < 30
    assert "exiting" in log.read_text()
    log.unlink()


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


def wait_for_log(log: Path, text: str, timeout: float = 30.0) -> str:
    deadline = time.monotonic() + timeout
    while text not in (got := log.read_text() if log.exists() else ""):
        assert time.monotonic() < deadline, f"no {text!r} in the owner log: {got[-500:]!r}"
        time.sleep(0.05)  # polling another process's log file, bounded by the deadline
    return got


def test_rm_removes_the_owner_log_unless_told_to_keep_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    for keep in (False, True):
        name = unique_name()
        log = tmp_path / f"kvshm-{name}-owner.log"
        mgr = connect(name, TEST_LAYOUT, num_blocks=8)
        try:
            wait_for_log(log, "owner of")
        finally:
            mgr.shutdown()
        try:
            rc = main(["rm", name, "--force", *["--keep-log"] * keep])
            out, err = capsys.readouterr()
            assert rc == 0 and f"removed {name}" in out, err
            assert log.exists() == keep, out
            assert (str(log) in out) == (not keep), out  # says which log it removed
        finally:
            Segment.unlink(name, keep_log=True)
            log.unlink(missing_ok=True)


def test_an_owner_log_stays_bounded_across_owner_starts(tmp_path, monkeypatch):
    """A log a long life of owners filled is cut to its newest part when the next owner
    starts: the file stays under the bound and keeps the newest lines."""
    from kvshm.logs import LOG_LIMIT
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    name = unique_name()
    log = tmp_path / f"kvshm-{name}-owner.log"
    with open(log, "w") as f:
        for i in range(3 * LOG_LIMIT // 32):
            f.write(f"old line {i:020d}\n")  # 30 bytes each: 3 bounds' worth
    last_old = f"old line {3 * LOG_LIMIT // 32 - 1:020d}\n"
    mgr = connect(name, TEST_LAYOUT, num_blocks=8)
    try:
        text = wait_for_log(log, "owner of")
        assert len(text) <= LOG_LIMIT
        assert last_old in text and text.startswith("[")  # says older lines were cut
    finally:
        mgr.shutdown()
        main(["rm", name, "--force"])


def test_the_owner_keeps_its_own_log_bounded(tmp_path):
    """An owner that logs a lot in one life keeps its log (its stderr) under the bound."""
    from kvshm.logs import BoundedStderr
    path = tmp_path / "owner.log"
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
    stream = os.fdopen(fd, "w", buffering=1)
    handler = BoundedStderr(str(path), limit=4096, stream=stream)
    logger = logging.getLogger(f"kvshm.test.{uuid.uuid4().hex}")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        for i in range(1000):
            logger.warning("line %04d of a chatty owner", i)
            assert path.stat().st_size <= 4096
    finally:
        logger.removeHandler(handler)
        stream.close()
    lines = path.read_text().splitlines()
    assert lines[-1] == "line 0999 of a chatty owner" and lines[0].startswith("[")


COMMANDS = (["-m", "kvshm.cli"], ["-m", "kvshm.cli", "serve"], ["-m", "kvshm.cli", "mover"],
            ["-m", "kvshm.owner"], ["-m", "kvshm.inspect.cli"])


def test_every_command_states_the_one_exit_status_policy_in_its_help():
    from kvshm.commands import EXIT_STATUS
    for cmd in COMMANDS:
        out = subprocess.run([sys.executable, *cmd, "--help"], env=ENV, capture_output=True,
                             text=True)
        assert out.returncode == 0, (cmd, out.stderr)
        assert " ".join(EXIT_STATUS.split()) in " ".join(out.stdout.split()), cmd


def test_daemons_that_cannot_run_exit_2_with_one_line():
    name = unique_name()  # no such segment
    for cmd in (["-m", "kvshm.cli", "serve", name],
                ["-m", "kvshm.cli", "mover", name, "--master", "127.0.0.1:1", "--metadata",
                 "http://127.0.0.1:1/metadata"]):
        out = subprocess.run([sys.executable, *cmd], env=ENV, capture_output=True, text=True,
                             timeout=60)
        errors = [line for line in out.stderr.splitlines() if ": error: " in line]
        assert out.returncode == 2 and len(errors) == 1, (cmd, out.stderr)
        assert "Traceback" not in out.stderr, out.stderr
