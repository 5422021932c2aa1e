"""Polling with bounded exponential backoff: the one way kvshm waits for a condition.

This module owns ``poll_until``: test a condition, sleep, double the sleep up to a cap, until
the condition holds or a deadline passes. It is for state other processes change without
telling us (a kernel lock falling, a record being written); it never synchronises on time,
never touches shared memory and never locks.
"""
from __future__ import annotations

import time
from collections.abc import Callable


def poll_until(cond: Callable[[], object], timeout: float, *,
               first: float = 1e-4, cap: float = 0.01) -> bool:
    """Wait until ``cond()`` is true: True if it became so within ``timeout`` seconds, False
    if not (the caller says what it waited for).

    ``cond`` is tested at once, then after sleeps of ``first``, ``2*first``, ... capped at
    ``cap`` seconds.
    """
    if cond():
        return True
    deadline = time.monotonic() + timeout
    delay = first
    while True:
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)  # polling another process's progress, bounded by the deadline
        delay = min(delay * 2, cap)
        if cond():
            return True
