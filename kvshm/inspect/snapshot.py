"""Read-only views of a kvshm segment: ``snapshot()``, ``verify()``, ``block_rows()``, metrics.

This module owns turning a mapped segment into plain dicts and lists (ready for JSON) for
``kvshm-inspect``, the soak harness and tests, the checks of the invariants that the segment
can show (listed in ``docs/inspect.md``), and the Prometheus rendering; ``docs/inspect.md``
documents the output's stable schema. It works on a private copy of the metadata, so it must
never write to the segment, never take a lock (it only asks the kernel who holds one), never
spin on an entry a dead owner left half-written, and never import ``kvshm.owner.manager``.
"""
from __future__ import annotations

import os
import struct
import time
import zlib
from typing import Any

import numpy as np

from kvshm.logs import owner_log_path
from kvshm.shm import layout as L
from kvshm.shm import writers
from kvshm.shm.checksums import BlockSums
from kvshm.shm.entry import key_checksum
from kvshm.shm.keyindex import KeyIndex
from kvshm.shm.ring import Ring
from kvshm.shm.segment import Segment
from kvshm.shm.table import BlockTable, state_counts
from kvshm.tier.area import TierArea

_ENTRY_DT = L.ENTRY_DTYPE
_KEY_OFF = L.ENTRY_KEY_OFFSET
# Entry fields a ``blocks`` row shows (docs/inspect.md); seq and keysum are checked by verify.
_ROW_FIELDS = ("writer", "writer_gen", "writer_req", "last_use", "stored_ns", "pins")
_INDEX_DT = L.INDEX_SLOT_DTYPE
_GEOMETRY = ("num_blocks max_clients ring_capacity hold_capacity index_slots slot_bytes "
             "table_offset index_offset data_offset data_bytes total_bytes").split()
PIN_STATES = ("idle", "waiting", "running", "done", "failed")
COUNTERS = (*(n for n in L.COUNTER_NAMES if not n.startswith("gone_")), *L.SLOT_COUNTERS,
            "misses")
SLOT_FREE = L.SlotState.FREE


class _Meta:
    """A private copy of header, slot heads and holds, block table and key index."""

    def __init__(self, seg: Segment):
        g, src = seg.geometry, seg.buf
        self.g, self._keys_at = g, g.table_offset + _KEY_OFF  # Geometry recomputes offsets
        self.buf = buf = bytearray(g.index_offset + g.index_slots * L.INDEX_SLOT.size)
        buf[:L.HEADER_BYTES] = src[:L.HEADER_BYTES]
        for i in range(g.max_clients):
            o = g.slot_offset(i)
            buf[o:o + g.rings_offset] = src[o:o + g.rings_offset]
        buf[g.table_offset:] = src[g.table_offset:len(buf)]  # table and index in one copy
        self.e = np.frombuffer(buf, _ENTRY_DT, g.num_blocks, g.table_offset)
        self.index = np.frombuffer(buf, _INDEX_DT, g.index_slots, g.index_offset)
        odd = np.nonzero(self.e["seq"] & 1)[0]
        if len(odd):  # caught mid-rewrite: an owner finishes one in microseconds; look again
            time.sleep(0.001)
            buf[g.table_offset:g.index_offset] = src[g.table_offset:g.index_offset]
            odd = np.nonzero(self.e["seq"] & 1)[0]
        self.torn = odd.tolist()  # still odd: left torn by a death
        self.e["seq"][odd] += 1  # in our copy only, so that BlockTable readers proceed
        self.live, self.owner_alive = seg.clients_alive(), seg.owner_alive()
        self.find = KeyIndex(memoryview(buf), g, BlockTable(memoryview(buf), g)).find
        live = [self.holds(i) for i in range(g.max_clients) if self.alive(i)]
        codes = np.concatenate(live) if live else np.empty(0, np.int32)
        ok = lambda b: {int(x) for x in b if 0 <= x < g.num_blocks}
        self.live_pinned = ok(codes[codes >= 0])
        self.live_leased = ok(L.held_block(codes[codes < -1]))

    def key(self, b: int, keylen: int | None = None) -> bytes:
        o = self._keys_at + b * L.ENTRY_BYTES
        n = int(self.e["keylen"][b]) if keylen is None else keylen
        return bytes(self.buf[o:o + min(n, L.MAX_KEY_BYTES)])

    def slot(self, i: int) -> tuple[int, int, int, int, bytes, int]:
        return L.SLOT.unpack_from(self.buf, self.g.slot_offset(i))

    def alive(self, i: int) -> bool:
        return i in self.live and self.slot(i)[0] != SLOT_FREE

    def holds(self, i: int) -> np.ndarray:
        """Slot ``i``'s occupied hold entries: block ids (load pins) and ``lease_code``s
        (lookup leases). A FREE slot has none, whatever its array holds."""
        if self.slot(i)[0] == SLOT_FREE:
            return np.empty(0, np.int32)
        h = np.frombuffer(self.buf, "<i4", self.g.hold_capacity,
                          self.g.slot_offset(i) + self.g.hold_offset)
        return h[h != -1]


