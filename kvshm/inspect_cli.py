"""``kvshm-inspect``: look into the kvshm segments of this host, check them, clean up crashes.

This module owns the command line (stdlib argparse), its human and ``--json`` output (schema
in ``docs/inspect.md``), and the only two commands that write to a segment: ``gc`` (reclaims
what dead clients and a dead owner left, only while no owner runs) and ``rm`` (unlinks a
segment). Everything else reads through ``kvshm.snapshot``. It must never import torch, never
write to a segment outside ``gc``/``rm``, and never show a traceback: bad input gets one line
on stderr. Exit status: 0 ok, 1 ``verify`` found violations or ``rm`` refused, 2 error.
"""
from __future__ import annotations

import argparse
import json
import os
import struct
import sys
import time
from typing import Any, Callable

from . import layout as L
from . import locks
from .errors import OwnerUnavailableError, SegmentNotFoundError, SegmentPermissionError
from .segment import PREFIX, SHM_DIR, Segment, list_segments, shm_name
from .snapshot import block_rows, prometheus, snapshot, torn_entries, verify

PROG = "kvshm-inspect"
_STATES = ("free", "writing", "ready", "evicting", "pinned", "used", "all")


def _dur(s: float | None) -> str:
    if s is None:
        return "-"
    for big, small, n, m in (("d", "h", 86400, 3600), ("h", "m", 3600, 60), ("m", "s", 60, 1)):
        if s >= n:
            return f"{int(s // n)}{big}{int(s % n // m)}{small}"
    return f"{s:.1f}s"


def _size(n: int | None) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def _table(head: list[str], rows: list[list[Any]], indent: str = "  ") -> list[str]:
    cells = [head, *[["-" if x is None else str(x) for x in r] for r in rows]]
    width = [max(len(r[i]) for r in cells) for i in range(len(head))]
    return [indent + "  ".join(c.ljust(w) for c, w in zip(r, width)).rstrip() for r in cells]


def _emit(args: argparse.Namespace, data: dict[str, Any], human: Callable[[], str]) -> None:
    print(json.dumps(data, indent=2) if args.json else human(), flush=True)


def render_show(s: dict[str, Any]) -> str:
    """The human form of a ``snapshot()``."""
    h, g, b, o, c = s["header"], s["geometry"], s["blocks"], s["owner"], s["counters"]
    owner = ("none has run yet" if not o["epoch"] else
             f"pid {o['pid']}  alive  epoch {o['epoch']}  since {_dur(o['age_s'])}  tick "
             f"{o['tick']}" if o["alive"] else f"none alive (last: pid {o['pid'] or '-'}, epoch "
             f"{o['epoch']}; the next client to attach starts one)")
    out = [f"segment   {s['name']}  ({SHM_DIR}/{PREFIX}{s['name']}, {_size(h['total_bytes'])}, "
           f"format {h['format_version']}, age {_dur(h['age_s'])})",
           f"layout    model {h['layout']['model'] or '-'}  tokens/block {g['tokens_per_block']}"
           f"  page bytes {g['page_bytes']}  fingerprint {h['fingerprint'][:16]}",
           f"geometry  {g['num_blocks']} blocks x {_size(g['block_bytes'])} = "
           f"{_size(g['data_bytes'])} data  {g['max_clients']} client slots  ring "
           f"{_size(g['ring_capacity'])}  {g['hold_capacity']} holds/client",
           f"blocks    free {b['free']}  writing {b['writing']}  ready {b['ready']}  evicting "
           f"{b['evicting']}  pinned {b['pinned']}  ({b['usage']:.1%} used)"
           + (f"  INVALID {b['invalid']}" if b["invalid"] else ""),
           f"owner     {owner}",
           f"clients   {s['clients_alive']} alive, {s['clients_dead']} dead"]
    out += _table(["SLOT", "PID", "NAME", "ALIVE", "GEN", "HOLDS", "PINS", "PENDING",
                   *(r.upper() for r in L.RING_NAMES), "AGE"],
                  [[x["slot"], x["pid"], x["name"], "yes" if x["alive"] else "DEAD",
                    x["generation"], x["holds"], x["pins_held"], x["stores_pending"],
                    *x["rings"].values(), _dur(x["age_s"])] for x in s["clients"]]
                  ) if s["clients"] else []
    if s["pinners"]:
        out += ["pin progress"] + _table(["PID", "STATE", "DONE", "TOTAL", "ALIVE"], [
            [p["pid"], p["state"], _size(p["done_bytes"]), _size(p["total_bytes"]),
             "yes" if p["alive"] else "no"] for p in s["pinners"]])
    items = [f"{k} {v}" for k, v in c.items()]
    return "\n".join(out + ["counters"] + ["  " + "  ".join(items[i:i + 7])
                                           for i in range(0, len(items), 7)])


