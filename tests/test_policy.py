"""Tests for kvshm.owner.policy: LRU and ARC eviction order, ARC adaptation, all-or-nothing eviction."""
from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvshm.errors import InvalidArgumentError
from kvshm.index.access import RANKED, REUSED
from kvshm.owner.policy import ARCPolicy, CachePolicy, LRUPolicy, make_policy

POLICIES = ["lru", "arc"]


def k(i: int) -> bytes:
    return b"key-%d" % i


def everything(_key: bytes) -> bool:
    return True


def only(*allowed: bytes):
    return lambda key: key in allowed


def filled(name: str, n: int, capacity: int = 16) -> CachePolicy:
    p = make_policy(name, capacity)
    for i in range(n):
        p.insert(k(i))
    return p


def arc_with_target(target: int, capacity: int = 16) -> ARCPolicy:
    """An empty ARC whose target is `target`: B1 hits with B2 empty each add exactly 1."""
    p = make_policy("arc", capacity)
    ghost = b"ghost"
    p.insert(ghost)
    assert p.evict(1, everything) == [ghost]
    for _ in range(target):
        p.touch(ghost, ready=True)
    assert isinstance(p, ARCPolicy) and p.target == target
    return p


def snapshot(p: CachePolicy):
    state = (p.order(), len(p))
    if isinstance(p, ARCPolicy):
        state += (p.lists(), p.target)
    return state


# --- behaviour shared by both policies ---------------------------------------------------
@pytest.mark.parametrize("name", POLICIES)
def test_insert_order_is_next_victim_first(name):
    p = filled(name, 3)
    assert p.order() == [k(0), k(1), k(2)]
    assert len(p) == 3 and k(1) in p and k(9) not in p


@pytest.mark.parametrize("name", POLICIES)
@pytest.mark.parametrize("ready", [True, False])
def test_touch_makes_key_last_victim(name, ready):
    p = filled(name, 3)
    p.touch(k(0), ready=ready)
    assert p.order() == [k(1), k(2), k(0)]


@pytest.mark.parametrize("name", POLICIES)
def test_touch_in_reverse_leaves_prefix_head_most_recent(name):
    p = filled(name, 4)
    for key in reversed([k(0), k(1)]):  # how the manager touches a request's keys
        p.touch(key, ready=True)
    assert p.order() == [k(2), k(3), k(1), k(0)]


@pytest.mark.parametrize("name", POLICIES)
def test_touch_unknown_key_is_noop(name):
    p = filled(name, 2)
    before = snapshot(p)
    p.touch(k(9), ready=True)
    assert snapshot(p) == before


@pytest.mark.parametrize("name", POLICIES)
def test_evict_returns_victims_in_order_and_drops_them(name):
    p = filled(name, 4)
    assert p.evict(2, everything) == [k(0), k(1)]
    assert p.order() == [k(2), k(3)]
    assert k(0) not in p and len(p) == 2


@pytest.mark.parametrize("name", POLICIES)
def test_evict_skips_non_evictable_keys(name):
    p = filled(name, 4)
    assert p.evict(2, only(k(1), k(3))) == [k(1), k(3)]
    assert p.order() == [k(0), k(2)]


@pytest.mark.parametrize("name", POLICIES)
def test_evict_too_few_candidates_returns_none_and_changes_nothing(name):
    p = filled(name, 4)
    p.touch(k(1), ready=True)
    before = snapshot(p)
    assert p.evict(3, only(k(0), k(1))) is None
    assert p.evict(5, everything) is None
    assert snapshot(p) == before


@pytest.mark.parametrize("name", POLICIES)
def test_evict_zero_returns_empty_list(name):
    p = filled(name, 2)
    before = snapshot(p)
    assert p.evict(0, everything) == []
    assert make_policy(name, 4).evict(0, everything) == []
    assert snapshot(p) == before


@pytest.mark.parametrize("name", POLICIES)
def test_evict_negative_count_is_an_error(name):
    with pytest.raises(InvalidArgumentError):
        filled(name, 2).evict(-1, everything)


@pytest.mark.parametrize("name", POLICIES)
def test_evict_asks_can_evict_at_most_once_per_key(name):
    p = filled(name, 6)
    p.touch(k(0), ready=True)
    asked: list[bytes] = []

    def can_evict(key: bytes) -> bool:
        asked.append(key)
        return key != k(2)

    assert len(p.evict(4, can_evict)) == 4
    assert len(asked) == len(set(asked))


