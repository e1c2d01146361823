"""ARC's ghost lists: the compiled ones (``_ghosts.c``) and their Python definition alike, against cases worked out
by hand; the two against each other on random operations; and L1 deciding the same with either."""

from __future__ import annotations

import random
from collections.abc import Callable

import numpy as np
import pytest

from benchmarks import trace_gen
from benchmarks.null_cache import NullPublisher
from mpcache.cache.l1 import L1Manager
from mpcache.contract.keys import ChunkKey
from mpcache.eviction import ghosts as ghosts_module
from mpcache.eviction import order as eviction_order
from mpcache.eviction.ghosts import GhostListsReference

compiled = pytest.mark.skipif(not ghosts_module.COMPILED, reason="mpcache.eviction._ghosts was not built")
WAYS = [pytest.param(GhostListsReference, id="python"),
        pytest.param(ghosts_module.GhostLists, id="compiled", marks=compiled)]


def _state(lists) -> tuple:
    return (lists.keys(0), lists.keys(1), lists.nbytes(0), lists.nbytes(1), lists.count(0), lists.count(1), len(lists))


@pytest.mark.parametrize("lists_type", WAYS)
def test_ghosts_join_newest_and_the_larger_list_gives_up_its_oldest_while_both_hold_more_than_the_bound(lists_type):
    """B1 gets a, b, c of 10 bytes and B2 x of 15, bound 40: the fourth ghost takes both to 45, so B1 (30 bytes,
    the larger) gives up a; y of 15 in B2 takes them to 50 and B2 (30) gives up x; d of 25 in B1 takes them to 60
    and B1 gives up b (50) and c (40)."""
    lists = lists_type()
    for key in "abc":
        lists.add(0, key, 10, 40)
    lists.add(1, "x", 15, 40)
    assert (["b", "c"], ["x"], 20.0, 15.0, 2, 1, 3) == _state(lists)
    lists.add(1, "y", 15, 40)
    assert (["b", "c"], ["y"], 20.0, 15.0, 2, 1, 3) == _state(lists)
    lists.add(0, "d", 25, 40)
    assert (["d"], ["y"], 25.0, 15.0, 1, 1, 2) == _state(lists)


@pytest.mark.parametrize("lists_type", WAYS)
def test_on_a_tie_b2_gives_up_its_oldest_and_an_empty_larger_list_leaves_it_to_the_other(lists_type):
    lists = lists_type()
    lists.add(0, "a", 10, 100)
    lists.add(1, "x", 10, 100)
    lists.add(0, "b", 0, 19)  # 20 bytes, 10 each: B2 gives up x
    assert (["a", "b"], []) == (lists.keys(0), lists.keys(1))
    lists.add(1, "y", 5, 1)  # 15: B1 (10) gives up a; then B2 (5) is the larger and gives up y, and b (0) stays
    assert (["b"], [], 0.0, 0.0, 1) == (lists.keys(0), lists.keys(1), lists.nbytes(0), lists.nbytes(1), len(lists))
    lists.remove("b")
    lists.add(0, "p", 0.1, 100)
    lists.add(0, "q", 0.2, 100)
    lists.remove("p")
    lists.remove("q")
    residue = 0.0 + 0.1 + 0.2 - 0.1 - 0.2  # B1 is empty, its float bytes not quite 0
    lists.add(1, "y", residue / 2, 0)  # B1 holds more but is empty: B2 gives up y; then both are empty
    assert ([], [], residue, 0.0, 0) == (lists.keys(0), lists.keys(1), lists.nbytes(0), lists.nbytes(1), len(lists))
    assert residue > 0


