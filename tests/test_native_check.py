"""The compiled id checks: they accept exactly what numpy's checks accept, and a host without
a compiler loses speed, never a refusal.

The library is built once per test session (conftest's ``pytest_configure``), so the unit
tests here start no process; the build itself is tested in child processes with their own
cache directories.
"""
from __future__ import annotations

import contextlib
import itertools
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshm.errors import InvalidArgumentError
from kvshm.transfer import native_check
from kvshm.transfer.spec import _check_range, _check_unique

needs_native = pytest.mark.skipif(not native_check.load(), reason="no C compiler on this host")


def numpy_says_ok(dev: np.ndarray, seg: np.ndarray, n_dev: int, n_seg: int,
                  dst_is_dev: bool) -> bool:
    try:
        _check_range(dev, n_dev, "dev")
        _check_range(seg, n_seg, "seg")
        if dst_is_dev:
            _check_unique(dev, n_dev, "dev")
        else:
            _check_unique(seg, n_seg, "seg")
    except InvalidArgumentError:
        return False
    return True


ids = st.lists(st.integers(-3, 40), max_size=24).map(lambda v: np.array(v, np.int64))


@needs_native
@settings(max_examples=400, deadline=None)
@given(dev=ids, seg=ids, n_dev=st.integers(1, 40), n_seg=st.integers(1, 40),
       dst_is_dev=st.booleans())
def test_compiled_checks_accept_exactly_what_numpy_accepts(dev, seg, n_dev, n_seg, dst_is_dev):
    ok = numpy_says_ok(dev, seg, n_dev, n_seg, dst_is_dev)
    if dev.size and seg.size:  # empty arrays have no buffer to read: the numpy path takes them
        assert native_check.check(dev, seg, n_dev, n_seg, dst_is_dev) == ok


@needs_native
@pytest.mark.parametrize("dst_is_dev", [True, False])
def test_a_repeated_destination_is_found_in_every_call_not_only_the_first(dst_is_dev):
    good = np.arange(1000, dtype=np.int64)
    dup = good.copy()
    dup[999] = 0
    for _ in range(3):  # marks from earlier calls must neither hide nor invent a repeat
        assert native_check.check(good, good, 1000, 1000, dst_is_dev)
        assert not native_check.check(dup if dst_is_dev else good, good if dst_is_dev else dup,
                                      1000, 1000, dst_is_dev)


@needs_native
def test_a_negative_id_is_out_of_range():
    assert not native_check.check(np.array([0, -1]), np.array([0, 1]), 4, 4, False)


@needs_native
def test_a_larger_geometry_after_a_smaller_one_gets_marks_for_every_id():
    small = np.arange(8, dtype=np.int64)
    assert native_check.check(small, small, 8, 8, True)
    big = np.array([0, 70_000, 70_000], np.int64)
    assert not native_check.check(big, np.arange(3, dtype=np.int64), 70_001, 3, True)
    assert native_check.check(big[:2].copy(), np.arange(2, dtype=np.int64), 70_001, 2, True)


@pytest.mark.parametrize("arrays", [
    lambda: (np.arange(8, dtype=np.int64)[::2], np.arange(4, dtype=np.int64)),  # strided
    lambda: (np.arange(4, dtype=np.int32), np.arange(4, dtype=np.int64)),       # not int64
    lambda: (np.zeros(0, np.int64), np.zeros(0, np.int64)),                      # empty
])
def test_ids_it_cannot_read_in_place_are_left_to_numpy(arrays):
    dev, seg = arrays()
    assert native_check.check(dev, seg, 8, 8, True) is False


@needs_native
def test_a_repeat_is_found_across_the_generation_wrap_and_no_marks_are_wiped(monkeypatch):
    """At the wrap the marks start over in a fresh array: zeroing them in place would let a
    call running meanwhile in another thread (numpy fills without the GIL) miss a repeat."""
    ids = np.arange(16, dtype=np.int64)
    assert native_check.check(ids, ids, 16, 16, True)
    before = native_check._mark[0]
    seen = before.copy()
    monkeypatch.setattr(native_check, "_gen", itertools.count(1 << 32))  # next gen wraps to 0
    assert not native_check.check(np.array([3, 5, 3]), np.arange(3, dtype=np.int64), 16, 3,
                                  True)
    assert native_check._mark[0] is not before
    np.testing.assert_array_equal(before, seen)


