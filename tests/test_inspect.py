"""kvshm-inspect against live segments (owner and clients in other processes), segments whose
every process was SIGKILLed, deliberately broken segments, and bad input.

Most clients are simulated, so that a test controls exactly what a slot shows: a child process
takes its slot's kernel lock, writes an ACTIVE slot record, holds, counters and formatted rings,
then waits on its stdin pipe; an "engine" child is a real client (``kvshm.connect``). The owner
is a LocalManager in another child process.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import stat
import struct
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path

import msgspec
import posix_ipc
import pytest

from kvshm.shm import layout as L
from kvshm.inspect import snapshot as S
from kvshm.inspect.cli import main
from kvshm.owner.stocking import grant_budget
from kvshm.inspect.schema import DOCUMENTS, Show, render_docs
from kvshm.shm.layout import Layout
from kvshm.owner.manager import LocalManager
from kvshm.shm.segment import Segment
from kvshm.shm.keyindex import KeyIndex
from kvshm.shm.table import BlockTable

from conftest import unique_name
from procs import _proc_state  # (the module's name is a fixture here)
from test_shared import wait_for

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT)}
LAYOUT = Layout((4096, 2048), 16, "tiny-test")

# --- the documented --json schema: the Structs of kvshm.inspect.schema (docs/inspect.md embeds
# their tables), checked strictly: exactly their keys, their types, the right schema tag ---------
SCHEMAS = DOCUMENTS


def check_schema(obj: object, doc: type) -> None:
    msgspec.convert(obj, doc, strict=True)  # raises ValidationError naming the path
    if doc is Show:  # free-form objects in the Struct whose keys are fixed all the same
        assert list(obj["counters"]) == list(S.COUNTERS)
        for c in obj["clients"]:
            assert set(c["counters"]) == set(L.SLOT_COUNTERS) and set(c["rings"]) == set(
                L.RING_NAMES)


# --- simulated processes -----------------------------------------------------------------
CHILD = textwrap.dedent("""
    import json, os, struct, sys, time
    from kvshm.shm import layout as L
    from kvshm.shm import locks
    from kvshm.shm.segment import Segment
    spec = json.loads(sys.argv[1])
    seg = Segment.attach(spec["name"])
    g, out = seg.geometry, {}
    if spec["role"] == "engine":  # a real client: connect() starts an owner process
        from kvshm.client.connect import connect
        mgr = connect(spec["name"])
        keys = [b"E%035d" % i for i in range(4)]
        mgr.prepare_store(keys); mgr.complete_store(keys)
        mgr.lookup(keys)  # leases all four
        mgr.prepare_load(keys[:1])  # turns one lease into a load pin
        mgr.prepare_store([b"F%035d" % i for i in range(2)])  # never completed
        out = {"slot": mgr.slot, "owner": seg.owner_record()[0]}
    elif spec["role"] == "owner":
        from kvshm.owner.manager import LocalManager
        mgr = LocalManager(seg, writer_alive=lambda s, gen: True)
        ready = [b"R%035d" % i for i in range(spec["ready"])]
        mgr.prepare_store(ready); mgr.complete_store(ready)
        for slot, gen, n in spec["writing"]:
            mgr.prepare_store([b"W%d-%033d" % (slot, i) for i in range(n)], writer=(slot, gen, 7))
        mgr.prepare_store([b"O%035d" % i for i in range(spec["local"])])
        mgr.prepare_load(ready[:spec["pins"]])
        out = {"ready": [mgr.block_of(k) for k in ready]}
    else:
        from kvshm.shm.ring import Ring
        i = spec["slot"]
        assert locks.try_lock(seg.fd, L.LOCK_CLIENT_BASE + i)
        from kvshm.shm.slots import gen_lock  # a client holds its generation's lock too
        assert locks.try_lock(seg.fd, gen_lock(i, spec["gen"]))
        o = g.slot_offset(i)
        holds = (spec["holds"] + [-1] * g.hold_capacity)[:g.hold_capacity]
        struct.pack_into(f"<{g.hold_capacity}i", seg.buf, o + g.hold_offset, *holds)
        struct.pack_into(f"<{len(L.SLOT_COUNTERS)}Q", seg.buf, o + L.SLOT_OFF_COUNTERS,
                         *[spec["counters"].get(n, 0) for n in L.SLOT_COUNTERS])
        for k in range(len(L.RING_NAMES)):
            r = o + g.rings_offset + k * g.ring_region
            Ring.format(seg.buf[r:r + g.ring_region], g.ring_capacity)
        Ring(seg.buf[o + g.rings_offset:o + g.rings_offset + g.ring_region]).try_put(b"x" * 100)
        L.SLOT.pack_into(seg.buf, o, L.SlotState.CLIENT, os.getpid(), spec["gen"], time.time_ns(),
                         spec["proc"].encode(), 0)
    print(json.dumps(out), flush=True)
    sys.stdin.read()
