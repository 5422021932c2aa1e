"""C loops built once per host by its compiler, and loaded only when trusted and self-tested.

This module owns how kvshm's few compiled loops reach a process: a C source is compiled once
per host with ``cc`` (``$CC`` if set) into the user's cache directory, named by a hash of the
source, the machine and the flags, and loaded with ctypes (``PyDLL``: the GIL is held through
every call, which lasts microseconds). A library is loaded only if it and its directory are
this user's alone, opened without following links, sealed (``_SEAL``: a checksum of its
bytes that its build appended, verified before the load) and loaded from that very
descriptor, and used only if it answers its self-test rightly.

It must never build at import (``import kvshm`` stays light: ``CLibrary.load`` builds, called
where a process sets up its hot path), never raise out of ``load`` and never be the only way
to an answer: every caller has a Python path that gives the same result, slower, for a host
without a compiler or a usable cache.
"""
from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

BUILD_PREFIX = "build-"  # temporary build directories beside the libraries
_BUILD_SECONDS = 15      # a build takes ~0.1 s; a compiler that hangs costs a process no more
#                          than this, however many libraries it builds (an owner builds before
#                          its lock, and whoever started it waits 20 s for that lock)
_RETRY_SECONDS = 3600    # after a failed build, processes use Python this long before retrying
_FLAGS = ("-O2", "-shared", "-fPIC")  # no -march: a home directory may serve several CPUs
_SEAL = b"kvshm-so"  # a library ends with sha256(the rest) and this: the dynamic loader
#                      ignores bytes past its segments, and a damaged file must never reach it
#                      (truncated or altered code that still loads faults in whoever runs it)
_lock = threading.Lock()  # one build per process at a time
_hung = False  # a build of this process ran out of time: its later builds are not started


def _after_fork_in_child() -> None:
    # A fork while another thread held the lock (building) would leave the child's copy held
    # for good; the child builds or loads for itself.
    global _lock
    _lock = threading.Lock()


os.register_at_fork(after_in_child=_after_fork_in_child)

Signature = tuple[Any, list[Any]]  # (restype, argtypes) of one exported function


class CLibrary:
    """One C source, built on first ``load`` and then kept for the process's life.

    ``functions``: each exported name with its ctypes signature; ``self_test`` gets them as a
    dict and says whether they answer known cases rightly (a stale or foreign library must not
    be used); ``needs_gil``: the loops share state that only the GIL guards, so a free-threaded
    interpreter uses the Python path.
    """

    def __init__(self, stem: str, what: str, source: str, functions: dict[str, Signature],
                 self_test: Callable[[dict[str, Any]], bool], needs_gil: bool = False
                 ) -> None:
        self.stem, self.what, self.source = stem, what, source
        self.functions, self.self_test, self.needs_gil = functions, self_test, needs_gil
        self.fns: dict[str, Any] | None = None  # the loaded functions, once load() succeeded
        self._tried = False  # load() ran (and failed, if fns is still None): never retried

    def path(self) -> Path:
        """Where this host's build of the source lives (``$XDG_CACHE_HOME`` if absolute)."""
        import hashlib
        import platform
        what = "\0".join((self.source, platform.machine(), *_FLAGS))
        digest = hashlib.sha256(what.encode()).hexdigest()[:16]
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        cache = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"  # relative: void
        return cache / "kvshm" / f"{self.stem}-{digest}.so"

    def load(self) -> bool:
        """Build (once per host) and load the library; True when ``fns`` holds its functions."""
        if self._tried:
            return self.fns is not None
        with _lock:
            if not self._tried:
                self.fns = self._load()
                self._tried = True
        return self.fns is not None

    def _load(self) -> dict[str, Any] | None:
        if self.needs_gil and not getattr(sys, "_is_gil_enabled", lambda: True)():
            logger.debug("kvshm: compiled %s rely on the GIL; none here: Python", self.what)
            return None
        path = None
        try:
            path = self.path()  # (no home directory at all: a container's bare uid)
            if not path.exists():
                _build_unless_failed(path, self.source)
            try:
                lib = _dlopen(path)
            except PermissionError:
                raise
            except OSError:  # torn (a failed load leaves nothing loaded): build it again
                _build(path, self.source)
                lib = _dlopen(path)
            fns = {}
            for name, (restype, argtypes) in self.functions.items():
                fn = getattr(lib, name)
                fn.restype, fn.argtypes = restype, argtypes
                fns[name] = fn
            ok = self.self_test(fns)
        except Exception as e:  # no compiler, no usable cache: the Python path, slower
            logger.debug("kvshm: compiled %s unavailable (%s); using Python", self.what, e)
            return None
        if not ok:
            logger.warning("kvshm: %s answers its self-test wrongly; %s use Python (remove the "
                           "file to rebuild it)", path, self.what)
            return None
        return fns


