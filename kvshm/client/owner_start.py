"""Starting an owner for a segment that has none: detached, watched, explained when it fails.

This module owns how a client starts the owner process (``python -m kvshm.owner NAME
--detach --idle-exit S``) and waits until it holds the owner lock. The owner it starts is
nobody's descendant (``kvshm.owner.detach``): the process the client starts forks the owner
off, prints its pid and exits, so the owner is reparented to init and survives whatever
kills the engine's process tree or group (vLLM's shutdown SIGKILLs every descendant of its
EngineCore). Its stderr, the log, is appended to ``owner_log_path(name)``; when it fails to
start, the error quotes that log's new lines. The client watches the owner through a pidfd,
never through a child's exit status, since the owner is not its child.

It never talks to an owner (``owner_link.py`` does) and never reads the block table.
"""
from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

from kvshm.errors import OwnerUnavailableError
from kvshm.index.launch import OWNER_IDLE_EXIT_S, OWNER_MODULE
from kvshm.logs import bound as bound_log
from kvshm.logs import owner_log_path
from kvshm.shm.segment import Segment

OWNER_START_TIMEOUT_S = 20.0
_POLL_S = 0.005  # how often the lock is looked at while the new owner starts


class OwnerProcess:
    """An owner process this client started (not its child): its pid, and a pidfd to tell
    whether it still runs, wait for it or signal it without ever hitting a reused pid. Enough
    of ``subprocess.Popen``'s interface for a tool that stops the owner it started."""

    def __init__(self, pid: int):
        self.pid = pid
        try:
            self._fd: int | None = os.pidfd_open(pid)
        except ProcessLookupError:
            self._fd = None  # gone already

    def exited(self, timeout: float = 0.0) -> bool:
        """Whether it has exited, waiting up to ``timeout`` s for that."""
        return self._fd is None or bool(select.select([self._fd], [], [], timeout)[0])

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for it to exit; ``subprocess.TimeoutExpired`` if not."""
        if not self.exited(timeout):
            raise subprocess.TimeoutExpired(f"{OWNER_MODULE} (pid {self.pid})", timeout)

    def send_signal(self, sig: int) -> None:
        if not self.exited():
            assert self._fd is not None
            try:
                signal.pidfd_send_signal(self._fd, sig)
            except ProcessLookupError:
                pass  # exited meanwhile

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def close(self) -> None:
        """Stop watching it (also when this object is collected): ``exited`` says True."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    __del__ = close


def _tail(path: str, start: int, n: int = 3) -> list[str]:
    try:
        with open(path, "rb") as f:
            f.seek(start)
            return f.read().decode(errors="replace").strip().splitlines()[-n:]
    except OSError:
        return []


def refuse_removed(segment: Segment) -> None:
    if segment.removed():
        raise OwnerUnavailableError(
            f"segment {segment.name!r} was removed, and no owner serves it any more; shut "
            "this manager down and connect again (to the segment now under its name)")


def start_owner(segment: Segment) -> OwnerProcess | None:
    """Make sure an owner serves ``segment``: start one if nobody holds the owner lock, and
    return it (None if one served already). Raises ``OwnerUnavailableError`` with the new
    lines of the owner log if it could not start."""
    if segment.owner_alive():
        return None
    refuse_removed(segment)  # an owner started by name would serve a successor instead
    path = owner_log_path(segment.name)
    bound_log(path)  # before we note where the new owner's lines start
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        launcher = subprocess.Popen(
            [sys.executable, "-m", OWNER_MODULE, segment.name, "--detach", "--idle-exit",
             str(OWNER_IDLE_EXIT_S)], stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
            stderr=fd, start_new_session=True, close_fds=True)
    finally:
        os.close(fd)
    epoch = segment.owner_record()[1]
    deadline = time.monotonic() + OWNER_START_TIMEOUT_S

    def failed(why: str) -> OwnerUnavailableError:
        lines = _tail(path, start)
        return OwnerUnavailableError(
            f"could not start an owner for segment {segment.name!r} ({why}): "
            f"{' | '.join(lines) or 'no output'}; see {path}, or run 'kvshm serve "
            f"{segment.name}' to see why")

    assert launcher.stdout is not None
    with launcher, launcher.stdout:
        # The launcher prints the owner's pid and exits as soon as it has forked it.
        if not select.select([launcher.stdout], [], [], OWNER_START_TIMEOUT_S)[0]:
            launcher.kill()
            raise failed(f"no pid within {OWNER_START_TIMEOUT_S:g}s")
        line = launcher.stdout.readline()
        rc = launcher.wait()  # at once: it exits right after printing
    if rc != 0 or not line.strip().isdigit():
        raise failed(f"exit {rc}")
    owner = OwnerProcess(int(line))
    try:
        while not segment.owner_alive():
            if owner.exited():
                if segment.owner_record()[1] != epoch:
                    break  # it owned the segment and died already: the caller notices
                raise failed("it exited")
            if time.monotonic() > deadline:
                raise failed(f"no owner lock within {OWNER_START_TIMEOUT_S:g}s")
            refuse_removed(segment)  # removed meanwhile: our lock will never be taken
            owner.exited(_POLL_S)  # wakes at once if it exits
    except BaseException:
        owner.close()
        raise
    return owner
