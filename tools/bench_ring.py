#!/usr/bin/env python3
"""Benchmark kvshm's control ring against pyzmq ipc:// and multiprocessing.Pipe.

Run ``python tools/bench_ring.py --help`` for what is measured; results are recorded in
docs/benchmarks.md ("Control ring").
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import shutil
import sys
import tempfile
import time
import uuid
from typing import Any, Callable, Sequence

from proc_clock import cpu_ns, sched_ns

DESCRIPTION = """\
Round-trip latency and throughput of kvshm's manager operations through its shared-memory
control ring, measured in the same run against the same request/reply over two baselines.

Operations:
  events   take_events: one request without keys and its (empty) reply, the smallest round
           trip the protocol has (lookups never travel: clients read the segment).
  store    prepare_store then complete_store of 32 fresh keys of 36 bytes, like vLLM's
           offload keys; the cache is big enough that nothing is evicted (see
           --num-blocks). On the ring it takes granted blocks and sends one one-way frame
           (no round trip); the baselines answer both calls.

Transports (one client: this process; one server process each):
  ring     kvshm.connect() -> SharedManager; the owner process that connect() starts
           serves the ring (take_events, prepare_store, complete_store).
  zmq      pyzmq REQ/REP over ipc:// in a temp dir, msgspec frames.
  pipe     multiprocessing.Pipe, send_bytes/recv_bytes, msgspec frames.
Every server does the same real work: it owns a kvshm LocalManager on its own segment and
decodes/applies/encodes the very kvshm.index.protocol frames the owner handles. Transports run
interleaved in rounds so that noise from other load on the host hits them alike; ratios
(baseline p50 / ring p50) are computed within the run.

Also measured: the client-side lock-free paths, which need no round trip:
  lookup(32 keys, all hits) throughput in keys/s (best of 5 batches; repeated lookups of
  keys this client already leased, as a scheduler re-checking a waiting request does, and
  separately first lookups after release()), and key_status(1 key) latency; and idle CPU:
  after the run the owner and this (attached, idle) client sit for --idle-seconds and their
  CPU time is read from /proc/<pid>/schedstat (or /proc/<pid>/stat). For each transport and
  op it also reports, from schedstat, how much of the time server and client were on a CPU
  and how much they were runnable but waiting for one (a loaded host shows up there).

