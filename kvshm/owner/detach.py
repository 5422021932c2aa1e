"""How an auto-started owner leaves the process tree of the client that started it.

This module owns ``detach()``, what ``python -m kvshm.owner NAME --detach`` (the way clients
start an owner, ``kvshm.client.owner_start``) does once its arguments parsed and before the
owner's imports, which may start threads: it forks; the parent (the launcher) writes the
child's pid on stdout and exits; the child goes on as the owner in a session of its own. With
``--hold`` (which only a client passes) the launcher first waits until its reader closes its
stdin or kills it, so that the owner, its child until then, cannot exit and be reaped (its
pid free for reuse) before the reader watches it through a pidfd; without it, a caller's own
stdin is neither waited for nor read. The owner is then nobody's descendant: it is
reparented to init (or to the nearest subreaper, such as a container's init), so killing the
engine's whole process tree (what vLLM does to an EngineCore on shutdown) or its process
group leaves it serving. Its stdin and stdout are /dev/null; its stderr, the owner log, is
kept.

It imports nothing of kvshm but its crash points (it runs before the owner's imports).
"""
from __future__ import annotations

import os
import sys

from kvshm.crashpoints import crash_point

_detached = False  # this process is the detached child already


def detach(hold: bool = False) -> None:
    """Fork; in the parent, write the child's pid and a newline to stdout, wait for end of
    file on stdin if ``hold``, and exit 0; in the child, return in a new session with stdin
    and stdout on /dev/null. Once detached, a second call does nothing."""
    global _detached
    if _detached:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        try:
            crash_point("owner.launch.before_pid")
            os.write(1, b"%d\n" % pid)
            if hold:  # asked for (a client's launcher): never a caller's own stdin
                while os.read(0, 4096):
                    pass  # until the reader closes it, dies, or kills us
        finally:
            os._exit(0)
    _detached = True
    os.setsid()  # the child is no group leader: it becomes the leader of a new session
    null = os.open(os.devnull, os.O_RDWR)
    os.dup2(null, 0)
    os.dup2(null, 1)
    os.close(null)
