"""Large stores on first sight (``adaptive``): a store that needs more than ``LARGE_STORE_SHARE`` of L1 is refused
while stores that large return less often than smaller ones, and admitted where they return as often."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import numpy as np
from support.l1_requests import engine_request, engine_request_outcome

from benchmarks.null_cache import NullPublisher
from benchmarks.trace_sim import TraceRequest, lru
from mpcache.cache.l1 import L1Manager
from mpcache.eviction.returns import LARGE_STORE_SHARE, RETURNS_MIN, RETURNS_SIGMAS, RETURNS_WINDOW, StoreReturns
from mpcache.telemetry.mrc.mini import MiniCache

REPO = Path(__file__).resolve().parents[2]
CAPACITY = 200  # chunks of L1: too small for the admission trial, as the smallest sizes of the benchmarks are
LONG = 40  # chunks of a one-off prompt: more than LARGE_STORE_SHARE of L1
SHORT = 3  # new chunks of a conversation's turn


def _l1(first_sight: bool = True) -> L1Manager:
    return L1Manager(np.zeros(CAPACITY * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive",
                     first_sight=first_sight)


def _conversations_and_long_prompts(requests: int, long_returns: bool, seed: int = 3) -> list[list[int]]:
    """Conversations of SHORT new chunks a turn, continued within a few requests, and one request in three a long
    prompt of LONG chunks: asked for once (``long_returns`` False) or continued as a conversation is."""
    rng, fresh = random.Random(seed), itertools.count()
    open_turns: list[list[int]] = []
    out = []
    for _ in range(requests):
        if rng.random() < 1 / 3:
            prompt = [next(fresh) for _ in range(LONG)]
            if long_returns:
                open_turns.append(prompt)
        elif open_turns and rng.random() < 0.7:
            prompt = open_turns.pop(rng.randrange(len(open_turns))) + [next(fresh) for _ in range(SHORT)]
            open_turns.append(prompt)
        else:
            prompt = [next(fresh) for _ in range(SHORT)]
            open_turns.append(prompt)
        del open_turns[:-6]  # a conversation not continued within a few requests is over
        out.append(prompt)
    return out


def _offline_lru(trace: list[list[int]]) -> int:
    return sum(lru([TraceRequest(hashes, len(hashes) * 512) for hashes in trace], CAPACITY).found)


def _replay(l1: L1Manager, trace: list[list[int]]) -> tuple[int, list[int]]:
    """The chunks found, and the lengths of the stores refused in part or whole."""
    found, refused = 0, []
    for hashes in trace:
        got, failed = engine_request_outcome(l1, ("m", ""), hashes)
        found += got
        if failed:
            refused.append(len(hashes) - got)
    return found, refused


def test_one_off_long_prompts_are_refused_once_they_prove_to_return_less_and_l1_finds_more_than_lru():
    """The long prompts never return, the conversations' turns do: after enough of each has settled, a long prompt
    is refused (only long ones, counted as refusals) and L1 finds more than the offline LRU and more than the same
    order where a refused store would have had an L2 tier to reach (no first-sight refusal)."""
    trace = _conversations_and_long_prompts(3000, long_returns=False)
    assert LONG > LARGE_STORE_SHARE * CAPACITY > SHORT
    l1 = _l1()
    found, refused = _replay(l1, trace)
    returns = l1._order.returns
    assert returns.returned[1] == 0 < returns.returned[0] and returns.large_return_less()
    assert refused and set(refused) == {LONG}, set(refused)
    assert l1.refused_chunks == LONG * len(refused)
    without, _ = _replay(_l1(first_sight=False), trace)
    assert found > 1.1 * max(_offline_lru(trace), without), (found, _offline_lru(trace), without)


def test_long_prompts_that_return_as_often_as_short_ones_are_admitted():
    trace = _conversations_and_long_prompts(3000, long_returns=True)
    l1 = _l1()
    found, refused = _replay(l1, trace)
    assert not l1._order.returns.large_return_less()
    assert refused == [] and l1.refused_chunks == 0
    assert found >= _offline_lru(trace) > 0


def test_a_refused_long_prompt_is_told_so_and_its_second_sight_is_admitted():
    l1 = _l1()
    for hashes in _conversations_and_long_prompts(1000, long_returns=False):
        engine_request(l1, ("m", ""), hashes)
    assert l1._order.returns.large_return_less()
    prompt = list(range(10**9, 10**9 + LONG))
    assert engine_request_outcome(l1, ("m", ""), prompt) == (0, LONG)
    assert engine_request_outcome(l1, ("m", ""), prompt) == (0, 0)
    assert engine_request(l1, ("m", ""), prompt) == LONG


def test_a_named_store_s_later_parts_take_the_large_refusal_in_the_recency_phase_whatever_their_size():
    """A request's ranks (or a hybrid model's KV cache groups, which may differ in size) are of no use apart: the
    part after a large refused one is refused too, even one small enough to be admitted on its own."""
    l1 = _l1()
    for hashes in _conversations_and_long_prompts(1000, long_returns=False):
        engine_request(l1, ("m", ""), hashes)
    l1._order.join()  # the recency phase (if it had split), where nothing else is refused without a trial
    assert l1._order.recency and l1._order._trial is None and l1._order.returns.large_return_less()
    failed = []
    for part in (list(range(10**9, 10**9 + LONG)), list(range(2 * 10**9, 2 * 10**9 + SHORT))):
        reservation = l1.reserve_write("m", "", part, store="request")
        l1.commit_write("m", "", [part[position] for position in reservation.positions], 64)
        failed.append(reservation.failed)
    assert failed == [LONG, SHORT]
    small = list(range(3 * 10**9, 3 * 10**9 + SHORT))  # another store that small is admitted
    assert l1.reserve_write("m", "", small, store="another").failed == 0


def test_with_an_l2_tier_no_store_is_refused_for_its_size():
    l1 = _l1(first_sight=False)
    _, refused = _replay(l1, _conversations_and_long_prompts(3000, long_returns=False))
    assert refused == [] and l1.refused_chunks == 0 and not l1._order.returns.watched


def test_a_watched_store_returns_when_its_first_new_key_is_asked_for_and_not_once_newer_stores_fill_l1():
    returns = StoreReturns(1000.0)
    returns.stored("a", 300.0)  # large (more than a tenth of 1000 bytes)
    returns.stored("b", 50.0)
    returns.stored("a", 300.0)  # already watched: not again
    returns.asked("b")
    assert (returns.settled, returns.returned) == ([1, 0], [1, 0])
    returns.stored("c", 80.0)
    returns.stored("d", 700.0)  # 300 + 80 + 700 > 1000: the oldest, "a", did not return
    assert (returns.settled, returns.returned, list(returns.watched)) == ([1, 1], [1, 0], ["c", "d"])
    returns.stored("e", 2000.0)  # more than L1 on its own: every store settled, this one too
    assert (returns.settled, returns.returned, list(returns.watched)) == ([2, 3], [1, 0], [])


def test_large_stores_are_judged_only_on_enough_of_each_size_and_the_counts_halve_past_their_window():
    returns = StoreReturns(1000.0)
    for index in range(RETURNS_MIN + 1):
        returns.stored(("large", index), 600.0)  # each pushes the one before out: not returned
    for index in range(RETURNS_MIN - 1):
        returns.stored(("small", index), 1.0)
        returns.asked(("small", index))
    assert (returns.settled, returns.returned) == ([RETURNS_MIN - 1, RETURNS_MIN], [RETURNS_MIN - 1, 0])
    assert not returns.large_return_less()  # one small store short of comparing
    returns.stored("one more", 1.0)
    returns.asked("one more")
    assert returns.large_return_less()
    for index in range(RETURNS_WINDOW + 1 - 2 * RETURNS_MIN):  # settled: one past the window, then halved
        returns.stored(("more", index), 1.0)
        returns.asked(("more", index))
    small = RETURNS_WINDOW + 1 - RETURNS_MIN
    assert (returns.settled, returns.returned) == ([small / 2, RETURNS_MIN / 2], [small / 2, 0])


def test_large_stores_are_refused_only_where_their_share_of_returns_is_lower_by_the_sigmas_asked_for():
    """Shares of returns of 0.5 (smaller stores) and 0.3 or 0.4 (large), 100 settled each: the difference's standard
    deviation is (0.25 / 100 + 0.21 / 100) ** 0.5 = 0.068 and (0.25 / 100 + 0.24 / 100) ** 0.5 = 0.07."""
    returns = StoreReturns(1000.0)
    assert RETURNS_SIGMAS == 2.0  # 0.2 is more than twice 0.068, 0.1 less than twice 0.07
    for large_returned, refused in ((30, True), (40, False), (50, False), (60, False)):
        returns.settled, returns.returned = [100, 100], [50, large_returned]
        assert returns.large_return_less() is refused, large_returned


def test_the_curves_miniatures_refuse_large_stores_as_l1_does():
    """A miniature of L1's size, given every key, watches the same returns and refuses a large one-off prompt."""
    mini = MiniCache("adaptive", CAPACITY * 64.0)
    for hashes in _conversations_and_long_prompts(3000, long_returns=False):
        mini.lookup([(chunk, 64.0) for chunk in hashes])
    assert mini.order.returns.large_return_less()
    prompt = [(chunk, 64.0) for chunk in range(10**9, 10**9 + LONG)]
    assert mini.lookup(prompt) == [False] * LONG
    assert not any(chunk in mini.entries for chunk, _ in prompt)
    mini.lookup(prompt)  # its second sight: admitted
    assert all(chunk in mini.entries for chunk, _ in prompt)


