"""The lower tier against a real mooncake_master (no fakes): two hosts, one master.

Each "host" is a segment with its own owner and its own ``kvshm mover`` process; the master
runs on free loopback ports and is killed at teardown. Engines are TieredManagers in this
process. Skips (saying why) when the ``kvshm[mooncake]`` extra or libibverbs1 is missing.
No sleeps: every wait polls a condition with a deadline.
"""
from __future__ import annotations

import os
import signal
import shutil
import socket
import subprocess
import sys

import pytest

from kvshm.client.connect import connect
from kvshm.inspect.snapshot import tier_snapshot
from kvshm.shm.wait import poll_until
from kvshm.tier.client import TieredManager

from conftest import stop_owner, unique_name
from procs import check, store

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _why_no_mooncake() -> str | None:
    from kvshm.tier.mooncake import master_binary
    p = subprocess.run([sys.executable, "-c", "import mooncake.store"], capture_output=True,
                       text=True)
    if p.returncode:
        return ("Mooncake is not usable (pip install 'kvshm[mooncake]'; apt-get install "
                "libibverbs1): " + (p.stderr.strip().splitlines() or ["?"])[-1])
    if master_binary() is None:
        return "mooncake_master is not on PATH (pip install 'kvshm[mooncake]')"
    return None


WHY = _why_no_mooncake()
pytestmark = pytest.mark.skipif(WHY is not None, reason=WHY or "")


@pytest.fixture
def master(tmp_path):
    from kvshm.tier.mooncake import start_master
    started = []

    def start(ports=None):
        m = start_master(log_path=str(tmp_path / "master.log"), ports=ports)
        started.append(m)
        return m

    yield start
    for m in started:
        m.stop()


