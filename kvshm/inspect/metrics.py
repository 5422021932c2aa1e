"""Prometheus metrics of segments: what ``kvshm-inspect metrics`` prints.

This module owns the mapping from a ``snapshot`` (``snapshot.py``) to metric samples (gauges
and counters, their names and help texts, one ``segment`` label each) and their text
exposition format. It reads snapshots only: never a segment, never a lock.
"""
from __future__ import annotations

from typing import Any

from kvshm.tier.area import COUNTERS as TIER_COUNTERS

_GAUGES = (  # (metric, help, where in a snapshot)
    ("kvshm_blocks_pinned", "Blocks with a load pin.", "blocks.pinned"),
    ("kvshm_blocks_leased", "Blocks leased by a live client's lookup.", "blocks.leased"),
    ("kvshm_num_blocks", "Blocks the segment holds.", "blocks.total"),
    ("kvshm_cache_usage_perc", "Fraction of blocks in use (not free), 0..1.", "blocks.usage"),
    ("kvshm_cache_bytes", "Bytes of the data region.", "geometry.data_bytes"),
    ("kvshm_clients", "Live client processes.", "clients_alive"),
    ("kvshm_clients_dead", "Client slots whose process died, not reclaimed.", "clients_dead"),
    ("kvshm_owner_up", "1 while an owner process holds the owner lock.", "owner.alive"),
    ("kvshm_owner_epoch", "Owners the segment has had (1 again after 2**32 - 1).",
     "owner.epoch"))
_COUNTERS = (  # (snapshot counter, help): metric kvshm_<counter>_total unless renamed
    ("lookups", "Lookups clients made."), ("hits", "Lookups that hit."),
    ("misses", "Lookups that missed."), ("stores", "Completed stores."),
    ("store_blocks", "Blocks stored."), ("store_failed_blocks", "Blocks whose store failed."),
    ("prepare_store_refused", "prepare_store calls refused (full)."),
    ("loads", "Loads clients made."), ("load_blocks", "Blocks loaded."),
    ("bytes_in", "Bytes loaded from the cache."), ("bytes_out", "Bytes stored into the cache."),
    ("evictions", "Blocks evicted."), ("errors", "Errors answered."),
    ("failovers", "Times a new owner took over."), ("reclaimed_clients", "Dead clients reclaimed."),
    ("reclaimed_blocks", "Blocks reclaimed from dead processes."),
    ("granted_blocks", "Blocks granted to clients ahead of their stores."),
    ("recalled_blocks", "Granted blocks taken back from idle clients for busy ones."),
    ("recalls_refused", "Recalls given up: the client was taking those blocks."),
    ("owner_busy_ns", "CPU nanoseconds the owner spent serving frames (not idle spinning)."),
    ("idle_wakeups", "Times the owner woke and found nothing to serve or adopt."),
    ("round_trip_stores", "Stores that waited for a round trip to the owner: their client's "
     "grants could not cover them."))
_RENAMED = {"prepare_store_refused": "allocation_failure", "bytes_in": "load_bytes",
            "bytes_out": "store_bytes"}  # vLLM's names for the same things (client's view)


def metric_samples(snaps: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every metric sample of ``snapshot()`` results: ``metric``, ``type`` (gauge or counter),
    ``help``, ``labels`` (str -> str) and ``value`` (int or float)."""
    out: list[dict[str, Any]] = []

    def add(name: str, kind: str, text: str, value: Any, **labels: object) -> None:
        out.append({"metric": name, "type": kind, "help": text,
                    "labels": {k: str(v) for k, v in labels.items()},
                    "value": int(value) if isinstance(value, int) else float(value)})

    for s in snaps:
        seg = s["name"]
        for state in ("free", "writing", "ready", "evicting", "granted", "claimed"):
            add("kvshm_blocks", "gauge", "Blocks by state.", s["blocks"][state], segment=seg,
                state=state)
        for metric, text, path in _GAUGES:
            first, _, second = path.partition(".")
            add(metric, "gauge", text, s[first][second] if second else s[first], segment=seg)
        add("kvshm_cache_write_usage_perc", "gauge", "Fraction of blocks being written, 0..1.",
            s["blocks"]["writing"] / s["blocks"]["total"], segment=seg)
        for key, text in _COUNTERS:
            add(f"kvshm_{_RENAMED.get(key, key)}_total", "counter", text, s["counters"][key],
                segment=seg)
        t = s.get("tier")
        if t is not None:
            add("kvshm_tier_mover_up", "gauge", "1 while the host's lower-tier mover is alive.",
                int(t["mover_alive"]), segment=seg)
            add("kvshm_tier_up", "gauge", "1 while the mover's lower tier answers.",
                int(t["state"] == "connected"), segment=seg)
            for key in TIER_COUNTERS:
                add(f"kvshm_tier_{key}_total", "counter", f"Lower tier: {key.replace('_', ' ')}.",
                    t["counters"][key], segment=seg)
        for c in s["clients"]:
            add("kvshm_client_holds", "gauge", "Hold entries (load pins and leases) of a client.",
                c["holds"], segment=seg, slot=c["slot"], pid=c["pid"], alive=int(c["alive"]))
            if c["quota"]:
                add("kvshm_client_quota_blocks", "gauge", "Blocks a client may keep cached.",
                    c["quota"], segment=seg, slot=c["slot"])
                add("kvshm_client_cached_blocks", "gauge", "Blocks a client with a quota "
                    "stored that are cached.", c["cached"], segment=seg, slot=c["slot"])
            for ring, depth in c["rings"].items():
                if depth is not None:
                    add("kvshm_ring_depth_bytes", "gauge", "Bytes queued in a client's ring.",
                        depth, segment=seg, slot=c["slot"], ring=ring)
    return out


def prometheus(snaps: list[dict[str, Any]]) -> str:
    """Prometheus text exposition (format 0.0.4) of ``snapshot()`` results, one per segment."""
    fams: dict[str, tuple[str, str, list[str]]] = {}
    for m in metric_samples(snaps):
        lab = ",".join('{}="{}"'.format(k, v.replace("\\", r"\\").replace('"', r"\"")
                                        .replace("\n", r"\n")) for k, v in m["labels"].items())
        v = m["value"]
        num = str(int(v)) if isinstance(v, int) else repr(float(v))
        fams.setdefault(m["metric"], (m["type"], m["help"], []))[2].append(
            f"{m['metric']}{{{lab}}} {num}")
    return "".join(f"# HELP {n} {t}\n# TYPE {n} {k}\n" + "\n".join(rows) + "\n"
                   for n, (k, t, rows) in fams.items())
