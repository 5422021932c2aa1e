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
* ``WEAK_ORDER``: whether this CPU reorders stores with stores or loads with loads (not
  x86); code that fences only there tests it.
* ``full_fence()``: store→load ordering, which even x86 does not give. Needed where two
  processes each write a flag and then read the other's (the lease/eviction handshake).
"""
from __future__ import annotations

import platform
import threading

_lock = threading.Lock()
_acq, _rel = _lock.acquire, _lock.release
# The one platform check of kvshm: x86 is TSO (see above); everything else (ARM, POWER, ...)
# is treated as weakly ordered.
WEAK_ORDER = platform.machine().lower() not in ("x86_64", "amd64", "i386", "i686", "x86")

if WEAK_ORDER:
    def full_fence() -> None:
        # On AArch64 an acquire then a release lets accesses move into the pair, but
        # release->acquire is ordered (RCsc), so the middle pair of acquire-release-acquire-
        # release orders all before against all after.
        _acq(); _rel(); _acq(); _rel()  # noqa: E702
else:
    def full_fence() -> None:
        # On x86 one LOCK-prefixed instruction is a full fence.
        _acq(); _rel()  # noqa: E702


def _noop() -> None:
    return None


publish_fence = full_fence if WEAK_ORDER else _noop