class Host:
    """A segment, its mover process and one engine (a TieredManager) on it."""

    def __init__(self, seg, master, log_path):
        self.seg, self.master, self.log_path = seg, master, log_path
        self.proc: subprocess.Popen | None = None
        self.eng: TieredManager | None = None

    def start(self) -> "Host":
        self.start_mover()
        self.eng = TieredManager(connect(self.seg.name), max_wait=30.0)
        return self

    def start_mover(self, crash_at: str | None = None) -> None:
        env = {**os.environ, "PYTHONPATH": ROOT}
        if crash_at:
            env["KVSHM_CRASH_AT"] = crash_at
        cmd = self.master.mover_command(self.seg.name, "--global-segment", "64M",
                                        "--local-buffer", "16M", "--log-level", "INFO")
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        # This mover's state: a mover killed before left its own "connected" behind.
        assert poll_until(lambda: (self.tier()["state"] == "connected" and
                                   self.tier()["mover_pid"] == self.proc.pid) or
                          self.proc.poll() is not None, 90), self.log()
        assert self.proc.poll() is None, self.log()

    def tier(self) -> dict:
        return tier_snapshot(self.seg) or {"state": "none", "counters": {}}

    def count(self, name: str) -> int:
        return self.tier()["counters"].get(name, 0)

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()[-4000:]

    def kill_mover(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        if self.proc:
            self.proc.wait()

    def lookup_settled(self, keys: list[bytes], timeout: float = 120) -> int:
        """Look up until the answer is a number (None = "not yet", a fetch in flight)."""
        out = []
        assert poll_until(lambda: out.append(self.eng.lookup(keys)) or out[-1] is not None,
                          timeout), f"still 'not yet' after {timeout}s\n{self.log()}"
        return out[-1]

    def verify(self, keys: list[bytes]) -> None:
        blocks = self.eng.prepare_load(keys)
        try:
            planes = self.eng.segment.planes()
            assert all(check(planes, b, k) for b, k in zip(blocks, keys))
        finally:
            self.eng.complete_load(keys)

    def close(self) -> None:
        if self.eng is not None:
            self.eng.shutdown()
        self.kill_mover()
        pid = self.seg.owner_record()[0]
        if pid:
            stop_owner(pid)


@pytest.fixture
def hosts(make_segment, tmp_path):
    made: list[Host] = []

    def host(master) -> Host:
        seg = make_segment(unique_name(), num_blocks=64)
        h = Host(seg, master, str(tmp_path / f"mover-{len(made)}.log"))
        made.append(h)  # cleaned up even when its mover fails to start
        return h.start()

    yield host
    for h in made:
        h.close()


def keys_of(tag: str, n: int = 8) -> list[bytes]:
    return [f"{tag}-{i:03d}".encode() for i in range(n)]


def write_through_fresh(h: Host, tag: str, timeout: float = 180) -> list[bytes]:
    """Store fresh prefixes on ``h`` until one is written through whole; return its keys.
    (A store is dropped while the mover backs off, and puts fail while the master still lists
    a dead client's share or has no share mounted yet: each failure is seen in a counter, and
    after one the next prefix waits until the mover reports its tier answering again.)"""
    import time
    deadline = time.monotonic() + timeout
    attempt = 0
    while time.monotonic() < deadline:
        attempt += 1
        keys = keys_of(f"{tag}{attempt}")
        base, bad = h.count("puts"), h.count("put_dropped") + h.count("put_failed") + \
            h.count("put_refused_space")
        store(h.eng, keys)
        assert poll_until(lambda: h.count("puts") >= base + len(keys) or
                          h.count("put_dropped") + h.count("put_failed") +
                          h.count("put_refused_space") > bad, 60), h.log()
        if h.count("puts") >= base + len(keys):
            return keys
        assert poll_until(lambda: h.tier()["state"] == "connected", 60), h.log()
    raise AssertionError("no prefix was written through\n" + h.log())


def spilled(h: Host, n: int) -> None:
    assert poll_until(lambda: h.count("puts") >= n, 60), h.log()


def two_hosts_sharing(master, hosts, tag: str):
    """A fresh master, two hosts on it, and keys stored on host 1 and written through."""
    m = master()
    h1, h2 = hosts(m), hosts(m)
    keys = keys_of(tag)
    store(h1.eng, keys)
    spilled(h1, len(keys))
    return m, h1, h2, keys


def test_a_prefix_stored_on_host_1_is_a_hit_on_host_2(master, hosts):
    m = master()
    h1, h2 = hosts(m), hosts(m)
    keys = keys_of("shared")
    assert store(h1.eng, keys) == keys
    spilled(h1, len(keys))
    assert h2.lookup_settled(keys) == len(keys)
    h2.verify(keys)
    assert h2.count("gets") == len(keys) and h2.count("get_rejected") == 0
    # absent everywhere: one "not yet", then a plain miss
    assert h2.lookup_settled(keys_of("nowhere")) == 0
    assert h2.count("get_misses") >= 1


def test_master_killed_and_restarted_mid_run(master, hosts):
    m, h1, h2, before = two_hosts_sharing(master, hosts, "before")
    m.stop()
    # Master down: lookups on host 2 settle as misses (never an error), spills are dropped.
    assert h2.lookup_settled(before) == 0
    during = keys_of("during")
    store(h1.eng, during)
    assert poll_until(lambda: h1.count("put_dropped") + h1.count("put_failed") > 0, 120), \
        h1.log()
    m2 = master(ports=(m.rpc_port, m.metadata_port, m.metrics_port))
    for h in (h1, h2):  # each mover's probe finds the master back, with no traffic
        assert poll_until(lambda: h.tier()["state"] == "connected", 120), h.log()
    # Back by itself: new stores are written through again and hit on host 2.
    after = write_through_fresh(h1, "after")
    assert h2.lookup_settled(after) == len(after)
    h2.verify(after)
    assert h2.tier()["state"] == "connected"
    del m2


def test_host_1_mover_killed(master, hosts):
    _, h1, h2, keys = two_hosts_sharing(master, hosts, "orphan")
    h1.kill_mover()
    # Host 1's share of the pool is gone with its mover: host 2 gets a miss or (while the
    # master still lists the share) a verified hit; never an error, never wrong bytes.
    hits = h2.lookup_settled(keys)
    if hits:
        h2.verify(keys[:hits])
    # Host 1 keeps working without its mover, and a new one picks up where it left off.
    assert store(h1.eng, keys_of("local")) == keys_of("local")
    assert h1.eng.lookup(keys_of("local")) == len(keys)
    h1.start_mover()
    fresh = write_through_fresh(h1, "fresh")
    assert h2.lookup_settled(fresh) == len(fresh)
    h2.verify(fresh)


@pytest.mark.parametrize("point", ["mover.fill.after_prepare", "mover.fill.after_get"])
def test_a_mover_killed_mid_fetch_leaves_no_block_half_fetched(master, hosts, point):
    from kvshm.inspect.snapshot import verify
    _, h1, h2, keys = two_hosts_sharing(master, hosts, "crash")
    h2.kill_mover()
    h2.start_mover(crash_at=point)
    assert h2.eng.lookup(keys) is None  # asks the armed mover, which dies at the point
    assert h2.proc.wait(60) == -signal.SIGKILL
    hits = h2.lookup_settled(keys)  # its WRITING blocks are freed by the owner: misses
    assert hits == 0 or h2.verify(keys[:hits]) is None
    assert poll_until(lambda: verify(h2.seg) == [], 30), verify(h2.seg)
    # A new mover works. (The killed one took its share of the pool along, which may have
    # held some of host 1's blocks: check with prefixes written through after it died.)
    h2.start_mover()
    fresh = write_through_fresh(h1, "after-crash")
    assert h2.lookup_settled(fresh) == len(fresh)
    h2.verify(fresh)


def test_a_mover_killed_with_blocks_pinned_for_a_put(master, hosts):
    from kvshm.inspect.snapshot import verify
    m = master()
    h1 = hosts(m)
    h1.kill_mover()
    h1.start_mover(crash_at="mover.spill.after_pin")
    store(h1.eng, keys_of("pinned"))
    assert h1.proc.wait(60) == -signal.SIGKILL
    assert poll_until(lambda: verify(h1.seg) == [], 60), verify(h1.seg)
    h1.start_mover()
    write_through_fresh(h1, "unpinned")


def _mover_process(seg, master: str, metadata: str, log_path) -> subprocess.Popen:
    """A real ``kvshm mover`` of ``seg`` pointed at ``master`` and ``metadata``."""
    cmd = [sys.executable, "-m", "kvshm.cli", "mover", seg.name, "--master", master,
           "--metadata", metadata, "--global-segment", "64M", "--local-buffer", "16M",
           "--log-level", "INFO"]
    with open(log_path, "ab") as log:
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": ROOT})


@pytest.fixture
def unreachable(make_segment, tmp_path):
    """A segment whose mover process is pointed at a master and a metadata server nobody
    listens for (closed loopback ports), once that mover lives; yields (segment, process)."""
    from kvshm.tier.area import TierArea
    from kvshm.tier.mooncake import free_port
    seg = make_segment(unique_name(), num_blocks=64)
    log_path = tmp_path / "mover.log"
    proc = _mover_process(seg, f"127.0.0.1:{free_port()}",
                          f"http://127.0.0.1:{free_port()}/metadata", log_path)
    areas = []

    def alive() -> bool:
        if not areas and (a := TierArea.attach(seg)) is not None:
            areas.append(a)
        return bool(areas) and areas[0].mover_alive()

    try:
        assert poll_until(lambda: alive() or proc.poll() is not None, 60), log_path.read_text()
        assert proc.poll() is None, log_path.read_text()
        yield seg, proc
    finally:
        for a in areas:
            a.close()
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        stop_owner(seg.owner_record()[0])


def test_a_lookup_while_the_master_is_unreachable_is_a_miss_at_once(unreachable):
    from kvshm.index.api import LookupResult
    seg, _ = unreachable
    eng = TieredManager(connect(seg.name), max_wait=60.0)
    try:
        assert eng.lookup(keys_of("unreachable")) == 0
        assert eng.key_status(b"unreachable-key") is LookupResult.MISS
        assert eng.not_yet == 0  # never "not yet": no tier is as good as no mover
    finally:
        eng.shutdown()


def test_a_mover_whose_master_is_unreachable_answers_wants_as_misses(unreachable):
    from kvshm.tier.area import TierArea
    seg, _ = unreachable
    mgr = connect(seg.name)
    area = TierArea.attach(seg)
    try:
        seq = area.want(mgr.slot, keys_of("wanted"))  # as an engine that asked just before
        assert poll_until(lambda: area.answered(mgr.slot, seq), 30)
        assert all(mgr.index.find(k)[0] < 0 for k in keys_of("wanted"))
    finally:
        area.close()
        mgr.shutdown()


def test_a_mover_whose_master_is_unreachable_stops_on_sigterm(unreachable):
    seg, proc = unreachable
    # Once it has tried the master (its loop runs, the tier shows down), not before.
    assert poll_until(lambda: tier_snapshot(seg)["state"] == "down", 30), tier_snapshot(seg)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=30) == 0
    assert tier_snapshot(seg)["state"] == "stopped"