@pytest.mark.parametrize("lists_type", WAYS)
def test_a_ghost_is_found_in_its_list_removed_on_a_hit_and_added_again_as_the_newest(lists_type):
    lists = lists_type()
    key = ChunkKey("m", "", 7)
    lists.add(0, key, 64, 1000)
    lists.add(0, ChunkKey("m", "", 8), 64, 1000)
    assert (0, -1, True) == (lists.tier(ChunkKey("m", "", 7)), lists.tier(ChunkKey("m", "", 9)), key in lists)
    lists.remove(ChunkKey("m", "", 7))
    assert (-1, False, 64.0, 1) == (lists.tier(key), key in lists, lists.nbytes(0), lists.count(0))
    lists.add(1, key, 64, 1000)
    lists.add(0, ChunkKey("m", "", 8), 32, 1000)  # held already: it moves, with its new bytes
    assert ([ChunkKey("m", "", 8)], [key], 32.0, 64.0) == _state(lists)[:4]


@pytest.mark.parametrize("lists_type", WAYS)
def test_arc_bounds_t1_and_b1_within_capacity_then_everything_within_twice_it_b2_first(lists_type):
    """B1 a, b, c of 10 and B2 x, y of 15 (added unbounded); T1 25 and all resident 60 bytes of capacity 40: T1 + B1
    is 55, so B1 gives up a (45) and b (35); then 60 + 10 + 30 = 100 is over 80, so B2 gives up x (85) and y (70).
    With nothing resident in T1 and 75 bytes in all, B1 keeps c by the first bound (10) but the second (85) takes it,
    B2 being empty; then nothing is left to trim."""
    lists = lists_type()
    for key in "abc":
        lists.add(0, key, 10, float("inf"))
    for key in "xy":
        lists.add(1, key, 15, float("inf"))
    lists.trim_as_arc(25, 60, 40)
    assert (["c"], [], 10.0, 0.0, 1, 0, 1) == _state(lists)
    lists.trim_as_arc(0, 75, 40.0)
    assert ([], [], 0.0, 0.0, 0, 0, 0) == _state(lists)
    lists.trim_as_arc(100, 200, 40)
    assert 0 == len(lists)


@pytest.mark.parametrize("lists_type", WAYS)
@pytest.mark.parametrize("call", [
    lambda lists: lists.add(2, "k", 1, 10), lambda lists: lists.add(-1, "k", 1, 10),
    lambda lists: lists.add(True, "k", 1, 10), lambda lists: lists.add(0.0, "k", 1, 10),
    lambda lists: lists.nbytes(2), lambda lists: lists.count("0"), lambda lists: lists.keys(None),
    lambda lists: lists.add(1 << 70, "k", 1, 10),
], ids=["two", "minus-one", "bool", "float", "nbytes", "count", "keys", "huge"])
def test_a_tier_other_than_the_int_0_or_1_is_a_value_error_and_changes_nothing(lists_type, call):
    lists = lists_type()
    lists.add(0, "a", 1, 10)
    with pytest.raises(ValueError, match="tier must be 0 or 1"):
        call(lists)
    assert (["a"], [], 1.0, 0.0, 1, 0, 1) == _state(lists)


@pytest.mark.parametrize("lists_type", WAYS)
def test_unhashable_keys_and_bytes_that_are_no_number_are_type_errors_and_change_nothing(lists_type):
    lists = lists_type()
    lists.add(0, "a", 1, 10)
    for call in (lambda: lists.add(0, [1], 1, 10), lambda: lists.add(0, "b", "1", 10),
                 lambda: lists.add(0, "b", 1, None), lambda: lists.tier({}), lambda: lists.remove([]),
                 lambda: lists.trim_as_arc(0, "1", 10), lambda: lists.trim_as_arc(0, 1, [10]),
                 lambda: lists.trim_as_arc(memoryview(b"1"), 0, 0), lambda: lists.add(0, "b", bytearray(b"1"), 10)):
        with pytest.raises(TypeError):
            call()
    with pytest.raises(KeyError):
        lists.remove("b")
    assert (["a"], [], 1.0, 0.0, 1, 0, 1) == _state(lists)


class _Tenfold(float):
    """A float whose ``__float__`` says ten times its value: C reads a float's own value, not the override."""

    def __float__(self) -> float:
        return 10 * float.__float__(self)


class _Index:
    """A number by ``__index__`` alone."""

    def __index__(self) -> int:
        return 3


