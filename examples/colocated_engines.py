#!/usr/bin/env python3
"""N engine processes share one kvshm cache: the prefix one computes is a hit for all.

Run ``python examples/colocated_engines.py --help`` for what it does and how to read it.
``run(options)`` is the same thing as a function (``tools/bench_sharing.py`` uses it).
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import signal
import sys
import time
import traceback
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.append(os.path.dirname(HERE))  # a repository checkout works without installing kvshm

import kvshm  # noqa: E402
from demo_options import (OPTION_HELP, DemoError, OneLineParser, Options,  # noqa: E402,F401
                          check, cuda_available)
from mini_engine import STAT_KEYS, Engine, EngineConfig, layout_for  # noqa: E402
from mini_model import VOCAB, generate  # noqa: E402

DESCRIPTION = """\
Start N mini engines (each a scheduler process plus a worker process) that share ONE kvshm
cache in /dev/shm, serve a chat workload, and print where every prompt token came from.

The workload: C conversations, each starting with one of S shared system prompts, run for T
turns. Turn t of conversation c is sent to engine (c + t) mod N — a load balancer without
session affinity — so every turn lands on a different engine than the previous one. Turns
run in rounds (all conversations' turn t, then t+1), like users reading and typing.

Each engine has a small device KV pool with its own prefix cache. A prompt's tokens are
  device hits  found in this engine's own device cache,
  kvshm hits   loaded from the shared cache, split into blocks that THIS engine stored
               ("own") and blocks ANOTHER engine stored ("other": what sharing buys),
  recomputed   computed by the model.
Every loaded block is verified byte for byte: the mini model's KV is a function of token and
position, so "mismatched" must be 0. Bytes moved are the worker's loads and stores.

examples:
  python examples/colocated_engines.py                  # 3 engines, summary table
  python examples/colocated_engines.py --json           # the same as one JSON object
  python examples/colocated_engines.py --keep --cache demo && kvshm-inspect show demo
  python examples/colocated_engines.py --engines 4 --turns 6 --inline-workers

Every option is checked before anything starts. Only a cache this run created is ever
removed: a --cache name that exists is refused and left as it is.
exit status: 0 every loaded block and reply was right; 1 one was not; 2 a bad option, or a
cache that could not be created; 130 interrupted (Ctrl-C: engines stopped, cache removed)
"""


@dataclass
class Turn:
    req_id: str
    engine: int
    prompt: list[int]
    reply: list[int]


def workload(o: Options) -> list[list[Turn]]:
    """Rounds of turns; every reply is known in advance (the model is deterministic)."""
    rng = np.random.default_rng(o.seed)
    systems = [rng.integers(0, VOCAB, o.system_tokens).tolist() for _ in range(o.system_prompts)]
    context = [list(systems[c % o.system_prompts]) for c in range(o.conversations)]
    rounds = []
    for t in range(o.turns):
        turns = []
        for c in range(o.conversations):
            prompt = context[c] + rng.integers(0, VOCAB, o.user_tokens).tolist()
            reply = generate(prompt, o.reply_tokens)
            context[c] = prompt + reply
            turns.append(Turn(f"c{c}t{t}", (c + t) % o.engines, prompt, reply))
        rounds.append(turns)
    return rounds


def engine_main(cfg: EngineConfig, conn) -> None:
    """One engine process: serve each round it is sent, then report its statistics."""
    try:
        eng = Engine(cfg)
        conn.send(("ready", None))
        while (msg := conn.recv())[0] == "round":
            for t in msg[1]:
                eng.add_request(t.req_id, t.prompt, len(t.reply))
            eng.run_until_idle()  # includes its stores: published before the next round
            conn.send(("done", {t.req_id: eng.finished.pop(t.req_id) for t in msg[1]}))
        conn.send(("stats", eng.close()))
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def run(o: Options) -> dict[str, Any]:
    """Run the demo; returns the summary (see ``--json``). Raises ``DemoError`` for options
    that cannot make a sensible run, and for a cache name that exists, before it starts."""
    check(o)
    t0 = time.monotonic()
    base = o.cache or f"demo-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    names = [f"{base}-e{i}" for i in range(o.engines)] if o.private else [base]
    cfgs = [EngineConfig(cache=names[i if o.private else 0], name=f"engine{i}",
                         block_tokens=o.block_tokens, block_size_factor=o.block_size_factor,
                         token_bytes=o.token_bytes, device_blocks=o.device_blocks,
                         max_running=o.max_running,
                         worker="inline" if o.inline_workers else "process", device=o.device)
            for i in range(o.engines)]
    lay = layout_for(cfgs[0])
    num_blocks = max(1, int(o.cache_mib * 2**20) // lay.block_bytes)
    rounds = workload(o)
    procs, pipes = [], []
    created: dict[str, str] = {}  # name -> incarnation: only these may be stopped or removed
    try:
        for name in names:
            created[name] = create_cache(name, lay, num_blocks, max_clients=2 * o.engines + 2)
        start_engines(cfgs, engine_main, procs, pipes)
        wrong = sum(play_round(pipes, turns) for turns in rounds)
        stats = stop_engines(procs, pipes)
    finally:
        kill_engines(procs)
        for name, tag in created.items():
            release_cache(name, remove=not o.keep, tag=tag)
    total = {k: sum(s[k] for s in stats) for k in STAT_KEYS}
    return {"schema": "kvshm.demo/1", "options": asdict(o), "caches": names,
            "cache_bytes_each": num_blocks * lay.block_bytes, "kept": o.keep,
            "engines": [{"name": c.name, **s} for c, s in zip(cfgs, stats)], "total": total,
            "cross_engine_blocks": total["kvshm_blocks_other"],
            "wrong_outputs": wrong, "seconds": round(time.monotonic() - t0, 2)}


def start_engines(cfgs: list[EngineConfig], target, procs: list, pipes: list) -> None:
    """Spawn one process per config running ``target(cfg, pipe)`` (an ``engine_main``) and
    wait until each is ready. ``procs`` and ``pipes`` grow as processes start, so that the
    caller's ``kill_engines(procs)`` also stops those started before a failure."""
    ctx = mp.get_context("spawn")
    for cfg in cfgs:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=target, args=(cfg, child), name=cfg.name)
        # Started with SIGINT ignored, which exec keeps (and Python then leaves alone): a
        # terminal's Ctrl-C, sent to the whole process group, reaches only us, and our
        # cleanup stops the engines, instead of each printing a KeyboardInterrupt traceback.
        ctrl_c = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            p.start()
        finally:
            signal.signal(signal.SIGINT, ctrl_c)
        procs.append(p)
        pipes.append(parent)
    for pipe in pipes:
        expect(pipe, "ready")


