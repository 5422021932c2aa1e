"""Read-only views of a kvshm segment: ``snapshot()``, ``verify()``, ``block_rows()``, metrics.

This module owns turning a mapped segment into plain dicts and lists (ready for JSON) for
``kvshm-inspect``, the soak harness and tests, the checks of DESIGN.md's invariants that the
segment can show, and the Prometheus rendering; ``docs/inspect.md`` documents the output's
stable schema. It works on a private copy of the metadata, so it must never write to the
segment, never take a lock (it only asks the kernel who holds one), never spin on an entry a
dead owner left half-written, and never import torch or ``kvshm.manager``.
"""
from __future__ import annotations

import os
import struct
import time
import zlib
from typing import Any

import numpy as np

from . import layout as L
from .ring import Ring
from .segment import Segment
from .table import BlockTable, KeyIndex

_E = "seq state keylen writer writer_gen writer_req last_use stored_ns pins".split()
_ENTRY_DT = np.dtype({"names": _E, "formats": ["<" + c for c in "IBBhIIQQQ"],
                      "offsets": [struct.calcsize("<" + "IBBhIIQQQ"[:i]) for i in range(9)],
                      "itemsize": L.ENTRY_BYTES})
_KEY_OFF = struct.calcsize("<IBBhIIQQQ")
_INDEX_DT = np.dtype([("tag", "<u4"), ("block", "<i4")])
_GEOMETRY = ("num_blocks max_clients ring_capacity hold_capacity index_slots slot_bytes "
             "table_offset index_offset data_offset data_bytes total_bytes").split()
PIN_STATES = ("idle", "waiting", "running", "done", "failed")
COUNTERS = (*L.COUNTER_NAMES, *L.SLOT_COUNTERS, "misses")


class _Meta:
    """A private copy of header, slot heads and holds, block table and key index."""

    def __init__(self, seg: Segment):
        g, src = seg.geometry, seg.buf
        self.g = g
        self.buf = buf = bytearray(g.index_offset + g.index_slots * L.INDEX_SLOT.size)
        buf[:L.HEADER_BYTES] = src[:L.HEADER_BYTES]
        for i in range(g.max_clients):
            o = g.slot_offset(i)
            buf[o:o + g.rings_offset] = src[o:o + g.rings_offset]
        buf[g.table_offset:] = src[g.table_offset:len(buf)]  # table and index in one copy
        self.e = np.frombuffer(buf, _ENTRY_DT, g.num_blocks, g.table_offset)
        self.index = np.frombuffer(buf, _INDEX_DT, g.index_slots, g.index_offset)
        self.torn = self._settle(src)
        self.live, self.owner_alive = seg.clients_alive(), seg.owner_alive()
        self.live_held = {int(b) for i in range(g.max_clients) if self.alive(i)
                          for b in self.holds(i) if 0 <= b < g.num_blocks}
        mv = memoryview(buf)
        self.find = KeyIndex(mv, g, BlockTable(mv, g)).find

    def _settle(self, src: memoryview) -> list[int]:
        """Re-copy entries caught mid-rewrite; return those still odd (left torn by a death)."""
        torn = []
        for b in np.nonzero(self.e["seq"] & 1)[0].tolist():
            o = self.g.entry_offset(b)
            for _ in range(200):
                self.buf[o:o + L.ENTRY_BYTES] = src[o:o + L.ENTRY_BYTES]
                if not self.e["seq"][b] & 1:
                    break
                time.sleep(0.0001)  # an owner finishes a rewrite in microseconds
            else:
                torn.append(b)
                self.e["seq"][b] += 1  # in our copy only: lets BlockTable readers proceed
        return torn

    def key(self, b: int) -> bytes:
        o = self.g.entry_offset(b) + _KEY_OFF
        return bytes(self.buf[o:o + min(int(self.e["keylen"][b]), L.MAX_KEY_BYTES)])

    def slot(self, i: int) -> tuple[int, int, int, int, bytes]:
        return L.SLOT.unpack_from(self.buf, self.g.slot_offset(i))

    def alive(self, i: int) -> bool:
        return i in self.live and self.slot(i)[0] == L.SLOT_ACTIVE

    def holds(self, i: int) -> np.ndarray:
        """Block ids slot ``i`` holds (>= 0); holds mean something only in an active slot."""
        if self.slot(i)[0] != L.SLOT_ACTIVE:
            return np.empty(0, np.int32)
        h = np.frombuffer(self.buf, "<i4", self.g.hold_capacity,
                          self.g.slot_offset(i) + self.g.hold_offset)
        return h[h >= 0]