def _age(now: int, then: int) -> float:
    return round(max(0, now - then) / 1e9, 3)


def _ring_depths(seg: Segment, i: int) -> dict[str, int | None]:
    g = seg.geometry
    out: dict[str, int | None] = {}
    for k, name in enumerate(L.RING_NAMES):
        o = g.slot_offset(i) + g.rings_offset + k * g.ring_region
        with seg.buf[o:o + g.ring_region] as view:
            try:
                ring = Ring(view)
                out[name] = ring.depth()
                ring.close()
            except Exception:  # a ring never formatted (or damaged) has no depth to show
                out[name] = None
    return out


def _client(seg: Segment, m: _Meta, i: int, now: int) -> dict[str, Any]:
    state, pid, gen, attached, name, events = m.slot(i)
    base, codes = seg.geometry.slot_offset(i), m.holds(i)
    counters = struct.unpack_from(f"<{len(L.SLOT_COUNTERS)}Q", m.buf, base + L.SLOT_OFF_COUNTERS)
    e = m.e
    mine = (e["writer"] == i) & (e["writer_gen"] == gen)
    pending = int(((e["state"] == L.WRITING) & mine).sum())
    # granted, offered (READY with this writer) or claimed: in its grant ring or taken from it
    granted = int((np.isin(e["state"], (L.GRANTED, L.READY, L.CLAIMED)) & mine).sum())
    quota, cached = struct.unpack_from("<QQ", m.buf, base + L.SLOT_OFF_SHARE)
    stranded = struct.unpack_from("<Q", m.buf, base + L.SLOT_OFF_SERVED + L.field_offset(
        L.SERVED_DTYPE, "stranded"))[0]
    return {"slot": i, "pid": pid, "name": name.rstrip(b"\0").decode("utf-8", "replace"),
            "state": state, "alive": m.alive(i), "generation": gen, "attached_ns": attached,
            "age_s": _age(now, attached), "holds": len(codes), "pins": int((codes >= 0).sum()),
            "leases": int((codes < -1).sum()), "stores_pending": pending, "granted": granted,
            "stranded": stranded, "quota": quota, "cached": cached, "events": bool(events),
            "counters": dict(zip(L.SLOT_COUNTERS, counters)), "rings": _ring_depths(seg, i)}


