"""Admission by chance (``adaptive``): L1 admits a first-sight store with a chance of ``CHANCE`` where an LRU that
does so finds more than L1, and every store where one that does not finds more; a refusal is reported to the store
and its second sight admitted."""

from __future__ import annotations

import itertools
import os
import random
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import numpy as np
from support.cache_harness import CapturedLog, Harness
from support.l1_requests import engine_request, engine_request_outcome
from support.waiting import wait_for

from benchmarks.null_cache import NullPublisher
from benchmarks.trace_sim import TraceRequest, lru
from mpcache.cache.l1 import L1Manager
from mpcache.cache.process import CacheProcess
from mpcache.eviction.admission import (
    CHANCE,
    CHANCE_SIGMAS,
    TRIAL_HALVINGS,
    TRIAL_MIN_HALVINGS,
    TRIAL_MIN_KEYS,
    AdmissionTrial,
    trial_halvings,
)
from mpcache.eviction.frequency import MIX, FrequencySketchReference
from mpcache.eviction.refusal import RefusedKeys, draw
from mpcache.eviction.shadow import ShadowLru
from mpcache.shm import layout
from mpcache.shm.gauges import GaugeSlot
from mpcache.shm.segment import Segment

REPO = Path(__file__).resolve().parents[2]
CAPACITY = 4096  # chunks of L1: at least the trial's minimum
BLOCKS = 8  # new chunks per request


def _returning(requests: int, soonest: int, latest: int, seed: int = 7) -> list[list[int]]:
    """New conversations of BLOCKS chunks; with a chance of 0.3 a request returns ``soonest``..``latest`` requests
    later as its next turn (its chunks and BLOCKS more), which may return in turn."""
    rng = random.Random(seed)
    due: dict[int, list[int]] = {}
    fresh = 0
    out = []
    for index in range(requests):
        prompt = due.pop(index, []) + list(range(fresh, fresh + BLOCKS))
        fresh += BLOCKS
        out.append(prompt)
        if rng.random() < 0.3:
            at = index + rng.randint(soonest, latest)
            while at in due:
                at += 1
            due[at] = prompt
    return out


