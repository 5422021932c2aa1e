"""Child-process bodies for multi-process tests (importable by spawned interpreters).

Each function runs in its own process, talks to the test through a ``Connection`` and never
sleeps to synchronise: it reports what it did and then blocks on the pipe until told to go on
(or until the test SIGKILLs it).
"""
from __future__ import annotations

import os
import random
import time
import zlib

import numpy as np

from kvshm.client.connect import connect
from kvshm.shm import layout as L


def fill(planes: list[np.ndarray], block: int, key: bytes) -> None:
    """Write ``key``'s deterministic content into ``block`` of every plane."""
    for p, plane in enumerate(planes):
        seed = zlib.crc32(key + bytes([p]))
        plane[block] = np.random.default_rng(seed).integers(0, 256, plane.shape[1], np.uint8)


def check(planes: list[np.ndarray], block: int, key: bytes) -> bool:
    for p, plane in enumerate(planes):
        seed = zlib.crc32(key + bytes([p]))
        want = np.random.default_rng(seed).integers(0, 256, plane.shape[1], np.uint8)
        if not np.array_equal(plane[block], want):
            return False
    return True


def fill_all(planes: list[np.ndarray], blocks: list[int], keys: list[bytes]) -> None:
    for b, k in zip(blocks, keys):
        fill(planes, b, k)


def store(mgr, keys: list[bytes]) -> list[bytes]:
    """prepare_store + write + complete_store; returns the keys actually written."""
    out = mgr.prepare_store(keys)
    if out is None:
        return []
    planes = mgr.segment.planes()
    for k, b in zip(out.keys_to_store, out.block_ids):
        fill(planes, b, k)
    mgr.complete_store(out.keys_to_store)
    return out.keys_to_store


def hold_and_wait(name: str, conn, ready_keys: list[bytes], writing_keys: list[bytes]) -> None:
    """Lease ``ready_keys``, start (never finish) a store of ``writing_keys``, report, block."""
    mgr = connect(name)
    leased = mgr.lookup(ready_keys)
    pinned = mgr.prepare_load(ready_keys[:1]) if ready_keys else []
    out = mgr.prepare_store(writing_keys) if writing_keys else None
    conn.send({"slot": mgr.slot, "leased": leased, "pinned": pinned,
               "writing": out.block_ids if out else []})
    conn.recv()  # the test kills us while we wait here


def load_and_verify(name: str, conn, keys: list[bytes]) -> None:
    """Connect, look ``keys`` up, load them and check their bytes; report the result."""
    mgr = connect(name)
    hits = mgr.lookup(keys)
    ok = 0
    if hits:
        blocks = mgr.prepare_load(keys[:hits])
        planes = mgr.segment.planes()
        ok = sum(check(planes, b, k) for b, k in zip(blocks, keys[:hits]))
        mgr.complete_load(keys[:hits])
    conn.send({"hits": hits, "verified": ok, "slot": mgr.slot})
    mgr.shutdown()


def lease_then_load(name: str, conn, key: bytes, timeout: float = 30.0) -> None:
    """Lease ``key`` (a lookup) and report the hits; when told, load it and report the
    block, whether its bytes are ``key``'s, or the error."""
    from kvshm.errors import KvshmError
    mgr = connect(name, timeout=timeout)
    conn.send(mgr.lookup([key]))
    conn.recv()
    try:
        blocks = mgr.prepare_load([key])
        ok = check(mgr.segment.planes(), blocks[0], key)
        mgr.complete_load([key])
        conn.send({"blocks": blocks, "verified": ok})
    except KvshmError as e:
        conn.send({"error": type(e).__name__, "message": str(e)})
    conn.recv()  # the test lets us go
    mgr.shutdown()


def evict_and_store_again(name: str, conn, pinned: list[bytes], fresh: list[bytes],
                          again: bytes) -> None:
    """Pin ``pinned``, store ``fresh`` (evicting what is not pinned) and then ``again`` anew
    (a key that was evicted), unpin; report."""
    mgr = connect(name)
    assert mgr.lookup(pinned) == len(pinned)
    mgr.prepare_load(pinned)
    assert store(mgr, fresh) == fresh
    assert store(mgr, [again]) == [again]
    mgr.complete_load(pinned)
    conn.send("done")
    mgr.shutdown()


