"""kvshm's own lower-tier logic against an in-memory fake store (tests/tier_fake.py).

Two "hosts" are two segments with their own owners and movers (stepped by the test, in this
process) over one ``FakeStore``. What is proven here: a block stored on one host is put below
and fetched on a miss on the other, byte for byte; a lookup that may hit below answers "not
yet" (None) and never waits; a key absent everywhere becomes a plain miss after one round; a
value with a wrong checksum, length or layout never becomes READY; a store that is down or full
degrades to misses with counters and recovers by itself. The same against a real
mooncake_master: tests/test_tier_mooncake.py.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading

import pytest

from kvshm.errors import SegmentNotFoundError
from kvshm.client.connect import connect
from kvshm.shm.layout import Layout
from kvshm.shm.segment import Segment
from kvshm.shm.wait import poll_until
from kvshm.tier.area import TierArea
from kvshm.tier.client import TieredManager
from kvshm.errors import MoverRunningError
from kvshm.tier.mover import Mover

from conftest import TEST_LAYOUT, stop_owner, unique_name
import procs
from procs import check, store
from tier_fake import FakeStore, FakeTier

KEYS = [b"tier-key-%03d" % i for i in range(8)]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def hosts(make_segment):
    """Factory: ``host(store, layout=TEST_LAYOUT) -> (engine TieredManager, Mover)``."""
    made = []

    def host(fake: FakeStore, layout: Layout = TEST_LAYOUT, num_blocks: int = 32,
             spill: bool = True):
        seg = make_segment(unique_name(), layout, num_blocks)
        mover = Mover(seg.name, FakeTier(fake), spill=spill, batch=4)
        eng = TieredManager(connect(seg.name), max_wait=60.0)
        made.append((seg, mover, eng))
        return eng, connected(mover)

    yield host
    for seg, mover, eng in made:
        eng.shutdown()
        mover.close()
        pid = seg.owner_record()[0]
        if pid:
            stop_owner(pid)


def connected(mover: Mover) -> Mover:
    """``mover`` once it has connected to its tier (in a thread of its own: rounds go on)."""
    assert poll_until(lambda: (mover.step(), mover.area.connected())[1], 30), \
        mover.area.snapshot()
    return mover


def spill_all(mover: Mover, fake: FakeStore, n: int) -> None:
    assert poll_until(lambda: (mover.step(), len(fake.values) >= n)[1], 30), \
        f"the mover put {len(fake.values)} of {n} blocks"


def fill(eng: TieredManager, mover: Mover, keys: list[bytes]) -> int:
    """Look up until the answer is a number, stepping the mover between tries."""
    answers = []

    def looked() -> bool:
        answers.append(eng.lookup(keys))
        if answers[-1] is None:
            mover.step()
            return False
        return True

    assert poll_until(looked, 30), "lookups kept answering 'not yet'"
    assert None in answers[:1] or answers[0] == len(keys)  # the first miss says "not yet"
    return answers[-1]


def keys_below(hosts, n: int = len(KEYS), layout: Layout = TEST_LAYOUT):
    """Two hosts over a new fake store, host a having stored ``KEYS[:n]`` and put them below;
    host b has ``layout``. Returns the store, (a, its mover), (b, its mover)."""
    fake = FakeStore()
    a, ma = hosts(fake)
    b, mb = hosts(fake, layout)
    store(a, KEYS[:n])
    spill_all(ma, fake, n)
    return fake, (a, ma), (b, mb)


def counters(mover: Mover) -> dict[str, int]:
    return mover.area.snapshot()["counters"]


def test_a_block_stored_on_one_host_is_a_hit_on_the_other(hosts):
    fake = FakeStore()
    a, ma = hosts(fake)
    b, mb = hosts(fake)
    assert store(a, KEYS) == KEYS
    spill_all(ma, fake, len(KEYS))
    assert counters(ma)["puts"] == len(KEYS)
    assert b.lookup(KEYS) is None  # not yet: the mover of host b was asked
    assert fill(b, mb, KEYS) == len(KEYS)
    blocks = b.prepare_load(KEYS)
    planes = b.segment.planes()
    assert all(check(planes, blk, k) for blk, k in zip(blocks, KEYS))
    b.complete_load(KEYS)
    c = counters(mb)
    assert c["gets"] == len(KEYS) and c["get_bytes"] == len(KEYS) * TEST_LAYOUT.block_bytes
    # The fetched blocks are stored in b's segment, but never put back below.
    mb.step()
    mb._next_events = 0
    mb.step()
    assert counters(mb)["puts"] == 0


def test_a_key_absent_everywhere_is_a_plain_miss_after_one_round(hosts):
    fake = FakeStore()
    b, mb = hosts(fake)
    assert b.lookup(KEYS) is None
    mb.step()
    assert b.lookup(KEYS) == 0
    assert b.lookup(KEYS) == 0  # and is not asked for again at once
    assert counters(mb)["get_misses"] == len(KEYS)


def test_a_prefix_partly_below_hits_as_far_as_it_goes(hosts):
    _, _, (b, mb) = keys_below(hosts, 5)
    assert fill(b, mb, KEYS) == 5


@pytest.mark.parametrize("fault", ["corrupt", "unreadable"])
def test_a_bad_value_never_becomes_ready(hosts, fault):
    fake, _, (b, mb) = keys_below(hosts)
    setattr(fake, fault, True)
    assert fill(b, mb, KEYS) == 0
    c = counters(mb)
    assert c["get_rejected" if fault == "corrupt" else "get_failed"] == len(KEYS)
    assert all(b.manager.index.find(k)[0] < 0 for k in KEYS)  # freed, not READY
    setattr(fake, fault, False)
    b._asked.clear()  # the engine asks again (a later request for the same prefix)
    assert fill(b, mb, KEYS) == len(KEYS)


def _writing(seg) -> int:
    from kvshm.shm import layout as L
    from test_shared import states
    return states(seg).count(L.WRITING)


def test_a_fetch_whose_publish_fails_leaves_no_block_writing(hosts, monkeypatch):
    # The mover published the good blocks of a fetch, then freed the bad ones: when the
    # first call raised (the owner refuses a key a takeover dropped, after applying the
    # rest), the second never ran, and the bad blocks stayed WRITING, out of the cache and
    # "not yet" to every lookup, for as long as the mover lived.
    from kvshm.errors import UnknownKeyError
    fake, _, (b, mb) = keys_below(hosts)
    bad = sorted(fake.values)[0]
    fake.values[bad] = fake.values[bad][:-1] + bytes([fake.values[bad][-1] ^ 0xFF])
    real = mb.mgr.complete_store

    def then_refuse(keys, success=True, **kw):
        real(keys, success, **kw)
        if success:
            raise UnknownKeyError("injected: one key of the batch was dropped by a takeover")
    monkeypatch.setattr(mb.mgr, "complete_store", then_refuse)
    assert b.lookup(KEYS) is None
    mb.step()
    assert counters(mb)["get_rejected"] == 1
    assert _writing(mb.seg) == 0


def test_a_fetch_whose_get_raises_leaves_no_block_writing(hosts, monkeypatch):
    # A get that raises (here a KvshmError, which the mover's round logs and survives)
    # left every block the fetch had prepared WRITING while the mover lived.
    from kvshm.errors import TransferError
    fake, _, (b, mb) = keys_below(hosts)

    def fails(keys, buffers):
        raise TransferError("injected: the get broke off")
    monkeypatch.setattr(mb.tier, "get", fails)
    assert b.lookup(KEYS) is None
    mb.step()
    assert _writing(mb.seg) == 0


def test_another_layout_never_sees_the_blocks(hosts):
    _, _, (b, mb) = keys_below(hosts, layout=Layout((4096, 4096), 16, "another-model"))
    assert fill(b, mb, KEYS) == 0
    assert counters(mb)["get_misses"] == len(KEYS)


def test_a_store_that_is_down_is_a_miss_and_recovers_by_itself(hosts):
    fake, (a, ma), (b, mb) = keys_below(hosts, 4)
    assert fill(b, mb, [b"absent"]) == 0  # b's mover has connected
    fake.down = True
    assert fill(b, mb, KEYS[:4]) == 0  # misses, no error
    assert counters(mb)["rpc_failures"] >= 1
    assert mb.area.snapshot()["state"] == "down"
    store(a, KEYS[4:])  # host a's spills while down are dropped, counted
    assert poll_until(lambda: (ma.step(), counters(ma)["put_dropped"] +
                               counters(ma)["put_failed"] >= 4)[1], 30)
    asked = b.not_yet
    assert b.lookup([b"while-down"]) == 0 and b.not_yet == asked  # no tier: a miss at once
    fake.down = False
    b._asked.clear()
    # It comes back by itself once its backoff ends (its probe); engines only ever saw
    # misses meanwhile.
    connected(mb)
    assert fill(b, mb, KEYS[:4]) == 4


def test_puts_refused_for_space_are_counted_not_raised(hosts):
    fake = FakeStore()
    fake.full = True
    a, ma = hosts(fake)
    store(a, KEYS)
    assert poll_until(lambda: (ma.step(), counters(ma)["put_refused_space"] == len(KEYS))[1], 30)
    assert fake.values == {}


def test_without_a_mover_a_lookup_is_plain(make_segment):
    seg = make_segment()
    eng = TieredManager(connect(seg.name))
    try:
        assert eng.lookup(KEYS) == 0
    finally:
        eng.shutdown()
        stop_owner(seg.owner_record()[0])


def test_one_mover_per_segment(hosts):
    fake = FakeStore()
    b, mb = hosts(fake)
    with pytest.raises(MoverRunningError):
        Mover(b.segment.name, FakeTier(fake))


@pytest.mark.parametrize("batch", ["0", "-3"])
def test_kvshm_mover_refuses_a_batch_below_one_saying_what_to_pass(batch):
    p = subprocess.run([sys.executable, "-m", "kvshm.cli", "mover", unique_name(), "--master",
                        "127.0.0.1:1", "--metadata", "http://127.0.0.1:1/metadata",
                        "--batch", batch], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": ROOT})
    assert p.returncode == 2, p.stderr
    last = p.stderr.strip().splitlines()[-1]
    assert last.startswith("kvshm mover: error: argument --batch:"), p.stderr
    assert "at least 1" in last and batch in last, last


@pytest.mark.parametrize("batch", [0, -1])
def test_a_mover_refuses_a_batch_below_one_and_leaves_the_segment_to_the_next(make_segment,
                                                                              batch):
    from kvshm.errors import InvalidArgumentError
    seg = make_segment()
    try:
        with pytest.raises(InvalidArgumentError, match="batch"):
            Mover(seg.name, FakeTier(FakeStore()), batch=batch)
        Mover(seg.name, FakeTier(FakeStore())).close()  # nothing was left locked
    finally:
        stop_owner(seg.owner_record()[0])


def test_a_mover_that_cannot_become_a_client_leaves_the_segment_to_the_next(make_segment):
    from kvshm.errors import ClientSlotsExhaustedError
    seg = make_segment(max_clients=1)
    eng = connect(seg.name)  # takes the only client slot
    pid = seg.owner_record()[0]
    try:
        with pytest.raises(ClientSlotsExhaustedError):
            Mover(seg.name, FakeTier(FakeStore()))
        area = TierArea.attach(seg)
        try:
            assert not area.mover_alive()  # its lock went with it
        finally:
            area.close()
        eng.shutdown()
        Mover(seg.name, FakeTier(FakeStore())).close()  # the slot is free: a mover starts
    finally:
        eng.shutdown()
        stop_owner(pid)


def test_kvshm_inspect_shows_the_lower_tier(hosts):
    from kvshm.inspect.cli import render_show
    from kvshm.inspect.metrics import prometheus
    from kvshm.inspect.snapshot import snapshot
    fake = FakeStore()
    a, ma = hosts(fake)
    store(a, KEYS)
    spill_all(ma, fake, len(KEYS))
    snap = snapshot(a.segment)
    t = snap["tier"]
    assert t["mover_alive"] and t["state"] == "connected" and t["backend"] == FakeTier.description
    assert t["counters"]["puts"] == len(KEYS)
    assert "tier      mover pid" in render_show(snap)
    text = prometheus([snap])
    assert f'kvshm_tier_puts_total{{segment="{a.segment.name}"}} {len(KEYS)}' in text
    assert f'kvshm_tier_up{{segment="{a.segment.name}"}} 1' in text


@pytest.mark.unit
def test_a_want_ring_drops_what_its_producer_laps(make_segment):
    from kvshm.tier.area import RING_ENTRIES
    seg = make_segment()
    area = TierArea.create(seg)
    try:
        first = [b"a%d" % i for i in range(RING_ENTRIES)]
        area.want(0, first)
        last = area.want(0, [b"b%d" % i for i in range(10)])
        keys, done = area.drain(10 * RING_ENTRIES)
        assert keys == first[10:] + [b"b%d" % i for i in range(10)]
        assert area.snapshot()["counters"]["wants_dropped"] == 10
        assert not area.answered(0, last)  # answered only once the mover publishes
        area.publish(done)
        assert area.answered(0, last) and not area.pending()
    finally:
        area.close()


@pytest.mark.unit
def test_the_tier_area_gets_its_segments_mode_whatever_the_umask(make_segment):
    # Another user's engine that may open the segment must be able to open its area too.
    import stat
    seg = make_segment(mode=0o666)
    old = os.umask(0o022)
    try:
        area = TierArea.create(seg)
    finally:
        os.umask(old)
    try:
        assert stat.S_IMODE(os.fstat(area.fd).st_mode) == 0o666
    finally:
        area.close()


def _objects(name: str) -> list[str]:
    """The segment's other objects in /dev/shm (its tier area, its doorbells)."""
    return sorted(e for e in os.listdir("/dev/shm")
                  if e.startswith((f"kvshm-{name}@", f"sem.kvshm-{name}@")))