def torn_entries(seg: Segment) -> list[int]:
    """Blocks whose entry stays mid-rewrite (odd sequence number): its writer died writing it."""
    return _Meta(seg).torn


def _age(now: int, then: int) -> float:
    return round(max(0, now - then) / 1e9, 3)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):
        pass
    return pid > 0


def _ring_depths(seg: Segment, i: int) -> dict[str, int | None]:
    g, out = seg.geometry, {}
    for k, name in enumerate(L.RING_NAMES):
        o = g.slot_offset(i) + g.rings_offset + k * g.ring_region
        out[name] = None  # a ring never formatted (or damaged) has no depth to show
        with seg.buf[o:o + g.ring_region] as view:
            try:
                ring = Ring(view)
            except Exception:
                continue
            out[name] = ring.depth()
            ring.close()
    return out


def _client(seg: Segment, m: _Meta, i: int, now: int) -> dict[str, Any]:
    state, pid, gen, attached, name = m.slot(i)
    base = seg.geometry.slot_offset(i)
    counters = struct.unpack_from(f"<{len(L.SLOT_COUNTERS)}Q", m.buf, base + L.SLOT_OFF_COUNTERS)
    pins, pending = L.SLOT_OWNER_VIEW.unpack_from(m.buf, base + L.SLOT_OFF_OWNER_VIEW)
    return {"slot": i, "pid": pid, "name": name.rstrip(b"\0").decode("utf-8", "replace"),
            "state": state, "alive": m.alive(i), "generation": gen, "attached_ns": attached,
            "age_s": _age(now, attached), "holds": len(m.holds(i)), "pins_held": pins,
            "stores_pending": pending, "counters": dict(zip(L.SLOT_COUNTERS, counters)),
            "rings": _ring_depths(seg, i)}


def snapshot(seg: Segment) -> dict[str, Any]:
    """Everything ``kvshm-inspect show`` reports, as JSON-ready dicts (``docs/inspect.md``)."""
    m, g, lay, now = _Meta(seg), seg.geometry, seg.layout, time.time_ns()
    h = L.HEADER.unpack_from(m.buf, 0)
    n = np.bincount(np.minimum(m.e["state"], 4), minlength=5).tolist()
    pinned = m.live_held | set(np.nonzero(m.e["pins"])[0].tolist())
    clients = [_client(seg, m, i, now) for i in range(g.max_clients)
               if m.slot(i)[0] == L.SLOT_ACTIVE or i in m.live]
    counters = dict(zip(L.COUNTER_NAMES, struct.unpack_from(
        f"<{len(L.COUNTER_NAMES)}Q", m.buf, L.OFF_COUNTERS)))
    for name in L.SLOT_COUNTERS:  # clients' own counters, while their slot is active
        counters[name] = sum(c["counters"][name] for c in clients if c["state"] == L.SLOT_ACTIVE)
    counters["misses"] = max(0, counters["lookups"] - counters["hits"])
    pid, epoch, since, tick = L.OWNER.unpack_from(m.buf, L.OFF_OWNER)
    pinners = [{"pid": p, "alive": _pid_alive(p), "done_bytes": done, "total_bytes": total,
                "state": PIN_STATES[st] if st < 5 else str(st), "updated_ns": upd}
               for p, st, done, total, upd in (L.PINNER.unpack_from(
                   m.buf, L.OFF_PINNERS + k * L.PINNER.size) for k in range(L.MAX_PINNERS)) if p]
    used = g.num_blocks - n[L.FREE]
    return {
        "schema": "kvshm.show/1", "name": seg.name, "taken_ns": now,
        "header": {"format_version": h[1], "header_bytes": h[2], "total_bytes": h[3],
                   "created_ns": h[4], "age_s": _age(now, h[4]), "fingerprint": h[12].hex(),
                   "layout": {"model": lay.model, "page_bytes": list(lay.page_bytes),
                              "tokens_per_block": lay.tokens_per_block, "extra": lay.extra}},
        "geometry": {**{k: getattr(g, k) for k in _GEOMETRY}, "num_planes": len(g.page_bytes),
                     "page_bytes": list(g.page_bytes), "block_bytes": lay.block_bytes,
                     "tokens_per_block": lay.tokens_per_block},
        "blocks": {"total": g.num_blocks, "free": n[0], "writing": n[1], "ready": n[2],
                   "evicting": n[3], "invalid": n[4], "pinned": len(pinned), "used": used,
                   "usage": round(used / g.num_blocks, 6)},
        "owner": {"pid": pid, "alive": m.owner_alive, "epoch": epoch, "since_ns": since,
                  "age_s": _age(now, since) if since else None, "tick": tick},
        "clients": clients, "clients_alive": sum(c["alive"] for c in clients),
        "clients_dead": sum(c["state"] == L.SLOT_ACTIVE and not c["alive"] for c in clients),
        "pinners": pinners, "counters": counters}


