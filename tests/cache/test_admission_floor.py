"""Admission under an age floor (``adaptive``): where an LRU that refuses a store whose room would evict a key used
within FLOOR_AGES of its eviction ages finds more than L1 and than the rules that refuse less, L1 refuses so, in its
recency phase; a refusal is reported to the store."""

from __future__ import annotations

import numpy as np
from support.l1_requests import engine_request_outcome

from benchmarks.null_cache import NullPublisher
from benchmarks.trace_sim import TraceRequest, lru
from mpcache.cache.l1 import L1Manager
from mpcache.eviction.admission import FLOOR_AGES, RULES, AdmissionTrial
from mpcache.eviction.frequency import FrequencySketchReference
from mpcache.eviction.shadow import ShadowLru

CAPACITY = 4096  # objects of L1: its trial samples 1 / 32 of the keys
SESSION_CHUNKS = 128  # each session's context


def test_an_aged_shadow_lru_keeps_the_age_at_which_it_evicts():
    """One new key an access in an LRU of 4 keys: each leaves when the 4th access after its use settles."""
    shadow = ShadowLru(4, aged=True)
    for access in range(100):
        shadow.sees(access, 1, access)
    assert shadow.age == 4.0
    plain = ShadowLru(4)
    for access in range(100):
        plain.sees(access, 1, access)
    assert plain.age == 0.0  # not aged: no last uses kept


def test_a_shadow_lru_under_a_floor_refuses_only_what_would_evict_a_key_used_within_it():
    shadow = ShadowLru(2, aged=True)
    shadow.floor = 3.0
    shadow.sees("x", 1, 0)
    shadow.sees("y", 1, 1)
    shadow.sees("z", 1, 2)  # room for z would evict x, used 2 accesses before: refused as the next access begins
    assert shadow.sees("z", 1, 3) is False
    assert shadow.sees("y", 1, 3) is True
    shadow.sees("w", 1, 6)  # access 3 settles: z again, whose room takes x's, last used 3 accesses before
    assert [shadow.sees(key, 1, 6) for key in ("x", "y", "z")] == [False, True, True]


def _trial() -> AdmissionTrial:
    return AdmissionTrial(CAPACITY * 64.0, hash, FrequencySketchReference(16), 5)


def _observed(trial: AdmissionTrial, every: int, by_chance: int, floored: int, l1: int, accesses: int) -> None:
    """``accesses`` accesses in which each rule's LRU and L1 found so many sampled keys."""
    trial._settling = 0
    for _ in range(accesses):
        trial._found[:] = [every, by_chance, floored]
        trial._l1 = l1
        trial._settle()


def test_the_trial_follows_the_floor_only_where_it_finds_more_than_l1_and_each_rule_that_refuses_less():
    """The floor refuses more than chance does: where the two find as much, L1 admits by chance; where the floor
    finds more than both, L1 takes it once each lead passes 3 sigma (ten accesses of one key more)."""
    as_much = _trial()
    _observed(as_much, 2, 3, 3, 2, 100)
    assert (RULES[as_much.followed], as_much.switches) == ("by_chance", 1)
    more = _trial()
    _observed(more, 2, 3, 4, 2, 9)
    assert more.switches == 0
    _observed(more, 2, 3, 4, 2, 1)  # both lead at the 10th access: the rule that refuses less first
    assert RULES[more.followed] == "by_chance"
    _observed(more, 2, 3, 4, 2, 10)  # the floor leads the one followed, L1 and every store's LRU afresh
    assert (RULES[more.followed], more.chance, more.switches) == ("floored", 1.0, 2)
    _observed(more, 3, 2, 2, 2, 10)  # then admitting every store leads L1 and the floor: back
    assert (RULES[more.followed], more.switches) == ("every", 3)


def test_the_floor_is_the_age_at_which_an_lru_of_l1_s_capacity_evicts_times_floor_ages():
    trial = _trial()
    trial.every.age = 40.0
    trial.sees(0, 64.0, 1, False)  # an access begins: the floored LRU's floor follows
    assert (trial.floored.floor, trial.floor) == (FLOOR_AGES * 40.0, 0.0)  # L1 under no floor until it follows it
    trial.take(2)
    assert trial.floor == FLOOR_AGES * 40.0


def _sessions(sessions: int, rounds: int) -> list[list[int]]:
    """``sessions`` contexts of SESSION_CHUNKS chunks asked for in turn, each growing by a chunk a turn: a loop longer
    than L1, which an LRU finds nothing of."""
    contexts = [list(range(session * 10**6, session * 10**6 + SESSION_CHUNKS)) for session in range(sessions)]
    out = []
    for _ in range(rounds):
        for context in contexts:
            context.append(context[-1] + 1)
            out.append(list(context))
    return out


