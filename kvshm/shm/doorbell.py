"""Doorbells: how a producer wakes a consumer asleep in another process.

This module owns the wake-up that goes with the rings (``ring.py``): one 32-bit word of the
segment that is at once the consumer's "sleeping" flag and the futex it sleeps on. Nothing is
named, created or opened: a doorbell is memory of the segment itself, so no process can
truncate it or put something else in its place for another to map (a glibc semaphore is a
file that ``sem_open`` maps unchecked: truncated, it is SIGBUS for whoever posts on it; a
FIFO in its place fails every ``sem_open``). A truncated segment is the end of every process
that maps it anyway. The worst a scribbled word can do is wake its consumer early or let it
sleep until its timeout, the same as a lost or a stray wake-up; the kernel only compares the
word and hashes its address, and the operations are fixed here (a shared futex, never a
private one, whose flag a scribble could turn into another operation). It never blocks a
producer and never maps or frees memory.

Protocol. The consumer stores SLEEPING, fences, checks its rings once more and sleeps in
FUTEX_WAIT for as long as the word still reads SLEEPING. A producer, after publishing, fences,
reads the word and, if it is SLEEPING, stores AWAKE and calls FUTEX_WAKE. Store-then-load on
both sides: either the consumer's re-check sees the frame or the producer sees SLEEPING; then
either its wake finds the consumer asleep, or its store makes the FUTEX_WAIT return at once
(the kernel compares the word under the futex's lock). Producers race harmlessly: each only
ever stores AWAKE. On a CPU whose futex call number is not known here a consumer polls.
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import time
from collections.abc import Callable

from kvshm.errors import InvalidArgumentError
from kvshm.shm.fence import full_fence

__all__ = ["Doorbell"]

AWAKE, SLEEPING = 0, 1
FLAG_BYTES = 8  # what a doorbell's region holds (the futex is its first 4 bytes)
_FUTEX_WAIT, _FUTEX_WAKE = 0, 1  # shared futexes: no FUTEX_PRIVATE_FLAG
_WAKE_ALL = 2**31 - 1
_POLL_S = 1e-3  # a consumer without futexes looks this often
_SYS_FUTEX = {"x86_64": 202, "amd64": 202, "i386": 240, "i686": 240, "aarch64": 98,
              "arm64": 98, "armv7l": 240, "ppc64le": 221, "ppc64": 221, "s390x": 238,
              "riscv64": 98, "loongarch64": 98}.get(platform.machine().lower())

# Arguments are passed as ready-made ctypes objects (no ``argtypes`` conversion per call:
# a wake-up is on the path of every round trip whose peer sleeps).
_syscall = ctypes.CDLL(None, use_errno=True).syscall
_syscall.restype = ctypes.c_long


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


class _Futex:
    """The two futex calls on one word, their arguments built once."""

    def __init__(self, addr: int) -> None:
        a, nr, zero = ctypes.c_void_p(addr), ctypes.c_long(_SYS_FUTEX or 0), ctypes.c_uint(0)
        self._ts = _Timespec()
        self._wait = (nr, a, ctypes.c_int(_FUTEX_WAIT), ctypes.c_uint(SLEEPING),
                      ctypes.byref(self._ts), None, zero)
        self._wake = (nr, a, ctypes.c_int(_FUTEX_WAKE), ctypes.c_uint(_WAKE_ALL), None, None,
                      zero)

    def wait(self, timeout: float) -> int:
        """Sleep while the word reads SLEEPING, at most ``timeout`` s. 0 when woken (or
        spuriously), else the errno: EAGAIN (the word changed first), ETIMEDOUT, EINTR."""
        if _SYS_FUTEX is None:
            time.sleep(min(timeout, _POLL_S))
            return 0
        self._ts.tv_sec, self._ts.tv_nsec = int(timeout), int(timeout % 1 * 1e9)
        return 0 if _syscall(*self._wait) == 0 else ctypes.get_errno()

    def wake(self) -> None:
        if _SYS_FUTEX is not None:
            _syscall(*self._wake)


class Doorbell:
    """Wakes one consumer (that may serve many rings) from producers in other processes.

    ``flag_buf``: ``FLAG_BYTES`` of the segment, 8-byte aligned, that only this doorbell uses.
    """

    def __init__(self, flag_buf: memoryview) -> None:
        mv = memoryview(flag_buf).cast("B")
        if mv.readonly or len(mv) < FLAG_BYTES:
            raise InvalidArgumentError(f"a doorbell needs {FLAG_BYTES} writable bytes, got "
                                       f"{len(mv)}{' read-only' if mv.readonly else ''}")
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mv))
        if addr % 8:
            raise InvalidArgumentError(f"a doorbell at address {addr:#x} is not 8-byte "
                                       "aligned; carve regions at multiples of 64 bytes")
        self._futex = _Futex(addr)  # valid while _flag holds the mapping
        self._flag = mv[:4].cast("I")
        mv.release()

    @staticmethod
    def flag_size() -> int:
        return FLAG_BYTES

    def ring(self) -> bool:
        """Producer, after publishing: wake the consumer if it sleeps. Returns whether it
        called the kernel."""
        full_fence()  # our tail store must be visible before we load the flag (store->load)
        if self._flag[0] != AWAKE:  # SLEEPING, or scribbled: a wake costs nothing wrong
            self._flag[0] = AWAKE
            self._futex.wake()
            return True
        return False

    def wait(self, timeout: float, ready: Callable[[], bool], spin_s: float = 100e-6) -> bool:
        """Consumer: return True once ``ready()`` is true, False after ``timeout`` seconds or
        when a signal interrupted the sleep (its Python handler runs as this returns, so
        that whatever it asked for, such as a stop, is seen at once by the caller's loop)."""
        now = time.perf_counter()
        deadline, spin_end = now + timeout, now + min(spin_s, timeout)
        while True:  # spin first: a busy producer usually publishes within microseconds
            if ready():
                return True
            if time.perf_counter() >= spin_end:
                break
            os.sched_yield()  # on a loaded host the producer may be waiting for our core
        flag = self._flag
        try:
            while True:
                flag[0] = SLEEPING
                # Lost-wakeup guard: a producer that published before seeing our flag did not
                # wake us, so we look once more after raising it (fenced: store then load).
                full_fence()
                if ready():
                    return True
                left = deadline - time.perf_counter()
                if left <= 0:
                    return False
                if self._futex.wait(left) == errno.EINTR:
                    return ready()
        finally:
            flag[0] = AWAKE

    def reset(self) -> None:
        """Forget a sleeper that died asleep (its flag still raised, producers would call
        the kernel in vain); a consumer taking over calls this once."""
        self._flag[0] = AWAKE

    def close(self) -> None:
        """Release this object's view of the segment (a doorbell has nothing else)."""
        self._flag.release()