def _l1(capacity: int = CAPACITY) -> L1Manager:
    return L1Manager(np.zeros(capacity * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive")


def _offline_lru(trace: list[list[int]]) -> int:
    return sum(lru([TraceRequest(hashes, len(hashes) * 512) for hashes in trace], CAPACITY).found)


def test_draws_are_the_same_in_every_run_and_spread_evenly_over_0_to_1():
    draws = [draw(number) for number in range(20_000)]
    assert draws == [draw(number) for number in range(20_000)]
    assert all(0.0 <= value < 1.0 for value in draws)
    for bound in (0.1, 0.25, 0.5, 0.9):  # a uniform draw is below ``bound`` with that chance (±4 sigma)
        share = sum(value < bound for value in draws) / len(draws)
        assert abs(share - bound) < 4 * (bound * (1 - bound) / len(draws)) ** 0.5, (bound, share)
    assert len(set(draws)) == len(draws)


def test_where_turns_return_later_than_l1_keeps_them_l1_admits_by_chance_and_finds_what_lru_cannot():
    """A conversation's next turn comes 512-1,024 requests later, while a full L1 holds the last 512 requests'
    chunks: an LRU finds none of them; admitting a quarter of first-sight stores keeps those four times longer."""
    trace = _returning(8000, CAPACITY // BLOCKS, 2 * CAPACITY // BLOCKS)
    l1 = _l1()
    found = sum(engine_request(l1, ("m", ""), hashes) for hashes in trace)
    assert _offline_lru(trace) == 0
    assert l1._order.chance == CHANCE
    returning = sum(len(hashes) - BLOCKS for hashes in trace)  # the chunks a turn shares with the turn before
    assert found > 0.15 * returning, (found, returning)


def test_where_turns_return_while_l1_keeps_them_every_store_is_admitted_as_lru_admits_it():
    trace = _returning(6000, CAPACITY // BLOCKS // 8, CAPACITY // BLOCKS // 4)
    l1 = _l1()
    found = sum(engine_request(l1, ("m", ""), hashes) for hashes in trace)
    assert l1._order.chance == 1.0
    assert found == _offline_lru(trace) > 0


def test_a_store_refused_by_chance_is_told_so_and_its_second_sight_is_admitted():
    l1 = _l1()
    order = l1._order
    for index in range(2 * CAPACITY // BLOCKS):  # L1 full of requests never asked for again (the recency phase)
        engine_request(l1, ("m", ""), list(range(index * BLOCKS, (index + 1) * BLOCKS)))
    order._trial.take(1)  # as the trial takes it where an LRU admitting by chance finds more
    order.chance = CHANCE
    refused: list[int] = []
    admitted: list[int] = []
    fresh = 10**9
    while not refused or not admitted:
        hashes = list(range(fresh, fresh + BLOCKS))
        fresh += BLOCKS
        assert l1.lock_prefix("m", "", hashes, publish=False) == 0
        unlucky = draw(order.access) >= CHANCE
        reservation = l1.reserve_write("m", "", hashes)
        l1.commit_write("m", "", [hashes[position] for position in reservation.positions], 64)
        if unlucky:
            assert (reservation.positions, reservation.failed) == ([], BLOCKS)
            refused = refused or hashes
        else:
            assert (len(reservation.positions), reservation.failed) == (BLOCKS, 0)
            admitted = admitted or hashes
    assert order.recency
    refusals = l1.refused_chunks
    assert engine_request(l1, ("m", ""), refused) == 0  # its second sight: admitted whatever its draw
    assert engine_request(l1, ("m", ""), refused) == BLOCKS
    assert l1.refused_chunks == refusals


def _store(l1: L1Manager, hashes: list[int], limit: int | None = None) -> int:
    """A lookup and the store of ``hashes`` (at most ``limit`` new chunks), committed: the chunks that failed."""
    l1.lock_prefix("m", "", hashes, publish=False)
    reservation = l1.reserve_write("m", "", hashes, limit=limit)
    l1.commit_write("m", "", [hashes[position] for position in reservation.positions], 64)
    return reservation.failed


def test_l1_counts_the_chunks_its_order_refuses_where_it_could_make_room():
    """Stores refused by chance are counted in ``refused_chunks``, up to a store's ``limit`` (what is past it fails
    for the budget, not the order); with every object locked there is no room to make, and what fails, refused by
    chance or not, is an allocation failure but no refusal."""
    l1 = _l1()
    order = l1._order
    for index in range(2 * CAPACITY // BLOCKS):
        engine_request(l1, ("m", ""), list(range(index * BLOCKS, (index + 1) * BLOCKS)))
    assert l1.refused_chunks == 0
    order._trial.take(1)
    order.chance = CHANCE
    fresh = itertools.count(10**9, BLOCKS)
    failed = sum(_store(l1, list(range(start, start + BLOCKS))) for start in itertools.islice(fresh, 64))
    expected = BLOCKS * sum(draw(access) >= CHANCE for access in range(order.access - 63, order.access + 1))
    assert l1.refused_chunks == failed == expected > 0
    while draw(order.access + 1) < CHANCE:  # the next lookup's draw refuses its store
        engine_request(l1, ("m", ""), [next(fresh)])
    start = next(fresh)
    assert (_store(l1, list(range(start, start + BLOCKS)), limit=2), l1.refused_chunks) == (BLOCKS, expected + 2)
    held = [key.chunk_hash for key in l1.readable("m")]
    assert l1.lock_prefix("m", "", held, publish=False) == len(held) > 0  # every object locked: no room to make
    failed = sum(_store(l1, list(range(start, start + BLOCKS))) for start in itertools.islice(fresh, 16))
    assert any(draw(access) >= CHANCE for access in range(order.access - 15, order.access + 1))
    assert (failed, l1.refused_chunks) == (16 * BLOCKS, expected + 2)


def test_a_shadow_lru_that_admits_by_chance_refuses_a_first_sight_access_only_when_full():
    shadow = ShadowLru(2, admit=CHANCE)
    lucky = [access for access in range(100) if draw(access) < CHANCE]
    unlucky = [access for access in range(100) if draw(access) >= CHANCE]
    shadow.sees("x", 1, unlucky[0])
    shadow.sees("y", 1, unlucky[0])
    shadow.sees("z", 1, unlucky[1])  # settles the access before: admitted, there was room
    assert len(shadow) == 2
    assert shadow.sees("z", 1, unlucky[2]) is False  # refused: full, a first sight, an unlucky draw
    assert shadow.sees("x", 1, unlucky[2]) is True  # and nothing evicted for it
    shadow.sees("w", 1, unlucky[3])  # z asked for again by unlucky[2]: its second sight, admitted
    assert shadow.sees("z", 1, unlucky[4]) is True
    shadow.sees("v", 1, lucky[0])
    shadow.sees("u", 1, unlucky[5])  # a lucky draw admits a first sight
    assert shadow.sees("v", 1, unlucky[6]) is True


def test_refused_keys_are_kept_within_their_bound_newest_last():
    refused = RefusedKeys()
    refused.remember(["a", "b", "c"], 2.0, 5.0)
    assert ("a" in refused, "b" in refused, "c" in refused, len(refused)) == (False, True, True, 2)
    refused.remember(["b", "d"], [2.0, 2.0], 5.0)
    assert ("b" in refused, "c" in refused, "d" in refused) == (True, False, True)


def _trial() -> AdmissionTrial:
    return AdmissionTrial(CAPACITY * 64.0, hash, FrequencySketchReference(16), TRIAL_HALVINGS)


def _observed(trial: AdmissionTrial, lru_found: int, by_chance_found: int, l1_found: int, accesses: int,
              floored_found: int | None = None) -> None:
    """``accesses`` accesses in which the rules' LRUs and L1 found so many sampled keys each (the floored LRU as
    many as the one admitting every store, unless ``floored_found``)."""
    for _ in range(accesses):
        trial._found[:] = [lru_found, by_chance_found, lru_found if floored_found is None else floored_found]
        trial._l1 = l1_found
        trial._settle()


def test_the_trial_follows_an_lru_only_where_it_leads_both_l1_and_the_other_lru():
    """Admission by chance helping an LRU is not enough where L1 (ARC's lists) finds more than both; an LRU
    leading L1 is not enough where the other LRU finds as much."""
    arc_serves = _trial()
    arc_serves._settling = 0
    _observed(arc_serves, 2, 3, 4, 1000)
    assert (arc_serves.chance, arc_serves.switches) == (1.0, 0)
    recency_serves = _trial()
    recency_serves._settling = 0
    _observed(recency_serves, 3, 3, 2, 1000)  # an LRU finds more than L1, by chance or not
    assert (recency_serves.chance, recency_serves.switches) == (1.0, 0)
    chance_serves = _trial()
    chance_serves._settling = 0
    _observed(chance_serves, 2, 3, 2, 9)  # one more key per access than both: 3 sigma is crossed at the 10th
    assert chance_serves.chance == 1.0
    _observed(chance_serves, 2, 3, 2, 1)
    assert (chance_serves.chance, chance_serves.switches) == (CHANCE, 1)
    _observed(chance_serves, 3, 2, 2, 10)  # then admitting every store leads both: back
    assert (chance_serves.chance, chance_serves.switches) == (1.0, 2)


def test_the_trial_s_evidence_counts_once_l1_has_missed_its_capacity():
    trial = _trial()
    _observed(trial, 2, 5, 2, 1000)
    assert trial.chance == 1.0
    sampled = next(number for number in range(10**6) if not (number * MIX) % (1 << 64) >> (64 - TRIAL_HALVINGS))
    for access in range(CAPACITY // (1 << TRIAL_HALVINGS)):  # L1 misses a sampled key standing for 2 ** 5 objects
        trial.sees(sampled, 64.0, access, False)
    assert trial._settling <= 0
    _observed(trial, 2, 5, 2, 10)
    assert trial.chance == CHANCE


def test_a_request_s_tp_ranks_are_refused_by_chance_together_in_either_phase():
    """The parts of one named store (a request's ranks) follow the first part's verdict: a rank's chunks are of no
    use without the others'."""
    for split in (False, True):
        slots = TRIAL_MIN_KEYS << TRIAL_HALVINGS
        l1 = _l1(slots)
        for key in range(10**6, 10**6 + slots):  # full
            reservation = l1.reserve_write("m", "", [key])
            l1.commit_write("m", "", [key], 64)
        if split:
            l1._order.split()
        l1._order._trial.take(1)
        l1._order.chance = CHANCE
        while True:  # a lookup whose access draws a refusal
            assert l1.lock_prefix("m", "", [10**9 + l1._order.access], publish=False) == 0
            if draw(l1._order.access) >= CHANCE:
                break
        failed = []
        for rank_chunk in (5, 6):  # rank 0's chunk, rank 1's chunk, one store
            reservation = l1.reserve_write("m", "", [rank_chunk], store="request")
            l1.commit_write("m", "", [rank_chunk for _ in reservation.positions], 64)
            failed.append(reservation.failed)
        assert (l1._order.recency, failed) == (not split, [1, 1])


def test_where_a_refused_store_would_not_reach_l2_either_l1_admits_every_store():
    trace = _returning(6000, CAPACITY // BLOCKS, 2 * CAPACITY // BLOCKS)
    l1 = L1Manager(np.zeros(CAPACITY * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive",
                   first_sight=False)
    failed = sum(engine_request_outcome(l1, ("m", ""), hashes)[1] for hashes in trace)
    assert (l1._order.chance, failed) == (1.0, 0)


def test_the_curves_model_admission_by_chance_only_where_the_cache_processes_l1_admits_so(tmp_path):
    """The miniatures run the trial where L1 does: no L2 tier, and an L1 worth a trial; and refuse first-sight
    stores by frequency where L1 does: no L2 tier, whatever L1's size."""
    from support.cache_harness import make_config

    from mpcache.telemetry.subscribers.metrics.mrc import MissRatioSubscriber

    large, small = (TRIAL_MIN_KEYS << TRIAL_HALVINGS) * 64, (TRIAL_MIN_KEYS << TRIAL_MIN_HALVINGS) * 32
    tier = [{"type": "mock", "capacity_gb": 1}]
    for l1_bytes, l2, trial in ((large, [], True), (small, [], False), (large, tier, False)):
        config = make_config(str(tmp_path), l1_size_bytes=l1_bytes, chunk_bytes=64, l1_policy="adaptive", l2=l2)
        subscriber = MissRatioSubscriber(_NullMeter(), config)
        minis = [mini for history in subscriber.curves._histories for mini in history.minis]
        assert minis and {mini.order._trial is not None for mini in minis} == {trial}, (l1_bytes, l2)
        l1 = L1Manager(np.zeros(l1_bytes, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive",
                       first_sight=not l2)
        assert (l1._order._trial is not None) == trial
        assert {mini.order.first_sight for mini in minis} == {l1._order.first_sight} == {not l2}


def test_a_miniature_numbers_a_row_as_l1_numbers_its_chunk():
    """So that the miniatures' trial samples the keys L1's does (chunk hashes are 64-bit, where ``hash`` differs)."""
    from mpcache.cache.l1 import _CHUNK_CODE_ITEM
    from mpcache.contract.keys import ChunkKey
    from mpcache.telemetry.mrc.mini import _stable_code

    for chunk in (7, -5, (1 << 61) - 1, (1 << 63) + 12345, (1 << 64) - 1):
        assert _stable_code((chunk, "salt", "model")) == ChunkKey("model", "salt", chunk)[_CHUNK_CODE_ITEM]


def test_a_miniature_decides_the_same_whatever_the_process_s_string_hashes():
    """The curves' miniatures run the order on (chunk hash, salt, model) rows: their admission trial, sketch and
    shadow LRUs number a row by its chunk hash, not by a hash that changes with PYTHONHASHSEED."""
    script = """
import random
from mpcache.telemetry.mrc.mini import MiniCache
rng = random.Random(7)
due, fresh, found = {}, 0, 0
mini = MiniCache("adaptive", 4096.0)
for index in range(8000):
    prompt = due.pop(index, []) + list(range(fresh, fresh + 8))
    fresh += 8
    if rng.random() < 0.3:
        due.setdefault(index + rng.randint(512, 1024), prompt)
    keys = [((chunk, "salt", "model"), 1.0) for chunk in prompt]
    found += sum(mini.lookup(keys))
    mini.store(keys)
print(found, mini.order._trial.switches, mini.order._trial.chance)
"""
    outputs = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=REPO,
                              env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2", "3")}
    assert len(outputs) == 1, outputs
    found, switches, _ = next(iter(outputs)).split()
    assert int(found) > 0 and int(switches) >= 1


def test_the_trial_samples_as_few_keys_as_leave_its_lrus_enough_and_none_below_its_fewest_halvings():
    """Each halving of the sampling rate needs twice the objects for TRIAL_MIN_KEYS sampled keys in an LRU of L1's
    capacity; L1s with more sample at 1 / 2 ** TRIAL_HALVINGS, and those too small for TRIAL_MIN_HALVINGS run none."""
    for objects in range(1, (TRIAL_MIN_KEYS << TRIAL_HALVINGS) * 4, 7):
        fitting = [halvings for halvings in range(TRIAL_MIN_HALVINGS, TRIAL_HALVINGS + 1)
                   if objects >= TRIAL_MIN_KEYS * 2 ** halvings]
        assert trial_halvings(objects * 64.0, 64.0) == (fitting[-1] if fitting else None), objects
    minimum = TRIAL_MIN_KEYS << TRIAL_MIN_HALVINGS
    assert (trial_halvings(minimum * 64, 64), trial_halvings(minimum * 64 - 1, 64)) == (TRIAL_MIN_HALVINGS, None)
    assert _l1(minimum)._order.frequency.sample_bits == TRIAL_MIN_HALVINGS


def test_an_l1_too_small_for_the_trial_to_tell_anything_has_none_and_samples_no_key_for_it():
    """Below TRIAL_MIN_KEYS << TRIAL_MIN_HALVINGS objects, the trial's LRUs would hold fewer than TRIAL_MIN_KEYS
    sampled keys at the most the trial samples."""
    minimum = TRIAL_MIN_KEYS << TRIAL_MIN_HALVINGS
    small = _l1(minimum - 1)
    for hashes in _returning(3000, minimum // 4 // BLOCKS, minimum // 2 // BLOCKS):
        engine_request(small, ("m", ""), hashes)
    assert (small._order._trial, small._order.chance, small._order.floor,
            small._order.frequency.sample_bits) == (None, 1.0, 0.0, -1)


def test_the_docs_state_the_trial_s_numbers_as_the_code_has_them():
    changelog, history = (" ".join((REPO / path).read_text(encoding="utf-8").split())
                          for path in ("CHANGELOG.md", "benchmarks/HISTORY.md"))
    chance = str(Fraction(CHANCE))
    minimum = TRIAL_MIN_KEYS << TRIAL_HALVINGS
    assert f"with a chance of {chance} while it needs room" in changelog
    assert "nor where L1 holds fewer than 2,048 objects" in changelog  # the trial's minimum when it came
    assert (f"The trial now runs in an L1 of {TRIAL_MIN_KEYS << TRIAL_MIN_HALVINGS:,} objects or more (sampling 1 / "
            f"{1 << TRIAL_MIN_HALVINGS} of the keys there, 1 / {1 << TRIAL_HALVINGS} from {minimum:,})") in changelog
    assert f"a first-sight store with a chance of {chance}" in history
    assert f"top {TRIAL_HALVINGS} bits are 0 (1/{1 << TRIAL_HALVINGS};" in history
    assert f"by {CHANCE_SIGMAS:g} σ" in history
    assert f"({TRIAL_MIN_KEYS} sampled keys in an LRU of L1's capacity, {minimum:,} objects)" in history


class _NullMeter:
    """A meter whose instruments take anything and keep nothing."""

    def __getattr__(self, name: str):
        return lambda *args, **kwargs: _NullMeter()


def test_the_cache_process_logs_each_change_of_l1_s_admission(cache):
    """``cache.l1_admission`` with the rule, the chance and the floor, once per change of rule, at the heartbeat: an
    operator sees when admission by chance or under an age floor is on (its refusals are L1 allocation failures)."""
    log = CapturedLog()
    harness = cache(server_kwargs={"logger": log, "heartbeat_interval_s": 0.05}, l1_policy="adaptive",
                    chunk_bytes=64, l1_size_bytes=(TRIAL_MIN_KEYS << TRIAL_HALVINGS) * 64)
    l1 = harness.server.ctx.l1
    assert l1.admission_chance == 1.0

    def logged() -> list[dict]:
        return [fields for event, fields in log.infos if event == "cache.l1_admission"]

    l1.order._trial.take(1)  # as the trial takes it
    l1.order.chance = CHANCE
    wait_for(lambda: logged(), timeout_s=30, what="the log line")
    l1.order._trial.take(0)
    l1.order.chance = 1.0
    l1.order.floor = 48.4  # as the trial sets it where L1 admits under an age floor
    wait_for(lambda: len(logged()) == 2, timeout_s=30, what="the second log line")
    l1.order.floor = 0.0
    wait_for(lambda: len(logged()) == 3, timeout_s=30, what="the third log line")
    assert [(entry["rule"], entry["chance"], entry["floor_accesses"]) for entry in logged()] == [
        ("by_chance", CHANCE, 0), ("floored", 1.0, 48), ("every", 1.0, 0)]
    assert {entry["policy"] for entry in logged()} == {"adaptive"}


def test_a_restarted_cache_process_shows_its_own_admission_from_its_first_heartbeat(provisioned):
    """A cache process's words are its own from the heartbeat that makes it live, not from its first eviction tick
    (a minute away here), whatever the one before it left in the slot (a quarter admitted, copies lost) once the
    supervisor cleared it; the refusals counted before are kept, as the counter's series goes on."""
    config = provisioned(l1_policy="adaptive", chunk_bytes=64, l1_size_bytes=(TRIAL_MIN_KEYS << TRIAL_HALVINGS) * 64,
                         eviction_interval_s=60.0)
    board = Segment.attach(config.gauge_board_name())
    try:
        earlier = GaugeSlot(board, 0)
        for word, value in ((layout.G_L1_ADMITTING, 1000), (layout.G_L1_REFUSED, 99), (layout.G_L1_LOST_COPIES, 5),
                            (layout.G_HEARTBEAT, 0)):
            earlier.set(word, value)
        earlier.clear()  # as the supervisor clears a dead cache process's slot
        harness = Harness(config, CacheProcess(config, 0))
        try:
            wait_for(lambda: harness.board.word(0, layout.G_HEARTBEAT) > 0, timeout_s=30, what="the first heartbeat")
            capacity = harness.board.word(0, layout.G_L1_CAPACITY)
            assert (harness.board.word(0, layout.G_L1_ADMITTING), harness.board.word(0, layout.G_L1_REFUSED),
                    harness.board.word(0, layout.G_L1_LOST_COPIES)) == (capacity, 99, 0)
            assert capacity == harness.server.ctx.l1.capacity_bytes > 0
        finally:
            harness.stop()
    finally:
        board.close()


def test_the_cache_process_shows_l1_s_admission_and_refusals_on_the_gauge_board(cache):
    """The gauge board's words that ``mpcache_l1_admission_chance`` and ``mpcache_l1_refused_chunks_total`` read:
    L1's capacity times its chance, and the chunks its order refused, as the process's L1 has them."""
    harness = cache(server_kwargs={"heartbeat_interval_s": 0.05}, l1_policy="adaptive", chunk_bytes=64,
                    l1_size_bytes=(TRIAL_MIN_KEYS << TRIAL_HALVINGS) * 64, eviction_interval_s=0.05)
    l1, gauges = harness.server.ctx.l1, harness.server.ctx.gauges
    capacity = l1.capacity_bytes

    def board() -> tuple[int, int]:
        return gauges.get(layout.G_L1_ADMITTING), gauges.get(layout.G_L1_REFUSED)

    wait_for(lambda: board() == (capacity, 0), timeout_s=30, what="every store admitted, none refused")
    l1.order._trial.take(1)  # as the trial takes it
    l1.order.chance = CHANCE
    l1.refused_chunks += 123  # as refusals count them
    wait_for(lambda: board() == (round(capacity * CHANCE), 123), timeout_s=30, what="the chance and the refusals")
    l1.refused_chunks += 7
    wait_for(lambda: board()[1] == 130, timeout_s=30, what="the refusals added")