def store_and_report(name: str, conn, keys: list[bytes], grants: bool = True) -> None:
    """Connect, store ``keys`` (evicting what it must), report the keys stored."""
    mgr = connect(name, grants=grants)
    conn.send(store(mgr, keys))
    mgr.shutdown()


def connect_and_report(name: str, conn) -> None:
    mgr = connect(name)
    conn.send({"slot": mgr.slot, "owner": mgr.segment.owner_record()[:2]})
    conn.recv()
    mgr.shutdown()


def connect_with_quota_and_report(name: str, conn, quota: int) -> None:
    mgr = connect(name, quota=quota, timeout=60.0)
    conn.send({"slot": mgr.slot, "quota": mgr.quota})
    conn.recv()
    mgr.shutdown()


def pid() -> int:
    return os.getpid()


def store_then_hang(name: str, conn, layout, num_blocks: int, ready: list[bytes],
                    writing: list[bytes]) -> None:
    """Create/attach ``name``, store ``ready`` completely and ``writing`` half-way, report."""
    mgr = connect(name, layout, num_blocks=num_blocks, ring_capacity=8192, hold_capacity=64)
    store(mgr, ready)
    out = mgr.prepare_store(writing)
    conn.send({"owner": mgr.segment.owner_record()[0], "writing": out.block_ids})
    conn.recv()  # SIGKILLed here, with its owner


def cont_when_stopped(pid: int, stall_s: float) -> None:
    """Wait until ``pid`` stopped itself (a crash point with SIGSTOP), keep it stopped for
    ``stall_s`` — the stall is the scenario (an owner slower than a client's patience), not
    synchronisation — then let it go on."""
    import signal
    import time
    deadline = time.monotonic() + 30
    while _proc_state(pid) != "T":
        if time.monotonic() > deadline:
            return
        time.sleep(0.005)  # polling the process state, bounded by the deadline
    time.sleep(stall_s)
    os.kill(pid, signal.SIGCONT)


def _proc_state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def stopped(pid: int) -> bool:
    """Whether ``pid`` is stopped (by a signal, or traced); a process gone is not (a fork
    server reaps its dead child at once)."""
    return _proc_state(pid) in ("T", "t")


def poison_request(name: str, conn, point: str) -> None:
    """Make every owner that begins our next request die at ``point``; report what the
    call says."""
    import signal
    from kvshm.errors import KvshmError
    mgr = connect(name)
    store(mgr, [b"poison-0"])
    os.environ["KVSHM_CRASH_AT"] = point  # the owners we start inherit it
    os.kill(mgr.segment.owner_record()[0], signal.SIGKILL)
    try:
        mgr.prepare_store([b"poison-1"])
        conn.send({"error": None, "message": ""})
    except KvshmError as e:
        conn.send({"error": type(e).__name__, "message": str(e)})
    del os.environ["KVSHM_CRASH_AT"]


def poison_part_granted_store(name: str, conn, point: str) -> None:
    """A store partly served from our grant ring whose round trip for the rest meets owners
    that all die at ``point``; report what the call said and what the same store, asked
    again, then stores and finds."""
    import signal
    from kvshm.errors import KvshmError
    mgr = connect(name, timeout=30.0)
    store(mgr, [b"poison-0"])
    words = mgr._own._gw  # the grant ring's counts: wait until a block is stocked for us
    while words["granted"] <= words["taken"]:
        time.sleep(0.001)
    os.environ["KVSHM_CRASH_AT"] = point  # the owners we start inherit it
    os.kill(mgr.segment.owner_record()[0], signal.SIGKILL)
    keys = [b"mixed-0", b"mixed-1", b"mixed-2"]  # more than the ring holds: a round trip
    try:
        mgr.prepare_store(keys)
        error = None
    except KvshmError as e:
        error = type(e).__name__
    del os.environ["KVSHM_CRASH_AT"]
    os.kill(mgr.segment.owner_record()[0], signal.SIGKILL)  # it would die on our next request
    while mgr.segment.owner_alive():
        time.sleep(0.001)
    again = store(mgr, keys)  # as an engine does: it offers the keys again
    conn.send({"error": error, "stored": again, "found": mgr.lookup(keys)})
    mgr.shutdown()