""")


class Procs:
    def __init__(self) -> None:
        self.children: list[subprocess.Popen] = []

    def start(self, **spec: object) -> tuple[subprocess.Popen, dict]:
        p = subprocess.Popen([sys.executable, "-c", CHILD, json.dumps(spec)], env=ENV,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.children.append(p)
        line = p.stdout.readline()
        assert line, f"child {spec} failed to start (rc {p.wait()})"
        return p, json.loads(line)

    def kill_all(self) -> None:
        for p in self.children:
            if p.poll() is None:
                p.send_signal(signal.SIGKILL)
            p.wait()


def create(name: str, blocks: int = 32) -> Segment:
    return Segment.create(name, LAYOUT, blocks, max_clients=4, ring_capacity=4096,
                          hold_capacity=16)


@pytest.fixture
def procs():
    p = Procs()
    yield p
    p.kill_all()


@pytest.fixture
def name():
    n = unique_name()
    yield n
    Segment.unlink(n)


def populate(procs: Procs, name: str) -> dict:
    """Owner child with 5 ready (1 pinned), 2 writing for client slot 0 gen 1, 1 of its own;
    client slot 0 (gen 1) pinning one ready block and leasing another; client slot 2 (gen 5)
    holding none."""
    create(name).close()
    owner, out = procs.start(role="owner", name=name, ready=5, writing=[[0, 1, 2]], local=1,
                             pins=1)
    ready = out["ready"]
    c0, _ = procs.start(role="client", name=name, slot=0, gen=1,
                        holds=[ready[1], L.lease_code(ready[2])],
                        proc="fake-engine", counters={"lookups": 10, "hits": 7, "bytes_out": 99})
    c2, _ = procs.start(role="client", name=name, slot=2, gen=5, holds=[], proc="other",
                        counters={"lookups": 5, "hits": 1})
    return {"owner": owner, "c0": c0, "c2": c2, "ready": ready}


@pytest.fixture(scope="module")
def live():
    procs, n = Procs(), unique_name()
    info = populate(procs, n)
    yield n, info
    procs.kill_all()
    Segment.unlink(n)


@pytest.fixture(scope="module")
def dead():
    procs, n = Procs(), unique_name()
    info = populate(procs, n)
    procs.kill_all()  # SIGKILL every process that used the segment
    yield n, info
    Segment.unlink(n)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def run_json(capsys, *argv: str) -> tuple[int, dict]:
    rc, out, err = run(capsys, *argv, "--json")
    data = json.loads(out)
    check_schema(data, SCHEMAS[argv[0]])
    assert data["schema"] == f"kvshm.{'show' if argv[0] == 'watch' else argv[0]}/1"
    return rc, data


def seg_bytes(name: str) -> bytes:
    return Path(f"/dev/shm/kvshm-{name}").read_bytes()


# --- live segment: owner and two clients in other processes ------------------------------
def test_ls_live(live, capsys):
    n, _ = live
    rc, out, _ = run(capsys, "ls")
    assert rc == 0 and re.search(
        rf"^{re.escape(n)}\s+\S+ MiB\s+8/32\s+2\s+alive\s+{L.FORMAT_VERSION}\s", out, re.M)
    rc, data = run_json(capsys, "ls")
    row = next(r for r in data["segments"] if r["name"] == n)
    assert (row["blocks_used"], row["clients_alive"], row["owner_alive"], row["error"]) == \
        (8, 2, True, None)


def test_show_live(live, capsys):
    n, info = live
    rc, out, _ = run(capsys, "show", n)
    assert rc == 0 and "fake-engine" in out and f"pid {info['owner'].pid}  alive" in out
    assert re.search(r"free 24\s+writing 3\s+ready 5\s+evicting 0\s+granted 0\s+claimed 0\s+pinned 2\s+"
                     r"leased 1", out)
    rc, s = run_json(capsys, "show", n)
    assert s["owner"]["alive"] and s["owner"]["pid"] == info["owner"].pid
    assert s["clients_alive"] == 2 and s["clients_dead"] == 0
    c0 = next(c for c in s["clients"] if c["slot"] == 0)
    assert (c0["pid"], c0["name"], c0["alive"], c0["holds"], c0["pins"], c0["leases"]) == \
        (info["c0"].pid, "fake-engine", True, 2, 1, 1)
    assert c0["rings"]["request"] == 104 and c0["rings"]["reply"] == 0
    assert (s["counters"]["lookups"], s["counters"]["hits"], s["counters"]["misses"]) == (15, 8, 7)
    assert s["counters"]["bytes_out"] == 99 and s["counters"]["store_blocks"] == 5
    assert (s["blocks"]["pinned"], s["blocks"]["leased"]) == (2, 1)
    assert s["geometry"]["num_blocks"] == 32 and s["header"]["policy"] == "lru"


def test_blocks_live(live, capsys):
    n, info = live
    rc, out, _ = run(capsys, "blocks", n)
    assert rc == 0 and "(8 of 8 blocks" in out and "slot 0 gen 1 req 7" in out
    _, d = run_json(capsys, "blocks", n, "--state", "writing")
    assert d["matching"] == 3 and {r["writer"] for r in d["rows"]} == {0, -1}
    _, d = run_json(capsys, "blocks", n, "--state", "pinned")
    assert sorted(r["block"] for r in d["rows"]) == sorted(info["ready"][:2])
    assert [r["pinned_by"] for r in d["rows"] if r["block"] == info["ready"][1]] == [[0]]
    _, d = run_json(capsys, "blocks", n, "--state", "leased")
    assert [(r["block"], r["leased_by"]) for r in d["rows"]] == [(info["ready"][2], [0])]
    out = run(capsys, "blocks", n, "--state", "ready")[1]
    assert re.search(rf"^{info['ready'][2]}\s+ready\s+52303030\S*\s+0\s+0:lease\s", out, re.M)
    assert re.search(rf"^{info['ready'][1]}\s+ready\s+\S+\s+0\s+0:pin\s", out, re.M)
    _, d = run_json(capsys, "blocks", n, "--state", "all", "--limit", "2")
    assert d["matching"] == 32 and len(d["rows"]) == 2
    assert bytes.fromhex(d["rows"][0]["key"]).startswith(b"R")


def test_verify_live_clean(live, capsys):
    n, _ = live
    assert run(capsys, "verify", n)[:2] == (0, f"{n}: ok, no violations\n")
    assert run_json(capsys, "verify", n) == (0, {"schema": "kvshm.verify/1", "name": n,
                                                 "ok": True, "violations": []})
    rc, out, _ = run(capsys, "--json", "verify", n)  # --json also goes before the command
    assert rc == 0 and json.loads(out)["ok"]


PROM_LINE = re.compile(r'^([a-z_]+)\{segment="[^"]+"(,[a-z_]+="[^"]*")*\} -?[0-9.e+-]+$')


def parse_metrics(text: str) -> dict[str, float]:
    typed, out = set(), {}
    for line in text.splitlines():
        if line.startswith("# HELP "):
            continue
        if line.startswith("# TYPE "):
            _, _, metric, kind = line.split()
            assert kind in ("gauge", "counter") and metric not in typed
            typed.add(metric)
            continue
        m = PROM_LINE.match(line)
        assert m and m.group(1) in typed, f"bad or untyped sample line {line!r}"
        out[line.rsplit(" ", 1)[0]] = float(line.rsplit(" ", 1)[1])
    return out


def test_metrics_live(live, capsys):
    n, _ = live
    rc, out, _ = run(capsys, "metrics", n)
    m = parse_metrics(out)
    seg = f'segment="{n}"'
    assert rc == 0 and m[f"kvshm_owner_up{{{seg}}}"] == 1 and m[f"kvshm_clients{{{seg}}}"] == 2
    assert m[f'kvshm_blocks{{{seg},state="ready"}}'] == 5
    assert m[f"kvshm_cache_usage_perc{{{seg}}}"] == 0.25
    assert m[f"kvshm_lookups_total{{{seg}}}"] == 15 and m[f"kvshm_hits_total{{{seg}}}"] == 8
    assert m[f"kvshm_store_bytes_total{{{seg}}}"] == 99  # bytes_out: what clients stored
    assert m[f'kvshm_ring_depth_bytes{{{seg},slot="0",ring="request"}}'] == 104
    for name in ("stores", "evictions", "store_bytes", "errors"):
        assert f"kvshm_{name}_total{{{seg}}}" in m
    assert "# TYPE kvshm_stores_total counter" in out
    rc, d = run_json(capsys, "metrics", n)  # the same samples as JSON
    assert rc == 0 and {
        s["metric"] + "{" + ",".join(f'{k}="{v}"' for k, v in s["labels"].items()) + "}":
        s["value"] for s in d["samples"]} == m


def test_watch_live(live, capsys):
    n, _ = live
    rc, out, _ = run(capsys, "watch", n, "--count", "2", "--interval", "0.05")
    assert rc == 0 and out.count("fake-engine") == 2 and "Ctrl-C" in out
    rc, out, _ = run(capsys, "watch", n, "--count", "2", "--interval", "0.05", "--json")
    lines = out.splitlines()
    assert rc == 0 and len(lines) == 2
    for line in lines:
        check_schema(json.loads(line), SCHEMAS["watch"])


def test_watch_stops_on_interrupt(live):
    n, _ = live
    p = subprocess.Popen([sys.executable, "-m", "kvshm.inspect.cli", "watch", n], env=ENV,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert "fake-engine" in "".join(p.stdout.readline() for _ in range(10))
    p.send_signal(signal.SIGINT)
    _, err = p.communicate(timeout=10)
    assert p.returncode == 0 and "Traceback" not in err


def test_gc_leaves_live_owner_alone(live, capsys):
    n, _ = live
    before = seg_bytes(n)
    rc, out, _ = run(capsys, "gc", n)
    assert rc == 0 and "is alive and reclaims dead clients itself" in out
    rc, d = run_json(capsys, "gc", n)
    assert rc == 0 and not d["acted"] and d["freed_blocks"] == 0
    assert seg_bytes(n)[:L.HEADER_BYTES] == before[:L.HEADER_BYTES]


def test_rm_refuses_live_then_force(procs, name, capsys):
    info = populate(procs, name)
    rc, out, err = run(capsys, "rm", name)
    assert rc == 1 and "refusing" in err and f"pid {info['c0'].pid}" in err and not out
    assert Path(f"/dev/shm/kvshm-{name}").exists()
    rc, d = run_json(capsys, "rm", name, "--force")
    assert rc == 0 and d["removed"] and d["forced"] and d["owner_alive"]
    assert {c["slot"] for c in d["live_clients"]} == {0, 2}
    assert not Path(f"/dev/shm/kvshm-{name}").exists()


# --- every process SIGKILLed -------------------------------------------------------------
def test_readers_never_write(dead, capsys):
    n, _ = dead
    before = seg_bytes(n)
    for argv in (["ls"], ["show", n], ["blocks", n], ["verify", n], ["metrics", n],
                 ["watch", n, "--count", "1"]):
        run(capsys, *argv)
        run(capsys, *argv, "--json")
    assert seg_bytes(n) == before


def test_dead_segment_views(dead, capsys):
    n, info = dead
    _, d = run_json(capsys, "ls")
    row = next(r for r in d["segments"] if r["name"] == n)
    assert (row["clients_alive"], row["owner_alive"], row["error"]) == (0, False, None)
    rc, out, _ = run(capsys, "show", n)
    assert rc == 0 and "DEAD" in out and "none alive (last: pid" in out
    _, s = run_json(capsys, "show", n)
    assert s["clients_alive"] == 0 and s["clients_dead"] == 2 and not s["owner"]["alive"]
    assert s["blocks"]["pinned"] == 1  # the dead owner's load pin; dead clients' holds don't pin
    assert s["blocks"]["leased"] == 0
    m = parse_metrics(run(capsys, "metrics", n)[1])
    assert m[f'kvshm_owner_up{{segment="{n}"}}'] == 0
    assert m[f'kvshm_clients_dead{{segment="{n}"}}'] == 2


def test_dead_segment_verify_lists_leaks(dead, capsys):
    n, info = dead
    rc, out, _ = run(capsys, "verify", n)
    assert rc == 1 and f"{n}: 4 violations" in out
    rc, d = run_json(capsys, "verify", n)
    v = "\n".join(d["violations"])
    assert rc == 1 and not d["ok"]
    assert f"client slot 0 (pid {info['c0'].pid}) is dead but still holds 2 blocks" in v
    assert v.count("is writing for client slot 0, which is dead") == 2
    assert "owner's own store, but no owner is alive" in v


def test_gc_reclaims_dead_then_rm(procs, name, capsys):
    info = populate(procs, name)
    procs.kill_all()
    rc, out, _ = run(capsys, "gc", name)
    assert rc == 0 and "freed 3 unfinished blocks, kept 5 ready" in out
    assert f"slot 0 pid {info['c0'].pid} 'fake-engine': 2 holds released" in out
    assert run(capsys, "verify", name)[0] == 0
    _, s = run_json(capsys, "show", name)
    assert s["clients"] == [] and s["blocks"]["ready"] == 5 and s["blocks"]["writing"] == 0
    assert s["counters"]["reclaimed_clients"] == 2 and s["counters"]["reclaimed_blocks"] == 3
    rc, d = run_json(capsys, "gc", name)  # nothing left to do, still acts
    assert rc == 0 and d["acted"] and d["freed_blocks"] == 0 and d["reclaimed_clients"] == []
    rc, out, _ = run(capsys, "rm", name)
    assert rc == 0 and out == f"removed {name}\n"


def test_gc_keeps_live_writers(procs, name, capsys):
    info = populate(procs, name)
    info["owner"].send_signal(signal.SIGKILL)
    info["owner"].wait()
    rc, d = run_json(capsys, "gc", name)
    assert rc == 0 and d["acted"] and d["reclaimed_clients"] == []
    assert (d["freed_blocks"], d["kept_ready"], d["kept_pending"]) == (1, 5, 2)
    assert run(capsys, "verify", name)[0] == 0


# --- deliberately broken segments ----------------------------------------------------------
def _break(kind: str, seg: Segment, mgr: LocalManager, procs: Procs, name: str) -> str:
    t, g = BlockTable(seg.buf, seg.geometry), seg.geometry
    idx = KeyIndex(seg.buf, g, t)
    k = b"K" * 36
    free = next(b for b in range(g.num_blocks) if t.read(b).state == L.FREE)
    if kind == "unindexed":
        t.write(free, L.READY, b"Z" * 36)
        return f"block {free} (ready, key {(b'Z' * 36).hex()[:16]}) is not reachable"
    if kind == "index_to_free":
        idx.insert(b"Y" * 36, free)
        return f"points to block {free}, which is free"
    if kind == "duplicate":
        t.write(free, L.READY, k)
        idx.insert(k, free)
        return f"both hold key {k.hex()[:16]}"
    if kind == "pinned_writing":
        b = mgr.prepare_store([b"P" * 36]).block_ids[0]
        t.set_pins(b, 2)
        return f"block {b} is writing with 2 pins"
    if kind == "live_pin_on_free":
        procs.start(role="client", name=name, slot=1, gen=1, holds=[free], proc="x", counters={})
        return f"has a load pin on block {free}, which is free"
    if kind == "dead_lease":
        p, _ = procs.start(role="client", name=name, slot=1, gen=1, holds=[L.lease_code(0)],
                           proc="x", counters={})
        p.kill()
        p.wait()
        return f"client slot 1 (pid {p.pid}) is dead but still holds 1 blocks (0)"
    if kind == "bad_tag":
        j = next(j for j in range(g.index_slots)
                 if L.INDEX_SLOT.unpack_from(seg.buf, g.index_offset + 8 * j)[1] >= 0)
        tag, b = L.INDEX_SLOT.unpack_from(seg.buf, g.index_offset + 8 * j)
        L.INDEX_SLOT.pack_into(seg.buf, g.index_offset + 8 * j, tag ^ 1, b)
        return f"index slot {j} has tag {tag ^ 1:#010x}"
    if kind == "header":
        struct.pack_into("<I", seg.buf, struct.calcsize("<8sIIQQQ"), 99)  # tokens_per_block
        return "tokens_per_block is 99"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["unindexed", "index_to_free", "duplicate", "pinned_writing",
                                  "live_pin_on_free", "dead_lease", "bad_tag", "header"])
def test_verify_catches_broken_table(kind, procs, name, capsys):
    seg = create(name)
    mgr = LocalManager(seg)
    keys = [b"K" * 36, b"L" * 36]
    mgr.prepare_store(keys)
    mgr.complete_store(keys)
    assert run(capsys, "verify", name)[0] == 0
    expect = _break(kind, seg, mgr, procs, name)
    rc, out, err = run(capsys, "verify", name)
    if kind == "header":  # attach itself refuses a damaged header, naming the field
        assert rc != 0 and expect in err and f"kvshm-inspect rm {name}" in err, err
        return
    assert rc == 1 and expect in out, out
    rc, d = run_json(capsys, "verify", name)
    assert rc == 1 and any(expect in v for v in d["violations"])
    mgr.shutdown()
    seg.close()


def test_lease_on_a_free_block_is_no_violation(procs, name, capsys):
    """A client's own store may evict what it leased: only load pins must stay on ready blocks."""
    create(name).close()
    procs.start(role="client", name=name, slot=1, gen=1, holds=[L.lease_code(3)], proc="x",
                counters={})
    assert run(capsys, "verify", name)[0] == 0


