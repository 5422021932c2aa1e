"""Starting an owner for a segment that has none: detached, watched, explained when it fails.

This module owns how a client starts the owner process (``python -m kvshm.owner NAME
--detach --hold --idle-exit S``) and waits until it holds the owner lock. The owner it starts
is nobody's descendant (``kvshm.owner.detach``): the process the client starts forks the
owner off, prints its pid, and is killed once the client watches the owner, so the owner is
reparented to init and survives whatever kills the engine's process tree or group (vLLM's
shutdown SIGKILLs every descendant of its EngineCore). Its stderr, the log, is appended to
``owner_log_path(name)``; when it fails to start, the error quotes that log's new lines. The
client watches the owner through a pidfd, never through a child's exit status, since the
owner is not its child.

It never talks to an owner (``owner_link.py`` does) and never reads the block table.
"""
from __future__ import annotations

import errno
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
_WAIT_PID_S = 0.05  # how long the launcher's pid is waited for between looks at the lock


class OwnerProcess:
    """An owner process this client started (not its child): its pid, and a pidfd to tell
    whether it still runs, wait for it or signal it without ever hitting a reused pid. Where
    pidfds are refused (a kernel before 5.3, a container whose seccomp profile predates them)
    it is watched by pid and start time instead. Enough of ``subprocess.Popen``'s interface
    for a tool that stops the owner it started."""

    def __init__(self, pid: int):
        self.pid = pid
        self._fd: int | None = None
        self._start = _stat(pid)[1]  # its start time: a reused pid has another (no pidfd)
        self._gone = self._start is None
        if self._gone:
            return
        try:
            self._fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self._gone = True
        except OSError as e:
            if e.errno not in (errno.ENOSYS, errno.EPERM, errno.EACCES):
                raise

    def exited(self, timeout: float = 0.0) -> bool:
        """Whether it has exited, waiting up to ``timeout`` s for that."""
        if self._fd is not None:
            return _readable(self._fd, timeout)
        deadline = time.monotonic() + timeout
        while not self._gone:
            state, start = _stat(self.pid)
            self._gone = start != self._start or state in ("Z", "X")
            left = deadline - time.monotonic()
            if self._gone or left <= 0:
                break
            time.sleep(min(_POLL_S, left))  # no pidfd to wait on: its state, polled
        return self._gone

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` s for it to exit; ``subprocess.TimeoutExpired`` if not."""
        if not self.exited(timeout):
            raise subprocess.TimeoutExpired(f"{OWNER_MODULE} (pid {self.pid})", timeout)

    def send_signal(self, sig: int) -> None:
        if self.exited():
            return
        try:
            if self._fd is not None:
                signal.pidfd_send_signal(self._fd, sig)
            else:
                os.kill(self.pid, sig)
        except ProcessLookupError:
            pass  # exited meanwhile

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def close(self) -> None:
        """Stop watching it (also when this object is collected): ``exited`` says True."""
        self._gone = True
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    __del__ = close


def _stat(pid: int) -> tuple[str | None, int | None]:
    """A process's state letter and start time (clock ticks since boot); Nones if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError):
        return None, None
    return fields[0].decode(), int(fields[19])


def _readable(fd: int, timeout: float | None) -> bool:
    """Whether ``fd`` is readable (a pidfd: its process exited) within ``timeout`` s. poll,
    not select: an engine may well have file descriptors numbered above select's 1024."""
    p = select.poll()
    p.register(fd, select.POLLIN)
    return bool(p.poll(None if timeout is None else max(0.0, timeout) * 1e3))


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
    epoch = segment.owner_record()[1]  # before an owner we start could take the segment
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        start = os.lseek(fd, 0, os.SEEK_END)
        # The launcher prints the owner's pid, then (--hold) waits for its stdin to close or
        # for us to kill it: the owner, its child until then, cannot die and be reaped (its
        # pid reused) before we watch it.
        launcher = subprocess.Popen(
            [sys.executable, "-m", OWNER_MODULE, segment.name, "--detach", "--hold", "--idle-exit",
             str(OWNER_IDLE_EXIT_S)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=fd, start_new_session=True, close_fds=True)
    finally:
        os.close(fd)
    deadline = time.monotonic() + OWNER_START_TIMEOUT_S

    def failed(why: str) -> OwnerUnavailableError:
        lines = _tail(path, start)
        return OwnerUnavailableError(
            f"could not start an owner for segment {segment.name!r} ({why}): "
            f"{' | '.join(lines) or 'no output'}; see {path}, or run 'kvshm serve "
            f"{segment.name}' to see why")

    assert launcher.stdin is not None and launcher.stdout is not None
    owner: OwnerProcess | None = None
    with launcher:
        line = _pid_line(launcher, segment, epoch, deadline)
        if line.strip().isdigit():
            owner = OwnerProcess(int(line))
        launcher.stdin.close()
        launcher.kill()  # its work is done or failed; a fork of ours may hold its stdin open
        rc = launcher.wait()
    if owner is None:
        if segment.owner_alive() or segment.owner_record()[1] != epoch:
            return None  # an owner serves, or took the segment and died already (its
            # launcher died or stalled): none to watch, the caller notices either way
        raise failed(f"exit {rc}" if rc else f"no pid in its output: {line[:40]!r}" if line
                     else f"no pid within {OWNER_START_TIMEOUT_S:g}s")
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


def _pid_line(launcher: subprocess.Popen, segment: Segment, epoch: int, deadline: float
              ) -> bytes:
    """The launcher's line (the owner's pid), or b"" once an owner holds the segment (or
    took it after ``epoch`` and died already) or the deadline passed. A launcher that a
    signal ended (or stopped) after its fork has started an owner all the same: then only
    the segment tells, so it is watched too. One that exited with an error (it forks only
    once its arguments parsed) is reported at once."""
    assert launcher.stdout is not None
    eof = False
    while not segment.owner_alive() and segment.owner_record()[1] == epoch and \
            time.monotonic() < deadline:
        if eof:
            time.sleep(_WAIT_PID_S)  # the launcher is gone: only the segment can tell now
        elif _readable(launcher.stdout.fileno(), _WAIT_PID_S):
            line = launcher.stdout.readline()
            if line:
                return line
            eof = True
            if (launcher.wait() or 0) > 0:
                break
    return b""

