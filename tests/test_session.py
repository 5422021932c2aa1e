"""The suite's own rules, kept by tests/conftest.py: every test has exactly one tier, a unit
test starts no process, and a session that leaves something behind fails.

The session checks are proven on real pytest sessions: a child ``python -m pytest`` runs a
small test file written here, with this suite's conftest as its plugin and its setup.cfg.
"""
from __future__ import annotations

import configparser
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import BESIDE_TIERS, FILE_TIERS, TIERS, tier_of
from kvshm.shm.segment import Segment

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent


# --- tiers -------------------------------------------------------------------------------
def test_every_test_file_has_a_tier_and_every_entry_names_a_file():
    assert sorted(FILE_TIERS) == sorted(p.name for p in TESTS.glob("test_*.py"))
    assert set(FILE_TIERS.values()) <= set(TIERS)


def test_the_tiers_and_the_marks_beside_them_are_the_markers_in_setup_cfg():
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    pytest_cfg = cfg["tool:pytest"]
    markers = [line.split(":")[0] for line in pytest_cfg["markers"].strip().splitlines()]
    assert markers == [*TIERS, *BESIDE_TIERS]
    assert "--strict-markers" in pytest_cfg["addopts"].split()


def test_a_test_has_its_own_tier_else_its_files():
    assert tier_of("test_policy.py", set()) == FILE_TIERS["test_policy.py"] == "unit"
    assert tier_of("test_policy.py", {"procs"}) == "procs"
    with pytest.raises(ValueError, match="exactly one"):
        tier_of("test_policy.py", {"unit", "procs"})
    with pytest.raises(ValueError, match="FILE_TIERS"):
        tier_of("test_not_in_the_table.py", set())


# --- real sessions -------------------------------------------------------------------------
def run_session(tmp_path: Path, source: str, *args: str) -> subprocess.CompletedProcess:
    """``python -m pytest`` on ``source`` (as ``test_inner.py``) with this suite's conftest
    (a plugin: the file lies outside tests/) and setup.cfg."""
    (tmp_path / "test_inner.py").write_text(source)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(ROOT)])}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "conftest", "-c", str(ROOT / "setup.cfg"),
         "--rootdir", str(tmp_path), "-q", "test_inner.py", *args],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.procs
def test_a_test_file_without_a_tier_is_refused(tmp_path):
    r = run_session(tmp_path, "def test_anything():\n    pass\n")
    assert r.returncode == pytest.ExitCode.USAGE_ERROR, r.stdout + r.stderr
    assert "test_inner.py has no tier: add it to FILE_TIERS" in r.stderr


STARTING = '''
import subprocess, sys

import pytest


@pytest.mark.unit
def test_unit_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


@pytest.mark.procs
def test_procs_starts_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)
'''


@pytest.mark.procs
def test_a_unit_test_that_starts_a_process_fails_and_says_where(tmp_path):
    r = run_session(tmp_path, STARTING)
    assert r.returncode == pytest.ExitCode.TESTS_FAILED, r.stdout + r.stderr
    # (its call passed; the check fails it at teardown)
    assert "ERROR test_inner.py::test_unit_starts_a_process" in r.stdout, r.stdout
    assert "2 passed, 1 error" in r.stdout and "a unit test started processes" in r.stdout
    assert "test_inner.py:9" in r.stdout and "mark it @pytest.mark.procs" in r.stdout


FORKED = '''
import multiprocessing as mp

import pytest

CTX = mp.get_context("forkserver")


def _nothing():
    pass


def _start():
    p = CTX.Process(target=_nothing)
    p.start()
    p.join()


@pytest.mark.procs
def test_procs_starts_the_fork_server():
    _start()


@pytest.mark.unit
def test_unit_asks_the_running_fork_server_for_a_child():
    _start()
'''


@pytest.mark.procs
def test_a_unit_test_whose_child_a_running_fork_server_forks_fails_too(tmp_path):
    # Once the server runs, a child is forked by the server, asked through a socket: no
    # process start of the test's own to see.
    r = run_session(tmp_path, FORKED)
    assert r.returncode == pytest.ExitCode.TESTS_FAILED, r.stdout + r.stderr
    assert "ERROR test_inner.py::test_unit_asks_the_running_fork_server_for_a_child" \
        in r.stdout, r.stdout
    assert "connect_to_new_process from test_inner.py:15" in r.stdout, r.stdout


LEAKY = '''
import pytest
from conftest import TEST_LAYOUT, unique_name
from kvshm.shm.segment import Segment

pytestmark = pytest.mark.unit


def test_leaks_a_segment():
    name = unique_name()
    with open("leaked", "a") as f:
        f.write(name + "\\n")
    Segment.create(name, TEST_LAYOUT, 4).close()  # and never unlinked


def test_fails():
    assert False


def test_is_clean():
    pass
'''


@pytest.mark.procs
@pytest.mark.parametrize("args,outcome", [
    (["-k", "leaks"], "1 passed"),  # the leak alone fails the run
    (["-m", "unit", "-x"], "1 failed, 1 passed"),  # -x stops the run; the check still runs
], ids=["leak-only", "unit-x"])
def test_a_session_that_leaves_a_segment_fails_and_names_it(tmp_path, args, outcome):
    try:
        r = run_session(tmp_path, LEAKY, *args)
        leaked = (tmp_path / "leaked").read_text().split()
        assert r.returncode == pytest.ExitCode.TESTS_FAILED, r.stdout + r.stderr
        assert outcome in r.stdout and "this session left these behind" in r.stdout
        assert f"/dev/shm/kvshm-{leaked[0]}" in r.stdout, r.stdout
    finally:
        for name in (tmp_path / "leaked").read_text().split():
            Segment.unlink(name)


@pytest.mark.procs
def test_a_session_that_leaves_nothing_passes(tmp_path):
    r = run_session(tmp_path, LEAKY, "-k", "clean")
    assert r.returncode == pytest.ExitCode.OK, r.stdout + r.stderr
    assert "left these behind" not in r.stdout


ORPHANING = '''
import subprocess, sys

import pytest

pytestmark = pytest.mark.procs
STDIN = []  # the write ends of the pipes our leftovers read: they go when this session ends


def test_leaves_a_child_and_an_orphaned_grandchild():
    # The grandchild (what a detached owner is) outlives its parent: it is nobody's child
    # by the end, and is found by the session's mark in its environment.
    spawner = "import subprocess, sys; subprocess.Popen([sys.executable, '-c', sys.argv[1]])"
    for argv in (["-c", "import sys; sys.stdin.read()  # child"],
                 ["-c", spawner, "import sys; sys.stdin.read()  # grandchild"]):
        p = subprocess.Popen([sys.executable, *argv], stdin=subprocess.PIPE)
        STDIN.append(p.stdin)
    p.wait()  # the spawner: gone before the session ends
'''


@pytest.mark.procs
def test_a_session_whose_processes_outlive_it_fails_and_names_them(tmp_path):
    # With no grace: both leftovers read stdin until this child session exits.
    r = run_session(tmp_path, ORPHANING, "--leak-grace", "0")
    assert r.returncode == pytest.ExitCode.TESTS_FAILED, r.stdout + r.stderr
    assert "1 passed" in r.stdout and "this session left these behind" in r.stdout
    assert "sys.stdin.read()  # child" in r.stdout, r.stdout
    assert "sys.stdin.read()  # grandchild" in r.stdout, r.stdout