def test_a_relative_xdg_cache_home_is_ignored(monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")
    assert native_check.LIBRARY.path().parent == Path.home() / ".cache" / "kvshm"


def test_read_only_ids_are_left_to_numpy():
    dev = np.arange(4, dtype=np.int64)
    dev.flags.writeable = False
    assert native_check.check(dev, np.arange(4, dtype=np.int64), 8, 8, True) is False


# --- the build, in child processes with their own cache ----------------------------------
CHILD = """
import sys, numpy as np, torch
from kvshm.errors import InvalidArgumentError
from kvshm.transfer import native_check
from kvshm.transfer.factory import make_handler
from kvshm.transfer.spec import TransferSpec
h = make_handler([torch.zeros(8, 4, dtype=torch.uint8)], [torch.zeros(8, 4, dtype=torch.uint8)])
print("loaded", native_check.LIBRARY.fns is not None)
for spec in (TransferSpec("store", [0, 1], [2, 2]), TransferSpec("load", [0, 9], [0, 1])):
    try:
        h.transfer_async(1, spec)
        print("accepted")
    except InvalidArgumentError:
        print("refused")
h.transfer_async(2, TransferSpec("store", [0, 1], [2, 3]))
h.wait([2])
print("copied", [r.success for r in h.get_finished()])
h.shutdown()
"""


def run_child(cache: Path, cc: str) -> list[str]:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache), "CC": cc}
    out = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.split("\n")[:-1]


@pytest.mark.procs
def test_without_a_compiler_bad_jobs_are_still_refused_and_good_ones_copied(tmp_path):
    assert run_child(tmp_path, "false") == [
        "loaded False", "refused", "refused", "copied [True]"]
    assert not list((tmp_path / "kvshm").glob("*.so"))


@needs_native
@pytest.mark.procs
def test_the_library_is_built_once_and_then_loaded_without_a_compiler(tmp_path):
    assert run_child(tmp_path, os.environ.get("CC") or "cc")[0] == "loaded True"
    built = list((tmp_path / "kvshm").glob("*.so"))
    assert len(built) == 1
    assert run_child(tmp_path, "false") == [  # the cached build serves the next process
        "loaded True", "refused", "refused", "copied [True]"]
    assert [p.name for p in (tmp_path / "kvshm").iterdir()] == [built[0].name]  # no leftovers


LOAD = """
import logging, sys
logging.basicConfig(level=logging.WARNING, format="%(message)s", stream=sys.stdout)
from kvshm.transfer import native_check
print("loaded", native_check.load())
"""
LYING = "#include <stdint.h>\nint64_t kvshm_ids_ok(void) { return 1; }\n"


def load_in_child(cache: Path) -> str:
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    out = subprocess.run([sys.executable, "-c", LOAD], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout


def library_in(cache: Path, monkeypatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache))
    path = native_check.LIBRARY.path()
    path.parent.mkdir(mode=0o700, parents=True)
    return path


def seal(path: Path) -> None:
    import hashlib

    from kvshm.shm import native
    body = path.read_bytes()
    path.write_bytes(body + hashlib.sha256(body).digest() + native._SEAL)


@needs_native
@pytest.mark.procs
def test_a_library_that_says_everything_is_valid_is_not_used(tmp_path, monkeypatch):
    path = library_in(tmp_path, monkeypatch)
    src = tmp_path / "lying.c"
    src.write_text(LYING)
    subprocess.run([os.environ.get("CC") or "cc", "-shared", "-fPIC", "-o", str(path),
                    str(src)], check=True)
    seal(path)  # as a build seals it: the self-test, not the seal, is what must refuse it
    out = load_in_child(tmp_path)
    assert out.endswith("loaded False\n") and "self-test" in out


@needs_native
@pytest.mark.procs
def test_a_library_others_could_have_written_is_not_loaded(tmp_path, monkeypatch):
    assert load_in_child(tmp_path) == "loaded True\n"
    path = library_in(tmp_path / "other", monkeypatch)
    os.rmdir(path.parent)
    (tmp_path / "kvshm").rename(path.parent)
    path.chmod(0o777)
    assert load_in_child(tmp_path / "other") == "loaded False\n"


@needs_native
@pytest.mark.procs
def test_a_torn_library_is_built_again(tmp_path, monkeypatch):
    path = library_in(tmp_path, monkeypatch)
    path.write_bytes(b"\x7fELF torn")
    path.chmod(0o755)
    assert load_in_child(tmp_path) == "loaded True\n"
    assert path.stat().st_size > 1000