def _attach(name: str) -> Segment:
    return Segment.attach(name)


def _ls_row(name: str) -> dict[str, Any]:
    row: dict[str, Any] = dict.fromkeys(("size_bytes", "format_version", "blocks_used",
                                         "blocks_total", "clients_alive", "owner_alive",
                                         "age_s", "error"))
    row["name"] = name
    try:  # the raw header, to show the version of a segment this kvshm cannot read
        path = os.path.join(SHM_DIR, PREFIX + name)
        row["size_bytes"] = os.stat(path).st_size
        with open(path, "rb") as f:
            head = f.read(L.HEADER.size)
        if len(head) == L.HEADER.size and head[:8] == L.MAGIC:
            row["format_version"] = L.HEADER.unpack(head)[1]
    except OSError:
        pass  # attach below says why, in kvshm's words
    try:
        with _attach(name) as seg:
            s = snapshot(seg)
        row.update(blocks_used=s["blocks"]["used"], blocks_total=s["blocks"]["total"],
                   clients_alive=s["clients_alive"], owner_alive=s["owner"]["alive"],
                   age_s=s["header"]["age_s"])
    except Exception as e:  # one unreadable segment must not hide the others
        row["error"] = _one_line(e)
    return row


def cmd_ls(args: argparse.Namespace) -> int:
    rows = [_ls_row(n) for n in list_segments()]
    _emit(args, {"schema": "kvshm.ls/1", "segments": rows}, lambda: "\n".join(_table(
        ["NAME", "SIZE", "BLOCKS", "CLIENTS", "OWNER", "FORMAT", "AGE", "ERROR"],
        [[r["name"], _size(r["size_bytes"]), r["blocks_total"] and
          f"{r['blocks_used']}/{r['blocks_total']}", r["clients_alive"],
          {True: "alive", False: "none", None: None}[r["owner_alive"]], r["format_version"],
          _dur(r["age_s"]), r["error"]] for r in rows], indent="")) if rows else
        f"no kvshm segments in {SHM_DIR}")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    with _attach(args.name) as seg:
        s = snapshot(seg)
    _emit(args, s, lambda: render_show(s))
    return 0


def cmd_blocks(args: argparse.Namespace) -> int:
    states = set(args.state or ["used"])
    with _attach(args.name) as seg:
        matching, rows = block_rows(seg, states, args.limit)

    def human() -> str:
        out = _table(["BLOCK", "STATE", "KEY", "PINS", "HOLDERS", "LAST_USE", "WRITER"], [[
            r["block"], r["state"], r["key"][:16] + ("…" if len(r["key"]) > 16 else ""),
            r["pins"], ",".join(map(str, r["holders"])), r["last_use"],
            ("owner" if r["writer"] < 0 else f"slot {r['writer']} gen {r['writer_gen']} req "
             f"{r['writer_req']}") if r["state"] == "writing" else None] for r in rows], "")
        return "\n".join(out + [f"({len(rows)} of {matching} blocks in state "
                                f"{'/'.join(sorted(states))}; --limit 0 shows all)"])
    _emit(args, {"schema": "kvshm.blocks/1", "name": args.name, "states": sorted(states),
                 "matching": matching, "rows": rows}, human)
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    with _attach(args.name) as seg:
        found = verify(seg)
    _emit(args, {"schema": "kvshm.verify/1", "name": args.name, "ok": not found,
                 "violations": found}, lambda: f"{args.name}: ok, no violations" if not found
          else "\n".join([f"{args.name}: {len(found)} violations"] + [f"  - {v}" for v in found]))
    return 1 if found else 0


