"""The ``kvshm mover`` command: its arguments, and a mover run until SIGTERM or SIGINT.

This module owns the command line of the mover (``mover`` owns the mover itself): it builds
the Mooncake tier from the arguments, runs one ``Mover`` and says in one line, never a
traceback, why it could not. It must never import Mooncake before the command runs.
"""
from __future__ import annotations

import argparse
import logging
import threading

from kvshm import commands, signals
from kvshm.errors import KvshmError, MoverRunningError
from kvshm.tier.mover import Mover
from kvshm.units import parse_size

log = logging.getLogger("kvshm.mover")


def main(argv: list[str] | None = None) -> int:
    """``kvshm mover NAME --master HOST:PORT --metadata URL ...`` (see ``kvshm mover -h``)."""
    ap = argparse.ArgumentParser(prog="kvshm mover", epilog=commands.EXIT_STATUS)
    add_arguments(ap)
    return run_from_args(ap.parse_args(argv))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("name", help="segment name (the one engines pass to kvshm.connect)")
    ap.add_argument("--master", required=True, help="mooncake_master RPC address, host:port")
    ap.add_argument("--metadata", required=True,
                    help="metadata server URL, e.g. http://host:port/metadata (the master's "
                         "--enable_http_metadata_server)")
    ap.add_argument("--local-host", default="127.0.0.1",
                    help="this host's address as the other hosts reach it (default 127.0.0.1)")
    ap.add_argument("--global-segment", type=parse_size, default=512 << 20, metavar="BYTES",
                    help="memory this host contributes to the Mooncake pool (default 512M; "
                         "suffixes K, M, G, T)")
    ap.add_argument("--local-buffer", type=parse_size, default=64 << 20, metavar="BYTES",
                    help="Mooncake client's local buffer (default 64M)")
    ap.add_argument("--protocol", default="tcp", help="tcp (default) or rdma")
    ap.add_argument("--devices", default="", help="RDMA devices for --protocol rdma")
    ap.add_argument("--no-spill", action="store_true",
                    help="fetch on miss only; never write the segment's blocks below")
    ap.add_argument("--batch", type=_batch, default=64,
                    help="blocks per put/get call, at least 1 (default 64)")
    commands.add_log_level(ap, "stderr")


def _batch(text: str) -> int:
    try:
        n = int(text)
    except ValueError:
        n = 0
    if n < 1:  # argparse says it in one line, before the mover takes anything
        raise argparse.ArgumentTypeError(f"pass a whole number of blocks, at least 1 (such as "
                                         f"the default 64), not {text!r}")
    return n


def run_from_args(a: argparse.Namespace) -> int:
    from kvshm.tier.mooncake import MooncakeConfig, MooncakeTier
    logging.basicConfig(level=a.log_level, format="%(asctime)s kvshm-mover %(process)d "
                        "%(levelname)s %(message)s")
    stops = signals.StopSignals()  # before it starts: a stop asked meanwhile is kept
    try:
        tier = MooncakeTier(MooncakeConfig(a.master, a.metadata, a.local_host, a.global_segment,
                                           a.local_buffer, a.protocol, a.devices))
        mover = Mover(a.name, tier, spill=not a.no_spill, batch=a.batch, stops=stops)
    except MoverRunningError as e:
        log.info("%s; exiting", e)
        return commands.EXIT_OK
    except KvshmError as e:  # no such segment, bad arguments: say what to do, no traceback
        return commands.error("kvshm mover", e)
    stop = threading.Event()
    stops.on_stop(stop.set)
    log.info("mover of segment %r: %s, spill %s", a.name, tier.description,
             "write-through" if not a.no_spill else "off")
    try:
        mover.run(stop)
    except KvshmError as e:  # LowerTierUnavailableError: the backend can never work here
        return commands.error("kvshm mover", e)
    finally:
        mover.close()
    stops.report(log)
    return commands.EXIT_OK
