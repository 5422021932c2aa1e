"""``kvshm-inspect``: look into the kvshm segments of this host, check them, clean up crashes.

This module owns the command line (stdlib argparse), its human output (rendered, escaped, by
``kvshm.inspect.render``) and ``--json`` output (encoded through the Structs of
``kvshm.inspect.schema``), and the only two commands that write to a
segment: ``gc`` (reclaims what dead clients and a dead owner left, only while no owner runs)
and ``rm`` (unlinks), whose work is ``kvshm.inspect.cleanup``'s. Everything else reads through
``kvshm.inspect.snapshot``. It must never write to a segment outside ``gc``/``rm`` and never
show a traceback: bad input gets one line on stderr.
Exit status: 0 ok, 1 ``verify`` found violations or ``rm`` refused, 2 error.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from kvshm import commands, logs
from kvshm.errors import SegmentNotFoundError
from kvshm.index.launch import OWNER_IDLE_EXIT_S
from kvshm.inspect.cleanup import reclaim, users
from kvshm.inspect.metrics import metric_samples, prometheus
from kvshm.inspect.render import dur, render_show, size, table, text
from kvshm.inspect.schema import encode
from kvshm.inspect.snapshot import block_rows, snapshot, verify
from kvshm.shm import layout as L
from kvshm.shm.names import PREFIX, SHM_DIR, list_segments, remove, remove_objects
from kvshm.shm.segment import Segment

PROG = "kvshm-inspect"
Args = argparse.Namespace


def _emit(args: Args, data: dict[str, Any], human: Callable[[], str]) -> None:
    print(encode(data) if args.json else text(human()), flush=True)


def _ls_row(name: str) -> dict[str, Any]:
    row: dict[str, Any] = {"name": name, **dict.fromkeys((
        "size_bytes format_version blocks_used blocks_total clients_alive owner_alive age_s "
        "error").split())}
    path = os.path.join(SHM_DIR, PREFIX + name)
    try:  # the raw header: shows the version of a segment this kvshm cannot read
        row["size_bytes"] = os.stat(path).st_size
        with open(path, "rb") as f:
            head = f.read(L.HEADER.size)
        if len(head) == L.HEADER.size and head[:8] == L.MAGIC:
            row["format_version"] = L.HEADER.unpack(head)[1]
    except OSError:
        pass  # attach below says why, in kvshm's words
    try:
        with Segment.attach(name) as seg:
            s = snapshot(seg)
        row.update(blocks_used=s["blocks"]["used"], blocks_total=s["blocks"]["total"],
                   clients_alive=s["clients_alive"], owner_alive=s["owner"]["alive"],
                   age_s=s["header"]["age_s"])
    except Exception as e:  # one unreadable segment must not hide the others
        row["error"] = commands.one_line(e)
    return row


def cmd_ls(args: Args) -> int:
    rows = [_ls_row(n) for n in list_segments()]
    _emit(args, {"schema": "kvshm.ls/1", "segments": rows}, lambda: "\n".join(table(
        ["NAME", "SIZE", "BLOCKS", "CLIENTS", "OWNER", "FORMAT", "AGE", "ERROR"], [
            [r["name"], size(r["size_bytes"]), r["blocks_total"] and
             f"{r['blocks_used']}/{r['blocks_total']}", r["clients_alive"],
             {True: "alive", False: "none", None: None}[r["owner_alive"]],
             r["format_version"], dur(r["age_s"]), r["error"]] for r in rows], "")
        if rows else [f"no kvshm segments in {SHM_DIR}"]))
    return 0


def cmd_show(args: Args) -> int:
    with Segment.attach(args.name) as seg:
        s = snapshot(seg)
    _emit(args, s, lambda: render_show(s))
    return 0


def cmd_blocks(args: Args) -> int:
    states = set(args.state or ["used"])
    with Segment.attach(args.name) as seg:
        matching, rows = block_rows(seg, states, args.limit)
    _emit(args, {"schema": "kvshm.blocks/1", "name": args.name, "states": sorted(states),
                 "matching": matching, "rows": rows}, lambda: "\n".join(table(
        ["BLOCK", "STATE", "KEY", "PINS", "HELD_BY", "LAST_USE", "WRITER"], [
            [r["block"], r["state"], r["key"][:16] + "…" * (len(r["key"]) > 16), r["pins"],
             " ".join([f"{i}:pin" for i in r["pinned_by"]] + [f"{i}:lease" for i in
                                                              r["leased_by"]]),
             r["last_use"], None if r["state"] != "writing"
             else "owner" if r["writer"] < 0 else
             f"slot {r['writer']} gen {r['writer_gen']} req {r['writer_req']}"] for r in rows],
        "") + [f"({len(rows)} of {matching} blocks in state {'/'.join(sorted(states))}; "
               "--limit 0 shows all)"]))
    return 0


def cmd_verify(args: Args) -> int:
    with Segment.attach(args.name) as seg:
        found = verify(seg, data=args.data)
    _emit(args, {"schema": "kvshm.verify/1", "name": args.name, "ok": not found,
                 "violations": found}, lambda: "\n".join(
        [f"{args.name}: " + (f"{len(found)} violations" if found else "ok, no violations")]
        + [f"  - {v}" for v in found]))
    return 1 if found else 0


def cmd_metrics(args: Args) -> int:
    with Segment.attach(args.name) as seg:
        snaps = [snapshot(seg)]
    if args.json:
        _emit(args, {"schema": "kvshm.metrics/1", "name": args.name,
                     "samples": metric_samples(snaps)}, str)
    else:
        sys.stdout.write(prometheus(snaps))
    return 0


def cmd_watch(args: Args) -> int:
    # Ctrl-C must stop us even if we inherited SIGINT as ignored (a background job of a
    # non-interactive shell does), in which case Python never raises KeyboardInterrupt.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    clear = "\x1b[H\x1b[2J" if sys.stdout.isatty() else "\n"
    with Segment.attach(args.name) as seg:
        try:
            for n in range(1, sys.maxsize):
                s = snapshot(seg)
                print(encode(s, indent=0) if args.json else clear + render_show(s) +
                      f"\n(every {args.interval:g}s; Ctrl-C stops)", flush=True)
                if n == args.count:
                    break
                time.sleep(args.interval)  # the refresh period itself
        except KeyboardInterrupt:
            pass
    return 0


def cmd_gc(args: Args) -> int:
    with Segment.attach(args.name) as seg:
        r = reclaim(seg)
    _emit(args, r, lambda: "\n    ".join(
        [f"{args.name}: {r['reason']}"] + [
            f"freed {r['freed_blocks']} unfinished blocks, kept {r['kept_ready']} ready and "
            f"{r['kept_pending']} being written by live clients; reclaimed "
            f"{len(r['reclaimed_clients'])} dead client slots"] * r["acted"] +
        [f"  slot {c['slot']} pid {c['pid']} {c['name']!r}: {c['holds']} holds released"
         for c in r["reclaimed_clients"]]))
    return 0


def _wait_idle_owner(args: Args) -> tuple[list[dict[str, int]], bool]:
    """No client left but an owner: wait (up to --wait s) for its idle exit, saying so."""
    clients, owner = users(args.name)
    deadline, said = time.monotonic() + args.wait, -1
    while owner and not clients and not args.force and time.monotonic() < deadline:
        left = int(deadline - time.monotonic() + 0.999)
        if said < 0 or said - left >= 2:
            print(f"{PROG}: no client left; waiting for the owner's idle exit ({left}s left; "
                  "--force removes now)", file=sys.stderr, flush=True)
            said = left
        time.sleep(0.1)  # polling the owner lock, bounded by --wait
        clients, owner = users(args.name)
    return clients, owner


def cmd_rm(args: Args) -> int:
    out = {"schema": "kvshm.rm/1", "name": args.name, "removed": False, "forced": args.force,
           "owner_alive": False, "live_clients": [], "leftovers": [], "refused": [],
           "log_removed": None}
    try:
        clients, owner = _wait_idle_owner(args)
    except SegmentNotFoundError:
        # No segment, but perhaps what a process killed as it attached a removed one left,
        # or the log of its owners (a segment removed by other means than rm).
        out["leftovers"], out["refused"] = remove_objects(args.name)
        out["log_removed"] = None if args.keep_log else logs.remove(args.name)
        if not out["leftovers"] and not out["refused"] and not out["log_removed"]:
            raise
        return _removed(args, out)
    out.update(owner_alive=owner, live_clients=clients)
    if (clients or owner) and not args.force:
        # pid 0: a client that holds its slot's lock but has not written its record yet
        who = [f"slot {c['slot']} " + (f"pid {c['pid']}" if c["pid"] else "(pid not yet known)")
               for c in clients] + ["the owner"] * owner
        print(f"{PROG}: refusing to remove {args.name!r}: in use by {', '.join(who)}; stop "
              "them first (an auto-started owner exits within "
              f"{OWNER_IDLE_EXIT_S:g}s of its last client), or pass --force (they keep "
              "their mapping until they exit; the owner then exits by itself)", file=sys.stderr)
        if args.json:
            print(encode(out))
        return 1
    out["removed"], out["refused"] = remove(args.name, keep_log=True)
    out["log_removed"] = None if args.keep_log else logs.remove(args.name)
    return _removed(args, out)


def _removed(args: Args, out: dict[str, Any]) -> int:
    """Report an rm that ran; exit 1 if another user's objects stay."""
    name, left, log = args.name, out["leftovers"], out["log_removed"]
    _emit(args, out, lambda: (f"removed {name}" if out["removed"] else
          f"no segment {name}; removed what a removed one left: {', '.join(left)}" if left else
          f"no segment {name}" if log else f"{name} was already gone") +
          (f"; removed its owner log {log}" if log else ""))
    for entry in out["refused"]:
        with contextlib.suppress(OSError):
            entry += f" (uid {os.stat(os.path.join(SHM_DIR, entry)).st_uid})"
        print(f"{PROG}: could not remove {commands.printable(entry)} in {SHM_DIR}: another "
              f"user's; run '{PROG} rm {name}' as that user or as root", file=sys.stderr)
    return 1 if out["refused"] else 0


