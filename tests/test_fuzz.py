"""Fuzzing the owner: random frames and random operations with bad arguments.

A live owner process serves two clients. Hypothesis drives random sequences of valid and
invalid operations — unknown keys, double completes, completes of another client's store,
loads of keys being written — and raw frames (random bytes; truncated, retyped and
bit-flipped valid frames). Every call must end in a result or a typed ``KvshmError``; after
every step the owner is alive and serving, and the segment passes every invariant check
``kvshm-inspect verify`` makes.
"""
from __future__ import annotations

import time

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from kvshm.index import protocol as P
from kvshm.client.connect import connect
from kvshm.errors import KvshmError
from kvshm.inspect.snapshot import verify

from conftest import SMALL_GEOMETRY, TEST_LAYOUT, stop_owner, unique_name
from kvshm.shm.segment import Segment

KEYS = [b"fz-%d" % i for i in range(10)] + [b"x" * 64]
keys_st = st.lists(st.sampled_from(KEYS), min_size=1, max_size=5)
u64 = st.integers(-2**63, 2**64 - 1)
running_st = st.fixed_dictionaries(  # a running request's fields, valid or not
    {"request": u64, "positions": st.none() | st.lists(u64 | st.just(-1), max_size=6)})
valid_frames = st.builds(P.PrepareStore, st.integers(1, 2**31), keys_st) | st.builds(
    P.CompleteStore, st.integers(1, 2**31), keys_st, st.booleans()) | st.builds(
    P.Touch, st.just(0), keys_st) | st.builds(P.TakeEvents, st.integers(1, 2**31)) | st.builds(
    lambda req, keys, kw: P.PrepareStore(req, keys, **kw), st.integers(1, 2**31), keys_st,
    running_st) | st.builds(lambda keys, how, kw: P.Touch(0, keys, how, **kw), keys_st,
                            st.none() | st.binary(max_size=5), running_st)


def _mangle(frame: bytes, how: int, cut: int) -> bytes:
    if how == 0:
        return frame[:max(0, len(frame) - 1 - cut % max(1, len(frame)))]  # truncated
    if how == 1:
        return frame.replace(b"\xa2", b"\xa3", 1)  # a type or tag byte changed
    if how == 2:
        return frame + frame[:cut % 7]  # trailing garbage
    # One byte flipped anywhere, its high bit set: lengths, types, and names that are no
    # longer UTF-8 (msgspec raises UnicodeDecodeError there, not DecodeError).
    i = cut % max(1, len(frame))
    return frame[:i] + bytes([frame[i] ^ (0x80 | cut >> 8)]) + frame[i + 1:] if frame else frame


def _close(machine, clients: tuple[str, ...]) -> None:
    """Shut down the ``clients`` a machine made (attribute names, in order), stop its owner
    and unlink its segment: whatever of them its start made before it ended."""
    for attr in clients:
        if (m := getattr(machine, attr, None)) is not None:
            m.shutdown()
    if getattr(machine, "owner", 0):
        stop_owner(machine.owner)
    if hasattr(machine, "name"):
        Segment.unlink(machine.name)