@pytest.mark.parametrize("lists_type", WAYS)
def test_bytes_are_read_as_c_reads_a_double_a_float_s_own_value_or_through_index(lists_type):
    lists = lists_type()
    lists.add(0, "a", _Tenfold(2.0), 100)
    lists.add(1, "b", _Index(), 100)
    assert (2.0, 3.0) == (lists.nbytes(0), lists.nbytes(1))
    lists.trim_as_arc(0, _Index(), _Tenfold(4.0))  # 3 + 2 + 3 = 8 is within 8: nothing leaves
    assert 2 == len(lists)


class _Reentering:
    """A key whose ``__del__`` runs ``action`` on the lists that dropped it (a buggy key's finaliser)."""

    action: Callable[[], None] | None = None

    def __del__(self) -> None:
        action, _Reentering.action = _Reentering.action, None
        if action is not None:
            action()


@pytest.mark.parametrize("lists_type", WAYS)
def test_a_dropped_key_s_finaliser_that_adds_a_ghost_is_counted_in_the_bytes(lists_type):
    """B1 x (10 bytes, its finaliser adds "new" of 50 to B1) and keep (10), B2 y (5); with T1 15 and capacity 20,
    x leaves (35 > 20), its finaliser adds new (85), keep leaves (75), then new (25): B1 is empty and holds 0 bytes
    (the Python definition used to subtract x's bytes from the sum read before the finaliser ran: new's 50 lost)."""
    lists = lists_type()
    lists.add(0, _Reentering(), 10, float("inf"))
    lists.add(0, "keep", 10, float("inf"))
    lists.add(1, "y", 5, float("inf"))
    _Reentering.action = lambda: lists.add(0, "new", 50, float("inf"))
    lists.trim_as_arc(15, 15, 20)
    assert ([], ["y"], 0.0, 5.0, 0, 1, 1) == _state(lists) and _Reentering.action is None


@compiled
def test_the_compiled_lists_hold_what_their_python_definition_holds_after_every_operation():
    """20,000 random operations (adds to either list with int and fractional bytes and bounds that trim, ghost hits,
    ARC's bounds, a key added again), applied to both: the same answers, errors (a missing tuple key is the
    KeyError's one argument, as a dict's), keys in order and bytes after each."""
    rng = random.Random(5)
    both = (GhostListsReference(), ghosts_module.GhostLists())
    keys = [ChunkKey("m", "", rng.getrandbits(64)) for _ in range(300)] + list(range(100))
    for step in range(20_000):
        key = rng.choice(keys)
        operation = rng.random()
        if operation < 0.55:
            nbytes = rng.choice([64, 128, 0.37 * rng.random(), rng.randrange(1, 1000)])
            name, args = "add", (rng.randrange(2), key, nbytes, rng.choice([float("inf"), 5_000, 20_000, 2_500.5]))
        elif operation < 0.75:
            name, args = "tier", (key,)
        elif operation < 0.9:
            name, args = "remove", (key,)
        else:
            capacity = rng.choice([2_000, 6_000.5, 15_000])
            resident = rng.uniform(0, capacity)
            name, args = "trim_as_arc", (rng.uniform(0, resident), rng.choice([resident, int(resident)]), capacity)
        outcomes = []
        for lists in both:
            try:
                outcomes.append(("ok", getattr(lists, name)(*args)))
            except KeyError as error:
                outcomes.append(("KeyError", error.args))
            outcomes[-1] += (_state(lists), key in lists)
        assert outcomes[0] == outcomes[1], f"step {step}"
    assert len(both[0]) > 10


REPLAY_POLICIES = [("adaptive", "rag", 2), ("adaptive", "conversations", 3), ("arc", "rag", 2),
                   ("arc", "multitenant", 4)]