@pytest.mark.parametrize("name", POLICIES)
def test_remove_drops_key_and_ignores_unknown(name):
    p = filled(name, 3)
    p.remove(k(1))
    p.remove(k(9))
    assert p.order() == [k(0), k(2)]


@pytest.mark.parametrize("name", POLICIES)
def test_reinserted_key_after_eviction_is_last_victim(name):
    p = filled(name, 3)
    assert p.evict(1, everything) == [k(0)]
    p.insert(k(0))
    assert p.order() == [k(1), k(2), k(0)]


# --- LRU: a running request's provisional rank (vLLM 0.33's LRUCachePolicy) -------------
def test_lru_keys_of_a_running_request_share_its_rank_tails_first():
    p = filled("lru", 3)  # k0 k1 k2
    r = p.new_rank()  # the request first touches the cache now
    p.insert(k(3))  # another key, ranked after the request
    p.access(k(0), RANKED, (r, -16))  # the request reads k0 (its head) ...
    p.insert(k(4), (r, -32))  # ... and stores k4 after it
    assert p.order() == [k(1), k(2), k(4), k(0), k(3)]  # tail before head, both before k3
    assert p.evict(2, only(k(4), k(0), k(3))) == [k(4), k(0)]


def test_lru_a_provisional_rank_never_makes_a_key_older():
    p = filled("lru", 2)
    r = p.new_rank()
    p.insert(k(2))
    p.access(k(2), RANKED, (r, -8))  # k2 was used after the request took its rank
    p.access(k(0), RANKED, (r, -8))
    p.access(k(0), RANKED, (r, -99))  # a later position of the same request: not lower
    assert p.order() == [k(1), k(0), k(2)]
    p.access(k(9), RANKED, (r, -1))  # unknown: no-op
    p.access(k(1), RANKED, None)  # no rank: no-op
    assert p.order() == [k(1), k(0), k(2)]


def test_lru_a_finished_request_makes_its_keys_most_recent_again():
    p = filled("lru", 2)
    r = p.new_rank()
    p.insert(k(2), (r, -16))
    p.insert(k(3))
    for key in (k(2), k(0)):  # on_request_finished: tails first
        p.access(key, REUSED)
    assert p.order() == [k(1), k(3), k(2), k(0)]


def test_lru_equal_ranks_go_by_key_bytes():
    p = make_policy("lru", 4)
    r = p.new_rank()
    for key in (b"b", b"a", b"c"):  # one request, one position, several groups
        p.insert(key, (r, -5))
    assert p.order() == [b"a", b"b", b"c"]
    assert p.evict(2, everything) == [b"a", b"b"]


def test_arc_ignores_provisional_ranks():
    p = filled("arc", 2)
    r = p.new_rank()
    p.insert(k(2), (r, -16))
    p.access(k(0), RANKED, (r, -8))
    assert p.order() == [k(0), k(1), k(2)] and p.lists()["t2"] == []


def test_lru_heap_stays_bounded_under_many_touches():
    p = filled("lru", 4)
    for i in range(10_000):
        p.touch(k(i % 4), ready=True)
    assert len(p._heap) <= 2 * len(p) + 65  # (touches: no heap entries at all)
    assert p.order() == [k(0), k(1), k(2), k(3)]


# --- ARC ---------------------------------------------------------------------------------
def test_arc_touch_ready_promotes_t1_to_t2():
    p = filled("arc", 2)
    p.touch(k(0), ready=True)
    assert p.lists()["t1"] == [k(1)] and p.lists()["t2"] == [k(0)]


def test_arc_touch_not_ready_keeps_key_in_t1_as_mru():
    p = filled("arc", 2)
    p.touch(k(0), ready=False)
    assert p.lists()["t1"] == [k(1), k(0)] and p.lists()["t2"] == []


def test_arc_touch_in_t2_moves_to_t2_mru():
    p = filled("arc", 2)
    p.touch(k(0), ready=True)
    p.touch(k(1), ready=True)
    p.touch(k(0), ready=True)
    assert p.lists()["t2"] == [k(1), k(0)]


