"""The ``kvshm`` command: run an owner in the foreground for people who want a daemon.

This module owns only argument parsing for ``kvshm serve``; serving lives in ``kvshm.owner.server``.
``kvshm mover`` (the host's lower-tier mover) is parsed and run by ``kvshm.tier.mover_cli``.
"""
from __future__ import annotations

import argparse
import sys

from kvshm import commands


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="kvshm", epilog=commands.EXIT_STATUS,
        description="kvshm: a shared-memory KV-cache CPU tier shared by co-located engines. "
                    "Clients start an owner on demand; 'kvshm serve' runs one under your "
                    "process manager instead. Inspect caches with 'kvshm-inspect'.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    serve = sub.add_parser(
        "serve", help="serve a segment's index in the foreground", epilog=commands.EXIT_STATUS,
        description="Own segment NAME until SIGTERM/SIGINT: answer every client's manager "
                    "requests and reclaim what dead clients held. Exits 0 at once if another "
                    "owner already serves it. Example: kvshm serve mycache --log-level INFO")
    from kvshm.owner import command as server
    server.add_arguments(serve)
    mover = sub.add_parser(
        "mover", help="move segment NAME's blocks to and from Mooncake Store (one per host)",
        epilog=commands.EXIT_STATUS,
        description="Run the host's lower-tier mover for segment NAME until SIGTERM/SIGINT: "
                    "write every stored block through to Mooncake Store and fetch engines' "
                    "misses from it. Exits 0 at once if another mover serves NAME. Needs "
                    "pip install 'kvshm[mooncake]'. Example: kvshm mover mycache --master "
                    "10.0.0.1:50051 --metadata http://10.0.0.1:8080/metadata --local-host "
                    "10.0.0.2")
    from kvshm.tier.mover_cli import add_arguments, run_from_args
    add_arguments(mover)
    args = ap.parse_args(argv)
    if args.cmd == "mover":
        return run_from_args(args)
    return server.run_from_args(args)


if __name__ == "__main__":
    sys.exit(main())