@pytest.mark.unit
def test_an_engine_hinting_the_area_of_a_removed_segment_gets_no_error_and_leaves_nothing(
        make_segment):
    # An engine attached the area before its segment was removed and asks for keys after:
    # the hint is lost (there is no mover), it fails nothing, and it makes no doorbell for good.
    seg = make_segment()
    TierArea.create(seg).close()
    engine = TierArea.attach(seg)
    try:
        Segment.unlink(seg.name)
        engine.want(0, [b"asked"])
        engine.kick()
        assert _objects(seg.name) == []
    finally:
        engine.close()


@pytest.mark.unit
def test_the_area_of_a_removed_segment_still_answers_whether_its_mover_lives(make_segment):
    seg = make_segment()
    mover = TierArea.create(seg)
    engine = TierArea.attach(seg)
    try:
        assert mover.try_lock_mover()
        Segment.unlink(seg.name)
        assert engine.mover_alive()
        mover.close()
        assert not engine.mover_alive()
    finally:
        engine.close()


@pytest.mark.unit
def test_a_mover_starting_on_a_removed_segment_makes_no_tier_area(make_segment):
    seg = make_segment()
    Segment.unlink(seg.name)
    with pytest.raises(SegmentNotFoundError):
        TierArea.create(seg)
    assert _objects(seg.name) == []


