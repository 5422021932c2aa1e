"""kvshm's statistics as vLLM offloading metrics (``vllm:kvshm_*`` on vLLM's ``/metrics``).

vLLM 0.32 and 0.33 collect an offloading manager's statistics the same way: the connector's
scheduler calls ``manager.get_stats()`` every step and merges the returned
``OffloadingConnectorStats`` (counters as deltas, gauges as snapshots) into the engine's
``kv_connector_stats``; the frontend turns every name into a Prometheus metric, which the
spec must declare in ``build_metric_definitions`` (an undeclared name fails an assertion in
the frontend). Transfer bytes and times come from the worker's ``TransferResult``s and appear
as vLLM's own ``vllm:kv_offload_{load,store}_{bytes,time,size}``.

This module owns the list of kvshm's metrics (``METRICS``: name, kind, help, label names) and
``StatsReader``, which produces one step's samples for one engine: this client's counters
(keys looked up, hits, blocks and bytes moved: deltas since the previous call) and the shared
segment's state (blocks by state, usage, owner-side totals and the owner's CPU time: snapshots,
the same in every engine of the segment; the owner's CPU time and the block count of a large
table at most once per ``interval`` seconds; the block states only in a step in which the
owner's counters or this engine's moved, else once per ``interval``), each handed to vLLM only
when it moved: a step in which nothing moved returns nothing, so vLLM has no stats to process.
A step in which nothing moved costs a few microseconds.

It reads the segment only (never a round trip to the owner: ``get_stats`` runs every scheduler
step); the spec turns the samples into vLLM's types.
"""
from __future__ import annotations

import os
import struct
import time
from typing import Any, NamedTuple

import numpy as np

from kvshm.shm import layout as L
from kvshm.shm import slots
from kvshm.shm.table import state_counts

COUNTER, GAUGE = "counter", "gauge"
P = "vllm:kvshm_"


class Metric(NamedTuple):
    name: str
    kind: str  # COUNTER (a delta per step) or GAUGE (a snapshot)
    help: str
    labels: tuple[str, ...] = ()


# Per engine: this engine's kvshm client slot counters (see layout.SLOT_COUNTERS).
_CLIENT = (
    ("lookups", "lookups", "Keys this engine looked up in kvshm (every scheduler re-ask counts)."),
    ("hits", "hits", "Lookups of this engine that found a readable kvshm block."),
    ("load_blocks", "load_blocks", "kvshm blocks this engine loaded (completed loads)."),
    ("bytes_in", "load_bytes", "Bytes this engine loaded from kvshm (whole blocks)."),
    ("bytes_out", "store_bytes", "Bytes this engine stored into kvshm (completed stores)."),
)
# Segment-wide totals kept by the owner (layout.COUNTER_NAMES), reported as snapshots.
_SEGMENT = (
    ("stores", "Stores completed in the shared segment, by every engine."),
    ("evictions", "Blocks evicted from the shared segment."),
    ("prepare_store_refused", "Store requests the segment could not place (no evictable block)."),
    ("failovers", "Times a new kvshm owner process took over the segment."),
    ("quarantined_blocks", "Blocks of dead engines held back while their workers could write."),
    ("checksum_failures", "Loads refused because a block failed its checksum."),
)

METRICS: tuple[Metric, ...] = (
    *(Metric(f"{P}{name}", COUNTER, text) for _, name, text in _CLIENT),
    Metric(f"{P}blocks", GAUGE, "Blocks of the shared segment by state.", ("state",)),
    Metric(f"{P}usage_perc", GAUGE, "Fraction of the shared segment's blocks in use, 0..1."),
    *(Metric(f"{P}segment_{name}", GAUGE, text) for name, text in _SEGMENT),
    Metric(f"{P}owner_cpu_seconds", GAUGE,
           "CPU time (user + system) of the segment's current owner process."),
)
KINDS = {m.name: m.kind for m in METRICS}
_COUNTERS_FMT = f"<{len(L.COUNTER_NAMES)}Q"
_SEGMENT_AT = [(name, L.COUNTER_NAMES.index(name)) for name, _ in _SEGMENT]