def snapshot(seg: Segment) -> dict[str, Any]:
    """Everything ``kvshm-inspect show`` reports, as JSON-ready dicts (``docs/inspect.md``)."""
    m, g, lay, now = _Meta(seg), seg.geometry, seg.layout, time.time_ns()
    h = L.HEADER.unpack_from(m.buf, 0)
    n = state_counts(m.e["state"])
    pinned = m.live_pinned | set(np.nonzero(m.e["pins"])[0].tolist())
    clients = [_client(seg, m, i, now) for i in range(g.max_clients)
               if m.slot(i)[0] != SLOT_FREE or i in m.live]
    counters = dict(zip(L.COUNTER_NAMES, struct.unpack_from(
        f"<{len(L.COUNTER_NAMES)}Q", m.buf, L.OFF_COUNTERS)))
    for name in L.SLOT_COUNTERS:  # clients' own counters, plus those of clients gone
        counters[name] = counters.pop(f"gone_{name}") + sum(
            c["counters"][name] for c in clients if c["state"] != SLOT_FREE)
    counters["misses"] = max(0, counters["lookups"] - counters["hits"])
    pid, epoch, since, tick = L.OWNER.unpack_from(m.buf, L.OFF_OWNER)
    pinners = [{"pid": p, "alive": os.path.exists(f"/proc/{p}"), "done_bytes": done,
                "total_bytes": total, "state": PIN_STATES[st] if st < 5 else str(st),
                "updated_ns": upd}
               for p, st, done, total, upd in (L.PINNER.unpack_from(
                   m.buf, L.OFF_PINNERS + k * L.PINNER.size) for k in range(L.MAX_PINNERS)) if p]
    used = g.num_blocks - n[L.FREE]
    return {
        "schema": "kvshm.show/1", "name": seg.name, "taken_ns": now,
        "header": {"format_version": h[1], "header_bytes": h[2], "total_bytes": h[3],
                   "created_ns": h[4], "age_s": _age(now, h[4]), "fingerprint": h[12].hex(),
                   "policy": seg.policy, "layout": {
                       "model": lay.model, "page_bytes": list(lay.page_bytes),
                       "tokens_per_block": lay.tokens_per_block, "extra": lay.extra}},
        "geometry": {**{k: getattr(g, k) for k in _GEOMETRY}, "num_planes": len(g.page_bytes),
                     "page_bytes": list(g.page_bytes), "block_bytes": lay.block_bytes,
                     "tokens_per_block": lay.tokens_per_block},
        "blocks": {"total": g.num_blocks,
                   **{name: n[s] for s, name in L.STATE_NAMES.items()},
                   "invalid": n[L.INVALID], "pinned": len(pinned),
                   "leased": len(m.live_leased - pinned), "used": used,
                   "usage": round(used / g.num_blocks, 6)},
        "owner": {"pid": pid, "alive": m.owner_alive, "epoch": epoch, "since_ns": since,
                  "age_s": _age(now, since) if since else None, "tick": tick,
                  "log": owner_log_path(seg.name)},
        "clients": clients, "clients_alive": sum(c["alive"] for c in clients),
        "clients_dead": sum(c["state"] != SLOT_FREE and not c["alive"] for c in clients),
        "pinners": pinners, "counters": counters, "tier": tier_snapshot(seg)}


def tier_snapshot(seg: Segment) -> dict[str, Any] | None:
    """The lower tier's part of a snapshot, or None when no mover ever ran here."""
    area = TierArea.attach(seg)
    if area is None:
        return None
    try:
        return area.snapshot()
    finally:
        area.close()


def block_rows(seg: Segment, states: set[str], limit: int) -> tuple[int, list[dict[str, Any]]]:
    """(number of matching blocks, up to ``limit`` rows of them; 0 = all). ``states`` holds
    state names, 'pinned' (a load pin), 'leased' (a live client's lease), 'used' or 'all'."""
    m = _Meta(seg)
    st, n = m.e["state"], m.g.num_blocks
    mask = np.isin(st, [s for s, name in L.STATE_NAMES.items() if name in states])
    mask |= ("all" in states) | (("used" in states) & (st != L.FREE))
    if "pinned" in states:
        mask |= m.e["pins"] > 0
        mask[list(m.live_pinned)] = True
    if "leased" in states:
        mask[list(m.live_leased)] = True
    chosen = np.nonzero(mask)[0]
    by: dict[tuple[str, int], list[int]] = {}
    for i in range(m.g.max_clients):
        codes = m.holds(i)
        leased = L.held_block(codes[codes < -1])
        for kind, blocks in (("pinned", codes[codes >= 0]), ("leased", leased)):
            for b in np.unique(blocks[blocks < n]).tolist():
                by.setdefault((kind, b), []).append(i)
    rows = []
    for b in (chosen[:limit] if limit else chosen).tolist():
        e = m.e[b]
        rows.append({"block": b, "state": L.STATE_NAMES.get(int(e["state"]), "invalid"),
                     "key": m.key(b).hex(), "pinned_by": by.get(("pinned", b), []),
                     "leased_by": by.get(("leased", b), []),
                     **{k: int(e[k]) for k in _ROW_FIELDS},
                     "tenant": int(e["tenant"]) - 1, "tenant_gen": int(e["tenant_gen"])})
    return len(chosen), rows