def test_real_clients_live_then_killed(procs, name, capsys):
    """A real kvshm client (which starts a real owner process): live, then everything killed."""
    create(name).close()
    engine, info = procs.start(role="engine", name=name)
    owner = info["owner"]
    try:
        _, s = run_json(capsys, "show", name)
        c = next(c for c in s["clients"] if c["slot"] == info["slot"])
        assert c["alive"] and (c["pins"], c["leases"]) == (1, 3) and s["owner"]["pid"] == owner
        assert (s["blocks"]["ready"], s["blocks"]["pinned"]) == (4, 1)
        assert run(capsys, "verify", name)[0] == 0
        os.kill(owner, signal.SIGSTOP)  # so that it cannot reclaim before it dies, nor
        wait_for(lambda: _proc_state(owner) == "T", "the owner to stop")  # refill grants
        _, s = run_json(capsys, "show", name)
        c = next(c for c in s["clients"] if c["slot"] == info["slot"])
        # its 2 unfinished stores are WRITING (a round trip) or in its granted blocks, with
        # up to the grant budget's blocks it has not taken yet (its grants grow with its stores)
        unfinished = s["blocks"]["writing"] + c["granted"]
        assert c["stores_pending"] == s["blocks"]["writing"]
        with Segment.attach(name) as seg:
            assert 2 <= unfinished <= 2 + grant_budget(seg.geometry)
        engine.kill()
        engine.wait()
        os.kill(owner, signal.SIGKILL)
        with Segment.attach(name) as seg:
            deadline = time.monotonic() + 10
            while seg.owner_alive() and time.monotonic() < deadline:
                time.sleep(0.01)  # polling the kernel's release of the dead owner's lock
        rc, d = run_json(capsys, "verify", name)
        v = "\n".join(d["violations"])
        assert rc == 1 and f"client slot {info['slot']} (pid {engine.pid}) is dead but still " \
            "holds 4 blocks" in v and v.count("which is dead (leaked") == unfinished
        rc, d = run_json(capsys, "gc", name)
        assert (d["freed_blocks"], d["kept_ready"]) == (unfinished, 4)
        assert [(r["slot"], r["holds"]) for r in d["reclaimed_clients"]] == [(info["slot"], 4)]
        assert run(capsys, "verify", name)[0] == 0
    finally:
        try:
            os.kill(owner, signal.SIGKILL)
        except ProcessLookupError:
            pass