def poison_one_way(name: str, conn, kind: str, point: str, stay: bool = False) -> None:
    """Make every owner that begins our next one-way frame (``kind``: a touch, or the
    publish of a granted store) die at ``point``; then make a call behind it (it waits for an
    owner, starting them) and report what that says. ``stay``: then report our slot and the
    block of the publish, and go only when told."""
    import signal
    from kvshm.errors import KvshmError
    mgr = connect(name, timeout=30.0)
    store(mgr, [b"poison-0"])
    words = mgr._own._gw  # the grant ring's counts: wait until a block is stocked for us
    while words["granted"] <= words["taken"]:
        time.sleep(0.001)
    out = mgr.prepare_store([b"poison-1"])
    assert b"poison-1" in mgr._own.inflight  # served from the grants: its completion is one-way
    fill(mgr.segment.planes(), out.block_ids[0], b"poison-1")
    os.environ["KVSHM_CRASH_AT"] = point  # the owners we start inherit it
    os.kill(mgr.segment.owner_record()[0], signal.SIGKILL)
    while mgr.segment.owner_alive():  # dead before the frame goes out: it must not take it
        time.sleep(0.001)
    if kind == "touch":
        mgr.touch([b"poison-0"])
    else:
        mgr.complete_store([b"poison-1"])
    try:
        mgr.take_events()
        conn.send({"error": None, "message": ""})
    except KvshmError as e:
        conn.send({"error": type(e).__name__, "message": str(e)})
    del os.environ["KVSHM_CRASH_AT"]
    if stay:
        conn.send({"slot": mgr.slot, "gen": mgr.gen, "block": out.block_ids[0]})
        conn.recv()
    mgr.shutdown()


def reconnect_loop(name: str, cycles: int) -> None:
    """connect, one lookup, shutdown — again and again, as fast as possible."""
    for _ in range(cycles):
        mgr = connect(name, timeout=10.0)
        mgr.lookup([b"reconnect-probe"])
        mgr.shutdown()


def random_traffic(name: str, conn, seed: int, ops: int, nkeys: int, batch: int = 4) -> None:
    """Random stores (one in ten failed), loads, lookups, touches and releases of 1 to
    ``batch`` keys over a shared key space with checksummed contents, verifying every load.

    Survivors of a crash report ``errors`` (any kvshm error: a survivor must see none, only
    delays) and ``corrupt`` (a loaded block that does not hold its key's bytes). The crash
    points of the data copy live here, where this engine copies.
    """
    from kvshm.crashpoints import crash_point
    from kvshm.errors import KvshmError
    rng = random.Random(seed)
    mgr = connect(name)
    planes = mgr.segment.planes()
    keys = [b"walk-%04d" % i for i in range(nkeys)]
    stats = {"stores": 0, "loads": 0, "corrupt": 0, "errors": [], "refused": 0}
    for _ in range(ops):
        ks = rng.sample(keys, rng.randint(1, batch))
        try:
            if rng.random() < 0.5:
                out = mgr.prepare_store(ks)
                if out is None:
                    stats["refused"] += 1
                    continue
                for k, b in zip(out.keys_to_store, out.block_ids):
                    fill(planes, b, k)
                crash_point("client.store.after_copy")
                mgr.complete_store(out.keys_to_store, success=rng.random() > 0.1)
                stats["stores"] += 1
            else:
                n = mgr.lookup(ks)
                if n:
                    blocks = mgr.prepare_load(ks[:n])
                    crash_point("client.load.after_pin")
                    stats["corrupt"] += sum(not check(planes, b, k)
                                            for b, k in zip(blocks, ks[:n]))
                    mgr.complete_load(ks[:n])
                    stats["loads"] += 1
                mgr.touch(ks)
                mgr.release()
        except KvshmError as e:
            stats["errors"].append(f"{type(e).__name__}: {e}")
    mgr.release()
    conn.send(stats)
    mgr.shutdown()


