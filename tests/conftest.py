"""Shared fixtures: unique segment names, a segment factory, and the parametrised manager;
the test tiers; and the end-of-session leak check.

Every segment a test creates is named ``<SESSION_PREFIX>-<8 hex>``, where the prefix is unique
to this pytest session (pid + random), so concurrent test runs on one host never collide and
the leak check (``pytest_sessionfinish`` below) knows what is this session's in ``/dev/shm``.

Every test has exactly one tier (``TIERS``, registered in setup.cfg; ``-m unit`` runs one):
its own tier mark if it has one, else its file's, from ``FILE_TIERS``. A unit test that
starts a process fails.

Manager tests run against every implementation in ``MANAGER_KINDS`` (through the
``OffloadingManager`` interface only) and both eviction policies. To add an implementation,
append its name to ``MANAGER_KINDS`` and teach ``make_manager`` to build it.
"""
from __future__ import annotations

import _posixsubprocess
import fcntl
import multiprocessing.forkserver
import os
import select
import subprocess
import time
import traceback
import uuid
from pathlib import Path
from typing import Callable, Iterator

import pytest
from hypothesis import Phase, settings

# In CI a failing example is reported as found: shrinking it can take minutes.
settings.register_profile("ci", phases=[Phase.explicit, Phase.reuse, Phase.generate],
                          deadline=None)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")

from kvshm.index.api import OffloadingManager
from kvshm.shm.layout import Layout
from kvshm.shm.segment import Segment

# Session-unique: names must be [A-Za-z0-9_.-]; every name is PREFIX + "-" + 8 hex, so no
# name is a prefix of another (Segment.unlink removes semaphores by name prefix).
SESSION_PREFIX = f"kt{os.getpid()}x{uuid.uuid4().hex[:6]}"

TEST_LAYOUT = Layout((4096, 4096), 16, "test")
TEST_BLOCKS = 24
SMALL_GEOMETRY = dict(ring_capacity=8192, hold_capacity=64)

POLICIES = ["lru", "arc"]
MANAGER_KINDS = ["local", "shared"]


def unique_name() -> str:
    """A fresh segment name carrying this session's prefix (not cleaned up by itself)."""
    return f"{SESSION_PREFIX}-{uuid.uuid4().hex[:8]}"


def make_manager(kind: str, segment: Segment, policy: str,
                 enable_events: bool) -> OffloadingManager:
    """Build a manager of implementation ``kind`` serving ``segment``.

    The segment was created with ``policy`` recorded in its header (implementations that
    start an owner process read it from there).
    """
    if kind == "local":
        from kvshm.owner.manager import LocalManager
        return LocalManager(segment, policy, enable_events=enable_events)
    if kind == "shared":  # a proxy to an owner process it starts; the policy is the segment's
        from kvshm.client.manager import SharedManager
        return SharedManager(Segment.attach(segment.name), events=enable_events)
    raise ValueError(f"unknown manager kind {kind!r}; known: {MANAGER_KINDS}")


# --- segments ----------------------------------------------------------------------------
@pytest.fixture(scope="session")
def seg_prefix() -> str:
    return SESSION_PREFIX


@pytest.fixture
def seg_name() -> Iterator[str]:
    """A unique segment name; whatever exists under it is unlinked after the test."""
    name = unique_name()
    yield name
    Segment.unlink(name)


@pytest.fixture
def make_segment() -> Iterator[Callable[..., Segment]]:
    """Factory: ``make_segment(name=None, layout=TEST_LAYOUT, num_blocks=TEST_BLOCKS, **kw)``.

    Every segment it creates is closed and unlinked at teardown.
    """
    made: list[Segment] = []
    names: list[str] = []

    def make(name: str | None = None, layout: Layout = TEST_LAYOUT,
             num_blocks: int = TEST_BLOCKS, **kw) -> Segment:
        name = name or unique_name()
        names.append(name)
        for k, v in SMALL_GEOMETRY.items():
            kw.setdefault(k, v)
        seg = Segment.create(name, layout, num_blocks, **kw)
        made.append(seg)
        return seg

    yield make
    for seg in made:
        seg.close()
    for name in names:
        Segment.unlink(name)


# --- managers ----------------------------------------------------------------------------
# The kinds as fixture params, with the tier each needs beyond its file's: a shared manager
# starts an owner process. (A fixture of one kind or the other is parametrised with these.)
KIND_PARAMS = [pytest.param("local"), pytest.param("shared", marks=pytest.mark.procs)]
assert [p.values[0] for p in KIND_PARAMS] == MANAGER_KINDS


@pytest.fixture(params=KIND_PARAMS)
def manager_kind(request) -> str:
    return request.param


@pytest.fixture(params=POLICIES)
def policy(request) -> str:
    return request.param