Targets: ring p50 >= 10x faster than zmq; >= 1,000,000 client-side lookup keys/s;
key_status p50 <= 0.5 us for a key this client leases and <= 1 us for a fresh READY key
(lease included); idle owner and idle client < 1% CPU.
"""

KEYS_PER_OP = 32
KEY_BYTES = 36
ROUNDS = 10  # the measured iterations are split into this many interleaved rounds
PAGE_BYTES = (256,)  # block data is never touched: keep the segments small


def _layout():
    from kvshm.shm.layout import Layout
    return Layout(PAGE_BYTES, 16, "bench_ring")


def _unique(tag: str) -> str:
    # Segment.unlink removes semaphores by prefix "<name>-": no name may prefix another.
    return f"bench{os.getpid()}x{uuid.uuid4().hex[:8]}{tag}"


# --- baseline servers ----------------------------------------------------------------------
class _Apply:
    """What the kvshm owner does with a request frame, on a LocalManager of its own."""

    def __init__(self, seg_name: str, num_blocks: int, ring_capacity: int):
        from kvshm.index import protocol as P
        from kvshm.owner.manager import LocalManager
        from kvshm.shm.segment import Segment
        self.P = P
        self.seg = Segment.create(seg_name, _layout(), num_blocks, ring_capacity=ring_capacity)
        # enable_events like the owner's manager (the owner drains them after every store)
        self.manager = LocalManager(self.seg, enable_events=True)

    def __call__(self, frame: bytes) -> tuple[bytes, bool]:
        """Reply frame, and whether the server should stop."""
        P, m = self.P, self.manager
        req = 0
        try:
            msg = P.request_decoder.decode(frame)
            req = msg.req
            t = type(msg)
            if t is P.TakeEvents:
                ev = m.take_events()
                reply = P.Events(req, 1, [e.removed for e in ev], [e.keys for e in ev])
            elif t is P.PrepareStore:
                out = m.prepare_store(msg.keys)
                m.take_events()
                reply = P.NoRoom(req, 1) if out is None else \
                    P.Prepared(req, 1, out.keys_to_store, out.block_ids, out.evicted_keys)
            elif t is P.CompleteStore:
                m.complete_store(msg.keys, msg.success)
                m.take_events()
                reply = P.Ok(req, 1)
            elif t is P.Bye:
                return P.reply_encoder.encode(P.Ok(req, 1)), True
            else:
                reply = P.Error(req, 1, "ProtocolError", f"unsupported {t.__name__}")
        except Exception as e:  # noqa: BLE001 - report, like the owner does
            reply = P.error_reply(req, 1, e)
        return P.reply_encoder.encode(reply), False

    def close(self) -> None:
        from kvshm.shm.segment import Segment
        self.manager.shutdown()
        self.seg.close()
        Segment.unlink(self.seg.name)


def _serve(kind: str, endpoint: Any, ready: Any, seg_name: str, num_blocks: int,
           ring_capacity: int) -> None:
    """Server process body (spawned): ``kind`` is "zmq" or "pipe"."""
    apply = None
    try:
        apply = _Apply(seg_name, num_blocks, ring_capacity)
        if kind == "zmq":
            import zmq
            ctx = zmq.Context()
            sock = ctx.socket(zmq.REP)
            sock.setsockopt(zmq.LINGER, 0)
            sock.bind(endpoint)
            ready.send("ok")
            recv, send = sock.recv, sock.send
            while True:
                out, stop = apply(recv())
                send(out)
                if stop:
                    break
            sock.close()
            ctx.term()
        else:
            ready.send("ok")
            recv, send = endpoint.recv_bytes, endpoint.send_bytes
            while True:
                out, stop = apply(recv())
                send(out)
                if stop:
                    break
    except BaseException as e:  # noqa: BLE001 - tell the parent why
        try:
            ready.send(f"{kind} server failed: {e!r}")
        except Exception:  # noqa: BLE001
            pass
    finally:
        if apply is not None:
            apply.close()


# --- client-side transports ----------------------------------------------------------------
class _Transport:
    name = ""
    server_pid = 0

    def events(self, keys: list[bytes]) -> None:
        """One take_events round trip (``keys`` unused: the signature of every op)."""
        raise NotImplementedError

    def store(self, keys: list[bytes]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        pass


class _RingTransport(_Transport):
    name = "ring"

    def __init__(self, seg_name: str, num_blocks: int, ring_capacity: int):
        import kvshm
        self.mgr = kvshm.connect(seg_name, _layout(), num_blocks=num_blocks,
                                 ring_capacity=ring_capacity)
        self.owner_pid = self.server_pid = self.mgr.segment.owner_record()[0]

    def events(self, keys: list[bytes]) -> None:
        self.mgr.take_events()

    def store(self, keys: list[bytes]) -> None:
        out = self.mgr.prepare_store(keys)
        if out is None or len(out.block_ids) != len(keys):
            raise RuntimeError(f"ring prepare_store refused or partial: {out}")
        self.mgr.complete_store(keys)

    def close(self) -> None:
        self.mgr.shutdown()


class _MsgTransport(_Transport):
    """Client of a baseline server: same frames, same codec as the ring's client."""

    def __init__(self, kind: str, tmpdir: str, seg_name: str, num_blocks: int,
                 ring_capacity: int, ctx: Any):
        from kvshm.index import protocol as P
        self.P, self.name, self._req = P, kind, 0
        self._enc, self._dec = P.request_encoder.encode, P.reply_decoder.decode
        ready_r, ready_w = ctx.Pipe(duplex=False)
        if kind == "zmq":
            import zmq
            endpoint = f"ipc://{tmpdir}/bench.sock"
            server_end = endpoint
        else:
            mine, server_end = ctx.Pipe(duplex=True)
        self.proc = ctx.Process(target=_serve, args=(kind, server_end, ready_w, seg_name,
                                                      num_blocks, ring_capacity),
                                name=f"bench-{kind}-server", daemon=True)
        self.proc.start()
        ready_w.close()
        if not ready_r.poll(120):
            raise RuntimeError(f"{kind} server did not start within 120 s")
        status = ready_r.recv()
        if status != "ok":
            raise RuntimeError(status)
        self._ready = ready_r
        self.server_pid = self.proc.pid
        if kind == "zmq":
            self.zctx = zmq.Context()
            self.sock = self.zctx.socket(zmq.REQ)
            self.sock.setsockopt(zmq.LINGER, 0)
            self.sock.connect(endpoint)
            self._send, self._recv = self.sock.send, self.sock.recv
        else:
            self.conn = mine
            self._send, self._recv = mine.send_bytes, mine.recv_bytes

    def _call(self, msg: Any) -> Any:
        self._send(self._enc(msg))
        reply = self._dec(self._recv())
        if reply.req != msg.req or type(reply) is self.P.Error:
            raise RuntimeError(f"{self.name} server replied {reply!r}")
        return reply

    def _next(self) -> int:
        self._req += 1
        return self._req

    def events(self, keys: list[bytes]) -> None:
        self._call(self.P.TakeEvents(self._next()))

    def store(self, keys: list[bytes]) -> None:
        P = self.P
        r = self._call(P.PrepareStore(self._next(), list(keys)))
        if type(r) is not P.Prepared or len(r.blocks) != len(keys):
            raise RuntimeError(f"{self.name} prepare_store refused or partial: {r!r}")
        self._call(P.CompleteStore(self._next(), list(keys), True))

    def close(self) -> None:
        if self.proc.is_alive():
            try:
                self._call(self.P.Bye(self._next()))
            except Exception:  # noqa: BLE001 - it is going away anyway
                pass
        self.proc.join(10)
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join(5)
        if self.name == "zmq":
            self.sock.close()
            self.zctx.term()
        else:
            self.conn.close()
        self._ready.close()