def _build_unless_failed(path: Path, source: str) -> None:
    """``_build``, unless a build of ``path`` failed lately: an owner builds as it starts,
    while its first client waits, so a host whose compiler fails or hangs pays for it once an
    hour, not at every start. A failure of the compiler (an error, or its time limit) leaves
    a marker beside the library; a process interrupted while it waited does not."""
    marker = path.with_name(path.name + ".failed")
    with contextlib.suppress(OSError):
        if time.time() - marker.stat().st_mtime < _RETRY_SECONDS:
            raise RuntimeError(f"a build of {path.name} failed lately ({marker}); "
                               "remove it to try again")
    try:
        _build(path, source)
    except Exception:
        with contextlib.suppress(OSError):
            marker.touch()
        raise


def _build(path: Path, source: str) -> None:
    """Compile ``source`` into ``path``; another process building the same file at the same
    time is harmless (each writes its own temporary file, then renames it into place)."""
    import hashlib
    import shlex
    import shutil
    import subprocess
    import tempfile
    global _hung
    if _hung:
        raise TimeoutError(f"a compiler of this process hung for {_BUILD_SECONDS} s already")
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:  # nothing is built into a directory another user could write or swap
        _check_ours(dfd, path.parent)
    finally:
        os.close(dfd)
    for old in path.parent.glob(BUILD_PREFIX + "*"):  # left by builds killed midway
        with contextlib.suppress(OSError):
            if time.time() - old.stat().st_mtime > 10 * _BUILD_SECONDS:
                shutil.rmtree(old)
    cc = shlex.split(os.environ.get("CC") or "cc")
    with tempfile.TemporaryDirectory(prefix=BUILD_PREFIX, dir=path.parent) as tmp:
        src, out, log = Path(tmp) / "lib.c", Path(tmp) / "lib.so", Path(tmp) / "cc.log"
        src.write_text(source)
        # Its own session, so that a timeout kills the compiler's children too (cc1, as, ld);
        # its output to a file, not a pipe: the build ends when the compiler exits, whoever
        # else still holds its output (a compile cache's daemon). A process stopped past the
        # limit while the compiler finished finds it exited, not hung.
        with open(log, "wb") as err:
            proc = subprocess.Popen([*cc, *_FLAGS, "-o", str(out), str(src)],
                                    stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True)
        try:
            try:
                proc.wait(timeout=_BUILD_SECONDS)
            except subprocess.TimeoutExpired:
                if proc.poll() is None:  # (wait may look last just before a stop)
                    _hung = True
                    raise
        except BaseException:
            if proc.returncode is None:  # not reaped: its group id cannot have been reused
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            raise
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, cc,
                                                stderr=log.read_bytes()[-4000:])
        body = out.read_bytes()
        with open(out, "ab") as f:  # sealed, and on disk before it takes the library's name
            f.write(hashlib.sha256(body).digest() + _SEAL)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(out, 0o755)
        os.replace(out, path)


def _open_trusted(path: Path) -> int:
    """A descriptor of the library, opened through a descriptor of its directory, both
    checked to be this user's and writable by nobody else: code another user could have
    written is never loaded, even if the path is swapped between the check and the load.
    Nothing in an untrusted directory is opened, and nothing is opened that could block (a
    FIFO waits for a writer): the file must be a regular one."""
    dfd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        _check_ours(dfd, path.parent)
        fd = os.open(path.name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK, dir_fd=dfd)
        try:
            st = _check_ours(fd, path)
            if not stat.S_ISREG(st.st_mode):
                raise OSError(f"{path} is not a regular file")  # (rebuilt in its place)
            _check_sealed(fd, st.st_size, path)
        except BaseException:
            os.close(fd)
            raise
        return fd
    finally:
        os.close(dfd)


def _check_sealed(fd: int, size: int, what: Path) -> None:
    """OSError (the caller builds it again) unless the file's bytes are those its build
    sealed."""
    import hashlib
    data = os.pread(fd, size, 0)
    body, digest, seal = data[:-40], data[-40:-8], data[-8:]
    if len(data) != size or seal != _SEAL or hashlib.sha256(body).digest() != digest:
        raise OSError(f"{what} is damaged or not sealed by its build")


def _check_ours(fd: int, what: Path) -> os.stat_result:
    st = os.fstat(fd)
    if st.st_uid != os.getuid() or st.st_mode & 0o022:
        raise PermissionError(f"{what} is not this user's alone (owner {st.st_uid}, mode "
                              f"{st.st_mode & 0o777:o})")
    return st


def _dlopen(path: Path) -> Any:
    """The library through a trusted descriptor: what the descriptor holds is loaded, not
    whatever the path names by now. The descriptor stays open for the process's life: the
    loader knows a library by the name it was opened under, and a second library opened under
    a closed descriptor's reused number would be taken for the first."""
    fd = _open_trusted(path)
    try:
        return ctypes.PyDLL(f"/proc/self/fd/{fd}")
    except BaseException:
        os.close(fd)
        raise