def test_where_more_sessions_are_active_than_l1_holds_l1_keeps_some_under_the_floor_and_tells_the_refused():
    trace = _sessions(48, 40)  # 48 contexts of about 128 to 168 chunks: more than twice L1's 4,096
    assert sum(lru([TraceRequest(hashes, len(hashes) * 512) for hashes in trace], CAPACITY).found) == 0
    l1 = L1Manager(np.zeros(CAPACITY * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive")
    found = failed = 0
    for hashes in trace:
        request_found, request_failed = engine_request_outcome(l1, ("m", ""), hashes)
        found, failed = found + request_found, failed + request_failed
    asked = sum(len(hashes) for hashes in trace)
    assert (l1.admission, l1._order.recency) == ("floored", True)
    assert l1.admission_floor > 0
    assert found > 0.3 * asked, (found, asked)  # a third of the sessions kept, in the last rounds more
    assert l1.refused_chunks == failed > 0


def test_the_floor_is_not_taken_where_admitting_by_chance_finds_as_much_however_noisily():
    """The floor leads L1 and every store's LRU by one key an access; chance finds as much on average, two keys
    ahead and two behind in turn: L1 takes the rule that refuses less."""
    trial = _trial()
    trial._settling = 0
    for access in range(200):
        trial._found[:] = [2, 1 if access % 2 else 5, 3]
        trial._l1 = 2
        trial._settle()
    assert RULES[trial.followed] == "by_chance"


def _full_l1() -> L1Manager:
    """An adaptive L1 of CAPACITY objects, full of 8-chunk requests asked for once."""
    l1 = L1Manager(np.zeros(CAPACITY * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive")
    for start in range(0, 2 * CAPACITY, 8):
        engine_request_outcome(l1, ("m", ""), list(range(start, start + 8)))
    return l1


def _follow_the_floor(l1: L1Manager, floor: float) -> None:
    """As the trial sets it once the floor pays: each access's floor is FLOOR_AGES times every store's LRU's age."""
    trial = l1.order._trial
    trial.take(2)
    trial.every.age = floor / FLOOR_AGES


def test_following_the_floor_joins_arc_s_lists_and_holds_the_recency_phase(monkeypatch):
    from mpcache.eviction.phases import PhaseTests

    l1 = _full_l1()
    order = l1.order
    order.split()
    _follow_the_floor(l1, 10.0)
    fresh = 10**9
    for _ in range(CAPACITY):  # a sampled key asked for: the order reads the trial's floor, and joins
        if order.recency:
            break
        engine_request_outcome(l1, ("m", ""), list(range(fresh, fresh + 8)))
        fresh += 8
    assert order.recency and order.floor > 0 and order.phases.joins == 1
    monkeypatch.setattr(PhaseTests, "split_due", lambda *args: True)  # every ghost hit would split

    def ghost_hit() -> None:
        order._ghosts.add(1, "returning", 64, order._ghost_budget)
        order._ghost_hit(1, "returning", 64)

    ghost_hit()
    assert order.recency
    order.floor = 0.0  # the floor given up (as the order copies it from the trial): the next ghost hit splits
    ghost_hit()
    assert not order.recency


def test_a_store_s_later_part_takes_its_first_part_s_verdict_under_the_floor():
    """A request's ranks are one store: the first part, placed in L1's last free slot, admits the second, which
    evicts an object used within the floor; a store of its own is refused there."""
    l1 = L1Manager(np.zeros(CAPACITY * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive")
    for chunk in range(CAPACITY - 1):
        engine_request_outcome(l1, ("m", ""), [chunk])
    _follow_the_floor(l1, 10.0**6)
    l1.order.floor = 10.0**6  # as the order copies it from the trial at its next sampled key
    fresh = 10**9
    assert l1.lock_prefix("m", "", [fresh, fresh + 1], publish=False) == 0
    failures = []
    for part in ([fresh], [fresh + 1]):  # rank 0's chunk, rank 1's chunk
        reservation = l1.reserve_write("m", "", part, store="request")
        l1.commit_write("m", "", [part[position] for position in reservation.positions], 64)
        failures.append(reservation.failed)
    assert l1.lock_prefix("m", "", [fresh + 2], publish=False) == 0
    alone = l1.reserve_write("m", "", [fresh + 2])
    assert (failures, alone.failed, l1.admission) == ([0, 0], 1, "floored")