def text_section(data: bytes) -> tuple[int, int]:
    """(file offset, size) of an ELF64 library's ``.text``: where its functions' code lies."""
    import struct
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    def section(i):  # (name offset, file offset, size)
        name, _, _, _, off, size = struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize)
        return name, off, size
    names = section(shstrndx)[1]
    for i in range(shnum):
        name, off, size = section(i)
        if data[names + name:names + name + 6] == b".text\0":
            return off, size
    raise AssertionError("no .text section")


def truncated(data: bytes) -> bytes:
    return data[:len(data) // 2]


def code_trapped(data: bytes) -> bytes:  # every instruction of every function a trap (int3)
    off, size = text_section(data)
    return data[:off] + b"\xcc" * size + data[off + size:]


@needs_native
@pytest.mark.procs
@pytest.mark.skipif(platform.machine() != "x86_64", reason="int3 is an x86-64 instruction")
@pytest.mark.parametrize("damage", [truncated, code_trapped])
def test_a_damaged_library_that_still_loads_is_built_again_not_run(tmp_path, monkeypatch,
                                                                    damage):
    """A library damaged after its build (a power loss before its bytes reached the disk, a
    bad disk) may still pass the dynamic loader and then fault in whoever runs it: every
    owner on the host would die at its start. It is refused before it is loaded, and built
    again."""
    assert load_in_child(tmp_path) == "loaded True\n"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = native_check.LIBRARY.path()
    good = path.read_bytes()
    path.write_bytes(damage(good))
    assert load_in_child(tmp_path) == "loaded True\n"
    assert path.read_bytes() != damage(good)


FORK = """
import os, sys
from kvshm.transfer import native_check
from kvshm.shm import native
native._lock.acquire()  # as if another thread were building when we fork
pid = os.fork()
if pid == 0:
    native_check.load()  # blocks for good if the child inherited the held lock
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("child exited", os.waitstatus_to_exitcode(status))
"""


@pytest.mark.procs
def test_a_child_forked_while_the_library_is_being_built_loads_it_itself(tmp_path):
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", FORK], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout == "child exited 0\n", out.stderr


@needs_native
@pytest.mark.procs
def test_a_library_reached_through_a_link_is_never_loaded(tmp_path, monkeypatch):
    """The file is opened without following links and checked through its descriptor, which
    is what gets loaded: swapping the path after the check loads nothing of another's. A
    link in the library's place is replaced by a build of our own."""
    assert load_in_child(tmp_path / "real") == "loaded True\n"
    path = library_in(tmp_path, monkeypatch)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "real"))
    path.symlink_to(native_check.LIBRARY.path())
    assert load_in_child(tmp_path) == "loaded True\n"
    assert not path.is_symlink()


@needs_native
@pytest.mark.procs
def test_a_build_removes_what_builds_killed_midway_left_and_nothing_in_progress(
        tmp_path, monkeypatch):
    path = library_in(tmp_path, monkeypatch)
    stale, current = path.parent / "build-stale", path.parent / "build-current"
    for d in (stale, current):
        d.mkdir()
        (d / "lib.c").write_text("left over")
    old = time.time() - 3600
    os.utime(stale, (old, old))
    assert load_in_child(tmp_path) == "loaded True\n"
    assert sorted(p.name for p in path.parent.iterdir()) == ["build-current", path.name]


TWO = """
import ctypes
from kvshm.shm.native import CLibrary
libs = [CLibrary(f"two{i}", "test loops", f"int f{i}(void) {{ return {i}; }}\\n",
                 {f"f{i}": (ctypes.c_int, [])}, lambda fns, i=i: fns[f"f{i}"]() == i)
        for i in (1, 2)]
print([lib.load() for lib in libs])
"""