def play_round(pipes: list, turns: list[Turn]) -> int:
    """Send every engine its turns of one round, wait for all; returns the wrong replies."""
    for i, pipe in enumerate(pipes):
        pipe.send(("round", [t for t in turns if t.engine == i]))
    outputs: dict[str, list[int]] = {}
    for pipe in pipes:
        outputs.update(expect(pipe, "done"))
    return sum(outputs[t.req_id] != t.reply for t in turns)


def stop_engines(procs: list, pipes: list) -> list[Any]:
    """Tell every engine to stop; returns what each reported, and joins the processes."""
    for pipe in pipes:
        pipe.send(("stop", None))
    results = [expect(pipe, "stats") for pipe in pipes]
    for p in procs:
        p.join()
    return results


def kill_engines(procs: list) -> None:
    """Kill the engine processes still alive (cleanup after a failure)."""
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()


def expect(pipe, what: str) -> Any:
    """The payload of an engine's next message, which must be ``what``."""
    kind, payload = pipe.recv()
    if kind == "error":
        raise RuntimeError(f"an engine process failed:\n{payload}")
    assert kind == what, (kind, what)
    return payload


def create_cache(name: str, layout: "kvshm.Layout", num_blocks: int, max_clients: int) -> str:
    """Create segment ``name``; returns its incarnation tag. An existing segment is never
    taken over: it may be a cache someone kept, or another demo's, so it is left as it is."""
    try:
        seg = kvshm.Segment.create(name, layout, num_blocks, max_clients=max_clients)
    except kvshm.errors.SegmentExistsError:
        raise DemoError(
            f"a kvshm cache named {name!r} already exists (kept by an earlier --keep run, or "
            f"in use by another demo) and was left as it is: look at it with 'kvshm-inspect "
            f"show {name}', remove it with 'kvshm-inspect rm {name}', or choose another "
            "--cache") from None
    except kvshm.errors.KvshmError as e:  # no room in /dev/shm, no permission: say so
        raise DemoError(f"cannot create the cache {name!r}: {e}") from None
    tag = seg.tag
    seg.close()
    return tag