_COMMANDS: dict[str, tuple[Callable[[Args], int], str, str]] = {
    "ls": (cmd_ls, "list every kvshm segment on this host",
           "Per segment: size, blocks used/total, live clients, owner, format version, age;\n"
           "a foreign or damaged object shows its error instead.\n\nexample: kvshm-inspect ls"),
    "show": (cmd_show, "geometry, blocks by state, clients, owner, pin progress, counters",
             "Layout fingerprint and geometry; blocks free/writing/ready/evicting/granted/\n"
             "pinned; each client (pid, process name, alive, holds, pins, pending stores,\n"
             "ring depths in bytes); the owner; CUDA pin progress per process; counters.\n\n"
             "example: kvshm-inspect show llama8b --json"),
    "blocks": (cmd_blocks, "one row per block: state, key, pins, holders, last use, writer",
               "--state (repeatable): free, writing, ready, evicting, granted (in a client's\n"
               "grant ring), claimed (an offer its client took for a store), pinned (a load\n"
               "pin), leased (a live client's lookup lease), used\n"
               "(not free, the default), all.\n"
               "--limit caps the rows (0 = all)."
               "\n\nexample: kvshm-inspect blocks llama8b --state writing --limit 20"),
    "verify": (cmd_verify, "check the invariants the segment can show; exit 1 if violated",
               "Header; no entry left mid-rewrite; every used entry's key matches its key\n"
               "checksum (a torn key); key index vs block table; pins only on ready blocks;\n"
               "live clients hold only ready blocks; no block held or being written by a dead\n"
               "process (but a dead scheduler's stores stay while a copier registered for it\n"
               "lives: quarantined by the owner, not leaked).\n"
               "--data: also every ready block's planes against their block checksums\n"
               "(a segment created with Layout(checksums=True)).\n\n"
               "example: kvshm-inspect verify llama8b || kvshm-inspect gc llama8b"),
    "metrics": (cmd_metrics, "Prometheus text exposition of counters and gauges",
                "kvshm_* metrics (after vLLM's vllm:kv_offload_*) with a segment label;\n"
                "--json gives the same samples as one kvshm.metrics/1 document.\n\n"
                "example: kvshm-inspect metrics llama8b > /var/lib/node_exporter/kvshm.prom"),
    "watch": (cmd_watch, "'show', refreshed in place until Ctrl-C",
              "With --json: one snapshot per line.\n\n"
              "example: kvshm-inspect watch llama8b --interval 0.5"),
    "gc": (cmd_gc, "reclaim what dead clients hold (only while no owner runs)",
           "Frees blocks whose writer died; releases dead clients' holds and slots. A live\n"
           "owner does this itself within a second, so then gc does nothing.\n\n"
           "example: kvshm-inspect gc llama8b"),
    "rm": (cmd_rm, "remove a segment (refused while processes use it, unless --force)",
           "Refused (exit 1) while a client lives. When only the owner is left (an\n"
           f"auto-started owner exits {OWNER_IDLE_EXIT_S:g}s after its last client), rm waits up\n"
           "to --wait seconds for it to go, with progress on stderr, then removes the\n"
           "segment or refuses. --force removes at once: processes that still map the\n"
           "segment keep it until they exit, and the owner notices and exits. Also removes\n"
           "foreign or damaged kvshm-* objects, and the doorbells or tier area that a\n"
           "process killed as it attached a removed segment left behind. Exit 1 also\n"
           "when objects of another user stay (run rm as that user or as root).\n"
           "The segment's owner log (kvshm-NAME-owner.log, see 'show') goes with it,\n"
           "unless --keep-log; rm of a name with no segment left removes its log.\n\n"
           "example: kvshm-inspect rm llama8b --force"),
}