@pytest.mark.unit
def test_torn_entry_reported_and_repaired_by_gc(name, capsys):
    seg = create(name)
    mgr = LocalManager(seg)
    mgr.prepare_store([b"T" * 36])
    mgr.complete_store([b"T" * 36])
    mgr.shutdown()
    off = seg.geometry.entry_offset(0)
    struct.pack_into("<I", seg.buf, off, struct.unpack_from("<I", seg.buf, off)[0] + 1)
    seg.close()  # the "owner" died in the middle of rewriting entry 0
    rc, out, _ = run(capsys, "verify", name)
    assert rc == 1 and "block 0: entry left mid-rewrite" in out
    assert run(capsys, "gc", name)[0] == 0
    assert run(capsys, "verify", name)[0] == 0


# --- what processes wrote reaches an operator's terminal escaped ----------------------------
# Terminal control: clear the screen, retitle the window, colour, reorder the line (U+202E).
EVIL = "\x1b[2J\x1b]0;pwned\x07\x1b[31mROOT\u202e"
EVIL_SHOWN = r"\x1b[2J\x1b]0;pwned\x07\x1b[31mROOT\u202e"


def assert_printable(text: str) -> None:
    bad = sorted({c for c in text if not c.isprintable() and c != "\n"})
    assert not bad, f"raw {bad} in the text output"


