"""Child processes that use torch (a job channel's worker, an engine), started in milliseconds.

A spawned child imports torch afresh, about 2 s on a 2-core machine, and the tests start
dozens of them. ``CTX`` forks each child from multiprocessing's fork server, which imported
torch once (and nothing of kvshm). Such a child is as fresh as a spawned one for everything
the tests look at: the server is a new interpreter that holds no segment, lock or descriptor
of the test process, and the child imports kvshm and the test's module itself.

One difference is mended: a forked child would inherit the server's environment, which is
the one the server started with. Each child takes the starting process's environment as it
is at ``start()`` instead, as a spawned child does, and before it imports anything of the
test (so a crash point set for one child arms that child alone). What a process takes only
as it starts stays the server's, from its first start in the session: descriptors 0-2, the
umask, limits, the signal mask, and variables read as a library loads (OpenMP's). No test
using ``CTX`` varies those. The parent of a child is the server, which reaps a dead child at
once (no zombie keeps its pid).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import sys
from multiprocessing.context import ForkServerContext, ForkServerProcess


def _rebuilt(env: dict[str, str]) -> TorchProcess:
    """The child's first step, ahead of the process's state (its target, whose module
    imports kvshm): the environment its parent had at ``start()``."""
    # multiprocessing prepared the child first, under the server's environment: it runs the
    # parent's main script again unless that is a package's __main__ (``python -m pytest``).
    # A script that imports kvshm would have read its crash points there: refuse, never
    # arm the wrong ones.
    early = sorted(m for m in sys.modules if m == "kvshm" or m.startswith("kvshm."))
    if early:
        raise RuntimeError(f"{early[0]} was imported before this child's environment was "
                           "set: run the tests with `python -m pytest` or `pytest`")
    os.environ.clear()
    os.environ.update(env)
    return TorchProcess.__new__(TorchProcess)


class TorchProcess(ForkServerProcess):
    def start(self) -> None:
        self._env = dict(os.environ)
        super().start()

    def __reduce__(self):  # the environment is unpickled (and set) before the state
        return _rebuilt, (self._env,), self.__dict__


class _Context(ForkServerContext):
    Process = TorchProcess


CTX = _Context()
mp.set_forkserver_preload(["torch"])