def build_parser() -> argparse.ArgumentParser:
    raw = argparse.RawDescriptionHelpFormatter
    p = argparse.ArgumentParser(prog=PROG, formatter_class=raw, description="Inspect, check "
                                "and clean up kvshm shared-memory KV-cache segments.",
                                epilog=f"{commands.EXIT_STATUS}\nexample: kvshm-inspect show "
                                "llama8b")
    p.add_argument("--json", action="store_true", help="JSON output (docs/inspect.md)")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (func, short, long) in _COMMANDS.items():
        sp = sub.add_parser(name, help=short, description=long, formatter_class=raw)
        sp.set_defaults(func=func)
        if name != "ls":
            sp.add_argument("name", metavar="NAME", help="segment name (see 'kvshm-inspect ls')")
        sp.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                        help="JSON output (schema: docs/inspect.md)")
    sub.choices["blocks"].add_argument("--state", action="append", choices=(
        *L.STATE_NAMES.values(), "pinned", "leased", "used", "all"),
        help="show blocks in this state (repeatable; default used)")
    sub.choices["blocks"].add_argument("--limit", type=int, default=100,
                                       help="at most N rows (default 100, 0 = all)")
    sub.choices["verify"].add_argument("--data", action="store_true",
                                       help="check ready blocks' data against their checksums")
    sub.choices["watch"].add_argument("--interval", type=float, default=1.0,
                                      help="seconds between refreshes (default 1)")
    sub.choices["watch"].add_argument("--count", type=int, default=0,
                                      help="stop after N refreshes (default 0: until Ctrl-C)")
    sub.choices["rm"].add_argument("--force", action="store_true",
                                   help="remove at once, even while processes use it")
    sub.choices["rm"].add_argument("--keep-log", action="store_true",
                                   help="keep the segment's owner log (removed by default)")
    sub.choices["rm"].add_argument("--wait", type=float, default=OWNER_IDLE_EXIT_S + 5,
                                   metavar="S", help="when only an owner is left, wait up to S "
                                   f"seconds for its idle exit (default {OWNER_IDLE_EXIT_S + 5:g};"
                                   " 0: refuse at once)")
    return p



def main(argv: list[str] | None = None) -> int:
    """Run ``kvshm-inspect`` with ``argv`` (default ``sys.argv[1:]``); return the exit status."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or a usage error argparse has already explained
        return e.code if isinstance(e.code, int) else 2
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return commands.EXIT_INTERRUPTED
    except BrokenPipeError:  # piped into head: not an error
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # bad input must read as one line, never a traceback
        return commands.error(PROG, e)


if __name__ == "__main__":
    sys.exit(main())
