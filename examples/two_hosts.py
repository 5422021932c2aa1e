#!/usr/bin/env python3
"""Co-located engines on two simulated hosts share one cluster-wide cache through Mooncake.

Run ``python examples/two_hosts.py --help`` for what it does and how to read it. It needs
``pip install 'kvshm[mooncake]'`` (and Debian's libibverbs1); it starts its own
``mooncake_master`` on free loopback ports and stops everything it started on exit.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from dataclasses import asdict, dataclass, replace
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.append(ROOT)  # a repository checkout works without installing kvshm

import kvshm  # noqa: E402
from kvshm.shm.wait import poll_until  # noqa: E402
from colocated_engines import Options as DemoOptions  # noqa: E402
from colocated_engines import (kill_engines, play_round, release_cache,  # noqa: E402
                               start_engines, stop_engines, workload)
from mini_engine import STAT_KEYS, Engine, EngineConfig, layout_for  # noqa: E402

DESCRIPTION = """\
Two simulated hosts, each with its own kvshm segment (its own owner) and its own kvshm mover,
and one mooncake_master for both: the cluster-wide lower tier. Every engine on a host shares
that host's segment; each mover writes every block stored on its host through to Mooncake and
fetches its engines' misses from it ("not yet" answers, so no engine step waits).

The workload is the co-located demo's (conversations over shared system prompts), routed so
that consecutive turns of a conversation land on different HOSTS: turn t+1 finds turn t's
prefix only through Mooncake. Between rounds the demo waits until both movers have written
their host's new blocks through (a real cluster has no such barrier; it makes the numbers
reproducible).

Columns as in colocated_engines.py, plus "x-host blk": blocks an engine loaded that were
computed on the OTHER host only (they came through Mooncake). Every loaded block is verified
byte for byte against the mini model; "mismatched" must be 0.

examples:
  python examples/two_hosts.py
  python examples/two_hosts.py --json
  python examples/two_hosts.py --engines-per-host 2 --turns 6