@pytest.fixture
def new_manager(manager_kind, policy, make_segment):
    """Factory: ``new_manager(num_blocks=4, enable_events=True) -> (manager, segment)``.

    Managers are shut down at teardown (shutdown must tolerate being called twice).
    """
    made: list[OffloadingManager] = []

    def new(num_blocks: int = 4, enable_events: bool = True):
        seg = make_segment(num_blocks=num_blocks, policy=policy)
        m = make_manager(manager_kind, seg, policy, enable_events)
        made.append(m)
        return m, seg

    yield new
    for m in reversed(made):
        owner = getattr(m, "segment", None)
        pid = owner.owner_record()[0] if manager_kind == "shared" and owner else 0
        m.shutdown()
        if pid:
            stop_owner(pid)


def stop_owner(pid: int) -> None:
    """Kill an owner process a test started and reap it if it is our child. Pid 0 (the
    record of an owner that shut down) is nobody: ``kill(0)`` would hit our own group."""
    import signal
    if pid <= 0:
        return
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        return
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass


@pytest.fixture
def manager_and_segment(new_manager):
    return new_manager()


@pytest.fixture
def manager(manager_and_segment) -> OffloadingManager:
    """A manager over a fresh 4-block segment, events enabled, for every kind and policy."""
    return manager_and_segment[0]


@pytest.fixture
def seg(seg_name):
    """A fresh 16-block segment with small rings; whatever owner serves it at the end is
    stopped (tests that start owners themselves, or let clients start them, share this)."""
    s = Segment.create(seg_name, TEST_LAYOUT, 16, **SMALL_GEOMETRY)
    yield s
    pid = s.owner_record()[0]
    s.close()
    if pid:
        stop_owner(pid)


# --- the vLLM venv ------------------------------------------------------------------------
# End-to-end tests with vLLM run its code in a venv of its own (``.ci/install_vllm.sh``).
REPO = Path(__file__).resolve().parents[1]


def vllm_venv_dir() -> str:
    return os.environ.get("KVSHM_VLLM_VENV") or str(REPO / ".venv-vllm")


def vllm_python() -> str:
    """The vLLM venv's interpreter: ``$KVSHM_VLLM_PYTHON``, else the venv's (it may not
    exist: the ``vllm_venv`` fixture says whether it does)."""
    return os.environ.get("KVSHM_VLLM_PYTHON") or os.path.join(vllm_venv_dir(), "bin", "python")


def _wait_for_vllm_install() -> None:
    """Wait while ``.ci/install_vllm.sh`` runs (it holds ``<venv>.lock``): CI installs the
    venv while the tests before the ones that need it run."""
    try:
        fd = os.open(vllm_venv_dir() + ".lock", os.O_RDONLY)
    except FileNotFoundError:
        return  # no install ever ran here
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # granted once no installer holds it
    finally:
        os.close(fd)


@pytest.fixture(scope="session")
def vllm_venv() -> str:
    """The vLLM venv's interpreter, once an install in progress is over; the test is skipped
    if there is none (``needs_vllm`` in ``test_vllm.py`` asks for this)."""
    _wait_for_vllm_install()
    py = vllm_python()
    if not os.path.exists(py):
        pytest.skip(f"vLLM venv not found ({py}): run .ci/install_vllm.sh")
    return py


@pytest.fixture(scope="session")
def tiny_model(vllm_venv: str, tmp_path_factory: pytest.TempPathFactory) -> str:
    """A tiny random Llama checkpoint, made once per run by the vLLM venv (every module of
    end-to-end tests uses the same one: making it costs each ~6 s)."""
    path = tmp_path_factory.mktemp("vllm") / "tiny-llama"
    subprocess.run([vllm_venv, str(REPO / "tests/vllm_support/tiny_model.py"), str(path)],
                   check=True, cwd=REPO, capture_output=True, timeout=300)
    return str(path)


@pytest.fixture(scope="session")
def vllm033_wheel() -> str:
    """vLLM 0.33.0's wheel (``$KVSHM_VLLM033_WHEEL``, else the one ``.ci/install_vllm.sh``
    downloads to ``.cache-vllm033/``), once an install in progress is over; the test is
    skipped if there is none."""
    _wait_for_vllm_install()
    wheel = os.environ.get("KVSHM_VLLM033_WHEEL") or next(
        iter(sorted((REPO / ".cache-vllm033").glob("vllm-0.33.0-*.whl"), reverse=True)), None)
    if wheel is None or not os.path.exists(wheel):
        pytest.skip("vLLM 0.33.0 wheel not found (set KVSHM_VLLM033_WHEEL or run "
                    ".ci/install_vllm.sh, which downloads it to .cache-vllm033/)")
    return str(wheel)


