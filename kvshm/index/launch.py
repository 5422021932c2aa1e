"""How an owner process is started, and where it logs: what clients and operators share.

A client that finds no owner starts one as ``python -m OWNER_MODULE NAME``; this module names
that entry point (a test checks it is the owner package's ``main``), the idle time after which
an auto-started owner exits, and where its log goes, so that ``kvshm-inspect`` can point to
it. It starts nothing itself and imports nothing of the client or the owner.
"""
from __future__ import annotations

import os
import tempfile

OWNER_MODULE = "kvshm.owner"  # run with ``python -m``: kvshm/owner/__main__.py
OWNER_IDLE_EXIT_S = 10.0  # an auto-started owner exits this long after its last client left


def owner_log_path(name: str) -> str:
    """Where an auto-started owner of segment ``name`` logs: ``kvshm-NAME-owner.log`` in
    ``$XDG_RUNTIME_DIR`` if set, else the system temp dir (appended, mode 0600)."""
    return os.path.join(os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir(),
                        f"kvshm-{name}-owner.log")
