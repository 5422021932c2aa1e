"""Memory fences for Python code that shares memory with other processes.

This module owns the two orderings kvshm relies on. Python cannot emit a barrier
instruction, but acquiring and releasing a ``threading.Lock`` runs the C library's atomic
read-modify-write instructions (``lock cmpxchg`` on x86, ``ldaxr/stlxr`` + ``dmb`` on ARM),
which order every earlier load and store before every later one — the same trick vLLM's
shm ring uses. It must never be used as a lock.

* ``publish_fence()``: payload stores before a publishing store (and the matching loads on
  the reader side). x86 is TSO — stores are not reordered with stores nor loads with loads,
  and every Python-level store is a separate C call the compiler cannot move — so it is free
  there; on other CPUs it is a full fence.
* ``full_fence()``: store→load ordering, which even x86 does not give. Needed where two
  processes each write a flag and then read the other's (the lease/eviction handshake).
"""
from __future__ import annotations

import platform
import threading

_lock = threading.Lock()
_acq, _rel = _lock.acquire, _lock.release
_X86 = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686", "x86")


def full_fence() -> None:
    # On x86 one LOCK-prefixed instruction is a full fence. On AArch64 an acquire then a
    # release lets accesses move into the pair, but release->acquire is ordered (RCsc), so
    # the middle pair of acquire-release-acquire-release orders all before against all after.
    _acq(); _rel(); _acq(); _rel()  # noqa: E702


if _X86:
    def full_fence() -> None:  # noqa: F811
        _acq(); _rel()  # noqa: E702


def _noop() -> None:
    return None


publish_fence = _noop if _X86 else full_fence