# --- tiers -------------------------------------------------------------------------------
TIERS = ("unit", "procs", "e2e")  # registered (and described) in setup.cfg
# Marks registered beside the tiers: they never replace one, a run may leave them out.
BESIDE_TIERS = ("slow",)

# Every test file's tier: that of most of its tests. A test that needs more says so with its
# own mark (@pytest.mark.procs on a test of a unit file, or a marked parameter), which
# replaces its file's. A file missing here fails the collection: a new file must choose.
FILE_TIERS = {
    "test_architecture.py": "unit",
    "test_batch_writers.py": "unit",
    "test_block_checksums.py": "unit",
    "test_copy_kernel.py": "unit",
    "test_connector.py": "unit",
    "test_errors_doc.py": "unit",
    "test_manager.py": "unit",
    "test_manager_model.py": "unit",
    "test_native_check.py": "unit",
    "test_probing.py": "unit",
    "test_rounds.py": "unit",
    "test_pinning.py": "unit",
    "test_claim_paths.py": "unit",
    "test_policy.py": "unit",
    "test_quota_takeover.py": "unit",
    "test_quota_walks.py": "unit",
    "test_ring.py": "unit",
    "test_running_ranks.py": "unit",
    "test_segment.py": "unit",
    "test_session.py": "unit",
    "test_spin.py": "unit",
    "test_table_tear.py": "unit",
    "test_transfer.py": "unit",
    "test_vllm.py": "unit",
    "test_channel.py": "procs",
    "test_cotenancy.py": "procs",
    "test_crash_walk.py": "procs",
    "test_exactly_once.py": "procs",
    "test_fuzz.py": "procs",
    "test_grants.py": "procs",
    "test_grant_recall.py": "procs",
    "test_inspect.py": "procs",
    "test_late_writers.py": "procs",
    "test_leases.py": "procs",
    "test_offers.py": "procs",
    "test_publish_merging.py": "procs",
    "test_quotas.py": "procs",
    "test_owner_start.py": "procs",
    "test_operable.py": "procs",
    "test_segment_hardening.py": "procs",
    "test_shared.py": "procs",
    "test_stop_signals.py": "procs",
    "test_tier.py": "procs",
    "test_warm_restart.py": "procs",
    "test_bench_ring.py": "e2e",
    "test_bench_tools.py": "e2e",
    "test_demo.py": "e2e",
    "test_demo_options.py": "e2e",
    "test_docs.py": "e2e",
    "test_soak.py": "e2e",
    "test_tier_mooncake.py": "e2e",
    "test_tier_vllm.py": "e2e",
    "test_vllm_processes.py": "e2e",
    "test_vllm_serve.py": "e2e",
    "test_vllm_versions.py": "e2e",
}


def tier_of(file_name: str, marked: set[str]) -> str:
    """The one tier of a test in ``file_name`` whose own tier marks are ``marked``."""
    if len(marked) > 1:
        raise ValueError(f"has the tiers {sorted(marked)}: a test has exactly one")
    if marked:
        return next(iter(marked))
    if file_name not in FILE_TIERS:
        raise ValueError(f"{file_name} has no tier: add it to FILE_TIERS in tests/conftest.py "
                         f"(one of {', '.join(TIERS)})")
    return FILE_TIERS[file_name]


@pytest.hookimpl(tryfirst=True)  # before -m deselects by these marks
def pytest_collection_modifyitems(config, items) -> None:
    errors = []
    for item in items:
        marked = {m.name for m in item.iter_markers() if m.name in TIERS}
        try:
            tier = tier_of(item.path.name, marked)
        except ValueError as e:
            errors.append(str(e) if not marked else f"{item.nodeid} {e}")
            continue
        if not marked:
            item.add_marker(tier)
    if errors:
        raise pytest.UsageError("tests without exactly one tier:\n  "
                                + "\n  ".join(dict.fromkeys(errors)))


# Everything a process can be started through: subprocess (its own binding of fork_exec, or
# posix_spawn), multiprocessing's spawn context and the launch of its fork server
# (fork_exec), a fork server's child (the server forks it, asked through
# connect_to_new_process), the fork context (fork), and the rest of os.
PROCESS_STARTS = [(subprocess, "_fork_exec"), (_posixsubprocess, "fork_exec"), (os, "fork"),
                  (os, "forkpty"), (os, "posix_spawn"), (os, "posix_spawnp"), (os, "system"),
                  (multiprocessing.forkserver, "connect_to_new_process")]
TESTS_DIR = Path(__file__).resolve().parent