def test_arc_eviction_moves_keys_to_matching_ghost_list():
    p = filled("arc", 2)
    p.touch(k(1), ready=True)
    assert p.evict(2, everything) == [k(0), k(1)]
    assert p.lists() == {"t1": [], "t2": [], "b1": [k(0)], "b2": [k(1)]}
    assert len(p) == 0 and k(0) not in p  # ghosts are not cached


def test_arc_insert_clears_ghost_entry():
    p = filled("arc", 1)
    p.evict(1, everything)
    p.insert(k(0))
    assert p.lists() == {"t1": [k(0)], "t2": [], "b1": [], "b2": []}


def test_arc_remove_leaves_no_ghost_so_reinsert_does_not_adapt():
    p = filled("arc", 2)
    p.touch(k(1), ready=True)
    p.remove(k(0))
    p.remove(k(1))
    assert p.lists() == {"t1": [], "t2": [], "b1": [], "b2": []}
    p.touch(k(0), ready=True)  # a ghost hit would move the target
    p.insert(k(0))
    p.touch(k(0), ready=True)
    assert p.target == 0


def _ghosts(p: CachePolicy, b1: list[bytes], b2: list[bytes]) -> None:
    """Put keys into B2 (via T2) and B1 (via T1) by evicting them."""
    for key in b2:
        p.insert(key)
        p.touch(key, ready=True)
    assert p.evict(len(b2), everything) == b2  # T1 empty: falls back to T2
    for key in b1:
        p.insert(key)
    assert p.evict(len(b1), everything) == b1


def test_arc_b1_hit_raises_target_by_ghost_ratio():
    p = make_policy("arc", 8)
    _ghosts(p, b1=[b"x"], b2=[b"a", b"b", b"c"])
    p.touch(b"x", ready=True)
    assert p.target == 3  # max(1, |B2| / |B1|) = 3


def test_arc_b2_hit_lowers_target_by_ghost_ratio():
    p = make_policy("arc", 8)
    _ghosts(p, b1=[b"x", b"y", b"z"], b2=[b"a", b"b"])
    for _ in range(4):
        p.touch(b"x", ready=True)  # + max(1, 2/3) = +1 each
    assert p.target == 4
    p.touch(b"a", ready=True)
    assert p.target == pytest.approx(2.5)  # - max(1, 3/2)


def test_arc_target_capped_at_capacity():
    p = make_policy("arc", 2)
    _ghosts(p, b1=[b"x"], b2=[])
    for _ in range(5):
        p.touch(b"x", ready=True)
    assert p.target == 2


def test_arc_target_floored_at_zero():
    p = make_policy("arc", 4)
    _ghosts(p, b1=[], b2=[b"a"])
    p.touch(b"a", ready=True)
    assert p.target == 0


def test_arc_ghost_lists_bounded_by_capacity_keeping_newest():
    p = make_policy("arc", 2)
    _ghosts(p, b1=[k(0), k(1), k(2)], b2=[k(3), k(4), k(5)])
    assert p.lists()["b1"] == [k(1), k(2)] and p.lists()["b2"] == [k(4), k(5)]


def test_arc_ghost_hit_refreshes_ghost_so_it_outlives_older_ghosts():
    p = make_policy("arc", 2)
    _ghosts(p, b1=[b"x", b"y"], b2=[])
    p.touch(b"x", ready=True)
    _ghosts(p, b1=[b"z"], b2=[])
    assert p.lists()["b1"] == [b"x", b"z"]


def _t1_t2(p: CachePolicy, t1: list[bytes], t2: list[bytes]) -> None:
    for key in t2:
        p.insert(key)
        p.touch(key, ready=True)
    for key in t1:
        p.insert(key)


def test_arc_evicts_from_t1_when_t1_reaches_target():
    p = arc_with_target(1)
    _t1_t2(p, t1=[b"t"], t2=[b"u"])
    assert p.evict(1, everything) == [b"t"]
    assert b"t" in p.lists()["b1"]


def test_arc_evicts_from_t2_when_t1_below_target():
    p = arc_with_target(2)
    _t1_t2(p, t1=[b"t"], t2=[b"u", b"v"])
    assert p.evict(1, everything) == [b"u"]
    assert p.lists()["b2"] == [b"u"]