def release_cache(name: str, remove: bool, tag: str | None = None) -> None:
    """Stop the segment's auto-started owner (the cache stays intact) and, if ``remove``,
    unlink the segment and its objects. With ``tag``, only if the segment under ``name``
    is still that incarnation (the one this run created): never one made since by others."""
    try:
        seg = kvshm.Segment.attach(name)
    except kvshm.errors.SegmentNotFoundError:
        return
    if tag is not None and seg.tag != tag:  # ours was removed; this one is someone else's
        seg.close()
        return
    pid = seg.owner_record()[0] if seg.owner_alive() else 0
    seg.close()
    if remove:
        kvshm.Segment.unlink(name)  # an owner notices within ~0.2 s and exits by itself
    elif pid:
        os.kill(pid, signal.SIGTERM)  # a graceful stop: the block table keeps the cache
    deadline = time.monotonic() + 5.0
    while pid and _running(pid):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            deadline = time.monotonic() + 5.0
        time.sleep(0.02)  # polling a process we cannot wait() for; bounded by the deadline


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def print_summary(r: dict[str, Any]) -> None:
    o = r["options"]
    mib = r["cache_bytes_each"] / 2**20
    where = (f"{o['engines']} private caches of {mib:.0f} MiB" if o["private"] else
             f"one shared {mib:.0f} MiB kvshm cache {r['caches'][0]!r}")
    print(f"{o['engines']} engines, {where}; {o['conversations']} conversations x "
          f"{o['turns']} turns, {o['system_prompts']} shared system prompts of "
          f"{o['system_tokens']} tokens, turns routed round-robin across engines\n")
    cols = ("requests", "prompt tok", "device hit", "kvshm hit", "own blk", "other blk",
            "recomputed", "loaded MiB", "stored MiB", "verified", "mismatched")
    print(f"{'':9}" + "".join(f"{c:>11}" for c in cols))
    for row in r["engines"] + [{"name": "total", **r["total"]}]:
        vals = (row["requests"], row["prompt_tokens"], row["device_hit_tokens"],
                row["kvshm_hit_tokens"], row["kvshm_blocks_own"], row["kvshm_blocks_other"],
                row["recomputed_tokens"], f"{row['bytes_loaded'] / 2**20:.1f}",
                f"{row['bytes_stored'] / 2**20:.1f}", row["blocks_verified"],
                row["blocks_mismatched"])
        print(f"{row['name']:9}" + "".join(f"{v:>11}" for v in vals))
    t = r["total"]
    pct = 100 * (t["device_hit_tokens"] + t["kvshm_hit_tokens"]) / max(1, t["prompt_tokens"])
    print(f"\n{pct:.0f}% of prompt tokens were not recomputed; {r['cross_engine_blocks']} "
          f"blocks stored by one engine were loaded by another; {t['blocks_verified']} loaded "
          f"blocks verified, {t['blocks_mismatched']} mismatched; {r['wrong_outputs']} wrong "
          f"replies; {r['seconds']:.1f} s")
    if r["kept"]:
        print(f"kept: kvshm-inspect show {r['caches'][0]}   (remove: kvshm-inspect rm "
              f"{r['caches'][0]})")


def parse(argv: list[str] | None = None) -> Options:
    ap = OneLineParser(prog="colocated_engines.py", description=DESCRIPTION,
                       formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Options()
    for f, help_ in OPTION_HELP.items():
        ap.add_argument("--" + f.replace("_", "-"), type=int, default=getattr(d, f),
                        help=f"{help_} (default {getattr(d, f)})")
    ap.add_argument("--cache-mib", type=float, default=d.cache_mib,
                    help=f"kvshm cache size in MiB (default {d.cache_mib:g})")
    ap.add_argument("--private", action="store_true",
                    help="give each engine its own cache of --cache-mib (today's setup)")
    ap.add_argument("--inline-workers", action="store_true",
                    help="run each engine's worker in its scheduler process (no job channel)")
    ap.add_argument("--device", choices=("cpu", "cuda", "auto"), default="auto",
                    help="device KV pool: CPU memory, or CUDA tensors (auto: CUDA if present)")
    ap.add_argument("--cache", help="segment name (default: a fresh unique one); the demo "
                    "creates it and refuses a name that exists, which it leaves alone")
    ap.add_argument("--keep", action="store_true",
                    help="leave the cache in /dev/shm for kvshm-inspect (remove it with "
                    "'kvshm-inspect rm NAME' before reusing NAME)")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead")
    a = ap.parse_args(argv)
    opts = {k: v for k, v in vars(a).items() if k != "json"}
    if opts["device"] == "auto":
        opts["device"] = "cuda" if cuda_available() else "cpu"
    parse.json = a.json  # type: ignore[attr-defined]
    return replace(d, **opts)


def main(argv: list[str] | None = None) -> int:
    o = parse(argv)
    try:
        r = run(o)
    except DemoError as e:
        print(f"colocated_engines.py: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # its engines ignore Ctrl-C: run's cleanup has stopped them
        print("colocated_engines.py: interrupted; its engines were stopped and the cache it "
              f"created was {'kept' if o.keep else 'removed'}", file=sys.stderr)
        return 130
    if parse.json:  # type: ignore[attr-defined]
        print(json.dumps(r, indent=2))
    else:
        print_summary(r)
    return 0 if r["total"]["blocks_mismatched"] == 0 and r["wrong_outputs"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