@pytest.mark.parametrize("argv", [("show",), ("watch", "--count", "1")])
def test_text_output_escapes_what_a_client_wrote_in_its_name(procs, name, argv):
    create(name).close()
    procs.start(role="client", name=name, slot=1, gen=1, holds=[], proc=EVIL, counters={})
    p = cli(argv[0], name, *argv[1:])
    assert p.returncode == 0, p.stderr
    assert_printable(p.stdout)
    assert EVIL_SHOWN in p.stdout


def test_json_output_keeps_what_a_client_wrote_in_its_name_exact(procs, name):
    create(name).close()
    procs.start(role="client", name=name, slot=1, gen=1, holds=[], proc=EVIL, counters={})
    p = cli("show", name, "--json")
    assert p.returncode == 0, p.stderr
    assert [c["name"] for c in json.loads(p.stdout)["clients"]] == [EVIL]


def test_show_escapes_what_a_creator_wrote_as_the_model(name):
    Segment.create(name, Layout((4096, 2048), 16, EVIL), 32, max_clients=4,
                   ring_capacity=4096, hold_capacity=16).close()
    p = cli("show", name)
    assert p.returncode == 0, p.stderr
    assert_printable(p.stdout)
    assert f"model {EVIL_SHOWN}" in p.stdout


def test_show_prints_no_line_break_a_creator_wrote_in_the_model(name):
    # Lines were escaped one by one after being joined: a line break inside the model
    # started a line of the creator's own, a forged client row.
    forged = "  99     4242  root-shell  yes"
    Segment.create(name, Layout((4096, 2048), 16, "llama\n" + forged), 32, max_clients=4,
                   ring_capacity=4096, hold_capacity=16).close()
    p = cli("show", name)
    assert p.returncode == 0, p.stderr
    assert forged not in p.stdout.splitlines()
    assert "model llama\\n" + forged in p.stdout


