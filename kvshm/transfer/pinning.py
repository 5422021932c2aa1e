"""Pin the segment's data region for CUDA DMA (``cudaHostRegister``) in a process that copies.

This module owns: pre-faulting (``madvise(MADV_POPULATE_WRITE)``, read-touch fallback),
registration in chunks (<= 64 GiB per call: one call of >= 512 GiB fails on recent drivers),
complete rollback on any failure, progress reporting, taking the cross-process turn (a context
manager the segment provides, so engines starting together do not queue on the driver lock),
a background variant that never blocks an engine's start, and balanced unregistration.

It must never leave a partial registration behind, leave CUDA's per-thread last error set after
a failed call (it resurfaces later as a bogus "out of memory"), write to the region (other
processes may be storing KV in it), or raise because pinning failed: copies continue unpinned,
slower, and a warning says so. Registration costs ~0.1 s/GB, hence chunks, progress and the
background thread.
"""
from __future__ import annotations

import contextlib
import ctypes
import errno
import itertools
import logging
import mmap
import threading
import time
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager as ContextManager
from typing import Any, Protocol

import numpy as np

from kvshm.errors import InvalidArgumentError, PinningError

logger = logging.getLogger(__name__)

PAGE = mmap.PAGESIZE
MADV_POPULATE_WRITE = 23  # Linux >= 5.14
CUDA_HOST_REGISTER_PORTABLE = 1  # pinned for every CUDA context, whichever device is current
Progress = Callable[[int, int], None]


class PinBackend(Protocol):
    """What pin_region needs from CUDA; tests inject a fake."""

    def register(self, addr: int, nbytes: int) -> None:  # raises on failure
        ...

    def unregister(self, addr: int) -> None:
        ...

    def clear_error(self) -> None:  # drain the calling thread's last CUDA error
        ...


class CudaPinBackend:
    """cudaHostRegister/Unregister through torch's cudart bindings."""

    def __init__(self, device: int | None = None, flags: int = CUDA_HOST_REGISTER_PORTABLE):
        import torch
        self._torch = torch
        self._cudart = torch.cuda.cudart()
        self._device = torch.cuda.current_device() if device is None else device
        self._flags = flags
        self._bound = threading.local()

    def _bind(self) -> None:
        # A new thread's current device is 0: without this, a worker of GPU 3 would create a
        # context (and spend memory) on GPU 0 just to register.
        if not getattr(self._bound, "ok", False):
            self._torch.cuda.set_device(self._device)
            self._bound.ok = True

    def _check(self, err: Any, what: str) -> None:
        code = int(getattr(err, "value", err))
        if code != 0:
            raise PinningError(f"{what} failed: {self._cudart.cudaGetErrorString(err)} "
                               f"(cudaError {code})")

    def register(self, addr: int, nbytes: int) -> None:
        self._bind()
        self._check(self._cudart.cudaHostRegister(addr, nbytes, self._flags),
                    f"cudaHostRegister({nbytes} bytes at {addr:#x})")

    def unregister(self, addr: int) -> None:
        self._bind()
        self._check(self._cudart.cudaHostUnregister(addr), f"cudaHostUnregister({addr:#x})")

    def clear_error(self) -> None:
        lib = _loaded_cudart()
        if lib is not None:
            lib.cudaGetLastError()


def _loaded_cudart() -> ctypes.CDLL | None:
    """The libcudart torch already loaded (torch's bindings do not expose cudaGetLastError)."""
    try:
        with open("/proc/self/maps") as f:
            path = next((line.split()[-1] for line in f if "libcudart" in line), None)
        return ctypes.CDLL(path) if path else None
    except OSError:
        return None


def default_backend() -> PinBackend | None:
    """The CUDA backend, or None when torch has no usable GPU."""
    try:
        import torch
        return CudaPinBackend() if torch.cuda.is_available() else None
    except (ImportError, RuntimeError):
        return None