@pytest.fixture
def silent_master():
    """A loopback port that takes TCP connections and never answers on them, as a stopped
    or overloaded master (or a proxy in front of one) does; yields (host:port, a function
    that accepts what came and says how many connections came so far)."""
    lsock = socket.create_server(("127.0.0.1", 0))
    lsock.setblocking(False)
    conns: list[socket.socket] = []  # held open: the peer waits for an answer, not an EOF

    def accepted() -> int:
        while True:
            try:
                conns.append(lsock.accept()[0])
            except BlockingIOError:
                return len(conns)

    try:
        yield f"127.0.0.1:{lsock.getsockname()[1]}", accepted
    finally:
        for c in conns:
            c.close()
        lsock.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_mover_stuck_in_mooncake_setup_ends_on_a_signal(sig, silent_master, make_segment,
                                                         tmp_path):
    addr, accepted = silent_master
    seg = make_segment(unique_name(), num_blocks=64)
    log_path = tmp_path / "mover.log"
    proc = _mover_process(seg, addr, f"http://{addr}/metadata", log_path)
    try:
        # The reachability check opens one connection to the master and one to the metadata
        # server (both this port): one more is Mooncake's setup, which holds the GIL while it
        # waits for answers (minutes), so no Python signal handler runs meanwhile.
        assert poll_until(lambda: accepted() > 2 or proc.poll() is not None, 60), \
            log_path.read_text()
        assert proc.poll() is None, log_path.read_text()
        proc.send_signal(sig)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"still running 30 s after {sig.name}\n{log_path.read_text()[-3000:]}")
        assert rc == -sig, log_path.read_text()  # the kernel's default action ended it
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        stop_owner(seg.owner_record()[0])


