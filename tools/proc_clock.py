"""CPU time of another process, from /proc, for the benchmarks that report what a process
(the owner above all) spent: nanosecond clocks where the kernel keeps them; and the host's
load average, which every benchmark reports beside its figures.

Linux only; it never raises for a process that is gone (``sched_ns``) and imports nothing but
the standard library.
"""
from __future__ import annotations

import os


def sched_ns(pid: int) -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting for one) of ``pid``, from /proc/<pid>/schedstat."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            run_ns, wait_ns = f.read().split()[:2]
        return int(run_ns), int(wait_ns)
    except (OSError, ValueError):
        return 0, 0


def cpu_ns(pid: int) -> int:
    """CPU time (user+system) of ``pid`` in ns: schedstat's ns clock, else stat's ticks."""
    run_ns = sched_ns(pid)[0]
    if run_ns:
        return run_ns
    with open(f"/proc/{pid}/stat") as f:  # a kernel without schedstat
        fields = f.read().rsplit(")", 1)[1].split()
    ticks = int(fields[11]) + int(fields[12])  # utime, stime (fields 14, 15)
    return ticks * 1_000_000_000 // os.sysconf("SC_CLK_TCK")


def loadavg() -> str:
    """The host's 1, 5 and 15 minute load averages, as /proc/loadavg says them ("?" if not)."""
    try:
        with open("/proc/loadavg") as f:
            return " ".join(f.read().split()[:3])
    except OSError:
        return "?"


if __name__ == "__main__":  # a library: say what it is and who runs it
    import os.path
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from library_help import explain
    explain("proc_clock.py", __doc__, instead="tools/bench_scheduler.py")