def cmd_metrics(args: argparse.Namespace) -> int:
    with _attach(args.name) as seg:
        sys.stdout.write(prometheus([snapshot(seg)]))
    return 0


def cmd_watch(args: argparse.Namespace) -> int:
    tty, n = sys.stdout.isatty(), 0
    with _attach(args.name) as seg:
        try:
            while True:
                s = snapshot(seg)
                if args.json:
                    print(json.dumps(s), flush=True)
                else:
                    sys.stdout.write(("\x1b[H\x1b[2J" if tty else "\n") + render_show(s) +
                                     f"\n(every {args.interval:g}s; Ctrl-C stops)\n")
                    sys.stdout.flush()
                n += 1
                if args.count and n >= args.count:
                    return 0
                time.sleep(args.interval)  # the refresh period itself
        except KeyboardInterrupt:
            return 0


def _gc(seg: Segment) -> dict[str, Any]:
    out: dict[str, Any] = {"schema": "kvshm.gc/1", "name": seg.name, "acted": False,
                           "reason": "", "freed_blocks": 0, "kept_ready": 0, "kept_pending": 0,
                           "reclaimed_clients": []}
    if not locks.try_lock(seg.fd, L.LOCK_OWNER):  # OFD lock: LocalManager re-takes it below
        out["reason"] = (f"owner pid {seg.owner_record()[0]} is alive and reclaims dead "
                         "clients itself; nothing done")
        return out
    from .manager import LocalManager  # only gc needs the manager
    g, live, seq = seg.geometry, seg.clients_alive(), struct.Struct("<I")
    for b in torn_entries(seg):  # the last owner died mid-rewrite: free it, then make seq even
        struct.pack_into("<B", seg.buf, g.entry_offset(b) + 4, L.FREE)
        seq.pack_into(seg.buf, g.entry_offset(b), seq.unpack_from(seg.buf, g.entry_offset(b))[0] + 1)

    def slot(i: int) -> tuple[int, int, int, int, bytes]:
        return L.SLOT.unpack_from(seg.buf, g.slot_offset(i))

    def writer_alive(i: int, gen: int) -> bool:
        return i in live and slot(i)[0] == L.SLOT_ACTIVE and slot(i)[2] == gen

    try:
        mgr = LocalManager(seg, writer_alive=writer_alive)
    except OwnerUnavailableError:
        locks.unlock(seg.fd, L.LOCK_OWNER)
        out["reason"] = "an owner started meanwhile and reclaims by itself; nothing done"
        return out
    try:
        for i in range(g.max_clients):
            o, (state, pid, _, _, name) = g.slot_offset(i) + g.hold_offset, slot(i)
            holds = struct.unpack_from(f"<{g.hold_capacity}i", seg.buf, o)
            n = sum(h >= 0 for h in holds)
            if state == L.SLOT_ACTIVE and locks.try_lock(seg.fd, L.LOCK_CLIENT_BASE + i):
                seg.buf[o:o + 4 * g.hold_capacity] = b"\xff" * (4 * g.hold_capacity)
                L.SLOT_OWNER_VIEW.pack_into(seg.buf, g.slot_offset(i) + L.SLOT_OFF_OWNER_VIEW,
                                            0, 0)
                struct.pack_into("<I", seg.buf, g.slot_offset(i), 0)
                locks.unlock(seg.fd, L.LOCK_CLIENT_BASE + i)
                out["reclaimed_clients"].append({"slot": i, "pid": pid, "holds": n, "name": name
                                                 .rstrip(b"\0").decode("utf-8", "replace")})
        rec = mgr.recovered
        seg.counter_add("reclaimed_clients", len(out["reclaimed_clients"]))
        seg.counter_add("reclaimed_blocks", rec["freed"])
    finally:
        mgr.shutdown()
    out.update(acted=True, freed_blocks=rec["freed"], kept_ready=rec["ready"],
               kept_pending=rec["pending"], reason="no owner alive: reclaimed as a temporary owner")
    return out