"""


@dataclass
class Options:
    engines_per_host: int = 1
    conversations: int = 8
    turns: int = 4
    system_prompts: int = 2
    system_tokens: int = 256
    user_tokens: int = 48
    reply_tokens: int = 16
    cache_mib: float = 16.0
    global_segment_mib: int = 128  # what each host's mover contributes to Mooncake's pool
    seed: int = 0


class TieredEngine(Engine):
    """A mini engine over a TieredManager that remembers which keys it loaded."""

    def __init__(self, cfg: EngineConfig):
        from kvshm.tier.client import TieredManager
        self.tiered = TieredManager(kvshm.connect(cfg.cache, layout_for(cfg)), max_wait=10.0)
        super().__init__(cfg, manager=self.tiered)
        self.loaded_keys: list[bytes] = []

    def _loaded(self, r, done) -> None:
        before = self.stats["blocks_verified"], r.first_load
        super()._loaded(r, done)
        if self.stats["blocks_verified"] > before[0] and before[1]:
            self.loaded_keys += done.keys  # first admission only, as the hit columns count


def engine_main(cfg: EngineConfig, conn) -> None:
    try:
        eng = TieredEngine(cfg)
        conn.send(("ready", None))
        while (msg := conn.recv())[0] == "round":
            for t in msg[1]:
                eng.add_request(t.req_id, t.prompt, len(t.reply))
            eng.run_until_idle()
            conn.send(("done", {t.req_id: eng.finished.pop(t.req_id) for t in msg[1]}))
        stats = eng.close()
        stats["not_yet"] = eng.tiered.not_yet
        conn.send(("stats", (stats, sorted(eng.own_keys), eng.loaded_keys)))
        eng.tiered.shutdown()
    except BaseException:
        conn.send(("error", traceback.format_exc()))


def _tier(name: str) -> dict[str, Any]:
    from kvshm.inspect.snapshot import tier_snapshot
    with kvshm.Segment.attach(name) as seg:
        return tier_snapshot(seg) or {"state": "none", "counters": {}}


def _written_through(name: str, timeout: float = 30.0) -> None:
    """Wait (at most ``timeout`` s) until the host's mover has handled every block stored in
    its segment."""
    def handled() -> bool:
        c = _tier(name)["counters"]
        return sum(c.get(k, 0) for k in ("puts", "put_failed", "put_refused_space",
                                         "put_dropped", "put_skipped")) \
            >= seg.counter("store_blocks")

    seg = kvshm.Segment.attach(name)
    try:
        poll_until(handled, timeout)
    finally:
        seg.close()


def run(o: Options) -> dict[str, Any]:
    from kvshm.tier.mooncake import start_master
    t0 = time.monotonic()
    hosts = 2
    n = hosts * o.engines_per_host
    demo = DemoOptions(engines=n, conversations=o.conversations, turns=o.turns,
                       system_prompts=o.system_prompts, system_tokens=o.system_tokens,
                       user_tokens=o.user_tokens, reply_tokens=o.reply_tokens, seed=o.seed)
    base = f"twohosts-{os.getpid()}-{uuid.uuid4().hex[:6]}"
    names = [f"{base}-h{h}" for h in range(hosts)]
    host_of = [i % hosts for i in range(n)]  # turn t -> engine (c+t) % n: hosts alternate
    cfgs = [EngineConfig(cache=names[host_of[i]], name=f"h{host_of[i]}e{i // hosts}",
                         device_blocks=demo.device_blocks, max_running=demo.max_running,
                         worker="inline") for i in range(n)]
    lay = layout_for(cfgs[0])
    num_blocks = max(1, int(o.cache_mib * 2**20) // lay.block_bytes)
    logdir = tempfile.mkdtemp(prefix="kvshm-two-hosts-")
    master = start_master(log_path=os.path.join(logdir, "master.log"))
    movers: list[subprocess.Popen] = []
    procs, pipes = [], []
    try:
        for name in names:
            kvshm.Segment.create(name, lay, num_blocks, max_clients=2 * n + 4).close()
            with open(os.path.join(logdir, f"mover-{name}.log"), "ab") as log:
                movers.append(subprocess.Popen(
                    master.mover_command(name, "--global-segment", f"{o.global_segment_mib}M",
                                         "--local-buffer", "32M"),
                    stdout=log, stderr=subprocess.STDOUT,
                    env={**os.environ, "PYTHONPATH": ROOT + os.pathsep +
                         os.environ.get("PYTHONPATH", "")}))
        for name, mv in zip(names, movers):
            poll_until(lambda: _tier(name)["state"] == "connected" or mv.poll() is not None, 120)
            if _tier(name)["state"] != "connected":
                raise RuntimeError(f"the mover of {name} did not connect; see {logdir}")
        start_engines(cfgs, engine_main, procs, pipes)
        wrong = 0
        for turns in workload(demo):
            wrong += play_round(pipes, turns)
            for name in names:
                _written_through(name)
        results = stop_engines(procs, pipes)
        tiers = [_tier(name) for name in names]
    finally:
        kill_engines(procs)
        for mv in movers:
            mv.terminate()
            try:
                mv.wait(30)
            except subprocess.TimeoutExpired:
                mv.kill()
                mv.wait()
        master.stop()
        for name in names:
            release_cache(name, remove=True)  # the tier area goes with its segment
    stored = [set() for _ in range(hosts)]
    for i, (_, own, _) in enumerate(results):
        stored[host_of[i]].update(own)
    engines = []
    for i, (stats, _, loaded) in enumerate(results):
        h = host_of[i]
        others = set().union(*(stored[x] for x in range(hosts) if x != h)) - stored[h]
        engines.append({"name": cfgs[i].name, "host": h, **stats,
                        "cross_host_blocks": sum(k in others for k in loaded)})
    total = {k: sum(e[k] for e in engines) for k in (*STAT_KEYS, "cross_host_blocks", "not_yet")}
    return {"schema": "kvshm.two_hosts/1", "options": asdict(o), "hosts": names,
            "engines": engines, "total": total, "cross_host_blocks": total["cross_host_blocks"],
            "mismatched": total["blocks_mismatched"], "wrong_outputs": wrong,
            "tiers": [{"host": h, "state": t["state"], **t["counters"]}
                      for h, t in enumerate(tiers)],
            "logs": logdir, "seconds": round(time.monotonic() - t0, 2)}


def print_summary(r: dict[str, Any]) -> None:
    o = r["options"]
    print(f"2 hosts x {o['engines_per_host']} engine(s), one {o['cache_mib']:g} MiB kvshm "
          f"segment per host, one mooncake_master; {o['conversations']} conversations x "
          f"{o['turns']} turns, consecutive turns on different hosts\n")
    cols = ("host", "requests", "prompt tok", "device hit", "kvshm hit", "x-host blk",
            "not yet", "recomputed", "verified", "mismatched")
    print(f"{'':8}" + "".join(f"{c:>11}" for c in cols))
    for e in r["engines"] + [{"name": "total", "host": "", **r["total"]}]:
        vals = (e["host"], e["requests"], e["prompt_tokens"], e["device_hit_tokens"],
                e["kvshm_hit_tokens"], e["cross_host_blocks"], e["not_yet"],
                e["recomputed_tokens"], e["blocks_verified"], e["blocks_mismatched"])
        print(f"{e['name']:8}" + "".join(f"{v:>11}" for v in vals))
    print()
    for t in r["tiers"]:
        print(f"host {t['host']} mover: {t['state']}, put {t.get('puts', 0)} blocks, fetched "
              f"{t.get('gets', 0)}, misses below {t.get('get_misses', 0)}, failures "
              f"{t.get('get_failed', 0) + t.get('put_failed', 0)}, rejected "
              f"{t.get('get_rejected', 0)}")
    tot = r["total"]
    print(f"\n{r['cross_host_blocks']} blocks computed on one host were loaded on the other "
          f"(cross-host hits through Mooncake); {tot['blocks_verified']} loaded blocks "
          f"verified, {r['mismatched']} mismatched; {r['wrong_outputs']} wrong replies; "
          f"{r['seconds']:.1f} s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="two_hosts.py", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    d = Options()
    for f in ("engines_per_host", "conversations", "turns", "system_prompts", "system_tokens",
              "user_tokens", "reply_tokens", "global_segment_mib", "seed"):
        ap.add_argument("--" + f.replace("_", "-"), type=int, default=getattr(d, f),
                        help=f"{f.replace('_', ' ')} (default {getattr(d, f)})")
    ap.add_argument("--cache-mib", type=float, default=d.cache_mib,
                    help=f"each host's segment in MiB (default {d.cache_mib:g})")
    ap.add_argument("--json", action="store_true", help="print one JSON object instead")
    a = ap.parse_args(argv)
    o = replace(d, **{k: v for k, v in vars(a).items() if k != "json"})
    r = run(o)
    if a.json:
        print(json.dumps(r, indent=2))
    else:
        print_summary(r)
    return 0 if r["mismatched"] == 0 and r["wrong_outputs"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