def test_arc_falls_back_to_t1_when_t2_has_no_candidate():
    p = arc_with_target(2)
    _t1_t2(p, t1=[b"t"], t2=[b"u"])
    assert p.evict(1, only(b"t")) == [b"t"]


def test_arc_falls_back_to_t2_when_t1_has_no_candidate():
    p = make_policy("arc", 8)
    _t1_t2(p, t1=[b"t"], t2=[b"u"])
    assert p.evict(1, only(b"u")) == [b"u"]


def test_arc_multi_block_eviction_switches_side_as_t1_shrinks():
    p = arc_with_target(2)
    _t1_t2(p, t1=[b"t1", b"t2", b"t3"], t2=[b"u1", b"u2"])
    # |T1| 3 >= 2 -> T1; 2 >= 2 -> T1; 1 < 2 -> T2
    assert p.evict(3, everything) == [b"t1", b"t2", b"u1"]


def test_arc_order_is_the_full_eviction_order():
    p = arc_with_target(2)
    _t1_t2(p, t1=[b"t1", b"t2", b"t3"], t2=[b"u1", b"u2"])
    assert p.order() == [b"t1", b"t2", b"u1", b"u2", b"t3"]


# --- make_policy -------------------------------------------------------------------------
@pytest.mark.parametrize("name,cls", [("lru", LRUPolicy), ("LRU", LRUPolicy),
                                      ("arc", ARCPolicy), ("Arc", ARCPolicy)])
def test_make_policy_names_are_case_insensitive(name, cls):
    p = make_policy(name, 4)
    assert isinstance(p, cls) and p.name == name.lower()


@pytest.mark.parametrize("name", ["lfu", "", None])
def test_make_policy_unknown_name_lists_valid_names(name):
    with pytest.raises(InvalidArgumentError, match="lru.*arc"):
        make_policy(name, 4)


@pytest.mark.parametrize("capacity", [0, -1, 2.5, True, "8"])
def test_make_policy_rejects_capacity_below_one_or_not_int(capacity):
    with pytest.raises(InvalidArgumentError, match="capacity"):
        make_policy("lru", capacity)


def test_make_policy_error_is_also_a_value_error():
    with pytest.raises(ValueError):
        make_policy("nope", 1)


# --- random op sequences against trivial reference models --------------------------------
class ListLRU:
    """Reference LRU: a dict of ranks, sorted on every read (vLLM 0.33's rank rules)."""

    def __init__(self, capacity: int) -> None:
        self.rank: dict[bytes, tuple[int, int]] = {}
        self.n = 0

    def new_rank(self):
        self.n += 1
        return self.n

    def cached(self) -> list[bytes]:
        return sorted(self.rank, key=lambda key: (self.rank[key], key))

    def insert(self, key, rank=None):
        self.rank[key] = rank or (self.new_rank(), 0)

    def remove(self, key):
        self.rank.pop(key, None)

    def touch(self, key, ready):
        if key in self.rank:
            self.rank[key] = (self.new_rank(), 0)

    def ranked(self, key, rank):
        if key in self.rank:
            self.rank[key] = max(self.rank[key], rank)

    def evict(self, n, ok):
        victims = [key for key in self.cached() if ok(key)][:n]
        if len(victims) < n:
            return None
        for key in victims:
            del self.rank[key]
        return victims