@pytest.fixture(autouse=True)
def _a_unit_test_starts_no_process(request, monkeypatch) -> Iterator[None]:
    """A unit test (its fixtures included) that starts a process fails, naming where: what
    starts processes belongs to ``procs`` or ``e2e``, so that ``-m unit`` stays quick and
    runs anywhere."""
    if request.node.get_closest_marker("unit") is None:
        yield
        return
    started: list[str] = []

    def spy(real, name):
        def start(*args, **kwargs):
            stack = traceback.extract_stack()[:-1]  # where: the innermost line of the test's
            where = ([f for f in stack if f.filename == str(request.path)]  # file, else of
                     or [f for f in stack if f.filename.startswith(str(TESTS_DIR))]  # ours
                     or stack)[-1]
            started.append(f"{name} from {Path(where.filename).name}:{where.lineno}")
            return real(*args, **kwargs)
        return start

    for module, name in PROCESS_STARTS:
        if hasattr(module, name):
            monkeypatch.setattr(module, name, spy(getattr(module, name), name))
    yield
    if started:
        pytest.fail(f"a unit test started processes ({'; '.join(started)}): mark it "
                    "@pytest.mark.procs (or e2e)", pytrace=False)


# --- the leak check ----------------------------------------------------------------------
# Processes started by this session carry this mark in their environment (set when the
# session starts, so every descendant inherits it): an owner that a client started and that
# outlived that client is found too, though it is nobody's child any more.
SESSION_MARK = "KVSHM_TEST_SESSION"


def pytest_addoption(parser) -> None:
    parser.addoption("--leak-grace", type=float, default=30.0, metavar="SECONDS",
                     help="how long the end-of-session leak check waits for this session's "
                          "processes to exit (an idle owner exits 10 s after its last client)")


def pytest_configure(config) -> None:
    os.environ[SESSION_MARK] = SESSION_PREFIX
    # Build the compiled loops (once per host) before any test: the first handler or manager
    # a unit test makes would otherwise start the compiler, a process.
    from kvshm.owner.manager import build_loops
    from kvshm.transfer import native_check
    native_check.load()
    build_loops()


# multiprocessing's helper processes live as long as the process that started them.
HELPERS = ("from multiprocessing.resource_tracker import", "from multiprocessing.forkserver import")


def session_processes() -> dict[int, str]:
    """Living processes of this session (its children, and whatever carries its mark) ->
    their command lines."""
    me, mark = os.getpid(), f"{SESSION_MARK}={SESSION_PREFIX}".encode()
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                state, ppid = f.read().rsplit(b")", 1)[1].split()[:2]
            if state == b"Z":  # dead: only not reaped yet
                continue
            if int(ppid) != me:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark not in f.read().split(b"\0"):
                        continue
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError):  # gone meanwhile, or not ours to read
            continue
        if not (int(ppid) == me and any(h in cmd for h in HELPERS)):
            out[int(entry)] = cmd
    return out


def wait_for_exits(pids, timeout: float) -> None:
    """Wait until every process in ``pids`` exited or ``timeout`` passed (pidfds, no poll
    loop: a process's pidfd becomes readable when it exits)."""
    fds = []
    for pid in pids:
        try:
            fds.append(os.pidfd_open(pid))
        except OSError:  # gone already
            pass
    try:
        deadline = time.monotonic() + timeout
        for fd in fds:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return
    finally:
        for fd in fds:
            os.close(fd)


def shm_leftovers() -> list[str]:
    """What this session's prefix names in /dev/shm (segments and their semaphores)."""
    return sorted(e for e in os.listdir("/dev/shm") if SESSION_PREFIX in e)


def file_leftovers() -> list[str]:
    """What this session's prefix names in the temp dir or ``$XDG_RUNTIME_DIR``, where
    auto-started owners log (``kvshm-<prefix>…-owner.log``)."""
    import tempfile
    dirs = {tempfile.gettempdir(), os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()}
    return sorted(os.path.join(d, e) for d in dirs for e in os.listdir(d) if SESSION_PREFIX in e)


LEAKS: list[str] = []


@pytest.hookimpl(trylast=True)  # after the session's fixtures were torn down
def pytest_sessionfinish(session) -> None:
    """Fail the run if this session left anything behind: a name of its prefix in /dev/shm,
    the temp dir or ``$XDG_RUNTIME_DIR`` (an owner's log), or a process it started still
    running ``--leak-grace`` seconds after its last test.
    Whatever subset ran (-m, -k, -x), since it looks at the session, not at a test."""
    procs = session_processes()
    if procs:
        wait_for_exits(procs, session.config.getoption("leak_grace", 30.0))
        procs = session_processes()
    LEAKS[:] = [f"/dev/shm/{e}" for e in shm_leftovers()] + file_leftovers()
    LEAKS.extend(f"process {pid}: {cmd}" for pid, cmd in sorted(procs.items()))
    if LEAKS and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter) -> None:
    if LEAKS:
        terminalreporter.write_sep("=", "this session left these behind", red=True)
        for line in LEAKS:
            terminalreporter.write_line(line)