def test_the_changelog_states_the_large_store_numbers_as_the_code_has_them():
    changelog = " ".join((REPO / "CHANGELOG.md").read_text(encoding="utf-8").split())
    words = {0.1: "a tenth", 2.0: "two", 3.0: "three"}
    assert f"more than {words[LARGE_STORE_SHARE]} of L1 (`LARGE_STORE_SHARE`)" in changelog
    assert f"by {words[RETURNS_SIGMAS]} standard deviations of the difference (on {RETURNS_MIN} settled" in changelog


def test_a_named_store_refused_as_large_is_admitted_whole_on_its_second_sight():
    """The later part's keys, refused by its name's verdict, are remembered beside the first part's (not within
    what T2 holds, which would forget the first part's): stored again, every part is its second sight."""
    l1 = _l1()
    for hashes in _conversations_and_long_prompts(1000, long_returns=False):
        engine_request(l1, ("m", ""), hashes)
    l1._order.join()
    for start in range(5 * 10**9, 5 * 10**9 + CAPACITY, SHORT):  # L1 full of stores seen once: T2 holds little
        engine_request(l1, ("m", ""), list(range(start, start + SHORT)))
    parts = (list(range(10**9, 10**9 + LONG)), list(range(2 * 10**9, 2 * 10**9 + SHORT)))
    assert l1._order.sizes[1] < 64 * (LONG + SHORT) and l1._order.returns.large_return_less()
    for name, expected in (("request", [LONG, SHORT]), ("its retry", [0, 0])):
        failed = []
        for part in parts:
            reservation = l1.reserve_write("m", "", part, store=name)
            l1.commit_write("m", "", [part[position] for position in reservation.positions], 64)
            failed.append(reservation.failed)
        assert failed == expected, name


def test_a_store_of_no_bytes_is_not_watched():
    returns = StoreReturns(1000.0)
    returns.stored("empty", 0.0)
    assert not returns.watched and returns.settled == [0, 0]


def test_stores_are_watched_only_from_the_first_large_store_on():
    """A workload of smaller stores has nothing to refuse for its size: L1 watches none of them (no work per store)."""
    l1 = _l1()
    small = _conversations_and_long_prompts(400, long_returns=False, seed=5)
    for hashes in (hashes for hashes in small if len(hashes) < LONG):
        engine_request(l1, ("m", ""), hashes)
    returns = l1._order.returns
    assert not returns.watched and returns.settled == [0, 0]
    long_prompt = list(range(10**6, 10**6 + LONG))
    engine_request(l1, ("m", ""), long_prompt)
    engine_request(l1, ("m", ""), [10**7, 10**7 + 1])
    assert list(returns.watched) == [("m", "", long_prompt[0]), ("m", "", 10**7)]