@needs_native
@pytest.mark.procs
def test_two_compiled_libraries_load_side_by_side_in_one_process(tmp_path):
    """Each is loaded through a descriptor of its own file: the loader must not take the
    second for the first because both were opened under the same descriptor number."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", TWO], env=env, capture_output=True,
                         text=True, timeout=120)
    assert out.stdout == "[True, True]\n", out.stderr


@pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                    reason="no C compiler on this host")
def test_every_compiled_library_loads_where_a_compiler_is():
    """A change to a C source that breaks its self-test leaves the library unused (the Python
    paths answer): correct but slow, which only this test notices."""
    from kvshm.shm import probing, rounds
    assert [lib.load() for lib in (native_check, probing, rounds)] == [True] * 3


def test_a_process_without_a_home_directory_runs_without_the_library(monkeypatch):
    """A container's arbitrary uid may have no home (no HOME, no passwd entry): that costs
    the compiled loops, never the process (an owner that could not start, a handler that
    could not be made)."""
    from kvshm.shm.native import CLibrary

    def no_home() -> Path:
        raise RuntimeError("Could not determine home directory.")
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setattr(Path, "home", staticmethod(no_home))
    lib = CLibrary("nohome", "test loops", "int f(void) { return 1; }\n", {}, lambda fns: True)
    assert lib.load() is False


FIFO = """
import os, sys
from kvshm.shm import probing
os.makedirs(probing.LIBRARY.path().parent, mode=0o700)
os.mkfifo(probing.LIBRARY.path())
print("loaded", probing.load())
"""


@needs_native
@pytest.mark.procs
def test_a_fifo_in_the_librarys_place_is_replaced_by_a_build_and_blocks_nothing(tmp_path):
    """Opening a FIFO for reading waits for a writer: the loader must never open anything
    but a regular file it can check without blocking."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", FIFO], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout == "loaded True\n", out.stderr


def _with_compiler(tmp_path: Path, script: str, fifo: bool = False) -> dict[str, str]:
    """An environment whose compiler is ``script`` (as ``tmp_path/cc``; ``fifo``: with a
    ``cc.fifo`` beside it to read from) and whose cache is ``tmp_path/cache``."""
    cc = tmp_path / "cc"
    cc.write_text(script)
    cc.chmod(0o755)
    if fifo:
        os.mkfifo(tmp_path / "cc.fifo")
    return {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "CC": str(cc)}


HANG = """
import sys, time
from kvshm.shm import native
native._BUILD_SECONDS = 1  # (15 s in service; a normal build takes ~0.1 s)
lib = native.CLibrary("hang", "test loops", "int f(void) { return 1; }\\n", {},
                      lambda fns: True)
t0 = time.monotonic()
print(lib.load(), time.monotonic() - t0 < 5)
"""
HANGING_CC = """#!/bin/sh
echo run >> "$0.log"
sleep 1000 &
echo $! > "$0.pid"
wait
"""


@pytest.mark.procs
def test_a_hanging_compiler_is_killed_whole_and_not_run_again_soon(tmp_path):
    """An owner builds as it starts, while its first client waits for it:
    a compiler that hangs costs one bounded wait, its children die with it, and the next
    processes use Python at once instead of waiting again."""
    env = _with_compiler(tmp_path, HANGING_CC)
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", HANG], env=env, capture_output=True,
                             text=True, timeout=60)
        assert out.stdout == "False True\n", out.stderr
    assert (tmp_path / "cc.log").read_text() == "run\n"  # tried once, not per process
    pid = int((tmp_path / "cc.pid").read_text())
    assert not Path(f"/proc/{pid}").exists() or \
        Path(f"/proc/{pid}/stat").read_text().split()[2] == "Z"


INTERRUPTED = """
from kvshm.shm import native
lib = native.CLibrary("interrupted", "test loops", "int f(void) { return 1; }\\n", {},
                      lambda fns: True)
lib.load()
"""


@pytest.mark.procs
def test_a_build_interrupted_by_a_signal_leaves_no_failure_marker(tmp_path):
    """A failure marker makes every process on the host use Python for an hour: only the
    compiler's own failure may leave one, not a process interrupted while it waited (Ctrl-C,
    a signal handler's exception)."""
    builder = _in_a_blocked_build(tmp_path, ["-c", INTERRUPTED])
    try:
        builder.send_signal(signal.SIGINT)
        _, err = builder.communicate(timeout=60)
        assert "KeyboardInterrupt" in err, err
    finally:
        if builder.poll() is None:
            builder.kill()
            builder.wait()
    assert not list((tmp_path / "cache" / "kvshm").glob("*.failed"))


ESCAPING_CC = """#!/bin/sh
setsid sleep 30 &
echo $! > "$0.pid"
exec cc "$@"
"""
BUILD_ONE = """
from kvshm.shm import native
native._BUILD_SECONDS = 5  # (15 s in service)
lib = native.CLibrary("escaping", "test loops", "int f(void) { return 1; }\\n", {},
                      lambda fns: True)
print(lib.load())
"""