def verify(seg: Segment, attempts: int = 3, data: bool = False) -> list[str]:
    """Violations of the invariants (``docs/inspect.md``) visible in ``seg``, none when clean.
    While an owner or client lives the segment moves, so only what all ``attempts`` passes
    see counts. ``data``: also check every READY block's planes against their block checksums
    (a segment created with ``Layout(checksums=True)``; InvalidArgumentError otherwise)."""
    sums = BlockSums(seg) if data else None
    found = _verify_once(seg, sums)
    for _ in range(attempts - 1):
        if not found or not (seg.owner_alive() or seg.clients_alive()):
            break
        time.sleep(0.05)  # let an in-flight change (eviction handshake, reclaim) land
        again = set(_verify_once(seg, sums))
        found = [v for v in found if v in again]
    return found


def _data_violations(m: _Meta, sums: BlockSums) -> list[str]:
    ready = np.nonzero((m.e["state"] == L.READY) & (m.e["seq"] & 1 == 0))[0]
    return [f"block {b} plane {i}: its data does not match its block checksum (corrupt)"
            for b, i in sorted(sums.bad(ready, list(range(sums.sums.shape[1]))))]


# What an owner keeps of a dead client generation while a copier of it lives: a copy may land
# in its stores and in any grant it took (its offers it ends at once: nothing is copied into one).
_QUARANTINED = (L.WRITING, L.GRANTED, L.CLAIMED)


def _copier_alive(seg: Segment, slot: int, gen: int,
                  known: dict[tuple[int, int], bool]) -> bool:
    """Whether a live process registered to copy for client ``slot`` generation ``gen``: a
    dead scheduler's stores and grants are then kept on purpose (quarantined), since its
    late copy would land in whoever got the blocks next. A kernel lock query, once each."""
    if (slot, gen) not in known:
        known[slot, gen] = writers.alive(seg, slot, gen)
    return known[slot, gen]