def store_on_demand(name: str, conn, grants: bool = True) -> None:
    """Another engine: store each list of keys the test sends (evicting what it may) and
    report the keys stored, until it is sent None."""
    mgr = connect(name, grants=grants)
    while (keys := conn.recv()) is not None:
        conn.send(store(mgr, keys))
    mgr.shutdown()


def offered_to(mgr) -> dict[int, bytes]:
    """Block -> key of the READY blocks offered to client ``mgr`` now (still cached)."""
    from kvshm.shm import layout as L
    t = mgr.table
    es = [t.read(b) for b in range(t.num_blocks)]
    return {b: e.key for b, e in enumerate(es)
            if e.state == L.READY and (e.writer, e.writer_gen) == (mgr.slot, mgr.gen)}


def store_until_offered(mgr, n: int, batch: int, tag: str) -> dict[int, bytes]:
    """Store fresh ``batch``-key lots into ``mgr`` until the owner offers it ``n`` victims;
    returns them (block -> key)."""
    deadline = time.monotonic() + 30
    i = 0
    while len(offered := offered_to(mgr)) < n:
        assert time.monotonic() < deadline, "the owner never offered victims"
        store(mgr, [b"%s-%d-%d" % (tag.encode(), i, j) for j in range(batch)])
        i += 1
    return offered


def claim_and_wait(name: str, conn) -> None:
    """Fill the cache until the owner offers us victims, then start (never finish) a store
    that claims one: report our slot, the blocks claimed and the offers (block -> key) we
    never took, and block."""
    mgr = connect(name)
    before = store_until_offered(mgr, 2, 8, "claimer")
    out = mgr.prepare_store([b"claimer-last"])
    claimed = [b for b in out.block_ids if b in before]
    conn.send({"slot": mgr.slot, "claimed": claimed,
               "offered": {b: k for b, k in offered_to(mgr).items() if b not in claimed}})
    time.sleep(3600)  # killed by the test


