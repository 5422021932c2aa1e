"""Shared fixtures: unique segment names, a segment factory, and the parametrised manager.

Every segment a test creates is named ``<SESSION_PREFIX>-<8 hex>``, where the prefix is unique
to this pytest session (pid + random), so concurrent test runs on one host never collide and
``test_zz_no_leaks.py`` can check that this session left nothing in ``/dev/shm``.

Manager tests run against every implementation in ``MANAGER_KINDS`` (through the
``OffloadingManager`` interface only) and both eviction policies. To add an implementation,
append its name to ``MANAGER_KINDS`` and teach ``make_manager`` to build it.
"""
from __future__ import annotations

import os
import uuid
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
@pytest.fixture(params=MANAGER_KINDS)
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