class ListARC:
    """Reference ARC: lists, rescans per victim, works on copies and commits at the end."""

    def __init__(self, capacity: int) -> None:
        self.cap, self.target = capacity, 0.0
        self.t1: list[bytes] = []
        self.t2: list[bytes] = []
        self.b1: list[bytes] = []
        self.b2: list[bytes] = []

    def cached(self) -> list[bytes]:
        return self.t1 + self.t2

    def insert(self, key):
        self.t1.append(key)
        self.b1 = [g for g in self.b1 if g != key]
        self.b2 = [g for g in self.b2 if g != key]

    def remove(self, key):
        for lst in (self.t1, self.t2):
            if key in lst:
                lst.remove(key)

    def touch(self, key, ready):
        if key in self.t1:
            self.t1.remove(key)
            (self.t2 if ready else self.t1).append(key)
        elif key in self.t2:
            self.t2.remove(key)
            self.t2.append(key)
        elif key in self.b1:
            self.target = min(self.target + max(1, len(self.b2) / len(self.b1)), self.cap)
            self.b1.remove(key)
            self.b1.append(key)
        elif key in self.b2:
            self.target = max(self.target - max(1, len(self.b1) / len(self.b2)), 0)
            self.b2.remove(key)
            self.b2.append(key)

    def evict(self, n, ok):
        t1, t2, b1, b2, victims = list(self.t1), list(self.t2), list(self.b1), list(self.b2), []
        for _ in range(n):
            sides = [(t1, b1), (t2, b2)]
            if len(t1) < int(self.target):
                sides.reverse()
            for src, ghost in sides:
                cand = [key for key in src if ok(key)]
                if cand:
                    src.remove(cand[0])
                    ghost.append(cand[0])
                    victims.append(cand[0])
                    break
            else:
                return None
        self.t1, self.t2, self.b1, self.b2 = t1, t2, b1[-self.cap:], b2[-self.cap:]
        return victims

    def lists(self):
        return {"t1": self.t1, "t2": self.t2, "b1": self.b1, "b2": self.b2}


KEYS = st.integers(0, 7).map(k)
COMMON_OPS = (
    st.tuples(st.just("insert"), KEYS),
    st.tuples(st.just("remove"), KEYS),
    st.tuples(st.just("touch"), KEYS, st.booleans()),
    st.tuples(st.just("evict"), st.integers(0, 4), st.frozensets(KEYS)),
)
OPS = st.lists(st.one_of(*COMMON_OPS), max_size=60)
# LRU only: requests (0..2) take a rank at first use; their keys rank at (rank, -position)
RANKED_OPS = st.lists(st.one_of(
    *COMMON_OPS,
    st.tuples(st.just("ranked_insert"), KEYS, st.integers(0, 2), st.integers(0, 3)),
    st.tuples(st.just("ranked"), KEYS, st.integers(0, 2), st.integers(0, 3)),
), max_size=60)


def twin_ranks(p, model):
    """``rank_of(request, position)``: the provisional ranks the policy and the model give
    a key of a running request, each request taking its rank from both at first use."""
    requests: dict[int, tuple[int, int]] = {}  # request -> (policy's rank, model's rank)

    def rank_of(req, pos):
        if req not in requests:
            requests[req] = (p.new_rank(), model.new_rank())
        a, b = requests[req]
        return (a, -pos), (b, -pos)
    return rank_of


def apply_common(p, model, op: str, args: list) -> None:
    """A remove, touch or evict, applied to the policy and its reference model alike."""
    if op == "remove":
        p.remove(args[0])
        model.remove(args[0])
    elif op == "touch":
        p.touch(*args)
        model.touch(*args)
    else:
        n, allowed = args
        before = snapshot(p)
        got = p.evict(n, lambda key: key in allowed)
        assert got == model.evict(n, lambda key: key in allowed)
        if got is None:
            assert snapshot(p) == before  # all-or-nothing


@pytest.mark.parametrize("name,model_cls", [("lru", ListLRU), ("arc", ListARC)])
@settings(max_examples=300, deadline=None)
@given(ops=OPS, capacity=st.integers(1, 4))
def test_random_ops_match_reference_model(name, model_cls, ops, capacity):
    p, model = make_policy(name, capacity), model_cls(capacity)
    for op, *args in ops:
        if op == "insert":
            if args[0] in model.cached():
                continue  # the manager never inserts a cached key
            p.insert(args[0])
            model.insert(args[0])
        else:
            apply_common(p, model, op, args)
        assert sorted(p.order()) == sorted(model.cached()) and len(p) == len(model.cached())
        # order() is exactly the victim order when everything is evictable
        assert copy.deepcopy(p).evict(len(p), everything) == p.order()
        if name == "lru":
            assert p.order() == model.cached()
        else:
            assert p.lists() == model.lists() and p.target == model.target
            assert 0 <= p.target <= capacity
            assert len(p.lists()["b1"]) <= capacity and len(p.lists()["b2"]) <= capacity


