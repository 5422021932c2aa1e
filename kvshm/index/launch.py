"""How an owner process is started: what clients and operators share.

A client that finds no owner starts one as ``python -m OWNER_MODULE NAME``; this module names
that entry point (a test checks it is the owner package's ``main``) and the idle time after
which an auto-started owner exits (its log is ``kvshm.logs``'). It starts nothing itself and
imports nothing of the client or the owner.
"""
from __future__ import annotations

OWNER_MODULE = "kvshm.owner"  # run with ``python -m``: kvshm/owner/__main__.py
OWNER_IDLE_EXIT_S = 10.0  # an auto-started owner exits this long after its last client left