def claim_marked_and_wait(name: str, conn, layout, num_blocks: int,
                          finishing: bool = False) -> None:
    """Fill a fresh cache until the owner offers us a victim, report (block, key, slot,
    gen), and when told, mark our claim of it (EVICTING, the holds not read yet: a claimer
    about to die there; ``finishing``: then open the round that finishes it and store
    CLAIMED in it, the round left open); report, then block until killed."""
    from kvshm.shm import layout as L
    from kvshm.shm import offers
    mgr = connect(name, layout, num_blocks=num_blocks, max_clients=4, ring_capacity=8192,
                  hold_capacity=64)
    t = mgr.table
    blk, key = next(iter(store_until_offered(mgr, 1, num_blocks // 4, "filler").items()))
    conn.send((blk, key, mgr.slot, mgr.gen))
    conn.recv()
    assert offers.claim_one(t, blk, mgr.slot, mgr.gen)
    if finishing:
        from kvshm.shm.entry import STATE_OFF
        t._odd(blk)
        t.buf[t.base + blk * L.ENTRY_BYTES + STATE_OFF] = L.CLAIMED
    conn.send("marked")
    time.sleep(3600)  # killed by the test


def claim_written_and_wait(name: str, conn, layout, num_blocks: int) -> None:
    """Fill a fresh cache until the owner offers us a victim, then prepare a store that
    claims it (with the rest of our grant ring) and write the new keys' bytes, never
    completing it; report (the claimed offer's block, its old key, slot, gen) and block
    until killed."""
    from kvshm.shm import slots
    mgr = connect(name, layout, num_blocks=num_blocks, max_clients=4, ring_capacity=8192,
                  hold_capacity=64)
    offered = store_until_offered(mgr, 1, num_blocks // 4, "filler")
    head, _ = slots.grants(mgr.segment, mgr.slot)
    level = head["granted"] - mgr._own.taken
    out = mgr.prepare_store([b"claimer-new-%d" % i for i in range(level)])
    blk = next(b for b in out.block_ids if b in offered)
    fill_all(mgr.segment.planes(), out.block_ids, out.keys_to_store)
    conn.send((blk, offered[blk], mgr.slot, mgr.gen))
    time.sleep(3600)  # killed by the test


def touch_until_told(name: str, conn) -> None:
    """Keep the owner busy: one-way touches as fast as we can send them, until told."""
    mgr = connect(name)
    store(mgr, [b"busy-key"])
    conn.send("busy")
    while not conn.poll():
        for _ in range(64):
            mgr.touch([b"busy-key"])
    conn.recv()
    mgr.shutdown()


def scribble_want_ring(name: str, conn, tail: int, done: int) -> None:
    """A hostile client: leave its own slot's want ring (in the tier area) with the words
    ``tail`` and ``done``, any u64, and no entries behind them; report the slot and go."""
    from kvshm.tier.area import TierArea
    mgr = connect(name)
    area = TierArea.attach(mgr.segment)
    ring = area._rings[mgr.slot]
    ring["tail"], ring["done"] = tail, done
    conn.send(mgr.slot)
    area.close()


def spoil_reply_bell(name: str, conn, how: str, calls: int) -> None:
    """A hostile client: make the file its reply doorbell had (a glibc semaphore, before
    doorbells were words of the segment) 0 bytes long (``how="truncate"``) or a FIFO, and
    keep its doorbell word raised, so that every reply rings it, while it never sleeps on
    the doorbell itself; report, and on "go" make ``calls`` calls; report what they said."""
    from kvshm.errors import KvshmError
    from kvshm.shm import slots
    mgr = connect(name)

    def poll(timeout: float, ready, spin_s: float = 0.0) -> bool:
        deadline = time.monotonic() + timeout
        while not ready():
            if time.monotonic() > deadline:
                return False
            os.sched_yield()
        return True

    mgr._link.reply_bell.wait = poll
    seg = mgr.segment
    path = f"/dev/shm/sem.kvshm-{name}@{seg.tag}-c{mgr.slot}-reply"
    if how == "fifo":
        if os.path.exists(path):
            os.unlink(path)
        os.mkfifo(path, 0o600)
    else:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600))
    word = slots.bell_view(seg, mgr.slot, "reply").cast("I")
    conn.send("spoiled")
    conn.recv()
    served, errors = 0, []
    for _ in range(calls):
        word[0] = 0xFFFFFFFF  # "asleep", and then some: every reply rings it
        try:
            mgr.take_events()
            served += 1
        except KvshmError as e:
            errors.append(type(e).__name__)
    conn.send({"served": served, "errors": errors})
    conn.recv()
    word.release()
    mgr.shutdown()


def scribble_ring_positions(name: str, conn) -> None:
    """A hostile client: once told, leave its request ring's positions 16 bytes short of
    2**64 with a frame that claims to fit, and start an owner if none runs; report, and
    on "call" make a call; report what it said."""
    from kvshm.errors import KvshmError
    from kvshm.shm.ring import _HEAD, _TAIL
    mgr = connect(name, timeout=30.0)
    conn.send(mgr.slot)
    conn.recv()
    r = mgr._link.requests
    r._lens[(2**64 - 16) % r._cap >> 2] = 5
    r._w[_HEAD], r._w[_TAIL] = 2**64 - 16, 2**64 - 8
    mgr._link.ensure_owner()
    mgr._link.ring_owner()
    conn.send("scribbled")
    conn.recv()
    try:
        mgr.take_events()
        conn.send(None)
    except KvshmError as e:
        conn.send(type(e).__name__)
    conn.recv()


def hold_word_raised(name: str, conn, word: str) -> None:
    """A hostile client: on "go", keep ``word`` raised until told to stop — the segment's
    newcomer flag ("newcomer", as if it had just connected), or its request ring's head
    ("head", as if a frame waited); report how many times it stored it."""
    import numpy as np
    from kvshm.shm.ring import _HEAD
    mgr = connect(name)
    if word == "newcomer":
        w = np.frombuffer(mgr.segment.buf, np.uint64, 1, L.OFF_NEWCOMER)
        value = 1
    else:
        w = mgr._link.requests._w[_HEAD:_HEAD + 1]
        value = w[0] + 8
    conn.send("connected")
    conn.recv()
    stores = 0
    while not conn.poll():
        w[0] = value
        stores += 1
        os.sched_yield()
    conn.recv()
    conn.send(stores)
    mgr.shutdown()


def scribble_slot_state(name: str, conn, state: int) -> None:
    """A hostile client: begin a store of two keys (its blocks WRITING), then leave its own
    slot record's state at ``state``; report the slot, and wait to be SIGKILLed."""
    from kvshm.shm import words
    mgr = connect(name)
    out = mgr.prepare_store([b"scribbler-0", b"scribbler-1"])
    seg = mgr.segment
    words.store_fields(seg.buf, seg.geometry.slot_offset(mgr.slot), L.SLOT_DTYPE,
                       state=state)
    conn.send({"slot": mgr.slot, "blocks": out.block_ids})
    conn.recv()  # SIGKILLed here


def connect_and_store(name: str, conn, rounds: int) -> None:
    """Connect (reporting the error if that fails), then store and look up ``rounds`` pairs
    of fresh keys; report the slot taken, how many rounds were served in full and the first
    error."""
    from kvshm.errors import KvshmError
    try:
        mgr = connect(name)
    except KvshmError as e:
        conn.send({"error": f"{type(e).__name__}: {e}"})
        return
    done, error = 0, None
    try:
        for i in range(rounds):
            keys = [b"newcomer-%d-%d" % (i, j) for j in range(2)]
            done += store(mgr, keys) == keys and mgr.lookup(keys) == 2
            mgr.release()
    except KvshmError as e:
        error = f"{type(e).__name__}: {e}"
    conn.send({"slot": mgr.slot, "done": done, "error": error})
    mgr.shutdown()


def take_over_and_report(name: str, conn) -> None:
    """Become the segment's owner (a takeover: adopt, refuse or reclaim every slot), report
    the errors counted and the slots left FREE, and go."""
    from kvshm.owner.server import Owner
    from kvshm.shm import slots
    owner = Owner(name)
    seg = owner.seg
    free = [s for s in range(seg.geometry.max_clients)
            if slots.record(seg, s).state == L.SlotState.FREE]
    conn.send({"errors": seg.counter("errors"), "free": free})
    owner.close()


def grow_then_store(name: str, conn, levels: list[int], size: int) -> None:
    """Store alone until the grant ring holds each of ``levels`` in turn (the first store
    without grants, then one store per level, each from the ring and one take), report, then
    store ``size`` fresh keys (a crash point may stop us inside that take); report whether
    every key of it loads back with its own bytes, and stay until told to go."""
    from kvshm.shm import slots
    mgr = connect(name)
    words, _ = slots.grants(mgr.segment, mgr.slot)
    level = lambda: int(words["granted"]) - mgr._own.taken  # noqa: E731
    store(mgr, [b"grow-0-%d" % i for i in range(2)])
    for i, want in enumerate(levels):
        deadline = time.monotonic() + 30
        while level() < want and time.monotonic() < deadline:
            time.sleep(0.01)  # polling a condition; the test checks what we report
        if i + 1 < len(levels):
            store(mgr, [b"grow-%d-%d" % (i + 1, j) for j in range(levels[i + 1] // 2)])
    conn.send((level(), mgr.slot))
    keys = [b"last-%d" % i for i in range(size)]
    stored = store(mgr, keys)
    deadline = time.monotonic() + 30
    while mgr.lookup(keys) < size and time.monotonic() < deadline:
        time.sleep(0.01)  # (the owner has not applied our Publish yet: it may be stopped)
    good = mgr.lookup(keys) == size
    if good:
        good = all(check(mgr.segment.planes(), b, k)
                   for k, b in zip(keys, mgr.prepare_load(keys)))
        mgr.complete_load(keys)
    conn.send((stored == keys, good))
    conn.recv()
    mgr.shutdown()