@settings(max_examples=300, deadline=None)
@given(ops=RANKED_OPS)
def test_random_ranked_ops_match_the_rank_model(ops):
    p, model = make_policy("lru", 4), ListLRU(4)
    rank_of = twin_ranks(p, model)

    for op, *args in ops:
        if op in ("insert", "ranked_insert") and args[0] in model.rank:
            continue  # the manager never inserts a cached key
        if op == "insert":
            p.insert(args[0])
            model.insert(args[0])
        elif op == "ranked_insert":
            a, b = rank_of(args[1], args[2])
            p.insert(args[0], a)
            model.insert(args[0], b)
        elif op == "ranked":
            a, b = rank_of(args[1], args[2])
            p.access(args[0], RANKED, a)
            model.ranked(args[0], b)
        else:
            apply_common(p, model, op, args)
        assert p.order() == model.cached() and len(p) == len(model.cached())


# --- LRU: groups (a quota'd tenant's keys), which an eviction may skip whole -------------
def grouped(*groups) -> LRUPolicy:
    """An LRU with k(i) inserted in order, filed under ``groups[i]``."""
    p = LRUPolicy(16)
    for i, g in enumerate(groups):
        p.insert(k(i), None, g)
    return p


def test_lru_groups_keep_one_order_across_groups():
    p = grouped(None, "a", None, "a")
    assert p.order() == [k(0), k(1), k(2), k(3)] and len(p) == 4 and k(1) in p
    assert p.evict(3, everything) == [k(0), k(1), k(2)]


def test_lru_an_eviction_never_asks_about_keys_of_a_skipped_group():
    p = grouped("a", "a", None, "a", None)
    asked: list[bytes] = []
    victims = p.evict(2, lambda key: asked.append(key) or True, skip={"a"})
    assert victims == [k(2), k(4)] and asked == [k(2), k(4)]
    assert p.order() == [k(0), k(1), k(3)]


def test_lru_an_eviction_of_only_some_groups_asks_about_nothing_else():
    p = grouped(None, "a", "b", "a")
    asked: list[bytes] = []
    assert p.evict(2, lambda key: asked.append(key) or True, only=("a",)) == [k(1), k(3)]
    assert asked == [k(1), k(3)]
    assert p.evict(1, everything, only=("a",)) is None  # all-or-nothing, nothing changed
    assert p.order() == [k(0), k(2)]


def test_lru_a_touched_key_stays_in_its_group():
    p = grouped("a", None)
    p.touch(k(0), ready=True)
    p.touch_many([k(1), k(0)], [True, True])
    assert p.order() == [k(1), k(0)]
    assert p.evict(1, everything, skip={"a"}) == [k(1)]
    assert p.evict(1, everything, skip={"a"}) is None


def test_lru_a_provisional_key_goes_back_to_its_group():
    p = grouped("a", None)
    r = p.new_rank()
    p.insert(k(2), (r, -1), "a")
    p.access(k(0), RANKED, (r, -2))
    for key in (k(2), k(0)):  # its request finished: fresh ranks, in group "a" again
        p.access(key, REUSED)
    assert p.order() == [k(1), k(2), k(0)]
    assert p.evict(1, everything, only=("a",)) == [k(2)]


def test_lru_regroup_keeps_every_keys_place():
    p = grouped(None, None, "a", None)
    p.regroup([k(1), k(3), k(9)], "a")
    assert p.order() == [k(0), k(1), k(2), k(3)]
    assert p.evict(1, everything, skip={"a"}) == [k(0)]
    assert p.evict(1, everything, skip={"a"}) is None
    assert p.evict(3, everything, only=("a",)) == [k(1), k(2), k(3)]


GROUPS = (None, "a", "b")
GROUPED_OPS = st.lists(st.one_of(
    st.tuples(st.just("insert"), KEYS, st.sampled_from(GROUPS)),
    st.tuples(st.just("insert_many"), st.lists(KEYS, max_size=3, unique=True),
              st.sampled_from(GROUPS)),
    st.tuples(st.just("ranked_insert"), KEYS, st.sampled_from(GROUPS), st.integers(0, 2),
              st.integers(0, 3)),
    st.tuples(st.just("ranked"), KEYS, st.integers(0, 2), st.integers(0, 3)),
    st.tuples(st.just("touch_many"), st.lists(KEYS, max_size=3)),
    st.tuples(st.just("remove_many"), st.lists(KEYS, max_size=3)),
    st.tuples(st.just("regroup"), st.lists(KEYS, max_size=3), st.sampled_from(GROUPS)),
    st.tuples(st.just("dissolve"), st.sampled_from(GROUPS)),
    st.tuples(st.just("evict"), st.integers(1, 3), st.frozensets(KEYS),
              st.frozensets(st.sampled_from(GROUPS)), st.booleans()),
    *COMMON_OPS[1:3],
), max_size=60)