def _listening(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every TCP socket ``pid`` listens on."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    out = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for row in f.readlines()[1:]:
                cols = row.split()
                if cols[3] == "0A" and cols[9] in inodes:
                    addr, port = cols[1].split(":")
                    out.add((addr, int(port, 16)))
    return out


def test_which_ports_listen_beyond_loopback(master):
    """The master's RPC and metrics ports follow their loopback flags; its HTTP metadata
    port listens on every address whatever its host flag says (README: firewall it)."""
    m = master()
    assert poll_until(lambda: {p for _, p in _listening(m.proc.pid)} >=
                      {m.rpc_port, m.metadata_port, m.metrics_port}, 60)
    loopback = {"0100007F", "00000000000000000000000001000000"}
    wide = {p for a, p in _listening(m.proc.pid) if a not in loopback}
    assert m.rpc_port not in wide and m.metrics_port not in wide
    assert wide <= {m.metadata_port}, wide


def test_the_two_hosts_demo_hits_across_hosts_and_verifies_every_block():
    p = subprocess.run([sys.executable, os.path.join(ROOT, "examples", "two_hosts.py"),
                        "--json", "--conversations", "4", "--turns", "3"],
                       capture_output=True, text=True, timeout=300,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 0, p.stderr[-3000:]
    import json
    r = json.loads(p.stdout)
    shutil.rmtree(r["logs"])  # the master's and movers' logs, kept by the demo for its user
    assert r["cross_host_blocks"] > 0 and r["mismatched"] == 0 and r["wrong_outputs"] == 0
    assert r["total"]["blocks_verified"] >= r["cross_host_blocks"]
