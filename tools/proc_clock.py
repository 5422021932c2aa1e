"""CPU time of another process, from /proc, for the benchmarks that report what a process
(the owner above all) spent: nanosecond clocks where the kernel keeps them.

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


if __name__ == "__main__":  # a library: say what it is and who uses it
    import argparse
    argparse.ArgumentParser(prog="proc_clock.py", description=__doc__,
                            formatter_class=argparse.RawDescriptionHelpFormatter,
                            epilog="This file is a library, not a program: tools/bench_ring.py "
                            "and tools/bench_scheduler.py\nreport through it.").parse_args()
    raise SystemExit("proc_clock.py is a library; run tools/bench_ring.py or "
                     "tools/bench_scheduler.py instead")
