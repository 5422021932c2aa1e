"""What every kvshm command shares: its exit statuses and its logging options.

``kvshm serve``, ``kvshm mover``, ``python -m kvshm.owner`` (what clients start) and
``kvshm-inspect`` end the same way and log the same way, and their ``--help`` says so with
``EXIT_STATUS``. This module owns those numbers and words, and ``printable``: what a command
prints that another process wrote (a client's name, a file name in /dev/shm) never acts on
the operator's terminal. It imports nothing of kvshm.
"""
from __future__ import annotations

import argparse
import sys

EXIT_OK = 0  # done; a daemon: stopped by SIGTERM or SIGINT, or another one serves NAME already
EXIT_PROBLEM = 1  # it ran, and found or left a problem its output names
EXIT_ERROR = 2  # it could not run: bad arguments, or a kvshm error (one line on stderr)
EXIT_INTERRUPTED = 130  # an interactive command stopped by Ctrl-C

EXIT_STATUS = (
    "exit status: 0 done (a daemon: stopped by SIGTERM or SIGINT, or another one serves the "
    "segment already); 1 it ran and found or left a problem it names (kvshm-inspect: "
    "violations, objects it may not remove); 2 it could not run (bad arguments, or an error "
    "said in one line on stderr); 130 interrupted (Ctrl-C on an interactive command)")

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_LOG_LEVEL = "INFO"  # a daemon's log records its start, take-overs and reclaims


def add_log_level(parser: argparse.ArgumentParser, where: str) -> None:
    """The ``--log-level`` option of a daemon whose log goes ``where``."""
    parser.add_argument("--log-level", default=DEFAULT_LOG_LEVEL, type=str.upper,
                        choices=LOG_LEVELS, help=f"logging level, case-insensitive (default "
                        f"{DEFAULT_LOG_LEVEL}); the log goes to {where}")


def printable(text: str) -> str:
    """``text`` with every character that is not printable shown as its Python escape
    (``\\x1b``, ``\\u202e``, ``\\n``): a string another process wrote may hold terminal
    control sequences (clear the screen, retitle the window, forge lines) or characters that
    reorder or hide what follows. Printable text, any script's, is kept as it is."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def one_line(e: BaseException) -> str:
    """An exception's message on one line, as a command prints it: kvshm's own errors say
    what to do as they are; anything else is named, since its message alone may not say."""
    msg = printable(" ".join(str(e).split()))
    return msg if type(e).__module__.startswith("kvshm") and msg else \
        f"{type(e).__name__}: {msg}".rstrip(": ")


def error(prog: str, e: BaseException) -> int:
    """Say why ``prog`` could not run, in one line on stderr; its exit status."""
    print(f"{prog}: error: {one_line(e)}", file=sys.stderr)
    return EXIT_ERROR
