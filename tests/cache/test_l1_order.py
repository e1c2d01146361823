"""L1's eviction orders (``--l1-policy``): ARC's lists and ghosts, and the adaptive order's prefix awareness,
on hand-made objects whose victims follow from the definitions; and through L1Manager, tails before heads."""

from __future__ import annotations

import gc
import random

import numpy as np
import pytest
from support.l1_requests import engine_request

from benchmarks.null_cache import NullPublisher
from mpcache.cache.l1 import L1Manager
from mpcache.cache.l1_entries import Entry
from mpcache.contract.events import EventType
from mpcache.contract.keys import ChunkKey
from mpcache.eviction.order import ArcOrder, build
from mpcache.eviction.verdicts import STORE_PARTS, STORE_VERDICTS, StoreVerdicts


def _order(prefix_aware: bool, capacity: int = 10) -> tuple[ArcOrder, dict[str, Entry]]:
    entries: dict[str, Entry] = {}
    return ArcOrder(capacity, entries.get, prefix_aware=prefix_aware), entries


def _add(order: ArcOrder, entries: dict[str, Entry], *keys: str, parent: str | None = None) -> None:
    """Reserve and commit each key (one byte each), in this order, as L1 does (the first one ``parent``'s child,
    each next one the child of the one before, for a prefix-aware order)."""
    for key in keys:
        entries[key] = entry = Entry(0, 1)
        order.new(key, entry, entries[parent] if parent is not None and order.prefix_aware else None)
        order.lists[entry.tier][key] = entry
        parent = key


def _learned(l1: L1Manager) -> L1Manager:
    """``l1`` with its adaptive order past the recency phase, as once objects seen again have proved likelier to
    return than objects seen once (``test_the_recency_phase_ends_...``): ARC's lists and second-sight admission."""
    order = l1._order
    if getattr(order, "recency", False):
        order.split()
    return l1


class _FailuresCounted(NullPublisher):
    """Records each L1_ALLOCATION_FAILED event: its ``during`` and its per-(salt, model) chunk counts."""

    def __init__(self) -> None:
        self.failures: list[tuple[str, dict]] = []

    def emit(self, etype: EventType, fields: tuple = (), **options: object) -> bool:
        if etype is EventType.L1_ALLOCATION_FAILED:
            self.failures.append((fields[0], options["salt_counts"]))
        return True


def _store(l1: L1Manager, hashes: list[int], store: object = None) -> int:
    """Reserve and commit ``hashes`` (a store named ``store``); the chunks that got no space."""
    reservation = l1.reserve_write("m", "", hashes, store=store)
    l1.commit_write("m", "", [hashes[p] for p in reservation.positions], 64)
    return reservation.failed


def _victims(order: ArcOrder, entries: dict[str, Entry]) -> list[str]:
    out = []
    while (chosen := order.victim()) is not None:
        out.append(chosen[0])
        del entries[chosen[0]]
    return out


@pytest.mark.parametrize("prefix_aware, expected", [(False, ["x", "p", "y", "c"]), (True, ["x", "p", "c", "y"])])
def test_an_orphan_goes_before_everything_else(prefix_aware, expected):
    """c follows p in a store; once p is evicted c is worth nothing, so the adaptive order evicts it next, ahead
    of y, which ARC alone (all four seen once, least recently used first) would take before it."""
    order, entries = _order(prefix_aware)
    _add(order, entries, "x", "p")
    _add(order, entries, "y")
    _add(order, entries, "c", parent="p")
    assert expected == _victims(order, entries)


