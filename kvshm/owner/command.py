"""The owner as a command: ``python -m kvshm.owner NAME`` and ``kvshm serve NAME``.

This module owns the owner's arguments, its logging, its stop signals and its exit status
(``kvshm.commands``' policy); it serves nothing itself (``server.py`` does) and must never
turn an owner that lost the race to another into a failure: that is success.
"""
from __future__ import annotations

import argparse
import logging

from kvshm import commands, logs, signals
from kvshm.errors import KvshmError, OwnerUnavailableError
from kvshm.owner.detach import detach

log = logging.getLogger("kvshm.owner")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The arguments of an owner: ``kvshm serve`` and ``python -m kvshm.owner`` share them."""
    ap.add_argument("name", help="segment name (the one engines pass to kvshm.connect)")
    ap.add_argument("--idle-exit", type=float, default=None, metavar="S",
                    help="exit after S seconds without any attached client (an owner a "
                         "client starts does; default: serve until stopped)")
    commands.add_log_level(ap, "stderr (for an owner a client started: its log file, which "
                           "'kvshm-inspect show' names)")


def main(argv: list[str] | None = None) -> int:
    """``python -m kvshm.owner NAME``: what a client starts when no owner serves NAME."""
    ap = argparse.ArgumentParser(
        prog="python -m kvshm.owner", epilog=commands.EXIT_STATUS,
        description="Serve a kvshm segment's index (clients start this on demand; 'kvshm "
                    "serve' is the same for a process manager).")
    add_arguments(ap)
    ap.add_argument("--detach", action="store_true",
                    help="fork first: print the owner's pid and exit, the owner going on in a "
                         "session of its own, nobody's child (how clients start one)")
    ap.add_argument("--hold", action="store_true", help=argparse.SUPPRESS)  # a client's launcher
    args = ap.parse_args(argv)
    if args.detach:
        detach(hold=args.hold)
    return run_from_args(args)


def run_from_args(args: argparse.Namespace) -> int:
    from kvshm.owner.server import Owner  # after detach(): its imports may start threads
    logs.owner_logging(args.name, args.log_level)
    stops = signals.StopSignals()  # before it starts: a stop asked meanwhile is kept
    try:
        owner = Owner(args.name, idle_exit_s=args.idle_exit)
    except OwnerUnavailableError as e:  # someone else won the race: that is success
        log.info("%s", e)
        return commands.EXIT_OK
    except KvshmError as e:
        return commands.error("kvshm owner", e)
    stops.on_stop(owner.stop)
    try:
        owner.run()
    finally:
        owner.close()
    stops.report(log, "; the cache stays for the next owner")
    return commands.EXIT_OK