def cmd_gc(args: argparse.Namespace) -> int:
    with _attach(args.name) as seg:
        r = _gc(seg)
    _emit(args, r, lambda: f"{args.name}: {r['reason']}" + ("" if not r["acted"] else (
        f"\n  freed {r['freed_blocks']} unfinished blocks, kept {r['kept_ready']} ready and "
        f"{r['kept_pending']} still being written by live clients\n  reclaimed "
        f"{len(r['reclaimed_clients'])} dead client slots" + "".join(
            f"\n    slot {c['slot']} pid {c['pid']} {c['name']!r}: {c['holds']} holds released"
            for c in r["reclaimed_clients"]))))
    return 0


def _users(name: str) -> tuple[list[dict[str, int]], bool]:
    """Live client slots and owner liveness; for a damaged segment, straight from its locks."""
    shm_name(name)  # a bad name is an error, not a damaged segment
    try:
        with _attach(name) as seg:
            return [{"slot": i, "pid": L.SLOT.unpack_from(seg.buf, seg.geometry.slot_offset(i))[1]}
                    for i in sorted(seg.clients_alive())], seg.owner_alive()
    except (SegmentNotFoundError, SegmentPermissionError):
        raise
    except Exception:  # not (or no longer) a readable kvshm segment: ask the kernel
        import posix_ipc
        shm = posix_ipc.SharedMemory(shm_name(name))
        try:
            return ([{"slot": i, "pid": 0} for i in
                     sorted(locks.held_among(shm.fd, L.LOCK_CLIENT_BASE, 1024))],
                    locks.is_held(shm.fd, L.LOCK_OWNER))
        finally:
            shm.close_fd()


def cmd_rm(args: argparse.Namespace) -> int:
    clients, owner = _users(args.name)
    out = {"schema": "kvshm.rm/1", "name": args.name, "removed": False, "forced": args.force,
           "owner_alive": owner, "live_clients": clients}
    if (clients or owner) and not args.force:
        who = ", ".join([f"slot {c['slot']} pid {c['pid']}" for c in clients] +
                        ["the owner"] * owner)
        print(f"{PROG}: refusing to remove {args.name!r}: in use by {who}; stop those "
              "processes first, or pass --force (they keep their mapping until they exit)",
              file=sys.stderr)
        if args.json:
            print(json.dumps(out, indent=2))
        return 1
    out["removed"] = Segment.unlink(args.name)
    _emit(args, out, lambda: f"removed {args.name}" if out["removed"] else
          f"{args.name} was already gone")
    return 0