def block_rows(seg: Segment, states: set[str], limit: int) -> tuple[int, list[dict[str, Any]]]:
    """(number of matching blocks, up to ``limit`` rows of them; 0 = all). ``states`` holds
    state names, 'pinned' (owner pins or a live client's hold), 'used' (not free) or 'all'."""
    m = _Meta(seg)
    st, pins = m.e["state"], m.e["pins"]
    pinned = np.zeros(len(st), bool)
    pinned[list(m.live_held)] = True
    mask = np.isin(st, [s for s, name in L.STATE_NAMES.items() if name in states])
    mask |= ("all" in states) | (("used" in states) & (st != L.FREE))
    mask |= ("pinned" in states) & (pinned | (pins > 0))
    chosen = np.nonzero(mask)[0]
    holders: dict[int, list[int]] = {}
    for i in range(m.g.max_clients):
        for b in sorted(set(m.holds(i).tolist())):
            holders.setdefault(b, []).append(i)
    rows = []
    for b in (chosen[:limit] if limit else chosen).tolist():
        e = m.e[b]
        rows.append({"block": b, "state": L.STATE_NAMES.get(int(e["state"]), "invalid"),
                     "key": m.key(b).hex(), "holders": holders.get(b, []),
                     **{k: int(e[k]) for k in _E[3:]}})
    return len(chosen), rows


def verify(seg: Segment, attempts: int = 3) -> list[str]:
    """Violations of DESIGN.md's invariants visible in ``seg`` (empty when clean).

    While an owner or client is alive the segment moves under us, so a violation counts only
    if each of ``attempts`` passes (50 ms apart) sees it."""
    found = _verify_once(seg)
    for _ in range(attempts - 1):
        if not found or not (seg.owner_alive() or seg.clients_alive()):
            break
        time.sleep(0.05)  # let an in-flight change (eviction handshake, reclaim) land
        again = set(_verify_once(seg))
        found = [v for v in found if v in again]
    return found