class OwnerFuzz(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.name = unique_name()
        self.a = connect(self.name, TEST_LAYOUT, num_blocks=6, **SMALL_GEOMETRY)
        self.b = connect(self.name)
        # Raw frames go on a third client's ring: a client that breaks the protocol (ids out
        # of order, garbage) may lose its own service, never anyone else's.
        self.hostile = connect(self.name)
        self.owner = self.a.segment.owner_record()[0]

    def teardown(self):
        if hasattr(self, "hostile"):
            # Its raw frames may have carried request ids past its own counter's: the owner
            # takes its goodbye for a copy of a request answered already and sends nothing,
            # so the goodbye would wait out the whole call timeout. Unanswered, its slot is
            # reclaimed all the same (the unlock below tells the owner it left).
            self.hostile._link.timeout = 0.2
        _close(self, ("hostile", "b", "a"))

    def _try(self, fn, *args):
        try:
            return fn(*args)
        except KvshmError:
            return None

    @rule(which=st.booleans(), keys=keys_st)
    def prepare_store(self, which, keys):
        self._try((self.a if which else self.b).prepare_store, keys)

    @rule(which=st.booleans(), keys=keys_st, success=st.booleans())
    def complete_store(self, which, keys, success):
        self._try((self.a if which else self.b).complete_store, keys, success)

    @rule(which=st.booleans(), keys=keys_st)
    def load(self, which, keys):
        m = self.a if which else self.b
        n = m.lookup(keys)
        if self._try(m.prepare_load, keys[:n] or keys) is not None:
            m.complete_load(keys[:n] or keys)

    @rule(which=st.booleans(), keys=keys_st)
    def complete_load_unprepared(self, which, keys):
        self._try((self.a if which else self.b).complete_load, keys)

    @rule(which=st.booleans(), keys=keys_st)
    def touch_and_release(self, which, keys):
        m = self.a if which else self.b
        m.touch(keys)
        m.release(keys)

    @rule(data=st.binary(max_size=200))
    def random_frame(self, data):
        self._raw(data)

    @rule(msg=valid_frames, how=st.integers(0, 3), cut=st.integers(0, 2**15 - 1))
    def mangled_frame(self, msg, how, cut):
        self._raw(_mangle(P.request_encoder.encode(msg), how, cut))

    def _raw(self, frame: bytes):
        """Send a frame on the hostile client's ring and read whatever the owner answers."""
        m = self.hostile
        ring = m._link.requests
        ring.put(frame, timeout=5)
        m._link.owner_bell.ring()
        # The owner releases a frame from the ring only once it is done with it, its reply
        # (if any: a one-way Touch, a part of a request or a copy of an answered one gets
        # none) already on the reply ring. A ring never drained means it stopped reading
        # this client (it may, for a client that breaks the protocol): then only the
        # invariants below count, and no later frame is waited for either.
        end, deadline = ring.tail, time.monotonic() + 5
        while not getattr(self, "hostile_ignored", False) and not ring.consumed(end):
            if time.monotonic() > deadline:
                self.hostile_ignored = True
            time.sleep(0.001)  # polling the owner's progress on the ring
        while m._link.replies.pending():
            reply = P.reply_decoder.decode(m._link.replies.try_get())
            assert isinstance(reply, P._Msg)

    @invariant()
    def owner_serves_and_segment_is_consistent(self):
        if not hasattr(self, "a"):
            return
        assert self.a.segment.owner_alive()
        assert self.a.segment.owner_record()[0] == self.owner  # never crashed, never replaced
        assert isinstance(self.a.take_events(), list)  # still answering (a round trip)
        assert verify(self.a.segment) == []


OwnerFuzz.TestCase.settings = settings(max_examples=8, stateful_step_count=25,
                                       deadline=None)
TestOwnerFuzz = OwnerFuzz.TestCase


# --- hostile Publish frames with grants in play ------------------------------------------
# The machine above has too few blocks for grants (a client is granted a share of a quarter
# of the cache): its Publish frames name blocks nobody granted. Here the cache is big enough
# that every client holds a grant ring, and a hostile client publishes the blocks it really
# took, in frames queued together (the owner merges them) and bent: a block named twice,
# blocks never granted to it or out of any range, offers "returned" that it published,
# running ranks out of range, failed stores. An honest client stores and loads beside it and
# checks every byte it loads; every key's bytes are its own, whoever stored them.
GRANT_BLOCKS = 128
GRANT_GEOMETRY = dict(max_clients=4, ring_capacity=32 << 10, hold_capacity=256)
GKEYS = [b"fg-%d" % i for i in range(48)]
FAR = [2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**64 - 1, -1, -2**63, GRANT_BLOCKS,
       GRANT_BLOCKS - 1, 0]


def _content(key: bytes, nbytes: int) -> bytes:
    return (key * (nbytes // len(key) + 1))[:nbytes]


class GrantFuzz(RuleBasedStateMachine):
    @initialize()
    def start(self):
        self.name = unique_name()
        self.honest = connect(self.name, TEST_LAYOUT, num_blocks=GRANT_BLOCKS,
                              **GRANT_GEOMETRY)
        self.hostile = connect(self.name)
        self.owner = self.honest.segment.owner_record()[0]
        self.planes = self.honest.segment.planes()
        self.sent: list[int] = []  # blocks the hostile client published lately

    def teardown(self):
        _close(self, ("hostile", "honest"))

    def _write(self, key: bytes, block: int) -> None:
        for p in self.planes:
            p[block] = memoryview(_content(key, p.shape[1]))

    @rule(keys=st.lists(st.sampled_from(GKEYS), min_size=1, max_size=6, unique=True))
    def honest_store(self, keys):
        try:
            out = self.honest.prepare_store(keys)
            if out is not None:
                for k, b in zip(out.keys_to_store, out.block_ids):
                    self._write(k, b)
                self.honest.complete_store(out.keys_to_store)
        except KvshmError:
            pass

    @rule(keys=st.lists(st.sampled_from(GKEYS), min_size=1, max_size=12, unique=True))
    def honest_load_checks_every_byte(self, keys):
        m = self.honest
        hits = [k for k in keys if m.lookup([k])]  # each its own prefix: every cached one
        try:
            blocks = m.prepare_load(hits) if hits else []
        except KvshmError:
            blocks = []
        try:
            for k, b in zip(hits, blocks):
                for p in self.planes:
                    assert bytes(p[b]) == _content(k, p.shape[1]), f"wrong bytes for {k!r}"
        finally:
            if blocks:
                m.complete_load(hits)
            m.release()

    @rule(data=st.data())
    def hostile_publishes_bent_frames_together(self, data):
        m, own = self.hostile, self.hostile._own
        keys = data.draw(st.lists(st.sampled_from(GKEYS), max_size=8, unique=True))
        blocks = own.take(keys)
        keys = keys[:len(blocks)]
        for k, b in zip(keys, blocks):
            own.inflight.pop(k, None)  # the frames below say what becomes of them
            self._write(k, b)
        frames, i = [], 0
        while i < len(keys) or not frames:
            j = data.draw(st.integers(min(i + 1, len(keys)), len(keys)))
            ks, bs, i = keys[i:j], blocks[i:j], j
            bend = data.draw(st.integers(0, 3))
            if bend == 1 and ks:  # a block named twice
                ks, bs = ks + ks[:1], bs + bs[:1]
            elif bend == 2:  # a block never granted to it, or out of any range
                ks = ks + [data.draw(st.sampled_from(GKEYS))]
                bs = bs + [data.draw(st.sampled_from(FAR + self.sent[-5:]))]
            kw: dict = {}
            if data.draw(st.booleans()):
                kw["returned"] = data.draw(st.lists(st.sampled_from(FAR + bs + self.sent[-5:]),
                                                    min_size=1, max_size=3))
            if data.draw(st.booleans()):
                kw["request"] = data.draw(st.sampled_from([1, 2, 2**63, 2**64 - 1]))
                kw["positions"] = data.draw(st.lists(
                    st.sampled_from([-1, 0, 5, 2**63, 2**64 - 1]), min_size=len(ks),
                    max_size=len(ks)))
            frames.append(P.Publish(0, ks, bs, data.draw(st.booleans()), **kw))
            self.sent = (self.sent + bs)[-20:]
        link = m._link
        with link._lock:  # queued back to back, the bell rung once: the owner merges them
            for f in frames:
                link._put(P.request_encoder.encode(f), time.monotonic() + 5)
            link.owner_bell.ring()
            end, deadline = link.requests.tail, time.monotonic() + 10
            while not link.requests.consumed(end):
                assert time.monotonic() < deadline, "the owner stopped reading one-way frames"
                time.sleep(0.001)  # polling the owner's progress on the ring
        own.returned.clear()

    @invariant()
    def owner_serves_and_segment_is_consistent(self):
        if not hasattr(self, "honest"):
            return
        assert self.honest.segment.owner_record()[0] == self.owner  # never replaced
        assert isinstance(self.honest.take_events(), list)  # still answering (a round trip)
        assert verify(self.honest.segment) == []


GrantFuzz.TestCase.settings = settings(max_examples=6, stateful_step_count=30, deadline=None)
TestGrantFuzz = GrantFuzz.TestCase
