"""Read-only views of a kvshm segment: ``snapshot()``, ``verify()``, ``block_rows()``, metrics.

This module owns turning a mapped segment into plain dicts and lists (ready for JSON) for
``kvshm-inspect``, the soak harness and tests, the invariant checks of DESIGN.md that the
segment can show; ``docs/inspect.md`` documents the output's stable schema. It works on a private copy of the metadata, so it must never write to
the segment, never take a lock (it only asks the kernel who holds one), never spin on an entry
a dead owner left half-written, and never import torch or ``kvshm.manager``.
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
        self.g, self.seg = g, seg
        self.buf = buf = bytearray(g.index_offset + g.index_slots * L.INDEX_SLOT.size)
        buf[:L.HEADER_BYTES] = src[:L.HEADER_BYTES]
        for i in range(g.max_clients):
            o = g.slot_offset(i)
            buf[o:o + g.rings_offset] = src[o:o + g.rings_offset]
        buf[g.table_offset:] = src[g.table_offset:len(buf)]  # table and index in one copy
        self.e = np.frombuffer(buf, _ENTRY_DT, g.num_blocks, g.table_offset)
        self.index = np.frombuffer(buf, _INDEX_DT, g.index_slots, g.index_offset)
        self.torn = self._settle(src)
        self.live = seg.clients_alive()
        self.owner_alive = seg.owner_alive()
        mv = memoryview(buf)
        self._keys = KeyIndex(mv, g, BlockTable(mv, g))

    def _settle(self, src: memoryview) -> list[int]:
        """Re-copy entries caught mid-rewrite; return those still odd (left torn by a death)."""
        torn = []
        for b in np.nonzero(self.e["seq"] & 1)[0].tolist():
            o = self.g.entry_offset(b)
            for _ in range(200):
                self.buf[o:o + L.ENTRY_BYTES] = src[o:o + L.ENTRY_BYTES]
                if not self.e["seq"][b] & 1:
                    break
                time.sleep(0.0001)  # the owner finishes a rewrite in microseconds
            else:
                torn.append(b)
                self.e["seq"][b] += 1  # in our copy only: lets BlockTable readers proceed
        return torn

    def key(self, b: int) -> bytes:
        o = self.g.entry_offset(b) + _KEY_OFF
        return bytes(self.buf[o:o + min(int(self.e["keylen"][b]), L.MAX_KEY_BYTES)])

    def find(self, key: bytes) -> int:
        return self._keys.find(key)[0]

    def slot(self, i: int) -> tuple[int, int, int, int, bytes]:
        return L.SLOT.unpack_from(self.buf, self.g.slot_offset(i))

    def alive(self, i: int) -> bool:
        return i in self.live and self.slot(i)[0] == L.SLOT_ACTIVE

    def holds(self, i: int) -> np.ndarray:
        g = self.g
        return np.frombuffer(self.buf, "<i4", g.hold_capacity, g.slot_offset(i) + g.hold_offset)


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
        return pid > 0
    return pid > 0


def _ring_depths(seg: Segment, i: int) -> dict[str, int | None]:
    g, out = seg.geometry, {}
    for k, name in enumerate(L.RING_NAMES):
        o = g.slot_offset(i) + g.rings_offset + k * g.ring_region
        with seg.buf[o:o + g.ring_region] as view:
            try:
                ring = Ring(view)
            except Exception:  # never formatted (or damaged): no depth to show
                out[name] = None
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
            "age_s": _age(now, attached),
            "holds": int((m.holds(i) >= 0).sum()) if state == L.SLOT_ACTIVE else 0,
            "pins_held": pins, "stores_pending": pending,
            "counters": dict(zip(L.SLOT_COUNTERS, counters)), "rings": _ring_depths(seg, i)}


def _held_by_live(m: _Meta) -> set[int]:
    held: set[int] = set()
    for i in range(m.g.max_clients):
        if m.alive(i):
            h = m.holds(i)
            held.update(h[(h >= 0) & (h < m.g.num_blocks)].tolist())
    return held


def snapshot(seg: Segment) -> dict[str, Any]:
    """Everything ``kvshm-inspect show`` reports, as JSON-ready dicts (``docs/inspect.md``)."""
    m, g, lay, now = _Meta(seg), seg.geometry, seg.layout, time.time_ns()
    h = L.HEADER.unpack_from(m.buf, 0)
    states = m.e["state"]
    n = np.bincount(np.minimum(states, 4), minlength=5).tolist()
    pinned = _held_by_live(m) | set(np.nonzero(m.e["pins"])[0].tolist())
    clients = [_client(seg, m, i, now) for i in range(g.max_clients)
               if m.slot(i)[0] == L.SLOT_ACTIVE or i in m.live]
    counters = dict(zip(L.COUNTER_NAMES, struct.unpack_from(
        f"<{len(L.COUNTER_NAMES)}Q", m.buf, L.OFF_COUNTERS)))
    for name in L.SLOT_COUNTERS:
        counters[name] = sum(c["counters"][name] for c in clients if c["state"] == L.SLOT_ACTIVE)
    counters["misses"] = max(0, counters["lookups"] - counters["hits"])
    pid, epoch, since, tick = L.OWNER.unpack_from(m.buf, L.OFF_OWNER)
    pinners = []
    for k in range(L.MAX_PINNERS):
        ppid, pst, done, total, upd = L.PINNER.unpack_from(m.buf, L.OFF_PINNERS + k * L.PINNER.size)
        if ppid:
            pinners.append({"pid": ppid, "alive": _pid_alive(ppid), "done_bytes": done,
                            "state": PIN_STATES[pst] if pst < 5 else str(pst),
                            "total_bytes": total, "updated_ns": upd})
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
    """(number of matching blocks, up to ``limit`` rows; 0 = all). ``states`` may also hold
    'pinned' (owner pins or a live client's hold), 'used' (not free) and 'all'."""
    m = _Meta(seg)
    holders: dict[int, list[int]] = {}
    for i in range(m.g.max_clients):
        h = m.holds(i) if m.slot(i)[0] == L.SLOT_ACTIVE else m.holds(i)[:0]
        for b in set(h[h >= 0].tolist()):
            holders.setdefault(b, []).append(i)
    live_held = _held_by_live(m)
    rows, matching = [], 0
    for b in range(m.g.num_blocks):
        e = m.e[b]
        name = L.STATE_NAMES.get(int(e["state"]), f"invalid({int(e['state'])})")
        pinned = bool(e["pins"]) or b in live_held
        if not ("all" in states or name in states or ("used" in states and e["state"])
                or ("pinned" in states and pinned)):
            continue
        matching += 1
        if limit and len(rows) >= limit:
            continue
        rows.append({"block": b, "state": name, "key": m.key(b).hex(), "pins": int(e["pins"]),
                     "holders": holders.get(b, []), "last_use": int(e["last_use"]),
                     "stored_ns": int(e["stored_ns"]), "writer": int(e["writer"]),
                     "writer_gen": int(e["writer_gen"]), "writer_req": int(e["writer_req"])})
    return matching, rows


def verify(seg: Segment, attempts: int = 3) -> list[str]:
    """Violations of DESIGN.md's invariants visible in ``seg`` (empty when clean).

    While an owner or client is alive the segment moves under us, so a violation counts only
    if every one of ``attempts`` passes (50 ms apart) sees it."""
    found = _verify_once(seg)
    for _ in range(attempts - 1):
        if not found or not (seg.owner_alive() or seg.clients_alive()):
            break
        time.sleep(0.05)
        again = set(_verify_once(seg))
        found = [v for v in found if v in again]
    return found


def _ids(xs: list[int]) -> str:
    return ", ".join(map(str, xs[:8])) + (", …" if len(xs) > 8 else "")


def _verify_once(seg: Segment) -> list[str]:
    m, g, lay = _Meta(seg), seg.geometry, seg.layout
    out: list[str] = []
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
    out += [f"block {b}: entry left mid-rewrite (odd sequence number); a new owner rewrites it"
            for b in m.torn]
    st, pins = m.e["state"], m.e["pins"]
    seen: dict[int, int] = {}
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
        s = int(st[b])
        name = L.STATE_NAMES.get(s)
        if name is None:
            out.append(f"block {b} has unknown state {s}")
            continue
        key = m.key(b)
        if not 1 <= int(m.e["keylen"][b]) <= L.MAX_KEY_BYTES:
            out.append(f"block {b} is {name} with key length {int(m.e['keylen'][b])}")
        elif key in owners:
            out.append(f"blocks {owners[key]} and {b} both hold key {key.hex()[:16]}")
        elif m.find(key) != b:
            out.append(f"block {b} ({name}, key {key.hex()[:16]}) is not reachable through "
                       "the key index")
        owners.setdefault(key, b)
        w, gen = int(m.e["writer"][b]), int(m.e["writer_gen"][b])
        if s == L.WRITING and w < 0 and not m.owner_alive:
            out.append(f"block {b} is writing for the owner's own store but no owner is alive "
                       "(leaked store)")
        elif s == L.WRITING and w >= g.max_clients:
            out.append(f"block {b} is writing for client slot {w}, beyond {g.max_clients} slots")
        elif s == L.WRITING and w >= 0 and not m.alive(w):
            out.append(f"block {b} is writing for client slot {w}, which is dead (leaked store)")
        elif s == L.WRITING and w >= 0 and m.slot(w)[2] != gen:
            out.append(f"block {b} is writing for client slot {w} generation {gen}, but the slot "
                       f"now has generation {m.slot(w)[2]} (leaked store)")
        if s == L.EVICTING and not m.owner_alive:
            out.append(f"block {b} is evicting but no owner is alive")
    for b in np.nonzero((pins > 0) & (st != L.READY))[0].tolist():
        out.append(f"block {b} is {L.STATE_NAMES.get(int(st[b]), 'invalid')} with "
                   f"{int(pins[b])} pins (pins are only allowed on ready blocks)")
    for i in range(g.max_clients):  # holds mean something only in an active slot
        state, pid, *_ = m.slot(i)
        if state != L.SLOT_ACTIVE:
            continue
        h = m.holds(i)
        held, who = h[h >= 0].tolist(), f"client slot {i} (pid {pid})"
        if (h < -1).any():
            out.append(f"{who} has invalid hold entries {_ids(h[h < -1].tolist())}")
        if not held:
            continue
        if m.alive(i):
            bad = [b for b in held if b >= g.num_blocks or st[b] not in (L.READY, L.EVICTING)]
            out += [f"{who} holds block {b}, which is " + (
                f"{L.STATE_NAMES.get(int(st[b]), 'invalid')}" if b < g.num_blocks
                else f"outside 0..{g.num_blocks - 1}") for b in bad]
        else:
            out.append(f"{who} is dead but still holds {len(held)} blocks ({_ids(held)})")
    return out


def _esc(v: object) -> str:
    return str(v).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def prometheus(snaps: list[dict[str, Any]]) -> str:
    """Prometheus text exposition (format 0.0.4) of ``snapshot()`` results, one per segment."""
    fams: dict[str, tuple[str, str, list[str]]] = {}

    def add(name: str, kind: str, text: str, value: float, **labels: object) -> None:
        lab = ",".join(f'{k}="{_esc(v)}"' for k, v in labels.items())
        fams.setdefault(name, (kind, text, []))[2].append(f"{name}{{{lab}}} {value}")

    for s in snaps:
        seg, b, c = s["name"], s["blocks"], s["counters"]
        for st in ("free", "writing", "ready", "evicting"):
            add("kvshm_blocks", "gauge", "Blocks of the segment by state.", b[st],
                segment=seg, state=st)
        add("kvshm_blocks_pinned", "gauge", "Blocks pinned by a load or held by a live client.",
            b["pinned"], segment=seg)
        add("kvshm_num_blocks", "gauge", "Blocks the segment holds.", b["total"], segment=seg)
        add("kvshm_cache_usage_perc", "gauge", "Fraction of blocks in use (not free), 0..1.",
            b["usage"], segment=seg)
        add("kvshm_cache_write_usage_perc", "gauge", "Fraction of blocks being written, 0..1.",
            round(b["writing"] / b["total"], 6), segment=seg)
        add("kvshm_cache_bytes", "gauge", "Bytes of the data region.",
            s["geometry"]["data_bytes"], segment=seg)
        add("kvshm_clients", "gauge", "Live client processes.", s["clients_alive"], segment=seg)
        add("kvshm_clients_dead", "gauge", "Client slots whose process died, not yet reclaimed.",
            s["clients_dead"], segment=seg)
        add("kvshm_owner_up", "gauge", "1 while an owner process holds the owner lock.",
            int(s["owner"]["alive"]), segment=seg)
        add("kvshm_owner_epoch", "gauge", "Owners the segment has had.", s["owner"]["epoch"],
            segment=seg)
        for key, metric, text in _COUNTER_METRICS:
            add(metric, "counter", text, c[key], segment=seg)
        for cl in s["clients"]:
            add("kvshm_client_holds", "gauge", "Blocks a client holds (lookup leases, load pins).",
                cl["holds"], segment=seg, slot=cl["slot"], pid=cl["pid"])
            for ring, depth in cl["rings"].items():
                if depth is not None:
                    add("kvshm_ring_depth_bytes", "gauge", "Bytes queued in a client ring.",
                        depth, segment=seg, slot=cl["slot"], ring=ring)
        for p in s["pinners"]:
            add("kvshm_pin_done_bytes", "gauge", "Bytes a process has registered with CUDA.",
                p["done_bytes"], segment=seg, pid=p["pid"], state=p["state"])
    return "".join(f"# HELP {n} {t}\n# TYPE {n} {k}\n" + "\n".join(rows) + "\n"
                   for n, (k, t, rows) in fams.items())


_COUNTER_METRICS = (
    ("lookups", "kvshm_lookups_total", "Lookups clients made."),
    ("hits", "kvshm_hits_total", "Lookups that hit."),
    ("misses", "kvshm_misses_total", "Lookups that missed."),
    ("stores", "kvshm_stores_total", "Completed stores (complete_store calls)."),
    ("store_blocks", "kvshm_store_blocks_total", "Blocks stored."),
    ("store_failed_blocks", "kvshm_store_failed_blocks_total", "Blocks whose store failed."),
    ("prepare_store_refused", "kvshm_allocation_failure_total", "prepare_store refusals."),
    ("loads", "kvshm_loads_total", "Loads clients made."),
    ("load_blocks", "kvshm_load_blocks_total", "Blocks loaded."),
    ("bytes_in", "kvshm_store_bytes_total", "Bytes copied into the cache."),
    ("bytes_out", "kvshm_load_bytes_total", "Bytes copied out of the cache."),
    ("evictions", "kvshm_evictions_total", "Blocks evicted."),
    ("errors", "kvshm_errors_total", "Errors the owner answered."),
    ("failovers", "kvshm_failovers_total", "Times a new owner took over."),
    ("reclaimed_clients", "kvshm_reclaimed_clients_total", "Dead clients reclaimed."),
    ("reclaimed_blocks", "kvshm_reclaimed_blocks_total", "Blocks reclaimed from dead clients."),
)