def test_show_keeps_its_columns_for_wide_and_combining_characters(procs, name):
    create(name).close()
    wide, combining = "\uff37\uff29\uff24\uff25.py", "e\u0301\u0301\u0301.py"
    for slot, proc in enumerate((wide, combining, "plain.py")):
        procs.start(role="client", name=name, slot=slot, gen=1, holds=[], proc=proc,
                    counters={})
    p = cli("show", name)
    assert p.returncode == 0, p.stderr
    rows = [line for line in p.stdout.splitlines() if line.endswith(".py") or ".py " in line]
    cols = {_display_col(r, " yes ") for r in rows}
    assert len(rows) == 3 and len(cols) == 1, rows  # ALIVE lines up on a terminal


def _display_col(line: str, needle: str) -> int:
    """The terminal column at which ``needle`` starts in ``line``."""
    import unicodedata
    head = line[:line.index(needle)]
    return sum(0 if unicodedata.combining(c) else
               2 if unicodedata.east_asian_width(c) in "WF" else 1 for c in head)


def test_ls_escapes_what_another_process_named_an_object():
    path = Path(f"/dev/shm/kvshm-{unique_name()}{EVIL}")
    path.write_bytes(b"")
    try:
        p = cli("ls")
        assert p.returncode == 0, p.stderr
        assert_printable(p.stdout)
        assert f"{path.name[len('kvshm-'):-len(EVIL)]}{EVIL_SHOWN}" in p.stdout
    finally:
        path.unlink(missing_ok=True)


# --- bad input -----------------------------------------------------------------------------
def assert_one_line_error(rc: int, out: str, err: str, *needles: str) -> None:
    assert rc == 2 and not out and "Traceback" not in err
    assert err.count("\n") == 1 and err.startswith("kvshm-inspect: error: "), err
    for needle in needles:
        assert needle in err, err


def cli(*argv: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*prefix, sys.executable, "-m", "kvshm.inspect.cli", *argv], env=ENV,
                          capture_output=True, text=True, timeout=60)


def test_unknown_and_invalid_names(capsys):
    for cmd in ("show", "blocks", "verify", "metrics", "watch", "gc", "rm"):
        assert_one_line_error(*run(capsys, cmd, "no-such-seg-" + uuid.uuid4().hex),
                              "no kvshm segment named")
    assert_one_line_error(*run(capsys, "show", "../etc"), "segment names are")
    p = cli("show", "no-such-seg-x")
    assert_one_line_error(p.returncode, p.stdout, p.stderr, "no kvshm segment named")


@pytest.mark.unit
def test_foreign_object(name, capsys):
    shm = posix_ipc.SharedMemory(f"/kvshm-{name}", posix_ipc.O_CREX, size=8192)
    os.pwrite(shm.fd, b"not a kvshm header" * 100, 0)
    shm.close_fd()
    for cmd in ("show", "blocks", "verify", "metrics", "gc"):
        assert_one_line_error(*run(capsys, cmd, name), "is not a kvshm segment")
    rc, d = run_json(capsys, "ls")
    row = next(r for r in d["segments"] if r["name"] == name)
    assert rc == 0 and row["size_bytes"] == 8192 and "not a kvshm segment" in row["error"]
    rc, out, _ = run(capsys, "ls")
    assert rc == 0 and re.search(rf"^{re.escape(name)}\s+8.0 KiB\s+-.*not a kvshm", out, re.M)
    assert run(capsys, "rm", name)[:2] == (0, f"removed {name}\n")


@pytest.mark.parametrize("argv", [("ls",), ("show",), ("blocks",), ("verify",), ("metrics",),
                                  ("watch", "--count", "1")])
def test_read_commands_remove_a_dead_creators_leftover_and_say_so(name, argv):
    """What docs/inspect.md promises the read commands may remove: an object with no header
    (zero where the magic goes) whose creation lock nobody holds, as every attacher does."""
    path = Path(f"/dev/shm/kvshm-{name}")
    path.write_bytes(bytes(4096))
    p = cli(*argv[:1], *([] if argv == ("ls",) else [name]), *argv[1:])
    assert "a creator died half-way; its leftover was removed" in p.stdout + p.stderr
    assert not path.exists()


@pytest.mark.unit
def test_rm_of_a_removed_segment_removes_what_a_killed_process_left(name, capsys):
    # A process killed between opening a doorbell and seeing its segment removed leaves it:
    # no segment has the name any more, and rm still finds it.
    seg = create(name)
    posix_ipc.Semaphore(seg.object_name("c3-reply"), posix_ipc.O_CREX).close()
    seg.close()
    posix_ipc.unlink_shared_memory(f"/kvshm-{name}")  # as the remover had, before the bell
    rc, d = run_json(capsys, "rm", name)
    assert rc == 0 and not d["removed"] and d["leftovers"] == [f"sem.kvshm-{name}@{seg.tag}-c3-reply"]
    assert [e for e in os.listdir("/dev/shm") if name in e] == []