def _madvise(start: int, length: int, advice: int) -> int:
    """madvise(2); returns 0 or the errno."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return 0 if libc.madvise(start, length, advice) == 0 else ctypes.get_errno()


def prefault(addr: int, nbytes: int) -> str:
    """Fault the range in before registering; returns how: madvise, touched or skipped."""
    start = addr - addr % PAGE
    length = addr + nbytes - start
    err = _madvise(start, length, MADV_POPULATE_WRITE)
    if err == 0:
        return "madvise"
    if err != errno.EINVAL:
        logger.info("kvshm: pre-fault skipped (%s); cudaHostRegister faults pages itself",
                    errno.errorcode.get(err, err))
        return "skipped"
    # Kernel < 5.14: read one byte per page. Reads only: a read-modify-write could undo a
    # concurrent store by another process.
    np.frombuffer(memoryview((ctypes.c_uint8 * length).from_address(start)),
                  np.uint8)[::PAGE].max()
    return "touched"


def plan_chunks(addr: int, nbytes: int, chunk_bytes: int,
                align: int = PAGE) -> list[tuple[int, int]]:
    """(address, length) of each registration call: cuts every ``chunk_bytes`` rounded down to
    ``align`` (a row stride keeps every block inside one registration), counted from the page
    holding ``addr``, so cuts are page-aligned and two calls never share a page."""
    step = chunk_bytes // align * align
    origin, end = addr - addr % PAGE, addr + nbytes
    cuts = list(range(origin + step, end, step))
    bounds = [addr, *[c for c in cuts if c > addr], end]
    return [(a, b - a) for a, b in itertools.pairwise(bounds)]


class PinnedRegion:
    """A registered range. ``unregister`` is idempotent and undoes every chunk, last first."""

    def __init__(self, addr: int, nbytes: int, chunks: list[tuple[int, int]],
                 backend: PinBackend):
        self.addr, self.nbytes = addr, nbytes
        self._chunks = list(chunks)
        self._backend = backend
        self._lock = threading.Lock()

    @property
    def pinned(self) -> bool:
        return bool(self._chunks)

    @property
    def chunks(self) -> tuple[tuple[int, int], ...]:
        return tuple(self._chunks)

    def unregister(self) -> None:
        with self._lock:
            chunks, self._chunks = self._chunks, []
        _rollback(self._backend, chunks)

    def __repr__(self) -> str:
        return f"PinnedRegion({self.addr:#x}, {self.nbytes}, chunks={len(self._chunks)})"


def _rollback(backend: PinBackend, chunks: list[tuple[int, int]]) -> None:
    for a, _ in reversed(chunks):
        try:
            backend.unregister(a)
        except Exception as e:  # keep going: every other chunk must still be released
            logger.warning("kvshm: unregistering %#x failed: %s", a, e)
    with contextlib.suppress(Exception):
        backend.clear_error()


def _turn_cm(turn: ContextManager | Callable[[], ContextManager] | None) -> ContextManager:
    if turn is None:
        return contextlib.nullcontext()
    if hasattr(turn, "__enter__"):
        return turn  # type: ignore[return-value]
    return turn()  # a factory such as Segment.pin_turn


class _Cancelled(Exception):
    pass


def _check_args(addr: int, nbytes: int, chunk_bytes: int, align: int) -> None:
    if addr <= 0 or nbytes <= 0:
        raise InvalidArgumentError(f"cannot pin {nbytes} bytes at {addr:#x}; need addr > 0 "
                                   f"and nbytes > 0")
    if align <= 0 or align % PAGE:
        raise InvalidArgumentError(f"align must be a positive multiple of the page size "
                                   f"({PAGE}), got {align}")
    if chunk_bytes < align:
        raise InvalidArgumentError(f"chunk_bytes ({chunk_bytes}) must be >= align ({align})")


def pin_region(addr: int, nbytes: int, *, chunk_bytes: int = 64 << 30,
               turn: ContextManager | Callable[[], ContextManager] | None = None,
               progress: Progress | None = None, backend: PinBackend | None = None,
               align: int = PAGE, prefault_first: bool = True,
               cancel: threading.Event | None = None) -> PinnedRegion | None:
    """Pre-fault, then register ``[addr, addr + nbytes)`` chunk by chunk.

    ``turn`` (a context manager, or a factory of one) is held around the registration calls
    only; pre-faulting runs outside it. ``progress(done, total)`` is called with (0, total)
    once the turn is held, after every chunk, and with (0, total) again after a rollback.
    Returns None — after undoing every chunk and warning — when anything fails or CUDA is
    unavailable, and None without a warning when ``cancel`` is set.
    """
    _check_args(addr, nbytes, chunk_bytes, align)
    if backend is None:
        backend = default_backend()
        if backend is None:
            warnings.warn("kvshm: CUDA is not available, so the segment is not pinned; copies "
                          "continue unpinned", RuntimeWarning, stacklevel=2)
            return None
    report = progress or (lambda done, total: None)
    chunks = plan_chunks(addr, nbytes, chunk_bytes, align)
    done: list[tuple[int, int]] = []
    t0 = time.monotonic()
    try:
        if prefault_first:
            for a, n in chunks:  # outside the turn: it needs no driver lock
                if cancel is not None and cancel.is_set():
                    raise _Cancelled
                prefault(a, n)
        with _turn_cm(turn):
            report(0, nbytes)
            for a, n in chunks:
                if cancel is not None and cancel.is_set():
                    raise _Cancelled
                backend.register(a, n)
                done.append((a, n))
                pinned = sum(c[1] for c in done)
                report(pinned, nbytes)
                logger.info("kvshm: pinned %.1f of %.1f GiB (%.0f%%) in %.1f s", pinned / 2**30,
                            nbytes / 2**30, 100 * pinned / nbytes, time.monotonic() - t0)
    except BaseException as e:
        _rollback(backend, done)
        with contextlib.suppress(Exception):
            report(0, nbytes)
        if isinstance(e, _Cancelled):
            return None
        if not isinstance(e, Exception):
            raise  # KeyboardInterrupt and friends, after the rollback
        warnings.warn(f"kvshm: could not pin the segment ({nbytes} bytes at {addr:#x}): {e}. "
                      f"Every chunk was unregistered; copies continue unpinned (slower).",
                      RuntimeWarning, stacklevel=2)
        return None
    return PinnedRegion(addr, nbytes, done, backend)


class BackgroundPin:
    """pin_region on a daemon thread, so an engine's start never waits for it.

    ``done`` / ``pinned`` report its state (a CUDA handler given this object copies unpinned
    until ``pinned`` is True); ``unregister`` cancels a pin in progress or undoes a finished one.
    """

    def __init__(self, addr: int, nbytes: int, **kwargs: Any):
        _check_args(addr, nbytes, kwargs.get("chunk_bytes", 64 << 30), kwargs.get("align", PAGE))
        if kwargs.get("backend") is None:
            kwargs["backend"] = default_backend()  # chosen here: it records the caller's device
            if kwargs["backend"] is None:
                warnings.warn("kvshm: CUDA is not available, so the segment is not pinned; "
                              "copies continue unpinned", RuntimeWarning, stacklevel=3)
        self._cancel = threading.Event()
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._region: PinnedRegion | None = None
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(addr, nbytes, kwargs),
                                        name="kvshm-pin", daemon=True)
        if kwargs["backend"] is None:
            self._done.set()
        else:
            self._thread.start()

    def _run(self, addr: int, nbytes: int, kwargs: dict) -> None:
        try:
            region = pin_region(addr, nbytes, cancel=self._cancel, **kwargs)
            with self._lock:
                if region is not None and self._cancel.is_set():
                    region.unregister()  # cancelled while the last chunk went in
                else:
                    self._region = region
        except BaseException as e:  # a thread must not die silently
            self.error = e
            logger.exception("kvshm: background pinning failed")
        finally:
            self._done.set()

    @property
    def done(self) -> bool:
        return self._done.is_set()

    @property
    def pinned(self) -> bool:
        region = self._region
        return self.done and region is not None and region.pinned

    @property
    def region(self) -> PinnedRegion | None:
        return self._region

    def wait(self, timeout: float | None = None) -> bool:
        """Block until pinning finished (successfully or not); False on timeout."""
        return self._done.wait(timeout)

    def unregister(self, timeout: float | None = None) -> None:
        """Cancel or undo. With a timeout, a pin still waiting for its turn undoes itself."""
        self._cancel.set()
        self._done.wait(timeout)
        with self._lock:
            region, self._region = self._region, None
        if region is not None:
            region.unregister()


def pin_in_background(addr: int, nbytes: int, **kwargs: Any) -> BackgroundPin:
    """Start pin_region(addr, nbytes, **kwargs) on a thread; returns at once."""
    return BackgroundPin(addr, nbytes, **kwargs)