def _verify_once(seg: Segment) -> list[str]:
    m, g, lay, out = _Meta(seg), seg.geometry, seg.layout, []
    magic, ver, hb, total, created, nb, tpb, npl, _, _, _, islots, fp = L.HEADER.unpack_from(m.buf)
    pages = bytes(m.buf[L.OFF_PAGE_BYTES:L.OFF_PAGE_BYTES + 8 * L.MAX_PLANES])
    for what, got, want in (
            ("magic", magic, L.MAGIC), ("format version", ver, L.FORMAT_VERSION),
            ("header size", hb, L.HEADER_BYTES), ("total size", total, g.total_bytes),
            ("total size", total, os.fstat(seg.fd).st_size), ("num_blocks", nb, g.num_blocks),
            ("tokens_per_block", tpb, lay.tokens_per_block), ("index_slots", islots, g.index_slots),
            ("num_planes", npl, len(lay.page_bytes)), ("fingerprint", fp, lay.fingerprint()),
            ("page sizes", pages.hex(), L.plane_pages(lay.page_bytes).hex())):
        if got != want:
            out.append(f"header: {what} is {got!r}, expected {want!r}")
    if created > time.time_ns() + 60 * 10**9:
        out.append(f"header: created_ns {created} lies in the future")
    out += [f"block {b}: entry left mid-rewrite (odd sequence number)" for b in m.torn]
    st, pins, seen = m.e["state"], m.e["pins"], {}
    for j in np.nonzero(m.index["block"] != -1)[0].tolist():
        tag, b = int(m.index["tag"][j]), int(m.index["block"][j])
        if not 0 <= b < g.num_blocks:
            out.append(f"index slot {j} points to block {b}, outside 0..{g.num_blocks - 1}")
            continue
        if st[b] == L.FREE:
            out.append(f"index slot {j} points to block {b}, which is free")
        elif zlib.crc32(m.key(b)) != tag:
            out.append(f"index slot {j} has tag {tag:#010x} but block {b}'s key "
                       f"{m.key(b).hex()[:16]} hashes to {zlib.crc32(m.key(b)):#010x}")
        if b in seen:
            out.append(f"block {b} appears in index slots {seen[b]} and {j}")
        seen.setdefault(b, j)
    owners: dict[bytes, int] = {}
    for b in np.nonzero(st != L.FREE)[0].tolist():
        s, key, w, gen = int(st[b]), m.key(b), int(m.e["writer"][b]), int(m.e["writer_gen"][b])
        name, keylen = L.STATE_NAMES.get(s, f"in unknown state {s}"), int(m.e["keylen"][b])
        if not 1 <= keylen <= L.MAX_KEY_BYTES:
            out.append(f"block {b} is {name} with key length {keylen}")
        elif key in owners:
            out.append(f"blocks {owners[key]} and {b} both hold key {key.hex()[:16]}")
        elif m.find(key)[0] != b:
            out.append(f"block {b} ({name}, key {key.hex()[:16]}) is not reachable through "
                       "the key index")
        owners.setdefault(key, b)
        why = "" if s != L.WRITING else (
            ("" if m.owner_alive else "the owner's own store, but no owner is alive") if w < 0
            else f"client slot {w}, beyond {g.max_clients} slots" if w >= g.max_clients
            else f"client slot {w}, which is dead" if not m.alive(w)
            else f"client slot {w} generation {gen}, but the slot now has generation "
                 f"{m.slot(w)[2]}" if m.slot(w)[2] != gen else "")
        if why:
            out.append(f"block {b} is writing for {why} (leaked store)")
        if s == L.EVICTING and not m.owner_alive:
            out.append(f"block {b} is evicting but no owner is alive")
        if s not in L.STATE_NAMES:
            out.append(f"block {b} has unknown state {s}")
    out += [f"block {b} is {L.STATE_NAMES.get(int(st[b]), 'invalid')} with {int(pins[b])} pins "
            "(pins are only allowed on ready blocks)"
            for b in np.nonzero((pins > 0) & (st != L.READY))[0].tolist()]
    for i in range(g.max_clients):
        held, who = m.holds(i).tolist(), f"client slot {i} (pid {m.slot(i)[1]})"
        if held and not m.alive(i):
            more = ", …" if len(held) > 8 else ""
            out.append(f"{who} is dead but still holds {len(held)} blocks "
                       f"({', '.join(map(str, held[:8]))}{more})")
        elif held:
            out += [f"{who} holds block {b}, which is " + (
                L.STATE_NAMES.get(int(st[b]), "invalid") if b < g.num_blocks
                else f"outside 0..{g.num_blocks - 1}") for b in held
                if b >= g.num_blocks or st[b] not in (L.READY, L.EVICTING)]
    return out