@pytest.mark.parametrize("looked_up", [False, True])
def test_a_lookup_hint_makes_the_first_stored_chunk_its_prefix_s_child(looked_up):
    """A store reserves only what its lookup missed: the lookup of 1, 2 that found 1 makes the store of 2 alone
    the child of 1 (so evicting 1 makes 2 an orphan); without that lookup 2 has no parent."""
    l1 = L1Manager(np.zeros(3 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive")
    _store(l1, [1])
    if looked_up:
        assert 1 == l1.lock_prefix("m", "", [1, 2])
    _store(l1, [2])
    assert (l1.entry_of(("m", "", 1)) if looked_up else None) is l1.entry_of(("m", "", 2)).parent


def test_a_ghost_hit_in_b1_grows_t1_s_share_and_comes_back_seen_again():
    """ARC: a miss on T1's ghost moves T1's target up by the object's size (B2 being empty, at least once) and
    the object enters T2; with T1 now at its target, the next victim is T2's."""
    order, entries = _order(False)
    _add(order, entries, "a", "b")
    assert ["a"] == [order.victim()[0]]
    del entries["a"]
    _add(order, entries, "a")
    assert 1.0 == order.target
    assert 1 == entries["a"].tier
    assert ["a", "b"] == _victims(order, entries)


@pytest.mark.parametrize("prefix_aware, ghosts", [(False, []), (True, ["k2", "k3", "k4", "k5"])])
def test_the_ghosts_hold_at_most_l1_s_capacity_in_bytes(prefix_aware, ghosts):
    """Ten objects of one byte through four bytes of L1, none used again: six evicted.  The adaptive order keeps the
    four newest ghosts; ARC keeps T1 and B1 within L1's capacity, so with T1 holding all four bytes it keeps none."""
    order, entries = _order(prefix_aware, capacity=4)
    for number in range(10):
        _add(order, entries, f"k{number}")
        if len(order) > 4:
            chosen = order.victim()
            assert chosen is not None
            del entries[chosen[0]]
    assert ghosts == [*order._ghosts.keys(0), *order._ghosts.keys(1)]


def test_the_adaptive_order_gives_up_the_larger_ghost_list_s_oldest_first():
    """Four bytes of L1 in ARC's phase: x, y, z seen again (T2) and a, b, c evicted from T1 (B1); then x and y
    evicted from T2 (T1's target set past T1) make five ghosts, one more than L1's capacity: the larger list, B1,
    gives up its oldest (ARC would give up B2's first, T1 and B1 being within the capacity)."""
    order, entries = _order(True, capacity=4)
    order.split()

    def evict(expected: str) -> None:
        order.access += 1
        chosen = order.victim()
        assert chosen is not None and expected == chosen[0]
        del entries[expected]

    for key in ("a", "x", "y", "z"):
        _add(order, entries, key)  # one by one: no parents, so no orphans
    _use(order, entries, "x", "y", "z")
    for key, evicted in (("b", "a"), ("c", "b"), ("d", "c")):
        order.access += 1
        _add(order, entries, key)
        evict(evicted)
    order.target = 10.0
    for key, evicted in (("e", "x"), ("f", "y")):
        order.access += 1
        _add(order, entries, key)
        _use(order, entries, key)
        evict(evicted)
    assert (["b", "c"], ["x", "y"]) == (order._ghosts.keys(0), order._ghosts.keys(1))


def _ghosts_of(l1: L1Manager) -> tuple[list[int], list[int]]:
    """B1's and B2's chunks, oldest first."""
    order = l1.order
    assert isinstance(order, ArcOrder)
    return [key.chunk_hash for key in order._ghosts.keys(0)], [key.chunk_hash for key in order._ghosts.keys(1)]


def test_arc_keeps_t1_and_b1_within_l1_s_capacity_and_gives_up_b2_s_ghosts_first():
    """``arc`` through L1, four chunks, each request a lookup and a store: 1–4 stored and found again (T2); 5 and
    6 each stored (T2's oldest evicted: B2 1, 2) and found again; 7 stored (3 evicted: B2 1, 2, 3); 8, 9 and 10
    each evict T1's one object (B1 7, 8, 9).  ARC (Megiddo and Modha; LMCache's ``eviction_policy/arc.py``) holds
    T1 and B1 within the capacity and all four lists within twice it, B2 giving up its oldest first: 9's miss
    finds the lists at twice the capacity and drops B2's 1, 10's drops 2.  Trimming the larger ghost list to the
    capacity would keep B1 8, 9 and B2 2, 3."""
    l1 = L1Manager(np.zeros(4 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="arc")
    engine_request(l1, ("m", ""), [1, 2, 3, 4])
    assert 4 == engine_request(l1, ("m", ""), [1, 2, 3, 4])
    for chunk in (5, 6):
        engine_request(l1, ("m", ""), [chunk])
        assert 1 == engine_request(l1, ("m", ""), [chunk])
    for chunk in (7, 8, 9, 10):
        assert 0 == engine_request(l1, ("m", ""), [chunk])
    assert ([7, 8, 9], [3]) == _ghosts_of(l1)


def test_arc_takes_a_store_of_b2_s_oldest_ghost_as_a_ghost_hit():
    """``arc`` through L1, two chunks: 1 and 2 stored and found again (T2), 3 and 4 stored by one request (T2
    gives both: B2 1, 2).  1 stored again evicts 3 (B1) first; as in ARC, whose eviction comes after the miss,
    that does not drop 1's ghost (all four lists then hold twice the capacity), so 1 comes back seen again (T2)."""
    l1 = L1Manager(np.zeros(2 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="arc")
    engine_request(l1, ("m", ""), [1, 2])
    assert 2 == engine_request(l1, ("m", ""), [1, 2])
    engine_request(l1, ("m", ""), [3, 4])
    assert ([], [1, 2]) == _ghosts_of(l1)
    assert 0 == engine_request(l1, ("m", ""), [1])
    assert (1, ([3], [2])) == (l1.entry_of(("m", "", 1)).tier, _ghosts_of(l1))


def test_an_unknown_policy_is_one_clear_error():
    with pytest.raises(ValueError, match="unknown L1 policy 'mru': expected one of adaptive, lru, arc"):
        build("mru", 10, {}.get)


@pytest.mark.parametrize("policy, evicted", [("lru", 1), ("arc", 1), ("adaptive", 3)])
def test_a_full_l1_evicts_a_prefix_tail_first_only_with_the_adaptive_order(policy, evicted):
    """Three slots hold a request's chunks 1, 2, 3; a fourth chunk evicts 3 under the adaptive order (the tail,
    worthless without its head) and 1 under LRU and ARC (released head first, so least recently used)."""
    l1 = L1Manager(np.zeros(3 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy=policy)
    for hashes in ([1, 2, 3], [4]):
        _store(l1, hashes)
    assert [h != evicted for h in (1, 2, 3, 4)] == [l1.contains(ChunkKey("m", "", h)) for h in (1, 2, 3, 4)]


@pytest.mark.parametrize("chained", [True, False])
def test_position_independent_chunks_have_no_parent(chained):
    """Blend's fingerprints (``chained=False``) name no prefix: none is another's parent, so none is orphaned."""
    l1 = L1Manager(np.zeros(3 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive")
    reservation = l1.reserve_write("m", "", [1, 2], chained=chained)
    l1.commit_write("m", "", [[1, 2][p] for p in reservation.positions], 64)
    assert (l1.entry_of(("m", "", 1)) if chained else None) is l1.entry_of(("m", "", 2)).parent


@pytest.mark.parametrize("policy", ["lru", "arc", "adaptive"])
def test_a_request_stored_one_tp_rank_at_a_time_keeps_every_rank_s_chunks(policy):
    """LMCache at TP 2: one lookup per request (its chunks' objects, rank-interleaved), then one store per rank.
    Ten slots: requests 1 and 2 (2 chunks × 2 ranks each, looked up again after their stores: seen again) fill
    eight and request 3's rank 0 the last two, so request 3's rank 1 store evicts.  Rank 1's store must not evict
    what rank 0's store of the same request just wrote (ARC's T1, over its target of 0, would): each request's
    second lookup finds all four objects."""
    l1 = L1Manager(np.zeros(10 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy=policy)
    for request in (1, 2, 3):
        ranks = [[10 * request + chunk + 5 * rank for chunk in (0, 1)] for rank in (0, 1)]
        looked_up = [key for chunk in zip(*ranks) for key in chunk]
        assert 0 == l1.lock_prefix("m", "", looked_up)
        for hashes in ranks:
            _store(l1, hashes)
        found = l1.lock_prefix("m", "", looked_up)
        l1.release_read("m", "", looked_up[:found])
        assert (request, 4) == (request, found)


def _seen_again(l1: L1Manager, key: int, lookups: int) -> None:
    """``key`` looked up ``lookups`` times: the first finds it seen once (T1) and makes it seen again (T2), each
    later one uses it in T2."""
    for _ in range(lookups):
        assert 1 == l1.lock_prefix("m", "", [key])
        l1.release_read("m", "", [key])


@pytest.mark.parametrize("gate_score, refused", [(-1, 0), (0, 1)])
def test_a_first_sight_store_asked_for_less_often_than_what_it_would_evict_is_refused_once_the_gate_proved_right(
        gate_score, refused):
    """Four slots hold 1-4, seen again and in use (each asked for three times); T2 has not been used since a
    refusal, so second sight would admit a store of 5, never seen before.  Asked for once, less often than 1 (T2's
    least recently used, the first it would evict), it is a decision of the frequency gate: refused (counted as
    the order's refusal, 1-4 kept) while the gate's score is 0 or more, admitted (1 evicted, a decision left open
    that 1 settles) below 0."""
    l1 = _learned(L1Manager(np.zeros(4 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive"))
    _t2_in_use(l1, (1, 2, 3, 4))
    order = l1._order
    order.gate.score, order.reused = gate_score, False
    opened = order.gate.decisions
    assert (refused, refused) == (_store(l1, [5]), l1.refused_chunks)
    assert order.gate.decisions == opened + 1 and ChunkKey("m", "", 1) in order.gate.protected
    assert [bool(refused), True, True, True, not refused] == [l1.contains(ChunkKey("m", "", h)) for h in range(1, 6)]


@pytest.mark.parametrize("policy, phase, first_sight", [
    ("adaptive", "recency", True), ("adaptive", "arc", False), ("arc", "arc", True)])
def test_no_store_is_refused_by_frequency_in_the_recency_phase_nor_under_arc_nor_with_an_l2_tier(policy, phase,
                                                                                                 first_sight):
    """The same four slots and store of 5, the gate on: the recency phase admits every store, as LRU does; ``arc``
    knows no gate; and where a store L1 refuses would reach no L2 tier either (``first_sight`` False) it admits."""
    l1 = L1Manager(np.zeros(4 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy=policy, first_sight=first_sight)
    if phase == "arc":
        _learned(l1)
    _t2_in_use(l1, (1, 2, 3, 4))
    order = l1._order
    order.gate.score, order.reused = 0, False
    assert (0, 0) == (_store(l1, [5]), l1.refused_chunks)


def test_a_first_sight_store_an_orphan_makes_room_for_is_not_judged_by_frequency():
    """Five slots: 1-3 seen again, 11 seen again after its parent 10 was evicted (an orphan, evicted before anything
    else), 20 seen again; the gate on.  A store of 30, never seen, needs one slot, which the orphan gives: it is
    admitted in 11's place, whatever 30 was asked for against T2's head."""
    l1 = _learned(L1Manager(np.zeros(5 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive"))
    _t2_in_use(l1, (1, 2, 3))
    _store(l1, [10, 11])
    _seen_again(l1, 11, 2)
    assert 0 == _store(l1, [20])
    _seen_again(l1, 20, 2)
    order = l1._order
    assert [ChunkKey("m", "", 11)] == list(order.lists[2])
    order.gate.score = 0
    assert (0, 0) == (_store(l1, [30]), l1.refused_chunks)
    assert (False, True) == (l1.contains(ChunkKey("m", "", 11)), l1.contains(ChunkKey("m", "", 30)))


def test_a_first_sight_store_asked_for_as_often_as_the_seen_once_object_it_would_evict_is_admitted():
    """T1 holds 9, seen once and asked for once, and is over its target, so 9 is what a store of 5 would evict:
    asked for as often, 5 is admitted in 9's place, whatever the gate's score, and no decision is made."""
    l1 = _learned(L1Manager(np.zeros(4 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive"))
    _t2_in_use(l1, (1, 2, 3))
    _store(l1, [9])
    assert 0 == l1.lock_prefix("m", "", [77])  # a lookup: the store of 5 is another access than 9's
    order = l1._order
    order.gate.score, decisions = 0, order.gate.decisions
    assert order.sizes[0] > order.target
    assert (0, decisions) == (_store(l1, [5]), order.gate.decisions)
    assert (False, True) == (l1.contains(ChunkKey("m", "", 9)), l1.contains(ChunkKey("m", "", 5)))


@pytest.mark.parametrize("policy, first_refused", [("lru", 0), ("arc", 0), ("adaptive", 1)])
def test_a_store_seen_once_is_refused_where_only_objects_seen_again_and_in_use_could_give_room(policy,
                                                                                               first_refused):
    """Four slots hold 1-4, each looked up twice (seen again: ARC's T2, T1 empty; and used there).  A store of 5
    never seen before would evict one of them: the adaptive order refuses it (failed, and counted as
    L1_ALLOCATION_FAILED during l1_store, as a full L1's store is), and admits it when it is stored again (second
    sight), evicting 1, the least recently used; LRU and ARC admit it the first time."""
    publisher = _FailuresCounted()
    l1 = _learned(L1Manager(np.zeros(4 * 64, dtype=np.uint8), publisher, 1.0, 64, policy=policy))
    for key in (1, 2, 3, 4):
        _store(l1, [key])
        _seen_again(l1, key, 2)
    failed = []
    for _ in range(2):
        reservation = l1.reserve_write("m", "", [5])
        l1.commit_write("m", "", [5 for _ in reservation.positions], 64)
        failed.append(reservation.failed)
    assert [first_refused, 0] == failed
    assert [("l1_store", {("", "m"): 1})] * first_refused == publisher.failures
    assert [False, True, True, True, True] == [l1.contains(ChunkKey("m", "", h)) for h in (1, 2, 3, 4, 5)]


@pytest.mark.parametrize("policy, refused", [("lru", 0), ("arc", 0), ("adaptive", 3)])
def test_a_store_that_only_objects_seen_again_could_make_room_for_is_refused_whole(policy, refused):
    """Four slots: 1 and 2 seen again and in use (T2), 3 seen once (T1), one free.  A store of 5, 6, 7 never seen
    before needs two slots more than are free and T1 holds one: the adaptive order refuses all three before any
    is placed (3 stays; placed in part, 5 would take the free slot and 6 evict 3, only for 7 to be refused), and
    admits the same store the next time.  LRU and ARC place all three, evicting what their order says."""
    publisher = _FailuresCounted()
    l1 = _learned(L1Manager(np.zeros(4 * 64, dtype=np.uint8), publisher, 1.0, 64, policy=policy))
    for key in (1, 2):
        _store(l1, [key])
        _seen_again(l1, key, 2)
    _store(l1, [3])
    first = l1.reserve_write("m", "", [5, 6, 7])
    l1.commit_write("m", "", [[5, 6, 7][p] for p in first.positions], 64)
    assert refused == first.failed
    assert [("l1_store", {("", "m"): 3})] * bool(refused) == publisher.failures
    if refused:
        assert [True, True, True] == [l1.contains(ChunkKey("m", "", h)) for h in (1, 2, 3)]
        second = l1.reserve_write("m", "", [5, 6, 7])
        assert (0, [0, 1, 2]) == (second.failed, second.positions)


def _t2_in_use(l1: L1Manager, keys: tuple[int, ...]) -> None:
    """Each key stored and looked up twice: seen again (T2), and used there."""
    for key in keys:
        _store(l1, [key])
        _seen_again(l1, key, 2)


@pytest.mark.parametrize("named, rank_1_failed", [(False, 0), (True, 1)])
def test_a_named_store_s_other_reservations_are_refused_with_its_first(named, rank_1_failed):
    """Four slots, 1-4 seen again and in use.  A request's rank 0 store of 5 is refused; its rank 1 store of 6
    (the same chunk's other KV rank) comes next.  Unnamed it is a store of its own, admitted, as the refusal
    waits for T2 to be used again, and evicts 1 for an object no lookup can use without 5.  Named as rank 0's
    was, it is refused with it and 1-4 stay."""
    l1 = _learned(L1Manager(np.zeros(4 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive"))
    _t2_in_use(l1, (1, 2, 3, 4))
    name = ("uid", "m", "", "request", 0, 1) if named else None
    assert [1, rank_1_failed] == [_store(l1, [key], name) for key in (5, 6)]
    assert [True] * 3 + [named] == [l1.contains(ChunkKey("m", "", h)) for h in (4, 3, 2, 1)]


@pytest.mark.parametrize("named", [False, True])
def test_a_named_store_s_objects_are_kept_from_its_other_reservations_across_lookups(named):
    """Four slots, 1-3 seen again (T2).  A request's rank 0 store of 4 takes the last slot; a lookup of another
    request comes before its rank 1 store of 5.  Unnamed, that lookup began a new access, so rank 1's store
    evicts 4 (T1's oldest) and the request is never whole; named as rank 0's was, 4 is still the current
    access's and T2 gives one instead."""
    l1 = _learned(L1Manager(np.zeros(4 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive"))
    for key in (1, 2, 3):
        _store(l1, [key])
        _seen_again(l1, key, 1)
    name = ("uid", "m", "", "request", 0, 1) if named else None
    assert 0 == _store(l1, [4], name)
    assert 0 == l1.lock_prefix("m", "", [99])
    assert 0 == _store(l1, [5], name)
    assert [named, True] == [l1.contains(ChunkKey("m", "", h)) for h in (4, 5)]


def test_named_verdicts_are_kept_for_the_newest_stores_only():
    """A refused store's name keeps its verdict for :data:`STORE_VERDICTS` named stores judged after it, then is
    forgotten: the order's memory of names is bounded whatever names clients send."""
    l1 = _learned(L1Manager(np.zeros(4 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive"))
    _t2_in_use(l1, (1, 2, 3, 4))
    assert 1 == _store(l1, [5], "refused")
    for name in range(STORE_VERDICTS - 1):
        _seen_again(l1, 1, 1)  # T2 used: the next store is judged and refused, and its name gets that verdict
        assert 1 == _store(l1, [10 + name], name)
    assert 1 == _store(l1, [6], "refused")  # its name's verdict, though T2 was not used since the last refusal
    _seen_again(l1, 1, 1)
    assert 1 == _store(l1, [7], "one more")
    assert 0 == _store(l1, [8], "refused")  # forgotten: judged afresh, T2 not used since the last refusal


def test_a_name_keeps_only_its_newest_parts():
    """A client that sends one name with ever new parts (each with a new first key: the name carries neither the rank
    nor the chunks a part skips) has only the newest :data:`STORE_PARTS` kept: the verdict's memory, and the work of
    each part's test, stay bounded.  A kept part stored again is a retry, judged afresh; the oldest are forgotten,
    and take the name's verdict as any new part does."""
    verdicts = StoreVerdicts()
    for part in range(3 * STORE_PARTS):
        verdicts.record("name", [("m", "", part)], False)
    assert 1 + STORE_PARTS == len(verdicts.verdicts["name"])
    assert verdicts.of("name", [("m", "", 3 * STORE_PARTS - 1)]) is None
    assert verdicts.of("name", [("m", "", 2 * STORE_PARTS)]) is None
    assert verdicts.of("name", [("m", "", 2 * STORE_PARTS - 1)]) is False
    assert verdicts.of("name", [("m", "", 3 * STORE_PARTS)]) is False


def test_named_verdicts_are_numbers_the_cyclic_collector_stops_walking():
    """A verdict lives for :data:`STORE_VERDICTS` named stores, far longer than a young collection: kept as
    containers of keys, every full collection would walk them for as long as they are kept; kept as a tuple of a
    flag and numbers, under a name of strings and numbers, the collector does not track them (from the first
    collection they survive)."""
    l1 = _learned(L1Manager(np.zeros(4 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive"))
    _t2_in_use(l1, (1, 2, 3, 4))
    names = [("client", "m", "", f"request-{n}", 2, 0, 1, n) for n in range(3)]  # as the LMCache front end names
    for number, name in enumerate(names):
        _seen_again(l1, 1, 1)
        for rank in range(2):
            assert 1 == _store(l1, [10 + 2 * number + rank], name)  # refused, rank by rank
    verdicts = l1._order.named.verdicts
    gc.collect()
    assert names == list(verdicts) and [False] * 3 == [kept[0] for kept in verdicts.values()]
    assert [3] * 3 == [len(kept) for kept in verdicts.values()]  # the flag and both ranks' parts
    assert not any(gc.is_tracked(kept) for kept in verdicts.values()) and not any(map(gc.is_tracked, verdicts))


def test_a_named_part_with_nothing_to_place_gives_its_name_no_verdict():
    """Four slots, 1-4 seen again and in use.  A named store's first part has nothing to place (its chunk is in
    L1 already, as a hybrid group whose chunks are all skipped, or one cut to nothing by its connection's share):
    it is not judged, so it gives its name no verdict, and the next part is judged on its own: refused."""
    l1 = _learned(L1Manager(np.zeros(4 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive"))
    _t2_in_use(l1, (1, 2, 3, 4))
    assert 1 == l1.reserve_write("m", "", [1], store="request").present
    assert 1 == _store(l1, [5], "request")
    assert [True] * 4 == [l1.contains(ChunkKey("m", "", h)) for h in (1, 2, 3, 4)]


@pytest.mark.parametrize("named, rank_1_failed", [(False, 0), (True, 1)])
def test_a_refused_store_s_later_part_is_refused_though_it_would_fit(named, rank_1_failed):
    """Five slots, 1-4 seen again and in use, one free.  A request's rank 0 store of 5 and 6 needs two and is
    refused; its rank 1 store of 7 would fit the free slot.  Unnamed it is placed, where no lookup can use it
    without rank 0's; named as rank 0's was, it is refused with it and the slot stays free."""
    l1 = _learned(L1Manager(np.zeros(5 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive"))
    _t2_in_use(l1, (1, 2, 3, 4))
    name = "request" if named else None
    assert [2, rank_1_failed] == [_store(l1, [5, 6], name), _store(l1, [7], name)]
    assert [True] * 4 + [not named] == [l1.contains(ChunkKey("m", "", h)) for h in (1, 2, 3, 4, 7)]


def test_a_refused_part_stored_again_is_judged_afresh_once_its_keys_are_forgotten():
    """Four slots, 1-4 seen again and in use.  A named store's part of 5 and 6 is refused; another refusal's
    four keys then push 5 and 6 out of the keys remembered as refused (as many bytes as T2 holds).  The same part
    stored again (a retry) is judged afresh, not by the name's old verdict: with the frequency gate off (its
    decisions proved wrong), T2 has not been used since the last refusal, so it is admitted."""
    l1 = _learned(L1Manager(np.zeros(4 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive"))
    _t2_in_use(l1, (1, 2, 3, 4))
    assert 2 == _store(l1, [5, 6], "request")
    _seen_again(l1, 1, 1)
    assert 4 == _store(l1, [7, 8, 9, 10])
    l1._order.gate.score = -1
    assert 0 == _store(l1, [5, 6], "request")


def test_a_named_store_s_parts_take_its_verdict_where_one_part_s_keys_outlast_the_other_s():
    """Four slots, 1-4 seen again and in use.  Rank 1's key of a chunk (6) is remembered as refused where rank 0's
    (5) is not: the memory forgets its oldest keys, so one part's can outlast another's.  A request stores the
    chunk rank by rank: rank 0's store of 5 is a first sight, refused; rank 1's store of 6 would be a second sight,
    but it takes its name's verdict, so both ranks are refused and 1-4 stay (admitted, 6 would evict one of them
    for an object no lookup can use without 5).  The next time both keys are remembered: both ranks admitted."""
    l1 = _learned(L1Manager(np.zeros(4 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive"))
    _t2_in_use(l1, (1, 2, 3, 4))
    l1._order._refused.remember([ChunkKey("m", "", 6)], 64, 4 * 64)
    assert [1, 1] == [_store(l1, [key], "S") for key in (5, 6)]
    assert [True] * 4 == [l1.contains(ChunkKey("m", "", h)) for h in (1, 2, 3, 4)]
    assert [0, 0] == [_store(l1, [key], "T") for key in (5, 6)]


def test_a_retried_named_store_s_later_parts_take_the_retry_s_verdict():
    """Four slots, 1-4 seen again and in use.  A named store's parts A (5, 15) and B (6) are refused; another
    refusal then pushes 5 and 15, not 6, out of the keys remembered as refused.  The store is retried, B first:
    B is judged afresh (6 remembered: admitted, the gate off) and gives the name its verdict, which A, stored again
    after it, takes, so both parts are stored (judged afresh too, A would be refused, B's object useless)."""
    l1 = _learned(L1Manager(np.zeros(4 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive"))
    _t2_in_use(l1, (1, 2, 3, 4))
    assert [2, 1] == [_store(l1, [5, 15], "S"), _store(l1, [6], "S")]
    _seen_again(l1, 1, 1)
    assert 3 == _store(l1, [7, 8, 9])
    assert [False, False, True] == [ChunkKey("m", "", h) in l1._order._refused for h in (5, 15, 6)]
    _seen_again(l1, 1, 1)
    l1._order.gate.score = -1
    assert [0, 0] == [_store(l1, [6], "S"), _store(l1, [5, 15], "S")]
    assert [True] * 3 == [l1.contains(ChunkKey("m", "", h)) for h in (5, 15, 6)]


@pytest.mark.parametrize("named", [False, True])
def test_two_requests_stored_rank_by_rank_in_one_step_keep_each_other_s_objects(named):
    """Four slots, 1 and 2 seen again (T2).  One engine step stores requests A and B rank by rank, A0 B0 A1 B1,
    no lookup between: A1 and B1 each need a slot, and T2 gives both, as neither may evict what the step's other
    stores just wrote (named or not)."""
    l1 = L1Manager(np.zeros(4 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive")
    for key in (1, 2):
        _store(l1, [key])
        _seen_again(l1, key, 1)
    for key, request in ((10, "A"), (20, "B"), (11, "A"), (21, "B")):
        assert 0 == _store(l1, [key], request if named else None)
    assert [True] * 4 == [l1.contains(ChunkKey("m", "", h)) for h in (10, 20, 11, 21)]


def test_objects_seen_twice_and_never_used_again_do_not_keep_new_stores_out():
    """Each store is looked up once right after (a client's round trip): L1 fills with objects seen twice that
    no one uses again.  The adaptive order refuses a new store only while an object seen again is in use, so
    every round trip finds its chunks; and after a refusal it admits the next store unless T2 was used since."""
    l1 = _learned(L1Manager(np.zeros(4 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive"))
    failed = []
    for key in range(1, 21):
        reservation = l1.reserve_write("m", "", [key])
        l1.commit_write("m", "", [key for _ in reservation.positions], 64)
        failed.append(reservation.failed)
        if not reservation.failed:
            _seen_again(l1, key, 1)
    assert [0] * 20 == failed
    _seen_again(l1, 20, 1)  # used in T2: the next store seen once is refused, the one after it is not
    assert [1, 0] == [l1.reserve_write("m", "", [key]).failed for key in (21, 22)]


def test_a_parent_s_children_are_orphaned_in_the_order_they_were_stored():
    """An evicted parent's children go first, oldest first: the order is the stores', not the keys' hashes (which
    differ with the interpreter's hash seed, and made one trace's evictions differ from run to run)."""
    order, entries = _order(prefix_aware=True, capacity=100)
    children = [f"child-{i}" for i in range(12)]
    _add(order, entries, "parent")
    for child in children:
        _add(order, entries, child, parent="parent")
    assert _victims(order, entries) == ["parent", *children]


@pytest.mark.parametrize("flooder", [("m", "other-tenant"), ("other-model", "")])
@pytest.mark.parametrize("policy, kept", [("lru", False), ("arc", False), ("adaptive", True)])
def test_one_tenant_s_or_model_s_one_off_prompts_do_not_push_out_another_s_reused_prefixes(flooder, policy, kept):
    """A 64-chunk L1 shared by a tenant that asks its 3 prompts of 8 chunks in turn (24 chunks: they fit) and
    another tenant or model that sends 2 prompts of 16 chunks never seen again after each of them (112 chunks
    between two asks of one prompt).  Under LRU the flood evicts every prompt before it is asked again, so the
    first tenant never finds anything; so under ARC, which keeps T1 and the ghosts of what T1 evicted within L1's
    capacity: with T1 full of the flood it remembers nothing.  The adaptive order remembers as many bytes of
    evicted objects as L1 holds, whatever T1 holds: a prompt asked again within that is seen again (round 2) and
    kept apart from the objects seen once, so from the third round on the first tenant finds every chunk of every
    prompt."""
    l1 = _learned(L1Manager(np.zeros(64 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy=policy))
    prompts = [list(range(base, base + 8)) for base in (1000, 2000, 3000)]
    flood = iter(range(10**6, 2 * 10**6))
    found_per_round = []
    for _ in range(6):
        found = 0
        for prompt in prompts:
            found += engine_request(l1, ("m", "tenant"), prompt)
            for _ in range(2):
                engine_request(l1, flooder, [next(flood) for _ in range(16)])
        found_per_round.append(found)
    assert found_per_round == [0, 0] + ([24] * 4 if kept else [0] * 4)


def test_the_orphans_bytes_are_kept_as_they_come_and_go():
    """The orphans' size (what a store may take before it would evict an object seen again) follows every way an
    orphan comes and goes: orphaned with its parent's eviction, evicted, or used again (T2)."""
    order, entries = _order(prefix_aware=True, capacity=100)
    _add(order, entries, "parent")
    for child in ("a", "b", "c"):
        _add(order, entries, child, parent="parent")
    assert [4, 0, 0] == order.sizes
    assert "parent" == order.victim()[0]
    assert [0, 0, 3] == order.sizes
    assert "a" == order.victim()[0]
    del order.lists[2]["b"]  # taken out by a lookup: used again
    order.promote(entries["b"])
    assert [0, 1, 1] == order.sizes


def _use(order: ArcOrder, entries: dict[str, Entry], *keys: str) -> None:
    """Each key taken out of the order and put back, as a lookup's read does: used again."""
    for key in keys:
        entry = entries[key]
        del order.lists[entry.tier][key]
        if entry.tier != order.again:
            order.promote(entry)
        entry.used = order.access
        order.lists[entry.tier][key] = entry


@pytest.mark.parametrize("split, expected", [(False, ["a", "b", "c"]), (True, ["b", "c", "a"])])
def test_the_adaptive_order_starts_in_a_recency_phase_that_evicts_least_recently_used_first(split, expected):
    """a is used again (seen again: T2), then b and c are stored (seen once).  In the recency phase the adaptive
    order evicts as LRU does, a first (used longest ago), its ghost kept by its tier; past it, as ARC with T1's
    target at 0: T1's b and c before T2's a."""
    order, entries = _order(True)
    _add(order, entries, "a")
    _use(order, entries, "a")
    _add(order, entries, "b")
    _add(order, entries, "c")  # not b's child: each its own store
    assert (True, 3) == (order.recency, len(order))
    order.access += 1  # a lookup: none of them is the current access's, which ARC would spare
    if split:
        order.split()
        assert (["b", "c"], ["a"]) == (list(order.lists[0]), list(order.lists[1]))
    assert expected == _victims(order, entries)
    assert (["b", "c"], ["a"]) == (order._ghosts.keys(0), order._ghosts.keys(1))


def _ghosts(order: ArcOrder, entries: dict[str, Entry], count: int) -> None:
    """``count`` objects seen once (s0…) and ``count`` seen again (t0…), all evicted: B1 and B2 ``count`` bytes each."""
    for n in range(count):
        _add(order, entries, f"s{n}")
        _add(order, entries, f"t{n}")
        _use(order, entries, f"t{n}")
    _victims(order, entries)
    assert [count, count] == [order._ghosts.nbytes(0), order._ghosts.nbytes(1)]


def test_the_recency_phase_ends_once_objects_seen_again_return_more_often_than_their_share_by_three_sigmas():
    """B1 and B2 hold 20 ghosts each and only B2's come back.  The k-th hit finds 21 - k of the 41 - k ghosts in
    B2 (its share s_k, the chance of a hit in B2 were an object seen again no likelier to return): the phase ends
    at the first k where k - sum(s_i) exceeds 3 standard deviations of that sum, sqrt(sum(s_i * (1 - s_i))), at
    least 3; here k = 8 (7: 3.79 against 3.95; 8: 4.40 against 4.21).  T2 then holds what was seen again, in its
    order, and the next hit.  Splitting again changes nothing."""
    order, entries = _order(True, capacity=40)
    _ghosts(order, entries, 20)
    phases = []
    for n in range(9):
        _add(order, entries, f"t{n}")
        phases.append(order.recency)
    assert [True] * 7 + [False] * 2 == phases
    assert ([], [f"t{n}" for n in range(9)]) == (list(order.lists[0]), list(order.lists[1]))
    order.split()
    assert ([], [f"t{n}" for n in range(9)]) == (list(order.lists[0]), list(order.lists[1]))


def test_the_recency_phase_lasts_while_objects_seen_again_return_no_more_often_than_those_seen_once():
    """B1 and B2 hold 20 ghosts each and come back alternately, each at its share: the order stays in the
    recency phase (LRU's order), as an object seen again is no likelier to return."""
    order, entries = _order(True, capacity=40)
    _ghosts(order, entries, 20)
    for n in range(20):
        _add(order, entries, f"s{n}" if n % 2 == 0 else f"t{n}")
        assert order.recency
    assert order.lists[0] is order.lists[1] and 20 == len(order)


def _asked_alone(order: ArcOrder, key: str, found: bool) -> None:
    """``key`` (one byte) asked for by a lookup of its own (a new access), which L1 ``found`` or missed."""
    order.access += 1
    order.asked((key,), 1, found)


def _trail_an_lru(order: ArcOrder, capacity: int, keys_per_access: int = 1) -> int:
    """Past the split, L1 misses its capacity's bytes (new keys, settling) and then, access after access, the same
    ``keys_per_access`` keys, which an LRU holds (asked for in the access before); returns how many such accesses
    it took to end ARC's phase (an access's step counts once the next access asks its first key)."""
    for n in range(capacity):
        _asked_alone(order, f"new-{n}", False)
    hot = [f"hot-{n}" for n in range(keys_per_access)]
    order.access += 1
    for key in hot:
        order.asked((key,), 1, False)  # missed by both (new to the shadow too): no disagreement
    accesses = 0
    while not order.recency:
        order.access += 1
        for key in hot:
            order.asked((key,), 1, False)  # the LRU holds it, L1 missed it: this access's step -1 per key
            if order.recency:
                break
        accesses += 1
        assert accesses < 1000
    return accesses - 1  # the last access only ended the phase with the step of the one before


def test_arc_s_phase_ends_once_l1_trails_an_lru_of_its_capacity_by_join_sigmas():
    """Past the split, once L1 has missed its capacity's bytes, each access's sampled keys that an LRU of its
    capacity finds and L1 does not (or the other way) add up to its step.  With n accesses of one such key each
    the lead is -n and the root of the squares' sum sqrt(n): ARC's phase ends at the first n with sqrt(n) >
    JOIN_SIGMAS.  T1 and T2 are then one list again, least recently used first across both: b (used at access 1),
    c (stored at 2), a (used at 3), d (stored at 4), which neither list's order alone gives."""
    from mpcache.eviction import phases as module

    order, entries = _order(True, capacity=8)
    _add(order, entries, "a", "b")
    order.access = 1
    _use(order, entries, "b")
    order.access = 2
    _add(order, entries, "c")
    order.access = 3
    _use(order, entries, "a")
    order.access = 4
    _add(order, entries, "d")
    order.split()
    assert (["c", "d"], ["b", "a"]) == (list(order.lists[0]), list(order.lists[1]))
    expected = next(n for n in range(1, 1000) if n ** 0.5 > module.JOIN_SIGMAS)
    assert expected == _trail_an_lru(order, 8)
    assert order.lists[0] is order.lists[1] and ["b", "c", "a", "d"] == list(order.lists[0])
    assert 1 == order.phases.joins
    order.join()  # joined already: nothing changes
    assert 1 == order.phases.joins and ["b", "c", "a", "d"] == list(order.lists[0])


def test_the_shadow_lru_starts_from_the_one_list_and_l1_s_lead_counts_after_join_settling():
    """40 objects stored in the recency phase, then the split: the shadow LRU starts holding them, as an LRU
    would (the one list is its order).  L1 misses JOIN_SETTLING of its capacity in new keys (each pushing an old
    one out of the shadow); then, access after access, it misses a newer half's key the shadow still holds: ARC's
    phase ends at the first n with sqrt(n) > JOIN_SIGMAS, evidence only a shadow started from the list has."""
    from mpcache.eviction import phases as module

    order, entries = _order(True, capacity=40)
    old = [f"old-{n}" for n in range(40)]
    for key in old:
        order.access += 1
        _add(order, entries, key)
    order.split()
    settling = int(module.JOIN_SETTLING * 40)
    for n in range(settling):
        _asked_alone(order, f"new-{n}", False)
    accesses = 0
    for key in old[settling:]:
        _asked_alone(order, key, False)  # held by the shadow since the split, missed by L1: a step of -1
        if order.recency:
            break
        accesses += 1
    assert next(n for n in range(1, 1000) if n ** 0.5 > module.JOIN_SIGMAS) == accesses
    assert 1 == order.phases.joins


def test_a_request_s_chunks_kept_or_lost_together_are_one_piece_of_evidence():
    """Eight keys an access, each held by the LRU and missed by L1: the lead is -8n and the squares' sum 64n, so
    ARC's phase ends after as many accesses as with one key each, not after an eighth of them."""
    one, eight = _order(True, capacity=16)[0], _order(True, capacity=16)[0]
    one.split()
    eight.split()
    assert _trail_an_lru(one, 16) == _trail_an_lru(eight, 16, keys_per_access=8)


def test_l1_stamps_each_object_s_last_use_and_a_join_orders_t1_and_t2_by_it():
    """Through L1: 10 and 20 stored (accesses 1, 2), 10 looked up (3), 30 stored (4), 20 looked up (5), 40 stored
    (6).  Split, T1 holds 30, 40 and T2 10, 20; joined, they are one list in their last uses: 10, 30, 20, 40."""
    l1 = L1Manager(np.zeros(8 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive")
    for chunk in (10, 20, 10, 30, 20, 40):
        found = l1.lock_prefix("m", "", [chunk], publish=False)
        if not found:
            _store(l1, [chunk])
        l1.release_read("m", "", [chunk][:found])
    order = l1._order
    order.split()
    assert ([30, 40], [10, 20]) == ([key.chunk_hash for key in order.lists[0]],
                                    [key.chunk_hash for key in order.lists[1]])
    order.join()
    assert [10, 30, 20, 40] == [key.chunk_hash for key in order.lists[0]] and order.lists[1] is order.lists[0]


def test_arc_s_phase_lasts_while_l1_finds_what_an_lru_would_not():
    """The other way round: past the split and its settling, L1 finds a key the LRU would not hold (asked for
    once, long before: evicted from the LRU's capacity since) again and again; ARC's phase lasts."""
    order, entries = _order(True, capacity=8)
    order.split()
    for n in range(8):
        _asked_alone(order, f"new-{n}", False)
    for n in range(500):
        _asked_alone(order, f"old-{n}", True)  # the LRU never held it: L1's lead +1
        assert not order.recency
    assert 0 == order.phases.joins


def _lead_then_trail(order: ArcOrder, lead: int, dip: bool = False) -> int:
    """Past a split and its settling (8 bytes: the capacity of ``_order(True, capacity=8)``), L1 finds ``lead``
    keys the LRU would not, one access each (with ``dip``, then misses one the LRU holds and finds one more: back to
    its highest lead); then, access after access, it misses a key the LRU holds.  Returns how many such accesses
    it took to end ARC's phase."""
    order.split()
    for n in range(8):
        _asked_alone(order, f"new-{order.phases.joins}-{n}", False)
    for n in range(lead):
        _asked_alone(order, f"old-{order.phases.joins}-{n}", True)  # the LRU never held it: L1's lead +1
    hot = f"hot-{order.phases.joins}"
    _asked_alone(order, hot, False)  # missed by both: the LRU holds it from here on
    if dip:
        _asked_alone(order, hot, False)  # -1
        _asked_alone(order, f"old-{order.phases.joins}-dip", True)  # +1: the lead is at its highest again
    accesses = 0
    while not order.recency:
        _asked_alone(order, hot, False)  # the LRU holds it, L1 missed it: -1, counted at the next access
        accesses += 1
        assert accesses < 1000
    return accesses - 1


def test_arc_s_phase_ends_once_l1_trails_an_lru_and_has_fallen_from_its_highest_lead_by_join_fall_sigmas():
    """Past the split, L1 first leads the LRU by 100 accesses' keys (+1 each), then trails it access after access
    (-1 each): ARC's phase ends at the first n of those where the lead, 100 - n, is below 0 and has fallen from its
    highest by more than JOIN_FALL_SIGMAS times the root of the n steps' squares (n > JOIN_FALL_SIGMAS * sqrt(n)),
    or is below -JOIN_SIGMAS times the root of every step's squares since the split, sqrt(100 + n): n = 101 where
    the second test alone needs 148.  A second phase measures from its own split: a lead of 5 there, below the
    first phase's highest, ends it at the first n > 5 with n > JOIN_FALL_SIGMAS * sqrt(n).  A third, whose lead of
    5 dips by one and comes back before the losses, measures the fall from where it came back: the same n."""
    from mpcache.eviction import phases as module

    order = _order(True, capacity=8)[0]
    for lead, dip, phases in ((100, False, 1), (5, False, 2), (5, True, 3)):
        expected = next(n for n in range(1, 1000) if lead - n < 0 and (
            n > module.JOIN_FALL_SIGMAS * n ** 0.5 or lead - n < -module.JOIN_SIGMAS * (lead + 2 * dip + n) ** 0.5))
        assert expected == _lead_then_trail(order, lead, dip)
        assert phases == order.phases.joins


def test_after_a_join_the_recency_phase_asks_for_twice_the_evidence_before_it_splits_again():
    """The scene of ``test_the_recency_phase_ends_once_...`` after one join: B2's hits exceed their share by 4.40
    standard deviations at the 8th, past the 3 that split it before but short of the 6 it asks for now."""
    order, entries = _order(True, capacity=40)
    order.split()
    _trail_an_lru(order, 40)
    assert order.recency and 1 == order.phases.joins
    _ghosts(order, entries, 20)
    for n in range(9):
        _add(order, entries, f"t{n}")
        assert order.recency


def test_after_a_join_the_split_test_counts_at_most_resplit_hits_per_access_of_one_access_s_ghost_hits():
    """B2 ghost hits, each at a share of 1/2: before any join they count one by one, all in one access (the phase
    ends at the n-th where n / 2 > 3 * sqrt(n / 4), n = 10).  After a join (6 standard deviations) 10,000 in one
    access (a long context evicted, come back) do not end it: 16 of them count, 8 above their share against a
    standard deviation of 2.  16 an access end it once n / 2 > 6 * sqrt(n / 4), n = 37: the third access's 5th."""
    from mpcache.eviction import phases as module
    from mpcache.eviction.phases import PhaseTests

    assert 16 == module.RESPLIT_HITS_PER_ACCESS

    def b2_hit(phases: PhaseTests, access: int) -> bool:
        return phases.split_due(1, 10, 9, access)  # B2's ghost taken out: 10 and 10 left before it, a share of 1/2

    phases = PhaseTests(1000)
    assert 10 == next(n for n in range(1, 1000) if b2_hit(phases, 0))
    phases.split()
    phases.join()
    assert not any(b2_hit(phases, 1) for _ in range(10_000))
    phases = PhaseTests(1000)
    phases.join()
    assert (3, 5) == next((access, hit) for access in range(1, 100) for hit in range(1, 17) if b2_hit(phases, access))


def test_the_recency_phase_admits_the_store_the_second_sight_refuses():
    """The scene of the second-sight refusal (four slots, 1-4 seen again and in use; a store of 5 never seen
    before) in the recency phase: 5 is admitted at once and evicts 1, the least recently used, as under LRU."""
    publisher = _FailuresCounted()
    l1 = L1Manager(np.zeros(4 * 64, dtype=np.uint8), publisher, 1.0, 64, policy="adaptive")
    for key in (1, 2, 3, 4):
        _store(l1, [key])
        _seen_again(l1, key, 2)
    assert (0, []) == (_store(l1, [5]), publisher.failures)
    assert [False, True, True, True, True] == [l1.contains(ChunkKey("m", "", h)) for h in (1, 2, 3, 4, 5)]


def test_the_recency_phase_weighs_a_ghost_hit_as_one_object_whatever_its_bytes():
    """B1 holds 10 ghosts of 10 bytes, B2 10 of 1 byte, and they come back alternately: each list at its share of
    the objects.  The phase lasts (by bytes B2 would have looked hit ten times too often)."""
    order, entries = _order(True, capacity=200)
    for n in range(10):
        entries[f"s{n}"] = Entry(0, 10)
        order.new(f"s{n}", entries[f"s{n}"], None)
        order.lists[0][f"s{n}"] = entries[f"s{n}"]
        _add(order, entries, f"t{n}")
        _use(order, entries, f"t{n}")
    _victims(order, entries)
    assert [100, 10] == [order._ghosts.nbytes(0), order._ghosts.nbytes(1)]
    for n in range(10):
        key = f"s{n}" if n % 2 == 0 else f"t{n}"
        entries[key] = Entry(0, 10 if key[0] == "s" else 1)
        order.new(key, entries[key], None)
        assert order.recency


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_an_l1_of_uniformly_drawn_keys_stays_in_the_recency_phase(seed):
    """Each request one chunk drawn uniformly from 80 into an L1 of 40: an object seen again is exactly as likely to
    return as one seen once, so over 6,000 requests the order stays LRU's.  (Judged against B2's share as it was
    at the end, B2's hits drifted above it by more than three deviations within 1,800–4,500 requests.)"""
    rng = random.Random(seed)
    l1 = L1Manager(np.zeros(40 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive")
    for _ in range(6000):
        key = rng.randrange(80)
        found = l1.lock_prefix("m", "", [key], publish=False)
        if found:
            l1.release_read("m", "", [key])
        else:
            _store(l1, [key])
    assert l1._order.recency and l1._order.phases._b2_hits > 1000


@pytest.mark.parametrize("asked_first, refused", [("evicted", 1), ("admitted", 0)])
def test_the_frequency_gate_keeps_out_a_store_asked_for_twice_once_it_has_proved_right(asked_first, refused):
    """Four slots hold 1-4, each stored once and looked up four times (T2; asked for five times each).  A store
    of 10 is refused on first sight and admitted on its second: asked for twice, less often than T2's least
    recently used object (1), the frequency gate would refuse it, but its score starts below 0, so it only
    records the decision, and 10 evicts 1.  If 1 is then asked for again (stored again) before 10 is, the gate
    was right: the next store asked for twice (20) is refused on its second sight too, and 1-4 stay.  If 10 is
    asked for first (looked up), the gate was wrong and stays off: 20 is admitted on its second sight."""
    l1 = _learned(L1Manager(np.zeros(4 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive"))
    for key in (1, 2, 3, 4):
        _store(l1, [key])
        _seen_again(l1, key, 4)

    def second_sight(key: int, looked_up: tuple[int, ...]) -> list[int]:
        """``key`` stored twice, an object of T2 looked up before each (T2 in use): the chunks each failed."""
        failed = []
        for _ in range(2):
            for used in looked_up:
                _seen_again(l1, used, 1)
            failed.append(_store(l1, [key]))
        return failed

    assert [1, 0] == second_sight(10, (2,))
    assert [False, True, True, True, True] == [l1.contains(ChunkKey("m", "", h)) for h in (1, 2, 3, 4, 10)]
    if asked_first == "evicted":
        _seen_again(l1, 2, 1)  # a new access: 10 is no longer among the objects being admitted
        assert 0 == _store(l1, [1])  # a ghost of T2: admitted, and 10 (T1) makes room
        kept = (1, 2, 3, 4)
    else:
        _seen_again(l1, 10, 1)
        kept = (2, 3, 4, 10)
    assert [1, refused] == second_sight(20, kept)  # T2's least recently used: kept[0]
    assert [bool(refused), True, True, True, not refused] == [l1.contains(ChunkKey("m", "", h)) for h in (*kept, 20)]


def test_the_frequency_gate_settles_every_decision_a_key_names_once_and_keeps_its_evidence_bounded():
    """Stores of one new key each against T2's head (a, asked for more often): each is a decision that would
    protect a.  When a is asked for, every open decision naming it is settled right (+1 each, the score held
    within GATE_LIMIT); a store's key asked for afterwards settles nothing more.  However many decisions are
    made, GATE_DECISIONS stay open and a key names at most GATE_KEY_DECISIONS of them."""
    from mpcache.eviction import gate as module

    order, entries = _order(True, capacity=4)
    _hot_t2(order, entries)
    decisions = module.GATE_LIMIT + 5
    off = [order._gate([f"new-{n}"], order.lists[1]) for n in range(decisions)]
    assert [False] * decisions == off  # off: recorded only
    order.asked(("a",), 1, True)
    assert (module.GATE_LIMIT, 0) == (order.gate.score, len(order.gate.open))
    order.asked(("new-0",), 1, False)
    assert module.GATE_LIMIT == order.gate.score
    assert order._gate(["new-x"], order.lists[1]) is True  # proved right: refused
    for number in range(2 * module.GATE_DECISIONS):
        order._gate([f"more-{number}"], order.lists[1])
    assert module.GATE_DECISIONS == len(order.gate.open) == len(order.gate.contested)
    assert module.GATE_KEY_DECISIONS == len(order.gate.protected["a"])


@pytest.mark.parametrize("room, named", [(1, ["a"]), (2, ["a", "b"]), (10, ["a", "b", "c"])])
def test_a_gate_decision_names_the_objects_its_store_s_room_needs(room, named):
    """A store of three new keys against T2's a, b, c, d (each asked for more often): its decision names as would-be
    victims the least recently used objects that make the room it needs (one, two), never more than one per new key
    (three where it needs ten), so that only what the store would have evicted can prove the gate right."""
    order, entries = _order(True, capacity=4)
    _hot_t2(order, entries)
    order._need = room  # the bytes the store needs beyond the free ones (``refuses``)
    assert order._gate(["n1", "n2", "n3"], order.lists[1]) is False  # the score starts at -1: recorded
    assert named == list(order.gate.protected)


def _decision_names(l1: L1Manager, hashes: list[int], reused: int) -> tuple[list[int], list[int]]:
    """A second-sight store of ``hashes`` (the first remembered as refused; T2 in use: ``reused`` looked up; the
    gate off: it records and admits): what it evicted of 1-3 and the objects its decision names."""
    order = l1._order
    order._refused.remember([ChunkKey("m", "", hashes[0])], 64, order.capacity)
    _seen_again(l1, reused, 1)
    order.gate.score = -1
    named_before = dict(order.gate.protected)
    assert 0 == l1.reserve_write("m", "", hashes).failed
    evicted = [h for h in (1, 2, 3) if not l1.contains(ChunkKey("m", "", h))]
    return evicted, [key.chunk_hash for key, decisions in order.gate.protected.items()
                     if named_before.get(key) != decisions]


def test_a_gate_decision_names_what_its_store_evicts_from_t2_while_t1_is_within_its_target():
    """Four slots: 1 and 2 seen again (T2), 3 seen once (T1), one free; T1's target above what T1 holds (as after
    B1 ghost hits).  A second-sight store of three new chunks takes the free slot, then evicts T2's 1 and 2 (T1 is
    within its target): its decision names both, not only what T1 could not give."""
    l1 = _learned(L1Manager(np.zeros(4 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive"))
    _t2_in_use(l1, (1, 2))
    _store(l1, [3])
    l1._order.target = float(l1._order.capacity)
    assert ([1, 2], [1, 2]) == _decision_names(l1, [20, 21, 22], 2)


def test_a_gate_decision_made_while_a_store_is_placed_names_what_it_still_evicts():
    """Six slots: 1-3 seen again (T2); another request's store of 10 and 11 reserved, its data not yet written (T1,
    not evictable).  A second-sight store of three new chunks is not judged before it starts (T1 holds more than it
    needs), takes the free slot, and is judged once T1 has nothing to give: its decision names the two objects of T2
    it still evicts."""
    l1 = _learned(L1Manager(np.zeros(6 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive"))
    _t2_in_use(l1, (1, 2, 3))
    assert 0 == l1.reserve_write("m", "", [10, 11]).failed
    assert ([1, 2], [1, 2]) == _decision_names(l1, [20, 21, 22], 3)


def _hot_t2(order: ArcOrder, entries: dict[str, Entry]) -> None:
    """a, b, c, d in T2, each asked for five times."""
    order.split()
    _add(order, entries, "a", "b", "c", "d")
    for key in ("a", "b", "c", "d"):
        order.promote(entries[key])
        del order.lists[0][key]
        order.lists[1][key] = entries[key]
        for _ in range(5):
            order.asked((key,), 1, True)


def test_the_frequency_gate_judges_a_store_by_the_keys_it_would_place():
    """A store naming a resident key asked for often (d) and a new one: the gate weighs only the new key against
    T2's head, so it makes a decision, contested by the new key, as for the new key alone."""
    order, entries = _order(True, capacity=4)
    _hot_t2(order, entries)
    assert order._gate(["d", "new"], order.lists[1]) is False  # the score starts at -1: recorded, not refused
    assert ([1], False) == (order.gate.contested.get("new"), "d" in order.gate.contested)


def test_the_sketch_s_window_never_narrows_while_objects_are_locked():
    """2,000 objects in the order set a window of FREQUENCY_WINDOW counts each; taken out of it (read-locked, as
    lookups do), they are still resident, and the next halving keeps that window rather than the floor's."""
    from mpcache.eviction import order as module

    order, entries = _order(True, capacity=4000)
    _add(order, entries, *(f"k{n}" for n in range(2000)))
    for n in range(module.FREQUENCY_WINDOW * 16):
        order.asked((f"k{n % 2000}",), 1, True)
    wide = module.FREQUENCY_WINDOW * 2000
    assert wide == order.frequency.window
    for key in list(order.lists[0]):
        del order.lists[0][key]
    for n in range(wide):
        order.asked((f"k{n % 2000}",), 1, True)
    assert wide == order.frequency.window


def test_what_an_l2_prefetch_lands_is_asked_for_as_a_miss():
    """A landing's new chunks were asked for by a lookup and missed, as a store's are: the adaptive order counts
    each once (its frequency sketch) and, in ARC's phase, its shadow LRU takes them in, so that a later hit on a
    landed chunk is one an LRU would have had too."""
    l1 = L1Manager(np.zeros(8 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive")
    order = l1._order
    order.split()
    l1.lock_prefix("m", "", [7, 8], publish=False)  # the lookup the prefetch serves: both missing
    l1.reserve_prefetch("m", "", [7, 8])
    assert [1, 1] == [order.frequency.estimate(ChunkKey("m", "", chunk)) for chunk in (7, 8)]
    l1.lock_prefix("m", "", [9], publish=False)  # the next access: the landing's keys go into the shadow LRU
    assert [True, True] == [order._shadow.sees(ChunkKey("m", "", chunk), 64, order.access) for chunk in (7, 8)]


@pytest.mark.parametrize("head_missed, joined", [(True, False), (False, True)])
def test_the_shadow_lru_finds_a_prefix_nothing_after_its_first_miss_in_an_access(head_missed, joined):
    """Past the split and its settling, access after access asks for p, which the shadow LRU holds and L1 misses.
    Where each access first asks for a key new to both (its head, missed), the LRU would not find p either (a
    prefix ends at its first miss): no disagreement, and ARC's phase lasts.  Asked for alone, p is one the LRU
    finds and L1 does not, and the phase ends."""
    order, _ = _order(True, capacity=64)
    order.split()
    for n in range(64):
        _asked_alone(order, f"settle-{n}", False)
    _asked_alone(order, "p", False)  # p into the shadow (missed by both)
    for n in range(200):
        order.access += 1
        if head_missed:
            order.asked((f"head-{n}",), 1, False)
        order.asked(("p",), 1, False)
    assert joined == order.recency