def test_unsupported_format_version(name, capsys):
    create(name).close()
    with open(f"/dev/shm/kvshm-{name}", "r+b") as f:
        f.seek(8)
        f.write(struct.pack("<I", 99))
    assert_one_line_error(*run(capsys, "show", name), "format version 99")
    _, d = run_json(capsys, "ls")
    row = next(r for r in d["segments"] if r["name"] == name)
    assert row["format_version"] == 99 and "format version 99" in row["error"]
    p = cli("verify", name)
    assert_one_line_error(p.returncode, p.stdout, p.stderr, "format version 99")
    assert run(capsys, "rm", name)[0] == 0


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"),
                    reason="needs root to drop the capability that bypasses file modes")
def test_no_permission(name):
    Segment.create(name, LAYOUT, 8, mode=0o000, max_clients=2, ring_capacity=4096,
                   hold_capacity=16).close()
    nocaps = ("setpriv", "--inh-caps=-all", "--bounding-set=-all")
    p = cli("show", name, prefix=nocaps)
    assert_one_line_error(p.returncode, p.stdout, p.stderr, "permission denied")
    p = cli("ls", "--json", prefix=nocaps)
    row = next(r for r in json.loads(p.stdout)["segments"] if r["name"] == name)
    assert p.returncode == 0 and "permission denied" in row["error"]


def _rm_as_nobody(name: str) -> tuple[int, str, str]:
    import contextlib
    import io
    os.setgid(65534)
    os.setuid(65534)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(["rm", name, "--json"])
    return rc, out.getvalue(), err.getvalue()


@pytest.mark.skipif(os.geteuid() != 0 or not os.stat("/dev/shm").st_mode & stat.S_ISVTX,
                    reason="needs root to run rm as another user, and a sticky /dev/shm")
def test_rm_names_the_objects_of_another_user_it_may_not_remove(name):
    # The segment is nobody's, one of its doorbells root's, and the sticky /dev/shm lets
    # only root remove that one: rm run by nobody removes the segment, says what stays and
    # whose, and exits 1.
    from multiprocessing import get_context
    seg = create(name)
    posix_ipc.Semaphore(seg.object_name("owner"), posix_ipc.O_CREX).close()
    bell = f"sem.kvshm-{name}@{seg.tag}-owner"
    seg.close()
    os.chown(f"/dev/shm/kvshm-{name}", 65534, 65534)
    with get_context("spawn").Pool(1) as pool:
        rc, out, err = pool.apply(_rm_as_nobody, (name,))
    d = json.loads(out)
    assert rc == 1 and d["removed"] and d["refused"] == [bell], err
    assert f"{bell} (uid 0)" in err and "as that user or as root" in err
    assert not os.path.exists(f"/dev/shm/kvshm-{name}") and os.path.exists(f"/dev/shm/{bell}")


@pytest.mark.unit
def test_usage_errors_and_help(capsys):
    assert run(capsys, "frobnicate")[0] == 2
    assert run(capsys)[0] == 2
    for cmd in ("ls", "show", "blocks", "verify", "metrics", "watch", "gc", "rm"):
        rc, out, _ = run(capsys, cmd, "--help")
        assert rc == 0 and "example: kvshm-inspect " + cmd in out


# --- process-level promises -----------------------------------------------------------------
def test_subprocess_json_without_torch(live):
    n, _ = live
    p = cli("show", n, "--json")
    assert p.returncode == 0
    check_schema(json.loads(p.stdout), SCHEMAS["show"])
    script = ("import sys; from kvshm.inspect.cli import main\n"
              f"for a in (['ls'], ['show', {n!r}], ['blocks', {n!r}], ['verify', {n!r}], "
              f"['metrics', {n!r}], ['gc', {n!r}]):\n    main(a)\n"
              "import kvshm.owner.manager  # what gc imports when it acts\n"
              "assert 'torch' not in sys.modules, 'torch imported'\n"
              "print('NO-TORCH')")
    p = subprocess.run([sys.executable, "-c", script], env=ENV, capture_output=True, text=True)
    assert p.returncode == 0 and p.stdout.endswith("NO-TORCH\n"), p.stderr


def test_starts_fast():
    """Start-up is CPU work; count the child's CPU seconds so a busy machine cannot fail it."""
    import resource

    def cpu() -> float:
        r = resource.getrusage(resource.RUSAGE_CHILDREN)
        return r.ru_utime + r.ru_stime

    best = float("inf")
    for _ in range(3):
        t = cpu()
        assert cli("--help").returncode == 0
        best = min(best, cpu() - t)
    assert best < 0.8, f"kvshm-inspect --help took {best:.2f} CPU seconds"


@pytest.mark.unit
def test_docs_name_every_header_counter():
    doc = (ROOT / "docs" / "inspect.md").read_text()
    para = doc[doc.index("The `show` document's `counters`"):doc.index("## Metrics")]
    missing = [n for n in L.COUNTER_NAMES if not n.startswith("gone_") and f"`{n}`" not in para]
    assert not missing, f"docs/inspect.md's counter list lacks {missing}"


@pytest.mark.unit
def test_docs_embed_the_generated_schema():
    doc = (ROOT / "docs" / "inspect.md").read_text()
    begin = doc.index("<!-- BEGIN schema tables")
    body = doc[doc.index("\n", begin) + 1:doc.index("<!-- END schema tables -->")]
    assert body == render_docs(), "docs/inspect.md is stale: python -m kvshm.inspect.schema"
    for cmd, doc_type in DOCUMENTS.items():
        if cmd != "watch":
            assert f"kvshm.{cmd}/1" in msgspec.json.encode(msgspec.json.schema(doc_type)).decode()