_GAUGES = (  # (metric, help, value of a snapshot)
    ("kvshm_blocks_pinned", "Blocks pinned by a load or held by a live client.",
     lambda s: s["blocks"]["pinned"]),
    ("kvshm_num_blocks", "Blocks the segment holds.", lambda s: s["blocks"]["total"]),
    ("kvshm_cache_usage_perc", "Fraction of blocks in use (not free), 0..1.",
     lambda s: s["blocks"]["usage"]),
    ("kvshm_cache_write_usage_perc", "Fraction of blocks being written, 0..1.",
     lambda s: round(s["blocks"]["writing"] / s["blocks"]["total"], 6)),
    ("kvshm_cache_bytes", "Bytes of the data region.", lambda s: s["geometry"]["data_bytes"]),
    ("kvshm_clients", "Live client processes.", lambda s: s["clients_alive"]),
    ("kvshm_clients_dead", "Client slots whose process died, not yet reclaimed.",
     lambda s: s["clients_dead"]),
    ("kvshm_owner_up", "1 while an owner process holds the owner lock.",
     lambda s: int(s["owner"]["alive"])),
    ("kvshm_owner_epoch", "Owners the segment has had.", lambda s: s["owner"]["epoch"]),
)
_COUNTER_HELP = {  # counter -> (metric name without kvshm_ and _total, help)
    "lookups": ("lookups", "Lookups clients made."), "hits": ("hits", "Lookups that hit."),
    "misses": ("misses", "Lookups that missed."), "stores": ("stores", "Completed stores."),
    "store_blocks": ("store_blocks", "Blocks stored."),
    "store_failed_blocks": ("store_failed_blocks", "Blocks whose store failed."),
    "prepare_store_refused": ("allocation_failure", "prepare_store calls refused (full)."),
    "loads": ("loads", "Loads clients made."), "load_blocks": ("load_blocks", "Blocks loaded."),
    "bytes_in": ("store_bytes", "Bytes copied into the cache."),
    "bytes_out": ("load_bytes", "Bytes copied out of the cache."),
    "evictions": ("evictions", "Blocks evicted."), "errors": ("errors", "Errors answered."),
    "failovers": ("failovers", "Times a new owner took over."),
    "reclaimed_clients": ("reclaimed_clients", "Dead clients reclaimed."),
    "reclaimed_blocks": ("reclaimed_blocks", "Blocks reclaimed from dead processes."),
}


def prometheus(snaps: list[dict[str, Any]]) -> str:
    """Prometheus text exposition (format 0.0.4) of ``snapshot()`` results, one per segment."""
    fams: dict[str, tuple[str, str, list[str]]] = {}

    def add(name: str, kind: str, text: str, value: float, **labels: object) -> None:
        lab = ",".join('{}="{}"'.format(k, str(v).replace("\\", r"\\").replace('"', r"\"")
                                        .replace("\n", r"\n")) for k, v in labels.items())
        fams.setdefault(name, (kind, text, []))[2].append(f"{name}{{{lab}}} {value}")

    for s in snaps:
        seg = s["name"]
        for state in ("free", "writing", "ready", "evicting"):
            add("kvshm_blocks", "gauge", "Blocks by state.", s["blocks"][state], segment=seg,
                state=state)
        for metric, text, value in _GAUGES:
            add(metric, "gauge", text, value(s), segment=seg)
        for key, (metric, text) in _COUNTER_HELP.items():
            add(f"kvshm_{metric}_total", "counter", text, s["counters"][key], segment=seg)
        for c in s["clients"]:
            add("kvshm_client_holds", "gauge", "Blocks a client holds (leases and load pins).",
                c["holds"], segment=seg, slot=c["slot"], pid=c["pid"], alive=int(c["alive"]))
            for ring, depth in c["rings"].items():
                if depth is not None:
                    add("kvshm_ring_depth_bytes", "gauge", "Bytes queued in a client's ring.",
                        depth, segment=seg, slot=c["slot"], ring=ring)
        for p in s["pinners"]:
            add("kvshm_pin_done_bytes", "gauge", "Bytes a process has pinned for CUDA copies.",
                p["done_bytes"], segment=seg, pid=p["pid"], state=p["state"])
    return "".join(f"# HELP {n} {t}\n# TYPE {n} {k}\n" + "\n".join(rows) + "\n"
                   for n, (k, t, rows) in fams.items())