def _verify_once(seg: Segment, sums: BlockSums | None = None) -> list[str]:
    m, g, lay, out = _Meta(seg), seg.geometry, seg.layout, []
    if sums is not None:
        out += _data_violations(m, sums)
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
    st, pins = m.e["state"], m.e["pins"]
    seen: dict[int, int] = {}  # block -> the first index slot that points to it
    occupied, states = np.nonzero(m.index["block"] != -1)[0], st.tolist()
    for j, tag, b in zip(occupied.tolist(), *(m.index[k][occupied].tolist() for k in (
            "tag", "block"))):
        if not 0 <= b < g.num_blocks:
            out.append(f"index slot {j} points to block {b}, outside 0..{g.num_blocks - 1}")
            continue
        if states[b] == L.FREE:
            out.append(f"index slot {j} points to block {b}, which is free")
        elif zlib.crc32(m.key(b)) != tag:
            out.append(f"index slot {j} has tag {tag:#010x} but block {b}'s key "
                       f"{m.key(b).hex()[:16]} hashes to {zlib.crc32(m.key(b)):#010x}")
        if b in seen:
            out.append(f"block {b} appears in index slots {seen[b]} and {j}")
        seen.setdefault(b, j)
    owners: dict[bytes, int] = {}
    copiers: dict[tuple[int, int], bool] = {}  # (slot, gen) -> a live registered copier
    used = np.nonzero(st != L.FREE)[0]
    for b, s, w, gen, keylen, keysum in zip(used.tolist(), *(m.e[k][used].tolist() for k in (
            "state", "writer", "writer_gen", "keylen", "keysum"))):
        key, name = m.key(b, keylen), L.STATE_NAMES.get(s, f"in unknown state {s}")
        claim = s == L.CLAIMED
        if s == L.GRANTED:  # in a client's grant ring; with a key, a completed store the
            if keylen and key_checksum(key) != keysum:  # owner defers (not indexed yet)
                out.append(f"block {b} is granted with key {key.hex()[:16]}, which does not "
                           f"match the key checksum {keysum:#010x}")
        elif not 1 <= keylen <= L.MAX_KEY_BYTES:
            out.append(f"block {b} is {name} with key length {keylen}")
        elif key_checksum(key) != keysum:  # the next owner frees it instead of adopting it
            out.append(f"block {b} is {name} but its key {key.hex()[:16]} does not match the "
                       f"key checksum {keysum:#010x} (key torn by a rewrite cut short, or "
                       "damaged)")
        else:
            indexed = not claim and m.find(key)[0] == b
            # A claim holds its old key on its way out, and so does an offer a successor kept
            # as its client's claim, unindexed (its round was open): the key may be stored
            # again elsewhere
            claim = claim or (s in (L.READY, L.EVICTING) and w >= 0 and not indexed)
            if claim:
                pass
            elif key in owners:
                out.append(f"blocks {owners[key]} and {b} both hold key {key.hex()[:16]}")
            elif not indexed:
                out.append(f"block {b} ({name}, key {key.hex()[:16]}) is not reachable "
                           "through the key index")
        if s != L.GRANTED and not claim:
            owners.setdefault(key, b)  # (a deferred store's key is also its rival's)
        held_for = s == L.WRITING or s == L.CLAIMED or (s == L.GRANTED and not keylen) or \
            (s in (L.READY, L.EVICTING) and w >= 0)  # a store, a claim, a grant, an offer
        why = "" if not held_for else (
            ("" if m.owner_alive else "the owner's own store, but no owner is alive") if w < 0
            else f"client slot {w}, beyond {g.max_clients} slots" if w >= g.max_clients
            else f"client slot {w}, which is dead" if not m.alive(w)
            else f"client slot {w} generation {gen}, but the slot now has generation "
                 f"{m.slot(w)[2]}" if m.slot(w)[2] != gen else "")
        if why and w >= 0 and s in _QUARANTINED and _copier_alive(seg, w, gen, copiers):
            why = ""  # quarantined: the owner keeps them until the copier is gone
        if why:
            what = {L.WRITING: "store", L.CLAIMED: "claim", L.EVICTING: "claim",
                    L.READY: "offer"}.get(s, "grant")
            out.append(f"block {b} is {name} for {why} (leaked {what})")
        if s == L.EVICTING and not m.owner_alive and w < 0:  # (w >= 0: a client's claim)
            out.append(f"block {b} is evicting but no owner is alive")
        if s not in L.STATE_NAMES:
            out.append(f"block {b} has unknown state {s}")
    out += [f"block {b} is {L.STATE_NAMES.get(int(st[b]), 'invalid')} with {int(pins[b])} pins "
            "(pins are only allowed on ready blocks)"
            for b in np.nonzero((pins > 0) & (st != L.READY))[0].tolist()]
    for i in range(g.max_clients):
        codes, who = m.holds(i), f"client slot {i} (pid {m.slot(i)[1]})"
        blocks = L.held_block(codes).tolist()
        if blocks and not m.alive(i):
            out.append(f"{who} is dead but still holds {len(blocks)} blocks "
                       f"({', '.join(map(str, blocks[:8]))}{', …' * (len(blocks) > 8)})")
            continue
        out += [f"{who} holds block {b}, outside 0..{g.num_blocks - 1}"
                for b in blocks if b >= g.num_blocks]
        # A lease may outlive its block (its own stores may evict it); a load pin may not.
        out += [f"{who} has a load pin on block {b}, which is "
                f"{L.STATE_NAMES.get(int(st[b]), 'invalid')}" for b in codes[codes >= 0].tolist()
                if b < g.num_blocks and st[b] not in (L.READY, L.EVICTING)]
    return out