@compiled
@pytest.mark.parametrize(("policy", "kind", "seed"), REPLAY_POLICIES)
def test_l1_decides_the_same_with_the_compiled_lists_and_their_python_definition(monkeypatch, policy, kind, seed):
    """A generated trace through a 20-object L1 with each: the same prefix found per request, the same ghosts,
    ARC's target and each list's bytes, with ghost hits among them (so the lists decided something), and the order's
    ``recency`` true exactly while T1 and T2 are one list."""

    class CountedHits(GhostListsReference):
        hits = 0

        def remove(self, key, /):
            CountedHits.hits += 1
            super().remove(key)

    runs = []
    for lists_type in (CountedHits, ghosts_module.GhostLists):
        monkeypatch.setattr(eviction_order, "GhostLists", lists_type)
        l1 = L1Manager(np.zeros(20 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy=policy)
        found = []
        for request in getattr(trace_gen, kind)(800, seed=seed):
            found.append(l1.lock_prefix("m", "", request.hashes, publish=False))
            reservation = l1.reserve_write("m", "", request.hashes[found[-1]:])
            l1.commit_write("m", "", [request.hashes[found[-1] + p] for p in reservation.positions], 64)
            l1.release_read("m", "", request.hashes[:found[-1]])
            assert l1._order.recency == (l1._order.lists[1] is l1._order.lists[0])
        order = l1._order
        runs.append((found, _state(order._ghosts), order.target, list(order.sizes)))
    assert sum(runs[0][0]) > 0 and CountedHits.hits > 0 and runs[0][1][-1] > 0 and runs[0] == runs[1]


class _Armed:
    """A key whose hashes collide and whose comparison runs ``action`` once, when armed (a hostile or buggy key)."""

    action: Callable[[], None] | None = None

    def __init__(self, name: str) -> None:
        self.name = name

    def __hash__(self) -> int:
        return 42

    def __eq__(self, other: object) -> bool:
        action, _Armed.action = _Armed.action, None
        if action is not None:
            action()
        return self is other


@compiled
@pytest.mark.parametrize("during", ["remove", "add", "trim_as_arc"])
def test_a_key_whose_comparison_changes_or_raises_leaves_the_compiled_lists_whole(during):
    """A comparison that calls back into the lists is a RuntimeError, one that raises is its own error; either way
    the lists hold what they held, and go on working (before, the first crashed the process)."""
    lists = ghosts_module.GhostLists()
    first, second = _Armed("a"), _Armed("b")
    lists.add(0, first, 10, 1000)
    lists.add(1, second, 20, 1000)
    calls = {"remove": lambda: lists.remove(second), "add": lambda: lists.add(0, _Armed("c"), 5, 1000),
             "trim_as_arc": lambda: lists.trim_as_arc(0, 0, 14)}  # 30 bytes over 28: B2 gives up second
    for action, error in ((lambda: lists.remove(first), RuntimeError), (_raise, LookupError)):
        _Armed.action = action
        with pytest.raises(error):
            calls[during]()
        _Armed.action = None
        assert ([first], [second], 10.0, 20.0, 1, 1, 2) == _state(lists)
    lists.remove(second)
    assert ([first], [], 1) == (lists.keys(0), lists.keys(1), len(lists))


@compiled
def test_a_trim_stopped_by_a_raising_comparison_keeps_what_it_dropped_before_and_the_rest_whole():
    """B2 z, B1 a and b (their hashes collide); a trim that drops a, then b, whose deletion compares z, which raises:
    a is gone, b and z are where they were, and the lists go on working."""
    lists = ghosts_module.GhostLists()
    z, a, b = _Armed("z"), _Armed("a"), _Armed("b")
    lists.add(1, z, 1, float("inf"))
    lists.add(0, a, 10, float("inf"))
    lists.add(0, b, 10, float("inf"))
    compared: list[str] = []

    def raise_once_a_is_gone() -> None:
        compared.append("z")
        if a not in lists.keys(0):
            raise LookupError("a key's comparison failed")
        _Armed.action = raise_once_a_is_gone  # not yet: arm again for the next comparison

    _Armed.action = raise_once_a_is_gone
    with pytest.raises(LookupError):
        lists.trim_as_arc(100, 0, 105)
    _Armed.action = None
    assert ([b], [z], 10.0, 1.0, 1, 1, 2) == _state(lists) and compared
    lists.trim_as_arc(0, 0, 0)
    assert 0 == len(lists)


def _raise() -> None:
    raise LookupError("a key's comparison failed")