_STATE_OFF = L.field_offset(L.ENTRY_DTYPE, "state")
_TICK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def owner_cpu_seconds(pid: int) -> float | None:
    """utime + stime of process ``pid`` from /proc, or None where it cannot be read."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return None


class StatsReader:
    """One engine's kvshm samples, step by step, read from its client slot and the segment."""

    def __init__(self, segment: Any, slot: int, interval: float = 1.0,
                 every_step_blocks: int = 1 << 16):
        self.segment = segment
        self._ctr = slots.counters(segment, slot)
        self._last = self._ctr.tolist()
        g = segment.geometry
        self._states = np.frombuffer(segment.buf, np.uint8, g.num_blocks * L.ENTRY_BYTES,
                                     g.table_offset)[_STATE_OFF::L.ENTRY_BYTES]
        # counting block states costs a strided pass over the table: every step for tables
        # up to every_step_blocks (~12 us per 1,024 blocks), once per interval for larger ones;
        # the owner's CPU time (a /proc read) once per interval
        self._interval = interval
        self._blocks_interval = interval if g.num_blocks > every_step_blocks else 0.0
        self._next_blocks = self._next_cpu = self._next_idle = 0.0
        self._seen: tuple[int, ...] = ()  # the owner's counters at the previous step
        self._gauges: dict[tuple[str, tuple[str, ...]], float] = {}  # as last handed over

    def take(self) -> list[tuple[str, float, tuple[str, ...]]]:
        """``(metric name, value, label values)`` since the previous call: the client
        counters' deltas and the segment's gauges, each only if it moved (vLLM keeps a
        gauge's last value; every sample handed over costs it work in every step)."""
        now = self._ctr.tolist()
        out: list[tuple[str, float, tuple[str, ...]]] = []
        if now != self._last:
            d = dict(zip(L.SLOT_COUNTERS, (a - b for a, b in zip(now, self._last))))
            self._last = now
            out = [(f"{P}{name}", d[src], ()) for src, name, _ in _CLIENT if d[src] > 0]
        t = time.monotonic()
        counters = struct.unpack_from(_COUNTERS_FMT, self.segment.buf, L.OFF_COUNTERS)
        gauges: list[tuple[str, float, tuple[str, ...]]] = []
        # Blocks change state with the owner's work (its counters move) or this engine's
        # (ours moved); other engines' claims of their granted blocks show within interval.
        moved = counters != self._seen or bool(out)
        self._seen = counters
        if t >= self._next_blocks and (moved or t >= self._next_idle):
            self._next_blocks = t + self._blocks_interval
            self._next_idle = t + self._interval
            gauges += self.block_samples()
        gauges += self.segment_samples(t >= self._next_cpu, counters)
        if t >= self._next_cpu:
            self._next_cpu = t + self._interval
        for sample in gauges:
            key = (sample[0], sample[2])
            if self._gauges.get(key) != sample[1]:
                self._gauges[key] = sample[1]
                out.append(sample)
        return out

    def block_samples(self) -> list[tuple[str, float, tuple[str, ...]]]:
        """Blocks by state, racy (a gauge needs no seqlock), and the segment's usage."""
        n = state_counts(self._states)
        total = max(1, self.segment.geometry.num_blocks)
        out: list[tuple[str, float, tuple[str, ...]]] = [
            (f"{P}blocks", n[s], (name,)) for s, name in L.STATE_NAMES.items()]
        out.append((f"{P}usage_perc", (total - n[L.FREE]) / total, ()))
        return out

    def segment_samples(self, owner_cpu: bool = True, counters: tuple[int, ...] | None = None
                        ) -> list[tuple[str, float, tuple[str, ...]]]:
        """The owner's totals (one header read, unless given) and its CPU time (one /proc
        read)."""
        if counters is None:
            counters = struct.unpack_from(_COUNTERS_FMT, self.segment.buf, L.OFF_COUNTERS)
        out: list[tuple[str, float, tuple[str, ...]]] = [
            (f"{P}segment_{name}", counters[i], ()) for name, i in _SEGMENT_AT]
        if owner_cpu:
            cpu = owner_cpu_seconds(int(self.segment.owner_record()[0]))
            if cpu is not None:
                out.append((f"{P}owner_cpu_seconds", cpu, ()))
        return out