@pytest.mark.procs
def test_a_compiler_whose_helper_outlives_it_still_builds_the_library(tmp_path):
    """A compiler wrapper may leave a process of its own behind (a compile cache's or a
    distributed compiler's daemon, in a session of its own) that keeps the compiler's output
    open: the build ends when the compiler does, not when every holder of its output has
    closed it, and never waits past its time limit."""
    env = _with_compiler(tmp_path, ESCAPING_CC)
    try:
        out = subprocess.run([sys.executable, "-c", BUILD_ONE], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.stdout == "True\n", out.stderr
        assert not list((tmp_path / "cache" / "kvshm").glob("*.failed"))
    finally:
        with contextlib.suppress(OSError, ValueError):
            os.kill(int((tmp_path / "cc.pid").read_text()), signal.SIGKILL)


DONE_CC = """#!/bin/sh
read line < "$0.fifo"
cc "$@"
status=$?
touch "$0.done"
exit $status
"""


@pytest.mark.procs
def test_a_builder_stopped_while_its_compiler_finished_keeps_the_library(tmp_path):
    """A process stopped (a debugger, a frozen cgroup) longer than the build's time limit
    while its compiler finished has a library, not a hung compiler: it loads it and leaves no
    failure marker that would send every process on the host to Python for an hour."""
    env = _with_compiler(tmp_path, DONE_CC, fifo=True)
    builder = subprocess.Popen([sys.executable, "-c", BUILD_ONE.replace("= 5", "= 1")],
                               env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True)
    try:
        release(tmp_path / "cc.fifo", builder)  # the compiler is running: it waited for this
        builder.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 60
        while not (tmp_path / "cc.done").exists():  # the compiler finished meanwhile
            assert time.monotonic() < deadline, "the compiler never finished"
            time.sleep(0.01)
        stopped = time.monotonic()
        while time.monotonic() < stopped + 2:  # stopped past the build's limit (1 s)
            time.sleep(0.05)
        builder.send_signal(signal.SIGCONT)
        out, err = builder.communicate(timeout=60)
        assert out == "True\n", err
        assert not list((tmp_path / "cache" / "kvshm").glob("*.failed"))
    finally:
        if builder.poll() is None:
            builder.send_signal(signal.SIGCONT)
            builder.kill()
            builder.wait()


@pytest.mark.procs  # (starts the compiler)
def test_a_compiler_that_exited_as_the_wait_timed_out_is_not_hung(tmp_path, monkeypatch):
    """The window the stopped builder above may or may not hit: its wait looked at the
    compiler last just before the stop, and times out on waking although the compiler exited
    meanwhile. A compiler that exited is never taken for a hung one."""
    import subprocess as sp

    from kvshm.shm import native

    class LookedLastBeforeItExited(sp.Popen):
        def wait(self, timeout=None):
            if timeout is None:
                return super().wait()
            os.waitid(os.P_PID, self.pid, os.WEXITED | os.WNOWAIT)  # exited, not reaped
            raise sp.TimeoutExpired(self.args, timeout)

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(sp, "Popen", LookedLastBeforeItExited)
    monkeypatch.setattr(native, "_hung", False)
    lib = native.CLibrary("late", "test loops", "int f(void) { return 1; }\n", {},
                          lambda fns: True)
    assert lib.load()
    assert not native._hung and not list((tmp_path / "kvshm").glob("*.failed"))


HANG_TWO = """
from kvshm.shm import native
native._BUILD_SECONDS = 1  # (15 s in service; a normal build takes ~0.1 s)
libs = [native.CLibrary(stem, "test loops", f"int {stem}(void) {{ return 1; }}\\n", {},
                        lambda fns: True) for stem in ("one", "two")]
print([lib.load() for lib in libs])
"""


@pytest.mark.procs
def test_a_compiler_that_hung_once_is_not_started_again_by_the_same_process(tmp_path):
    """An owner builds several libraries before it takes the owner lock, and whoever started
    it waits a bounded time for that lock: a hanging compiler must cost one build's time
    limit, not one per library."""
    env = _with_compiler(tmp_path, HANGING_CC)
    out = subprocess.run([sys.executable, "-c", HANG_TWO], env=env, capture_output=True,
                         text=True, timeout=60)
    assert out.stdout == "[False, False]\n", out.stderr
    assert (tmp_path / "cc.log").read_text() == "run\n"


@needs_native
@pytest.mark.procs
def test_a_cache_directory_reached_through_a_link_is_neither_built_into_nor_loaded(
        tmp_path):
    """Whoever can write the cache's parent could point ``kvshm`` at a directory of their
    choosing: nothing is built into it and nothing loaded from it."""
    assert load_in_child(tmp_path / "real") == "loaded True\n"
    (tmp_path / "linked").mkdir()
    (tmp_path / "linked" / "kvshm").symlink_to(tmp_path / "real" / "kvshm")
    before = sorted(p.name for p in (tmp_path / "real" / "kvshm").iterdir())
    assert load_in_child(tmp_path / "linked") == "loaded False\n"
    assert sorted(p.name for p in (tmp_path / "real" / "kvshm").iterdir()) == before


BLOCKED_CC = """#!/bin/sh
[ -e "$0.started" ] && exit 1
touch "$0.started"
read line < "$0.fifo"
exit 1
"""
WOULD_BE_OWNER = """
import sys
from kvshm.errors import OwnerUnavailableError
from kvshm.owner.manager import LocalManager
from kvshm.shm.segment import Segment
seg = Segment.attach(sys.argv[1])
try:
    LocalManager(seg).shutdown()
    print("owner")
except OwnerUnavailableError:
    print("unavailable")
"""


def _in_a_blocked_build(tmp_path: Path, argv: list[str]) -> subprocess.Popen:
    """``python argv`` with a compiler that blocks on ``cc.fifo`` (``release`` lets it fail),
    once the process is inside that build."""
    env = _with_compiler(tmp_path, BLOCKED_CC, fifo=True)
    builder = subprocess.Popen([sys.executable, *argv], env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (tmp_path / "cc.started").exists():
        if builder.poll() is not None or time.monotonic() > deadline:
            builder.kill()
            raise AssertionError(f"the process never started its build: "
                                 f"{builder.communicate()}")
        time.sleep(0.01)
    return builder


def _owned_while_it_builds(tmp_path: Path, seg, argv: list[str]) -> tuple[int, str, str]:
    """Run ``argv`` with a compiler that blocks; once it is inside its build, this process
    becomes the segment's owner (it built its loops before the test began), then lets the
    compiler fail. Returns the process's exit status, stdout and stderr."""
    from kvshm.owner.manager import LocalManager
    builder = _in_a_blocked_build(tmp_path, argv)
    manager = None
    try:
        manager = LocalManager(seg)
        release(tmp_path / "cc.fifo", builder)  # the compiler fails; the process goes on
        out, err = builder.communicate(timeout=60)
        return builder.returncode, out, err
    finally:
        if builder.poll() is None:
            builder.kill()
            builder.wait()
        if manager is not None:
            manager.shutdown()


@pytest.mark.procs
def test_a_would_be_owner_building_its_loops_holds_no_lock_meanwhile(tmp_path, make_segment):
    """A process that becomes a segment's owner first builds its compiled loops (once per
    host). A compiler that hangs, or a process stopped mid-build, must not keep every other
    process from owning the segment meanwhile: the build comes before the owner lock."""
    seg = make_segment()
    _, out, err = _owned_while_it_builds(tmp_path, seg, ["-c", WOULD_BE_OWNER, seg.name])
    assert out == "unavailable\n", err  # and finds the segment owned


@pytest.mark.procs
def test_kvshm_inspect_gc_building_the_loops_holds_no_lock_meanwhile(tmp_path, make_segment):
    """``kvshm-inspect gc`` reclaims as a temporary owner, with the owner's loops: while its
    build hangs (or it is stopped in it) a real owner must still be able to start, and gc
    then finds one alive and leaves the segment to it."""
    seg = make_segment()
    rc, out, err = _owned_while_it_builds(
        tmp_path, seg, ["-m", "kvshm.inspect.cli", "gc", seg.name, "--json"])
    assert rc == 0, err
    assert json.loads(out)["acted"] is False, out


def release(fifo: Path, builder: subprocess.Popen) -> None:
    """Let the fake compiler read a line, once it reads its FIFO; nothing to do once the
    builder is gone, or the build's time limit ended the compiler (then no reader comes)."""
    deadline = time.monotonic() + 60
    while builder.poll() is None and time.monotonic() < deadline:
        try:
            fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while nobody reads it
        except OSError:
            time.sleep(0.01)
            continue
        os.write(fd, b"go\n")
        os.close(fd)
        return