# --- measurement helpers -------------------------------------------------------------------
def _pct(sorted_ns: Sequence[int], q: float) -> float:
    """Nearest-rank percentile in microseconds."""
    i = min(len(sorted_ns) - 1, max(0, int(round(q / 100 * len(sorted_ns))) - 1))
    return sorted_ns[i] / 1e3


def _summary(lat_ns: list[int], busy_ns: int) -> dict[str, float]:
    s = sorted(lat_ns)
    return {"n": len(s), "p50_us": _pct(s, 50), "p99_us": _pct(s, 99),
            "mean_us": sum(s) / len(s) / 1e3, "ops_per_s": len(s) / (busy_ns / 1e9)}


def _timed(fn: Callable[[list[bytes]], Any], batches: Sequence[list[bytes]],
           lat: list[int]) -> int:
    clock = time.perf_counter_ns
    start = clock()
    for keys in batches:
        t0 = clock()
        fn(keys)
        lat.append(clock() - t0)
    return clock() - start


def _machine() -> dict[str, Any]:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return {"cpu": model, "cores": cores, "python": platform.python_version(),
            "loadavg_1m_at_start": load}


# --- the benchmark -------------------------------------------------------------------------
def run(iterations: int, warmup: int, local_iterations: int, idle_s: float,
        num_blocks: int | None, ring_capacity: int, log: Callable[[str], None],
        seed: int = 0) -> dict:
    from kvshm.index import protocol as P
    from kvshm.shm.segment import Segment

    rng = random.Random(seed)  # the same keys every run of a seed: a run can be repeated
    rng_keys = lambda n: [rng.randbytes(KEY_BYTES) for _ in range(n)]  # noqa: E731
    lookup_keys = rng_keys(KEYS_PER_OP)
    n_store = warmup + iterations
    store_batches = [rng_keys(KEYS_PER_OP) for _ in range(n_store)]
    if num_blocks is None:  # room for every stored key: no eviction
        num_blocks = KEYS_PER_OP * (n_store + 1) + 1024

    result: dict[str, Any] = {
        "machine": _machine(),
        "params": {"iterations": iterations, "warmup": warmup, "rounds": ROUNDS,
                   "keys_per_op": KEYS_PER_OP, "key_bytes": KEY_BYTES,
                   "num_blocks": num_blocks, "ring_capacity": ring_capacity,
                   "local_iterations": local_iterations, "idle_seconds": idle_s,
                   "seed": seed},
    }
    names = {k: _unique(k) for k in ("ring", "zmq", "pipe")}
    tmpdir = tempfile.mkdtemp(prefix="kvshm-bench-")
    ctx = mp.get_context("spawn")
    transports: list[_Transport] = []
    ring: _RingTransport | None = None
    try:
        log(f"starting servers ({num_blocks} blocks per segment)...")
        ring = _RingTransport(names["ring"], num_blocks, ring_capacity)
        transports.append(ring)
        for kind in ("zmq", "pipe"):
            transports.append(_MsgTransport(kind, tmpdir, names[kind], num_blocks,
                                            ring_capacity, ctx))

        # Codec cost alone (encode request + decode it + encode reply + decode it), for scale.
        enc, dreq, drep = P.request_encoder.encode, P.request_decoder.decode, \
            P.reply_decoder.decode
        codec, blocks = [], list(range(KEYS_PER_OP))
        for i in range(2000):
            t0 = time.perf_counter_ns()
            m = dreq(enc(P.PrepareStore(i + 1, lookup_keys)))
            drep(enc(P.Prepared(m.req, 1, m.keys, blocks, [])))
            codec.append(time.perf_counter_ns() - t0)
        result["codec_store32_p50_us"] = _pct(sorted(codec), 50)

        # Seed the 32 keys the client-side lookups read, and check they all hit.
        ring.store(lookup_keys)
        if ring.mgr.lookup(lookup_keys) != KEYS_PER_OP:
            raise RuntimeError("ring: lookup of 32 seeded keys missed some")

        # Warm up every transport and op.
        log("warming up...")
        no_keys: list[list[bytes]] = [[]] * max(warmup, 1)
        for t in transports:
            _timed(t.events, no_keys, [])
            _timed(t.store, store_batches[:warmup], [])

        # Measure, interleaved in rounds (rotating the transport order each round).
        log(f"measuring {iterations} iterations x 2 ops x {len(transports)} transports...")
        lat = {(t.name, op): [] for t in transports for op in ("events", "store")}
        busy = dict.fromkeys(lat, 0)
        # Scheduler view: CPU use and run-queue wait of server and client during each op.
        sched = {key: [0, 0, 0, 0] for key in lat}  # server run, wait; client run, wait (ns)
        me = os.getpid()

        def measure(t: _Transport, op: str, batches: Sequence[list[bytes]]) -> None:
            s0, c0 = sched_ns(t.server_pid), sched_ns(me)
            busy[t.name, op] += _timed(getattr(t, op), batches, lat[t.name, op])
            s1, c1 = sched_ns(t.server_pid), sched_ns(me)
            acc = sched[t.name, op]
            for j, (a, b) in enumerate(zip(s0 + c0, s1 + c1)):
                acc[j] += b - a

        per_round = [iterations // ROUNDS + (r < iterations % ROUNDS) for r in range(ROUNDS)]
        at = warmup
        for r, n in enumerate(per_round):
            order = transports[r % len(transports):] + transports[:r % len(transports)]
            for t in order:
                measure(t, "events", [[]] * n)
            for t in order:
                measure(t, "store", store_batches[at:at + n])
            at += n
        if ring.mgr.lookup(lookup_keys) != KEYS_PER_OP:
            raise RuntimeError("ring: the seeded keys were lost during the run")
        result["round_trip"] = {f"{name}/{op}": _summary(v, busy[name, op])
                                for (name, op), v in lat.items()}
        ratios = {}
        for op in ("events", "store"):
            ring_p50 = result["round_trip"][f"ring/{op}"]["p50_us"]
            ring_p99 = result["round_trip"][f"ring/{op}"]["p99_us"]
            for base in ("zmq", "pipe"):
                b = result["round_trip"][f"{base}/{op}"]
                ratios[f"{base}/ring {op} p50"] = b["p50_us"] / ring_p50
                ratios[f"{base}/ring {op} p99"] = b["p99_us"] / ring_p99
        result["ratios"] = ratios
        result["sched_percent"] = {
            f"{name}/{op}": {"server_cpu": 100 * v[0] / busy[name, op],
                             "server_runq_wait": 100 * v[1] / busy[name, op],
                             "client_cpu": 100 * v[2] / busy[name, op],
                             "client_runq_wait": 100 * v[3] / busy[name, op]}
            for (name, op), v in sched.items()}

        # Client-side lock-free paths (no round trip).
        log("client-side lookup and key_status...")
        mgr = ring.mgr
        for _ in range(1000):
            mgr.lookup(lookup_keys)
        hits = mgr.lookup(lookup_keys)
        if hits != KEYS_PER_OP:
            raise RuntimeError(f"client-side lookup found {hits} of {KEYS_PER_OP}")
        lk = mgr.lookup
        best = None
        for _ in range(5):  # best of 5 batches: throughput the path can sustain
            t0 = time.perf_counter_ns()
            for _ in range(local_iterations // 5):
                lk(lookup_keys)
            dt = time.perf_counter_ns() - t0
            best = dt if best is None or dt < best else best
        lat_local: list[int] = []
        busy_local = _timed(lk, [lookup_keys] * local_iterations, lat_local)
        s = _summary(lat_local, busy_local)
        result["client_lookup32"] = {
            "keys_per_s": KEYS_PER_OP * (local_iterations // 5) / (best / 1e9),
            "keys_per_s_timed_loop": KEYS_PER_OP * s["ops_per_s"],
            "p50_us": s["p50_us"], "p99_us": s["p99_us"]}
        lat_cold: list[int] = []  # first lookup of keys this client has not leased yet
        release, clock = mgr.release, time.perf_counter_ns
        for _ in range(max(5, local_iterations // 10)):
            release()  # every lease: each lookup above counted one on its keys
            t0 = clock()
            lk(lookup_keys)
            lat_cold.append(clock() - t0)
        s = _summary(lat_cold, sum(lat_cold))
        result["client_lookup32"].update(unleased_keys_per_s=KEYS_PER_OP * s["ops_per_s"],
                                         unleased_p50_us=s["p50_us"])
        ks = mgr.key_status
        one = lookup_keys[0]
        lat_ks: list[int] = []
        for _ in range(1000):
            ks(one)
        for _ in range(local_iterations):
            t0 = clock()
            ks(one)
            lat_ks.append(clock() - t0)
        overhead = []
        for _ in range(10000):
            t0 = clock()
            overhead.append(clock() - t0)
        s = _summary(lat_ks, sum(lat_ks))
        lat_fresh: list[int] = []  # a READY key this client does not lease: lease included
        for _ in range(local_iterations):
            release()
            t0 = clock()
            ks(one)
            lat_fresh.append(clock() - t0)
        f = _summary(lat_fresh, sum(lat_fresh))
        result["client_key_status"] = {"p50_us": s["p50_us"], "p99_us": s["p99_us"],
                                       "fresh_p50_us": f["p50_us"], "fresh_p99_us": f["p99_us"],
                                       "clock_overhead_p50_us": _pct(sorted(overhead), 50)}

        # Idle CPU: the baselines stop, the owner and this attached client sit idle.
        for t in transports[1:]:
            t.close()
        transports = transports[:1]
        log(f"idle CPU over {idle_s:g} s...")
        owner = ring.owner_pid
        time.sleep(0.5)  # past the owner's post-work spin
        o0, c0, w0 = cpu_ns(owner), cpu_ns(os.getpid()), time.perf_counter_ns()
        time.sleep(idle_s)
        o1, c1, w1 = cpu_ns(owner), cpu_ns(os.getpid()), time.perf_counter_ns()
        wall = w1 - w0
        result["idle_cpu_percent"] = {"owner": 100 * (o1 - o0) / wall,
                                      "client": 100 * (c1 - c0) / wall,
                                      "owner_pid": owner, "seconds": wall / 1e9}
    finally:
        for t in transports:
            try:
                t.close()
            except Exception as e:  # noqa: BLE001
                log(f"closing {t.name}: {e!r}")
        for name in names.values():
            Segment.unlink(name)
        shutil.rmtree(tmpdir, ignore_errors=True)
        if ring is not None:  # the owner stops once its segment is unlinked (<= 0.2 s)
            deadline = time.monotonic() + 3
            while time.monotonic() < deadline and os.path.exists(f"/proc/{ring.owner_pid}"):
                try:
                    with open(f"/proc/{ring.owner_pid}/stat") as f:
                        if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                            break
                except OSError:
                    break
                time.sleep(0.05)

    ratios = result["ratios"]
    result["targets"] = {
        "ring_p50_10x_faster_than_zmq": {
            "events": ratios["zmq/ring events p50"] >= 10,
            "store": ratios["zmq/ring store p50"] >= 10},
        "client_lookup_1M_keys_per_s": result["client_lookup32"]["keys_per_s"] >= 1e6,
        "key_status_leased_p50_le_0.5us": result["client_key_status"]["p50_us"] <= 0.5,
        "key_status_fresh_p50_le_1us": result["client_key_status"]["fresh_p50_us"] <= 1.0,
        "idle_cpu_lt_1pct": {k: result["idle_cpu_percent"][k] < 1.0
                             for k in ("owner", "client")},
    }
    return result


def _table(r: dict) -> str:
    rt, ratios = r["round_trip"], r["ratios"]
    m, p = r["machine"], r["params"]
    lines = [f"machine: {m['cpu']}, {m['cores']} cores, Python {m['python']}, "
             f"load {m['loadavg_1m_at_start']}",
             f"{p['iterations']} iterations per transport and op ({p['warmup']} warm-up), "
             f"{p['keys_per_op']} keys of {p['key_bytes']} B, {p['rounds']} interleaved rounds",
             "",
             f"{'op':<28}{'transport':<11}{'p50 us':>9}{'p99 us':>9}{'mean us':>9}{'ops/s':>10}"]
    ops = {"events": "take_events round trip", "store": "prepare+complete_store(32)"}
    for op, label in ops.items():
        for t in ("ring", "zmq", "pipe"):
            s = rt[f"{t}/{op}"]
            lines.append(f"{label:<28}{t:<11}{s['p50_us']:>9.1f}{s['p99_us']:>9.1f}"
                         f"{s['mean_us']:>9.1f}{s['ops_per_s']:>10,.0f}")
    lines.append("")
    for op in ops:
        lines.append(f"ratios {op:<7} p50: zmq/ring {ratios[f'zmq/ring {op} p50']:5.2f}x   "
                     f"pipe/ring {ratios[f'pipe/ring {op} p50']:5.2f}x   "
                     f"(p99: zmq/ring {ratios[f'zmq/ring {op} p99']:.2f}x, "
                     f"pipe/ring {ratios[f'pipe/ring {op} p99']:.2f}x)")
    cl, ks, idle = r["client_lookup32"], r["client_key_status"], r["idle_cpu_percent"]
    lines += ["", "scheduler, % of each op's wall time: on a CPU / runnable but waiting for one"]
    for key, v in r["sched_percent"].items():
        lines.append(f"  {key:<12} server {v['server_cpu']:5.1f} / {v['server_runq_wait']:5.1f}"
                     f"   client {v['client_cpu']:5.1f} / {v['client_runq_wait']:5.1f}")
    lines += [
        "",
        f"msgspec encode+decode of a 32-key prepare_store and its reply: "
        f"{r['codec_store32_p50_us']:.2f} us p50",
        f"client-side lookup(32, all hits): {cl['keys_per_s']:,.0f} keys/s "
        f"(p50 {cl['p50_us']:.1f} us per call); keys not yet leased by this client: "
        f"{cl['unleased_keys_per_s']:,.0f} keys/s (p50 {cl['unleased_p50_us']:.1f} us)",
        f"client-side key_status(1 key): leased p50 {ks['p50_us']:.2f} us, p99 "
        f"{ks['p99_us']:.2f} us; fresh (lease taken) p50 {ks['fresh_p50_us']:.2f} us "
        f"(incl. ~{ks['clock_overhead_p50_us']:.2f} us timer overhead)",
        f"idle CPU over {idle['seconds']:.1f} s: owner {idle['owner']:.2f}%, "
        f"client {idle['client']:.2f}%",
        "",
        "targets:",
    ]
    t = r["targets"]
    ok = lambda b: "met" if b else "NOT met"  # noqa: E731
    t10 = t["ring_p50_10x_faster_than_zmq"]
    lines += [
        f"  ring p50 >= 10x faster than zmq: events {ok(t10['events'])}, "
        f"store {ok(t10['store'])}",
        f"  >= 1M client lookup keys/s: {ok(t['client_lookup_1M_keys_per_s'])}",
        f"  key_status p50 <= 0.5 us leased: {ok(t['key_status_leased_p50_le_0.5us'])}, "
        f"<= 1 us fresh: {ok(t['key_status_fresh_p50_le_1us'])}",
        f"  idle CPU < 1%: owner {ok(t['idle_cpu_lt_1pct']['owner'])}, "
        f"client {ok(t['idle_cpu_lt_1pct']['client'])}",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="tools/bench_ring.py", description=DESCRIPTION,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--iterations", type=int, default=3000,
                    help="measured round trips per transport and op (default: %(default)s; "
                         "the whole run then takes roughly 10-30 s)")
    ap.add_argument("--warmup", type=int, default=None,
                    help="warm-up iterations per transport and op (default: iterations/10, "
                         "at least 100)")
    ap.add_argument("--local-iterations", type=int, default=20_000,
                    help="calls of the client-side lookup and key_status (default: "
                         "%(default)s)")
    ap.add_argument("--idle-seconds", type=float, default=2.0,
                    help="how long the idle owner and client are watched (default: "
                         "%(default)s)")
    ap.add_argument("--num-blocks", type=int, default=None,
                    help="blocks per segment (default: room for every stored key, so no "
                         "eviction; smaller makes every server evict)")
    ap.add_argument("--ring-capacity", type=int, default=128 << 10,
                    help="ring data bytes (default: %(default)s, Segment.create's default)")
    ap.add_argument("--seed", type=int, default=0,
                    help="seed of the random keys (default: %(default)s)")
    ap.add_argument("--json", action="store_true",
                    help="print one JSON object with all figures, and nothing else, on stdout")
    args = ap.parse_args(argv)
    try:
        import zmq  # noqa: F401 - the zmq baseline's server process needs it too
    except ImportError:
        print("tools/bench_ring.py: error: the zmq baseline needs pyzmq: pip install -e "
              "'.[bench]'", file=sys.stderr)
        return 2
    if args.iterations < ROUNDS:
        ap.error(f"--iterations must be >= {ROUNDS}")
    if args.local_iterations < 5:
        ap.error("--local-iterations must be >= 5")
    warmup = args.warmup if args.warmup is not None else max(100, args.iterations // 10)
    log = (lambda s: print(s, file=sys.stderr, flush=True)) if not args.json else \
        (lambda s: None)
    result = run(args.iterations, warmup, args.local_iterations, args.idle_seconds,
                 args.num_blocks, args.ring_capacity, log, args.seed)
    if args.json:
        json.dump(result, sys.stdout)
        sys.stdout.write("\n")
    else:
        print(_table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
