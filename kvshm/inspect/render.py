"""The human (text) form of ``kvshm-inspect``'s output: tables, sizes, durations, ``show``.

This module owns how the documents of ``kvshm.inspect.snapshot`` read on a terminal, and that
nothing another process wrote reaches it raw: a client names its own slot record, a creator
writes the layout's model, a mover its backend's description, any local user names files in
/dev/shm. So every line is escaped on its own (``lines``, ``text``: ``commands.printable``
shows non-printable characters escaped) on its way out, and columns are measured as a
terminal shows them; ``--json`` output is encoded exactly instead
(``kvshm.inspect.schema``), since JSON escapes control characters itself. It must never read
a segment, print, or import anything heavier than the standard library.
"""
from __future__ import annotations

import unicodedata
from typing import Any

from kvshm.commands import printable
from kvshm.shm import layout as L
from kvshm.shm.names import PREFIX, SHM_DIR


def text(s: str) -> str:
    """``s`` with every line made printable (the line breaks themselves are kept)."""
    return "\n".join(printable(line) for line in s.split("\n"))


def lines(out: list[str]) -> str:
    """Lines made printable one by one, then joined: a line break inside one (a field
    another process wrote) is shown escaped, never a line of that process's own."""
    return "\n".join(map(printable, out))


def width(s: str) -> int:
    """The terminal columns ``s`` takes: two for a wide character, none for a combining
    mark (a client names its own slot in any script)."""
    if s.isascii():
        return len(s)
    return sum(0 if unicodedata.combining(c) else
               2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in s)


def dur(s: float | None) -> str:
    """A duration in seconds as a person reads it (``2h5m``, ``3.2s``; None: ``-``)."""
    for big, small, n, m in (("d", "h", 86400, 3600), ("h", "m", 3600, 60), ("m", "s", 60, 1)):
        if s is not None and s >= n:
            return f"{int(s // n)}{big}{int(s % n // m)}{small}"
    return "-" if s is None else f"{s:.1f}s"


def size(n: float | None) -> str:
    """A byte count in binary units (``1.5 MiB``; None: ``-``)."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n is None or n < 1024 or unit == "TiB":
            return "-" if n is None else f"{n:.0f} B" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return ""


def table(head: list[str], rows: list[list[Any]], indent: str = "  ") -> list[str]:
    """Aligned columns; None shows as ``-``. Cells are escaped here, before they are measured,
    so that a cell another process wrote keeps the columns straight too."""
    cells = [head, *[["-" if x is None else printable(str(x)) for x in r] for r in rows]]
    cols = [max(width(r[i]) for r in cells) for i in range(len(head))]
    return [indent + "  ".join(c + " " * (w - width(c)) for c, w in zip(r, cols)).rstrip()
            for r in cells]


def render_show(s: dict[str, Any]) -> str:
    """The human form of a ``snapshot()``, printable (``lines``)."""
    h, g, b, o = s["header"], s["geometry"], s["blocks"], s["owner"]
    owner = ("none has run yet" if not o["epoch"] else
             f"pid {o['pid']}  alive  epoch {o['epoch']}  since {dur(o['age_s'])}  tick "
             f"{o['tick']}" if o["alive"] else f"none alive (last: pid {o['pid'] or '-'}, epoch "
             f"{o['epoch']}; the next client to attach starts one)")
    out = [f"segment   {s['name']}  ({SHM_DIR}/{PREFIX}{s['name']}, {size(h['total_bytes'])}, "
           f"format {h['format_version']}, age {dur(h['age_s'])})",
           f"layout    model {h['layout']['model'] or '-'}  tokens/block {g['tokens_per_block']}"
           f"  page bytes {g['page_bytes']}  policy {h['policy']}  fingerprint "
           f"{h['fingerprint'][:16]}",
           f"geometry  {g['num_blocks']} blocks x {size(g['block_bytes'])} = "
           f"{size(g['data_bytes'])}  {g['max_clients']} client slots  rings of "
           f"{size(g['ring_capacity'])}  {g['hold_capacity']} holds/client",
           f"blocks    free {b['free']}  writing {b['writing']}  ready {b['ready']}  evicting "
           f"{b['evicting']}  granted {b['granted']}  claimed {b['claimed']}  pinned "
           f"{b['pinned']}  leased "
           f"{b['leased']}  ({b['usage']:.1%} used)"
           + (f"  INVALID {b['invalid']}" if b["invalid"] else ""),
           f"owner     {owner}",
           f"owner log {o['log']}  (an auto-started owner's; 'kvshm serve' logs to its stderr)",
           f"clients   {s['clients_alive']} alive, {s['clients_dead']} dead"]
    if s["clients"]:
        out += table(["SLOT", "PID", "NAME", "ALIVE", "GEN", "PINS", "LEASES", "PENDING",
                      "STRANDED", "QUOTA", *(r.upper() for r in L.RING_NAMES), "AGE"], [
            [c["slot"], c["pid"], c["name"], "yes" if c["alive"] else "DEAD", c["generation"],
             c["pins"], c["leases"], c["stores_pending"], c["stranded"],
             f"{c['cached']}/{c['quota']}" if c["quota"] else "-", *c["rings"].values(),
             dur(c["age_s"])] for c in s["clients"]])
    if s["pinners"]:
        out += ["pin progress"] + table(["PID", "STATE", "DONE", "TOTAL", "ALIVE"], [
            [p["pid"], p["state"], size(p["done_bytes"]), size(p["total_bytes"]),
             "yes" if p["alive"] else "no"] for p in s["pinners"]])
    items = [f"{k} {v}" for k, v in s["counters"].items()]
    return lines(out + ["counters"] + ["  " + "  ".join(items[i:i + 7])
                                       for i in range(0, len(items), 7)] + _tier_lines(s))


def _tier_lines(s: dict[str, Any]) -> list[str]:
    t = s.get("tier")
    if t is None:
        return []
    c = t["counters"]
    who = (f"mover pid {t['mover_pid']}  {t['state']}" if t["mover_alive"] else
           f"no mover alive (last: pid {t['mover_pid'] or '-'})")
    items = [f"{k} {v}" for k, v in c.items()]
    return [f"tier      {who}  {t['backend'] or '-'}  wants queued {t['wants_queued']}"
            + (f"  last error {t['last_error']}" if t["last_error"] else ""),
            f"          put {size(c['put_bytes'])}  got {size(c['get_bytes'])}"] + [
        "  " + "  ".join(items[i:i + 6]) for i in range(0, len(items), 6)]