@settings(max_examples=400, deadline=None)
@given(ops=GROUPED_OPS)
def test_random_grouped_ops_match_the_rank_model_with_group_filters(ops):
    """Groups change what an eviction walks, never what it takes: the reference model,
    which knows no groups, refuses the skipped groups' keys in its test instead."""
    p, model = LRUPolicy(4), ListLRU(4)
    group: dict[bytes, object] = {}  # the model's key -> group
    rank_of = twin_ranks(p, model)

    for op, *args in ops:
        if op == "insert" and args[0] not in model.rank:
            p.insert(args[0], None, args[1])
            model.insert(args[0])
            group[args[0]] = args[1]
        elif op == "insert_many":
            keys = [key for key in args[0] if key not in model.rank]
            p.insert_many(keys, args[1])
            for key in keys:
                model.insert(key)
                group[key] = args[1]
        elif op == "ranked_insert" and args[0] not in model.rank:
            a, b = rank_of(args[2], args[3])
            p.insert(args[0], a, args[1])
            model.insert(args[0], b)
            group[args[0]] = args[1]
        elif op == "ranked":
            a, b = rank_of(args[1], args[2])
            p.access(args[0], RANKED, a)
            model.ranked(args[0], b)
        elif op == "touch_many":
            p.touch_many(args[0], [True] * len(args[0]))
            for key in args[0]:
                model.touch(key, True)
        elif op == "remove_many":
            p.remove_many(args[0])
            for key in args[0]:
                model.remove(key)
        elif op == "regroup":
            p.regroup(args[0], args[1])
            group.update((key, args[1]) for key in args[0] if key in model.rank)
        elif op == "dissolve":
            p.dissolve(args[0])
            group.update((key, None) for key, g in group.items() if g == args[0])
        elif op == "evict":
            n, allowed, groups, as_only = args
            def ok(key, allowed=allowed, groups=groups, as_only=as_only):
                return key in allowed and (group[key] in groups) == as_only
            before = p.order()
            got = p.evict(n, ok, *((groups, ()) if as_only else (None, groups)))
            assert got == model.evict(n, ok)
            if got is None:
                assert p.order() == before  # all-or-nothing
        elif op in ("remove", "touch"):
            apply_common(p, model, op, args)
        assert p.order() == model.cached() and len(p) == len(model.cached())
        assert not any(map(p.__contains__, (key for key in group if key not in model.rank)))


def test_lru_dissolve_files_a_groups_keys_back_in_the_common_order():
    p = grouped("a", None, "a", None)
    p.dissolve("a")
    assert p.order() == [k(0), k(1), k(2), k(3)]
    assert p.evict(2, everything, only=(None,)) == [k(0), k(1)]


def test_lru_a_cached_key_inserted_again_moves_to_the_new_group_once():
    p = grouped("a", None)
    p.insert_many([k(0), k(2)], "b")  # k0 is cached already (the caller broke its promise)
    assert len(p) == 3 and p.order() == [k(1), k(0), k(2)]
    assert p.evict(3, everything) == [k(1), k(0), k(2)] and len(p) == 0


def test_lru_evicts_provisional_keys_in_rank_order_after_its_heap_was_rebuilt():
    # A provisional key's heap entry is current while the policy's dict holds that very
    # entry; a rebuild of the heap (mostly stale entries) must keep the entries themselves,
    # or no key would be current any more and none evictable by rank.
    p = filled("lru", 0)
    r = p.new_rank()
    for i in range(4):
        p.insert(k(i), (r, -i))
    for _ in range(200):  # one key re-ranked over and over: the heap fills with stale
        p.access(k(3), RANKED, (p.new_rank(), 0))  # entries and is rebuilt, the others kept
    assert len(p._heap) <= 2 * len(p) + 65
    assert p.evict(4, everything) == [k(2), k(1), k(0), k(3)]  # tails first
