"""How an auto-started owner leaves the process tree of the client that started it.

This module owns ``detach()``, the first thing ``python -m kvshm.owner NAME --detach`` (the
way clients start an owner, ``kvshm.client.owner_start``) does: it forks, the parent writes
the child's pid on stdout and exits at once, and the child goes on as the owner in a session
of its own. The owner is then nobody's descendant: it is reparented to init (or to the
nearest subreaper, such as a container's init), so killing the engine's whole process tree
(what vLLM does to an EngineCore on shutdown) or its process group leaves it serving. Its
stdin stays /dev/null and its stderr, the owner log, is kept.

It must run before the process starts any thread (it forks), and never imports anything of
kvshm.
"""
from __future__ import annotations

import os
import sys


def detach() -> None:
    """Fork; in the parent, write the child's pid and a newline to stdout and exit 0 at once;
    in the child, return in a new session with stdout on /dev/null (the parent's reader sees
    end of file once the parent is gone)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        try:
            os.write(1, b"%d\n" % pid)
        finally:
            os._exit(0)
    os.setsid()  # the child is no group leader: it becomes the leader of a new session
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.close(null)