# --- gc preempted right after it gave the owner lock back ----------------------------------
# gc leaves the dead owner's pid in the owner record (the next real owner counts that death).
# Written after the unlock, it overwrote the record of an owner a client started meanwhile. A
# SIGSTOP right after the unlock stands for any scheduler delay there.
_GC_PREEMPTED = """
import os, signal, sys
from kvshm.shm import layout as L, locks
unlock = locks.unlock
def preempted(fd, byte):
    unlock(fd, byte)
    if byte == L.LOCK_OWNER:
        os.kill(os.getpid(), signal.SIGSTOP)  # preempted right after it gave the lock back
locks.unlock = preempted
from kvshm.inspect.cli import main
sys.exit(main(["gc", sys.argv[1]]))
"""


def _gc_preempted_while_an_owner_starts(name: str, **connect_kw):
    """O1 dies; gc runs, stops right after its unlock; a client connects (starting O2); gc
    goes on. Returns (first client, second client, O2's record, pids to kill)."""
    from kvshm.client.connect import connect
    from conftest import TEST_LAYOUT
    Segment.create(name, TEST_LAYOUT, 4, max_clients=4, ring_capacity=8192).close()
    seg = Segment.attach(name)
    m1 = connect(name)
    o1 = seg.owner_record().pid
    os.kill(o1, signal.SIGKILL)
    wait_for(lambda: not seg.owner_alive(), "the owner to die")
    gc = subprocess.Popen([sys.executable, "-c", _GC_PREEMPTED, name], env=ENV,
                          stdout=subprocess.DEVNULL)
    try:
        wait_for(lambda: _proc_state(gc.pid) == "T", "gc to stop after its unlock", 30)
        m2 = connect(name, **connect_kw)  # starts O2 (gc gave the lock back)
        os.environ.pop("KVSHM_CRASH_AT", None)
        o2 = seg.owner_record()
        os.kill(gc.pid, signal.SIGCONT)
        assert gc.wait() == 0
    finally:
        gc.kill()
        gc.wait()
    return seg, m1, m2, o2, {o1, o2.pid}


def _leave(seg: Segment, clients, pids: set[int]) -> None:
    """The clients leave, every owner of the test is stopped, the segment closed."""
    from conftest import stop_owner
    pids.add(seg.owner_record().pid)
    for m in clients:
        m.shutdown()
    for p in pids:
        stop_owner(p)
    seg.close()


def test_gc_preempted_after_its_unlock_leaves_the_next_owners_record_alone(name):
    seg, m1, m2, o2, pids = _gc_preempted_while_an_owner_starts(name)
    try:
        assert seg.owner_alive()
        # the record of the live owner, not that of the owner that died before gc
        assert seg.owner_record()[:2] == o2[:2]
        os.kill(o2.pid, signal.SIGKILL)
        wait_for(lambda: not seg.owner_alive(), "O2 to die")
        from kvshm.client.connect import connect
        m3 = connect(name)  # starts O3
        pids.add(seg.owner_record().pid)
        # consecutive owners never share an epoch (records.next_epoch)
        assert seg.owner_record().epoch != o2.epoch
        m3.shutdown()
    finally:
        _leave(seg, (m1, m2), pids)


def test_gc_preempted_after_its_unlock_costs_no_client_a_failover(name):
    """The owner after O2 took O2's epoch, so a client misses that failover: it keeps the
    lease of a key the dead O2 evicted for its own store (a replay cannot list evictions) and
    lookup() says hit for a key that is gone."""
    from procs import fill
    # O2 dies after executing its 4th frame: Hello, PrepareStore, CompleteStore, PrepareStore
    os.environ["KVSHM_CRASH_AT"] = "owner.request.after_execute:4"
    try:
        seg, m1, m2, o2, pids = _gc_preempted_while_an_owner_starts(name, grants=False)
    finally:
        os.environ.pop("KVSHM_CRASH_AT", None)
    try:
        keys = [b"K%d" % i for i in range(4)]  # fill the 4 blocks, lease them all
        out = m2.prepare_store(keys)
        for k, b in zip(out.keys_to_store, out.block_ids):
            fill(m2.segment.planes(), b, k)
        m2.complete_store(out.keys_to_store)
        assert m2.lookup(keys) == 4
        m2.prepare_store([b"N0"])  # evicts K0 (our own lease); O2 dies, O3 replays
        pids.add(seg.owner_record().pid)
        assert seg.owner_record().pid != o2.pid
        assert m2.lookup([b"K0"]) == 0  # evicted: a miss, not a lease kept across the failover
    finally:
        _leave(seg, (m1, m2), pids)


def test_rm_names_no_pid_for_a_client_still_taking_its_slot(name):
    """A client that holds a slot's lock but has not written its record yet is in use, and
    rm refuses; its pid is not known yet, and rm must not name pid 0 (``kill 0`` would signal
    the operator's own process group)."""
    Segment.create(name, LAYOUT, 8, max_clients=4, ring_capacity=8192).close()
    env = {**ENV, "KVSHM_CRASH_AT": "client.slot.after_lock", "KVSHM_CRASH_SIGNAL": "STOP"}
    c = subprocess.Popen([sys.executable, "-c", "import sys; from kvshm.client.connect import "
                          "connect; connect(sys.argv[1]).shutdown()", name], env=env)
    try:
        wait_for(lambda: _proc_state(c.pid) == "T", "the client to stop holding a slot lock")
        p = cli("rm", name, "--wait", "0")
        assert p.returncode == 1 and "refusing" in p.stderr, p.stderr
        assert "pid 0" not in p.stderr and "slot 0 (pid not yet known)" in p.stderr, p.stderr
    finally:
        c.kill()
        c.wait()
        Segment.unlink(name)