def test_a_mover_of_a_removed_segment_leaves_the_area_of_its_successor_alone(make_segment):
    # A mover had its segment open and had just made the tier area when the segment was
    # removed and made again under the same name, with a mover of its own. The late mover
    # removes what it made and nothing of the new segment's: engines keep finding the new
    # mover's area.
    from test_segment_hardening import DEADLINE_S, ROOT, outcome, poll, stopped
    name = unique_name()
    make_segment(name)
    code = ("import sys, json; from kvshm.shm.segment import Segment\n"
            "from kvshm.tier.area import TierArea\ntry:\n"
            " TierArea.create(Segment.attach(sys.argv[1])); print(json.dumps(['ok', '']))\n"
            "except Exception as e:\n print(json.dumps([type(e).__name__, str(e)]))\n")
    env = dict(os.environ, PYTHONPATH=ROOT, KVSHM_CRASH_AT="mover.area.after_open",
               KVSHM_CRASH_SIGNAL="STOP")
    late = subprocess.Popen([sys.executable, "-c", code, name], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        poll(lambda: stopped(late), "the late mover to freeze with the area open")
        Segment.unlink(name)
        seg = make_segment(name)
        area = TierArea.create(seg)
        assert area.try_lock_mover()
        os.kill(late.pid, signal.SIGCONT)
        assert outcome(late)[0] == "SegmentNotFoundError"
        engine = TierArea.attach(seg)
        assert engine is not None and engine.mover_alive()
        engine.close()
        area.close()
    finally:
        late.kill()
        late.wait(timeout=DEADLINE_S)


def test_a_mover_whose_segment_was_removed_before_it_runs_exits_quietly(make_segment):
    seg = make_segment()
    mover = Mover(seg.name, FakeTier(FakeStore()))
    pid = seg.owner_record()[0]
    try:
        Segment.unlink(seg.name)
        mover.run(threading.Event())  # returns: no doorbell to wait on, nothing to serve
    finally:
        mover.close()
        stop_owner(pid)


def test_a_mover_stops_when_its_segment_is_replaced_under_its_name(make_segment):
    # A segment made since under the same name has a mover of its own to come.
    seg = make_segment()
    mover = Mover(seg.name, FakeTier(FakeStore()))
    pid = seg.owner_record()[0]
    stop = threading.Event()
    failed: list[BaseException] = []

    def run() -> None:
        try:
            mover.run(stop)
        except BaseException as e:  # noqa: BLE001 - the test reports it
            failed.append(e)

    runner = threading.Thread(target=run)
    try:
        runner.start()
        assert poll_until(lambda: mover.area._bell is not None, 60)  # it waits on its bell
        Segment.unlink(seg.name)
        make_segment(seg.name)
        mover.area.kick()  # wake it: it looks at its segment after each round
        runner.join(60)
        assert not runner.is_alive() and failed == []
    finally:
        stop.set()
        mover.area.kick()
        runner.join(60)
        mover.close()
        stop_owner(pid)


def test_a_checksummed_segment_sends_its_own_sums_and_gets_them_back(hosts):
    from kvshm.shm.checksums import BlockSums
    lay = Layout((4096, 4096), 16, "test", checksums=True)
    fake = FakeStore()
    a, ma = hosts(fake, lay)
    b, mb = hosts(fake, lay)
    out = a.prepare_store(KEYS)
    planes = a.segment.planes()
    for k, blk in zip(out.keys_to_store, out.block_ids):
        for p, plane in enumerate(planes):
            plane[blk] = (len(k) + p) % 251
    import numpy as np
    BlockSums(a.segment).store(np.array(out.block_ids), [0, 1])  # what a CPU handler does
    a.complete_store(out.keys_to_store)
    spill_all(ma, fake, len(KEYS))
    assert fill(b, mb, KEYS) == len(KEYS)
    sums = BlockSums(b.segment)
    blocks = b.prepare_load(KEYS)
    assert sums.bad(np.array(blocks), [0, 1]) == []  # fetched blocks carry valid sums
    b.complete_load(KEYS)


@pytest.mark.unit
@pytest.mark.parametrize("algo", ["crc32", "xxh3"])
def test_a_value_header_catches_another_key_layout_length_or_byte(algo):
    import numpy as np
    from kvshm.tier import api
    code = {"crc32": api.SUM_CRC32, "xxh3": api.SUM_XXH3}[algo]
    if api._summer(code) is None:
        pytest.skip("xxhash is not installed (pip install 'kvshm[mooncake]')")
    fp = bytes(range(32))
    pages = [np.arange(4096, dtype=np.uint8), np.full(4096, 7, np.uint8)]
    hdr = memoryview(bytearray(api.header_bytes(2)))
    api.pack_header(hdr, fp, b"key", pages, code)
    assert api.check_value(hdr, fp, b"key", pages) is None
    assert "key" in api.check_value(hdr, fp, b"other", pages)
    assert "layout" in api.check_value(hdr, bytes(32), b"key", pages)
    assert "length" in api.check_value(hdr, fp, b"key", [pages[0], pages[1][:100]])
    pages[1][5] ^= 1
    assert "checksum" in api.check_value(hdr, fp, b"key", pages)


def test_an_engine_asking_while_a_later_fill_runs_hears_not_yet(hosts):
    # The mover stores by round trip only (no grants): its fills show as WRITING in the
    # index while they run, on its second fill as on its first.
    fake = FakeStore()
    a, ma = hosts(fake, num_blocks=1024)
    b, mb = hosts(fake, num_blocks=1024)
    warm, more = [b"warm-%d" % i for i in range(4)], [b"more-%d" % i for i in range(2)]
    assert store(a, warm + more) == warm + more
    spill_all(ma, fake, len(warm + more))
    assert fill(b, mb, warm) == len(warm)  # the mover's first fill
    seen = []
    real_get = mb.tier.get

    def get(keys, bufs):  # the fetch is in flight: what does the engine hear now?
        seen.append(b.lookup(more))
        return real_get(keys, bufs)

    mb.tier.get = get
    assert b.lookup(more) is None  # want posted
    mb.step()
    assert seen == [None]
    assert fill(b, mb, more) == len(more)


def test_a_not_yet_answer_gives_back_only_its_own_lookup_of_a_hit(hosts):
    # One request's lookup hits KEYS[0]; another's, in the same step, hits it too and then
    # hears "not yet" (its next key may be below), which releases its hits. The first
    # request's hit must stay leased while another client stores over the whole cache.
    eng, _ = hosts(FakeStore(), num_blocks=8)
    assert store(eng, KEYS) == KEYS  # the cache is full
    assert eng.lookup(KEYS[:1]) == 1
    assert eng.lookup(KEYS[:1] + [b"maybe-below"]) is None
    other = connect(eng.segment.name, grants=False)
    try:
        fresh = [b"fresh-%d" % i for i in range(8)]
        stored = store(other, fresh)  # evicts all it may
    finally:
        other.shutdown()
    blocks = eng.prepare_load(KEYS[:1])
    assert check(eng.segment.planes(), blocks[0], KEYS[0])
    eng.complete_load(KEYS[:1])
    assert stored == []


# A client of a slot may leave its want ring's words anything (a crash, or on purpose); they
# are the mover's and the slot's next client's input.
RING_WORDS = {"tail at the limit": (2**64 - 1, 0), "both at the limit": (2**64 - 1, 2**64 - 1),
              "done past tail": (5, 1000), "tail past its entries": (5, 0),
              "tail far past done": (2**63, 3)}


@pytest.mark.parametrize("words", RING_WORDS.values(), ids=RING_WORDS.keys())
def test_a_want_ring_its_last_client_scribbled_never_fails_nor_spins(hosts, make_segment,
                                                                    words):
    # A real client process leaves its slot's want ring impossible and goes. The mover
    # must not be woken for it after one round (it would spin), and the next engine in
    # that slot must look up without an error and still get its keys from below.
    from test_shared import spawn
    fake = FakeStore()
    a, ma = hosts(fake)
    store(a, KEYS)
    spill_all(ma, fake, len(KEYS))
    seg = make_segment(max_clients=2)  # the mover's slot and one more: the engine gets it
    mover = connected(Mover(seg.name, FakeTier(fake), batch=4))
    pid = seg.owner_record()[0]
    eng = None
    try:
        p, conn = spawn(procs.scribble_want_ring, seg.name, *words)
        slot = conn.recv()
        p.join()
        mover.step()
        assert not mover._woken(), "the mover would wake again at once, for good"
        eng = TieredManager(connect(seg.name), max_wait=60.0)
        assert eng.slot == slot
        for i in range(20):  # each one asks the mover (and must not raise)
            eng.lookup([b"absent-%d" % i])
        assert fill(eng, mover, KEYS) == len(KEYS)
        mover.step()
        assert not mover._woken()
        assert mover.area.snapshot()["wants_queued"] == 0
    finally:
        if eng is not None:
            eng.shutdown()
        mover.close()
        stop_owner(pid)


def test_a_client_checks_that_the_mover_lives_at_most_once_per_interval(make_segment,
                                                                        monkeypatch):
    from kvshm.tier import client
    seg = make_segment()
    mover = connected(Mover(seg.name, FakeTier(FakeStore())))
    eng = TieredManager(connect(seg.name))
    checks = []
    alive = TierArea.mover_alive
    monkeypatch.setattr(TierArea, "mover_alive", lambda self: checks.append(1) or alive(self))
    clock = [client._now()]
    monkeypatch.setattr(client, "_now", lambda: clock[0])  # the test's clock stands still
    try:
        for i in range(20):  # twenty misses asked for in one instant: one look at the lock
            assert eng.lookup([b"absent-%d" % i]) is None
        eng.complete_store([])
        assert len(checks) == 1
        mover.close()
        assert eng.lookup([b"after"]) == 0  # it said "stopped": a miss, the lock not looked at
        assert len(checks) == 1
        clock[0] += client._ALIVE_EVERY_S
        assert eng.lookup([b"after-2"]) == 0  # looked again: no mover, a plain miss
        assert len(checks) == 2
    finally:
        eng.shutdown()
        stop_owner(seg.owner_record()[0])


def test_vllms_per_key_lookup_asks_once_a_step_and_hits_after_the_fetch(hosts):
    from kvshm.index.api import LookupResult as R
    from kvshm.integrations.vllm.core import ManagerCore
    _, _, (b, mb) = keys_below(hosts)
    core = ManagerCore(b)  # the vLLM scheduler's side, over a TieredManager
    assert [core.lookup(k, "r") for k in KEYS] == [R.RETRY] * len(KEYS)
    assert not mb.area.pending()  # asked for together, when the step ends
    core.schedule_end()
    assert counters(mb)["wants"] == 0 and mb.area.pending()
    assert [core.lookup(k, "r") for k in KEYS] == [R.RETRY] * len(KEYS)
    seen = []
    real_get = mb.tier.get

    def get(keys, bufs):  # the fetch is in flight: what does the scheduler hear now?
        seen.append(core.lookup(KEYS[0], "r"))
        return real_get(keys, bufs)

    mb.tier.get = get
    mb.step()
    assert seen[:1] == [R.RETRY] and counters(mb)["wants"] == len(KEYS)
    assert [core.lookup(k, "r") for k in KEYS] == [R.HIT] * len(KEYS)
    blocks = core.prepare_load(KEYS, "r")
    assert all(check(b.segment.planes(), blk, k) for blk, k in zip(blocks, KEYS))
    core.complete_load(KEYS, "r")
    core.schedule_end()
    # absent everywhere: RETRY until the mover has looked, then a plain miss
    assert core.lookup(b"nowhere", "r") is R.RETRY
    core.schedule_end()
    mb.step()
    assert core.lookup(b"nowhere", "r") is R.MISS
    assert b.held_blocks() == 0


def test_a_get_answering_fewer_keys_than_asked_leaves_no_block_writing(hosts, monkeypatch):
    # A lower tier answering fewer codes than keys asked (a buggy store, a client version
    # that stops early): the keys past its answer were neither good nor bad, never freed,
    # and stayed WRITING, out of the cache and "not yet" to every lookup, while the mover
    # lived.
    _, _, (b, mb) = keys_below(hosts)
    real = mb.tier.get
    monkeypatch.setattr(mb.tier, "get", lambda keys, buffers: real(keys, buffers)[:-1])
    assert b.lookup(KEYS) is None
    mb.step()
    assert _writing(mb.seg) == 0
