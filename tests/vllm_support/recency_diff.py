"""Differential check: kvshm's vLLM manager against vLLM's own ``CPUOffloadingManager``.

Run with the vLLM venv's interpreter: ``recency_diff.py SEGMENT_PREFIX SEQUENCES SEED [WHEEL]``;
with the vLLM 0.33.0 wheel, 0.33's manager, cache policies and API are loaded from it over the
installed 0.32 (``vllm033.load_033``), and kvshm runs as it does under 0.33 (provisional LRU
ranks, metadata-only removal events for failed stores). Random connector-shaped sequences
(requests over shared prompt prefixes: lookups, loads of the hits, stores of the rest,
completions, request finishes; few chunks, so evictions happen) go through both managers;
every step compares lookup results, keys to store, evicted keys and events. A sequence stops
at its first difference (its later calls could be invalid for one side). Prints one JSON
line: per policy, the sequences that differed and the first few differences.
"""
from __future__ import annotations

import hashlib
import json
import random
import sys

if len(sys.argv) > 4:  # vLLM 0.33's manager and API, from its wheel (over the 0.32 install)
    from vllm033 import load_033
    load_033(sys.argv[4], manager=True)

from vllm.v1.kv_offload.base import ReqContext  # noqa: E402
from vllm.v1.kv_offload.cpu.manager import CPUOffloadingManager  # noqa: E402

from kvshm.client.connect import connect  # noqa: E402
from kvshm.integrations.vllm.spec import KvshmOffloadingManager  # noqa: E402
from kvshm.shm.layout import Layout  # noqa: E402
from kvshm.shm.segment import Segment  # noqa: E402

CHUNKS = 8
STATS = {"evicted": 0}  # keys vLLM evicted in the sequences compared (evictions did happen)


def _key(doc: int, i: int) -> bytes:
    return hashlib.sha256(f"{doc}/{i}".encode()).digest()[:28] + b"\0\0\0\0"  # group 0


def _events(mgr) -> list:
    return [[list(e.keys), bool(e.removed), bool(getattr(e, "metadata_only", False))]
            for e in mgr.take_events()]


def run_sequence(rng: random.Random, ours, theirs) -> str | None:
    """One random sequence through both managers; the first difference, or None."""
    docs = [[_key(d, i) for i in range(rng.randint(3, 10))] for d in range(4)]
    active: dict[str, tuple[ReqContext, list[bytes], int]] = {}  # req -> ctx, keys, offered
    jobs: list[tuple[str, str, list[bytes]]] = []  # (kind, req, keys) in flight
    n_req = 0

    def both(name: str, *args, ctx):
        a = getattr(theirs, name)(*args, ctx)
        b = getattr(ours, name)(*args, ctx)
        return a, b

    for step in range(60):
        op = rng.random()
        if op < 0.25 or not active:  # a new request: lookups, then a load of some hits
            n_req += 1
            req = f"r{n_req}"
            doc = rng.choice(docs)
            keys = doc[:rng.randint(1, len(doc))]
            ctx = ReqContext(req_id=req)
            for i, k in enumerate(keys):
                ctx.set_offload_key_position(k, (i + 1) * 16)
            theirs.on_new_request(ctx)
            ours.on_new_request(ctx)
            hits = 0
            for k in keys:
                a, b = both("lookup", k, ctx=ctx)
                if a.name != b.name:
                    return f"step {step}: lookup {a.name} != {b.name}"
                if a.name != "HIT":
                    break
                hits += 1
            n = rng.randint(0, hits)
            if n:
                both("prepare_load", keys[:n], ctx=ctx)
                jobs.append(("load", req, keys[:n]))
            theirs.on_schedule_end(None)
            ours.on_schedule_end(None)
            active[req] = (ctx, keys, n)
        elif op < 0.55:  # a store of the next few keys of a request
            req = rng.choice(list(active))
            ctx, keys, off = active[req]
            if off >= len(keys):
                continue
            part = keys[off:off + rng.randint(1, 4)]
            a, b = both("prepare_store", part, ctx=ctx)
            if (a is None) != (b is None):
                return f"step {step}: prepare_store {a} vs {b}"
            if a is not None:
                if list(a.keys_to_store) != list(b.keys_to_store):
                    return f"step {step}: keys_to_store differ"
                STATS["evicted"] += len(a.evicted_keys)
                if list(a.evicted_keys) != list(b.evicted_keys):
                    return f"step {step}: evicted {len(a.evicted_keys)} keys differ"
                active[req] = (ctx, keys, off + len(part))
                if a.keys_to_store:
                    jobs.append(("store", req, list(a.keys_to_store)))
        elif op < 0.8 and jobs:  # a transfer finishes
            kind, req, keys = jobs.pop(rng.randrange(len(jobs)))
            ctx = ReqContext(req_id=req) if req not in active else active[req][0]
            if kind == "load":
                both("complete_load", keys, ctx=ctx)
            else:
                ok = rng.random() < 0.9
                theirs.complete_store(keys, ctx, ok)
                ours.complete_store(keys, ctx, ok)
        else:  # a request finishes (its transfers may still be in flight)
            req = rng.choice(list(active))
            ctx = active.pop(req)[0]
            theirs.on_request_finished(ctx)
            ours.on_request_finished(ctx)
        ea, eb = _events(theirs), _events(ours)
        if ea != eb:
            return (f"step {step}: events differ (keys, removed, metadata only): "
                    f"{[(len(e[0]), *e[1:]) for e in ea]} vs {[(len(e[0]), *e[1:]) for e in eb]}")
    return None


def main(prefix: str, sequences: int, seed: int) -> dict:
    out = {}
    for policy in ("lru", "arc"):
        bad, first = 0, []
        rng = random.Random(seed)
        for s in range(sequences):
            theirs = CPUOffloadingManager(CHUNKS, cache_policy=policy, enable_events=True)
            shared = connect(f"{prefix}-{policy}-{s}", Layout((4096,), 16, "diff"),
                             num_blocks=CHUNKS, policy=policy, events=True, hold_capacity=64)
            ours = KvshmOffloadingManager(shared, events=True)
            try:
                diff = run_sequence(rng, ours, theirs)
            finally:
                ours.shutdown()
                Segment.unlink(f"{prefix}-{policy}-{s}")
            if diff is not None:
                bad += 1
                if len(first) < 5:
                    first.append(f"seq {s}: {diff}")
        out[policy] = {"mismatches": bad, "sequences": sequences, "first": first,
                       "evicted": STATS["evicted"]}
        STATS["evicted"] = 0
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