_COMMANDS: dict[str, tuple[Callable[[argparse.Namespace], int], str, str]] = {
    "ls": (cmd_ls, "list every kvshm segment on this host",
           "One row per segment in /dev/shm: size, blocks used/total, live clients, owner,\n"
           "format version, age; a foreign or damaged object shows its error instead.\n\n"
           "example: kvshm-inspect ls --json"),
    "show": (cmd_show, "geometry, blocks by state, clients, owner, pin progress, counters",
             "Everything about one segment: layout fingerprint and geometry; blocks free,\n"
             "writing, ready, evicting, pinned; each client (pid, process name, alive, holds,\n"
             "pins, pending stores, ring depths in bytes); the owner; CUDA pin progress per\n"
             "process; counters.\n\nexample: kvshm-inspect show llama8b"),
    "blocks": (cmd_blocks, "one row per block: state, key, pins, holders, last use, writer",
               "One row per block. Filter with --state (repeatable; 'used' = not free, the\n"
               "default; 'pinned' = load pins or a live client's hold; 'all'); --limit caps\n"
               "the rows (0 = all).\n\nexample: kvshm-inspect blocks llama8b --state writing"),
    "verify": (cmd_verify, "check the invariants the segment can show; exit 1 if violated",
               "Checks the header, the key index against the block table, pins only on ready\n"
               "blocks, holds of live clients only on ready blocks, no block held or being\n"
               "written by a dead client. Exit 0 when clean, 1 with the list otherwise.\n\n"
               "example: kvshm-inspect verify llama8b || kvshm-inspect gc llama8b"),
    "metrics": (cmd_metrics, "Prometheus text exposition of counters and gauges",
                "Prints kvshm_* metrics (like vLLM's vllm:kv_offload_*), labelled with the\n"
                "segment, for a node-exporter textfile collector or a scrape wrapper.\n\n"
                "example: kvshm-inspect metrics llama8b > /var/lib/node_exporter/kvshm.prom"),
    "watch": (cmd_watch, "'show', refreshed in place until Ctrl-C",
              "Redraws 'show' every --interval seconds; with --json prints one snapshot per\n"
              "line instead.\n\nexample: kvshm-inspect watch llama8b --interval 0.5"),
    "gc": (cmd_gc, "reclaim what dead clients hold (only while no owner runs)",
           "Frees blocks whose writer died, releases dead clients' holds and slots. A live\n"
           "owner does this itself within a second, so gc then does nothing.\n\n"
           "example: kvshm-inspect gc llama8b"),
    "rm": (cmd_rm, "remove a segment (refused while processes use it, unless --force)",
           "Unlinks the segment and its semaphores; works on damaged or foreign objects\n"
           "named kvshm-*. Processes that still map it keep it until they exit.\n\n"
           "example: kvshm-inspect rm llama8b --force"),
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, formatter_class=argparse.RawDescriptionHelpFormatter,
                                description="Inspect, check and clean up kvshm shared-memory "
                                "KV-cache segments.", epilog="exit status: 0 ok, 1 violations "
                                "(verify) or refused (rm), 2 error\nexample: kvshm-inspect ls")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (func, short, long) in _COMMANDS.items():
        sp = sub.add_parser(name, help=short, description=long,
                            formatter_class=argparse.RawDescriptionHelpFormatter)
        sp.set_defaults(func=func)
        if name != "ls":
            sp.add_argument("name", metavar="NAME", help="segment name (see 'kvshm-inspect ls')")
        if name != "metrics":
            sp.add_argument("--json", action="store_true", default=argparse.SUPPRESS,
                            help="print JSON (schema: docs/inspect.md)")
    sub.choices["blocks"].add_argument("--state", action="append", choices=_STATES)
    sub.choices["blocks"].add_argument("--limit", type=int, default=100, help="default 100")
    sub.choices["watch"].add_argument("--interval", type=float, default=1.0, help="seconds")
    sub.choices["watch"].add_argument("--count", type=int, default=0, help="stop after N")
    sub.choices["rm"].add_argument("--force", action="store_true", help="remove while in use")
    return p


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split()) or type(e).__name__
    return msg if hasattr(e, "__module__") and e.__module__.startswith("kvshm") else \
        f"{type(e).__name__}: {msg}"


def main(argv: list[str] | None = None) -> int:
    """Run ``kvshm-inspect`` with ``argv``; returns the exit status."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:  # --help, or a usage error argparse already explained
        return e.code if isinstance(e.code, int) else 2
    try:
        return args.func(args)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # e.g. piped into head
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except Exception as e:  # bad input must read as one line, never a traceback
        print(f"{PROG}: error: {_one_line(e)}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
