"""Curves of the orders that are not stack algorithms (``--l1-policy arc``/``adaptive``): miniature simulations over
the sampled keys, checked against L1 itself running that order over the whole trace."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from benchmarks import mrc_accuracy
from benchmarks.mrc_traces import CHUNK_BYTES
from benchmarks.null_cache import NullPublisher
from mpcache.cache.l1 import L1Manager
from mpcache.contract.keys import SAMPLE_MODULUS
from mpcache.eviction import order as eviction_order
from mpcache.telemetry.mrc.curves import ALL, HEAD, MISS, POINT_RATIOS, SAMPLED, CurveSet
from mpcache.telemetry.mrc.mini import MiniCache, _Entry

MODEL, SALT, SIZE = "m", "s", 64
CAPACITY = 1500 * SIZE  # the size the curves are taken at: 150 sampled objects at rate 0.1


def prefix_trace(rng: random.Random, requests: int) -> list[list[int]]:
    """Requests of shared prefixes: one of 4000 documents (Pareto popularity, 2–12 chunks each) followed by 1–3
    chunks of its own; chunk hashes uniform, as content hashes are."""
    documents = [[rng.getrandbits(64) for _ in range(rng.randint(2, 12))] for _ in range(4000)]
    return [documents[int(rng.paretovariate(0.9) * 50) % len(documents)]
            + [rng.getrandbits(64) for _ in range(rng.randint(1, 3))] for _ in range(requests)]


def l1_hit_ratio(trace: list[list[int]], policy: str, capacity: int) -> float:
    """Chunks found over chunks looked up by L1 running ``policy`` in ``capacity`` bytes: each request looks up
    its prefix, stores the rest, then releases the prefix it found (as the engine's lookup, store and retrieve)."""
    l1 = L1Manager(np.zeros(capacity, dtype=np.uint8), NullPublisher(), 1.0, SIZE, policy=policy)
    hits = looked = 0
    for hashes in trace:
        found = l1.lock_prefix(MODEL, SALT, hashes)
        rest = hashes[found:]
        reservation = l1.reserve_write(MODEL, SALT, rest)
        l1.commit_write(MODEL, SALT, [rest[p] for p in reservation.positions], SIZE)
        l1.release_read(MODEL, SALT, hashes[:found])
        hits, looked = hits + found, looked + len(hashes)
    return hits / looked


@pytest.mark.parametrize("policy", ["arc", "adaptive"])
def test_the_curve_at_one_size_predicts_the_policy_at_half_and_twice_that_size(policy):
    """At rate 0.1 the curve of a run (one lookup and one store per request, as the events carry them) is within
    0.02 of L1 running the same order at half, once and twice the size, and says which order it models."""
    trace = prefix_trace(random.Random(7), 12_000)
    curves = CurveSet(0.1, 1 << 16, {"l1": CAPACITY}, policy=policy)
    for hashes in trace:
        rows = [(h, SALT, MODEL) for h in hashes]
        curves.lookup(MODEL, SALT, 1, [(row, SAMPLED, MISS, 1) for row in rows])
        curves.store(MODEL, SIZE, rows)
    [curve] = [c for c in curves.curves() if (c["model_name"], c["cache_salt"]) == (ALL, ALL)]
    predicted = {point["capacity_bytes"]: point["hit_ratio"] for point in curve["points"]}
    assert 0.5 in POINT_RATIOS and 2.0 in POINT_RATIOS and curves.rate == 0.1 and curves.policy == policy
    for factor in (0.5, 1.0, 2.0):
        size = round(CAPACITY * factor)
        measured = l1_hit_ratio(trace, policy, size)
        assert 0.1 < measured < 0.9, measured  # the sizes are on the curve's slope, where an error would show
        assert abs(predicted[size] - measured) <= 0.02, (factor, predicted[size], measured)


def _learned(mini: MiniCache) -> MiniCache:
    """``mini`` with its adaptive order past the recency phase (as L1's once objects seen again have proved
    likelier to return than objects seen once): ARC's lists and second-sight admission."""
    mini.order.split()
    return mini


def test_when_the_rate_drops_each_miniature_keeps_only_admitted_keys_in_bytes_that_add_up():
    """Fixed-size mode lowers the sampled rate: every miniature forgets the keys the new rate leaves out (unless
    the history still tracks them), holds at most its capacity, in resident bytes that add up."""
    curves = CurveSet(1.0, 400, {"l1": CAPACITY}, policy="adaptive")
    for hashes in prefix_trace(random.Random(3), 3000):
        rows = [(h, SALT, MODEL) for h in hashes]
        curves.lookup(MODEL, SALT, 1, [(row, SAMPLED, MISS, 1) for row in rows])
        curves.store(MODEL, SIZE, rows)
    threshold = curves.rate * SAMPLE_MODULUS
    history = curves._histories[0]
    assert curves.rate < 0.5
    for edge, mini in zip(history.mini_edges, history.minis, strict=True):
        assert mini.capacity == edge
        assert all(key[0] % SAMPLE_MODULUS < threshold or key in history.stack for key in mini.entries)
        assert mini.used == pytest.approx(sum(entry.size for entry in mini.entries.values()))
        assert mini.used <= mini.capacity
        assert len(mini.entries) == len(mini.order)  # each resident key in one of the order's lists


def test_the_miniatures_run_at_the_octaves_of_distinct_capacities_and_the_points_between_lie_on_a_spline():
    """A miniature per octave of each distinct capacity (l1_l2 equal to l1: one set; at 4×: two more, 32× and 64×),
    not one per quarter-octave point; a point between two octaves lies on the cubic Hermite spline (in log
    capacity, Catmull-Rom tangents) through the octaves' hit ratios, computed here from the octave points alone."""
    assert [] == [r for r in (0.125, 0.25, 0.5, 1, 2, 4, 8, 16) if r not in POINT_RATIOS]  # what the spline joins
    equal = CurveSet(0.1, 1 << 16, {"l1": CAPACITY, "l1_l2": CAPACITY}, policy="adaptive")._histories[0]
    wider = CurveSet(0.1, 1 << 16, {"l1": CAPACITY, "l1_l2": 4 * CAPACITY}, policy="adaptive")._histories[0]
    assert [round(CAPACITY * 2.0 ** k) for k in range(-3, 5)] == [mini.capacity for mini in equal.minis]
    assert [round(CAPACITY * 2.0 ** k) for k in range(-3, 7)] == [mini.capacity for mini in wider.minis]
    curves = CurveSet(0.1, 1 << 16, {"l1": CAPACITY}, policy="adaptive")
    for hashes in prefix_trace(random.Random(5), 3000):
        rows = [(h, SALT, MODEL) for h in hashes]
        curves.lookup(MODEL, SALT, 1, [(row, SAMPLED, MISS, 1) for row in rows])
        curves.store(MODEL, SIZE, rows)
    [curve] = [c for c in curves.curves() if (c["model_name"], c["cache_salt"]) == (ALL, ALL)]
    ratios = [point["hit_ratio"] for point in curve["points"]]
    sizes = [math.log(point["capacity_bytes"]) for point in curve["points"]]
    assert 0.05 < ratios[12] < 0.95  # 1×: on the slope, where a wrong spline would show
    octaves = list(range(0, 29, 4))  # POINT_RATIOS[octave] = 2 ** (octave / 4 - 3)

    def tangent(position: int) -> float:
        low, high = octaves[max(position - 1, 0)], octaves[min(position + 1, len(octaves) - 1)]
        return (ratios[high] - ratios[low]) / (sizes[high] - sizes[low])

    for position, octave in enumerate(octaves[:-1]):
        width = sizes[octave + 4] - sizes[octave]
        for step in (1, 2, 3):
            t = (sizes[octave + step] - sizes[octave]) / width
            expected = ((2 * t**3 - 3 * t**2 + 1) * ratios[octave] + (3 * t**2 - 2 * t**3) * ratios[octave + 4]
                        + width * ((t**3 - 2 * t**2 + t) * tangent(position) + (t**3 - t**2) * tangent(position + 1)))
            assert ratios[octave + step] == pytest.approx(max(0.0, min(1.0, expected)), abs=1e-4), (octave, step)


def test_the_miniatures_hold_a_lookups_first_chunks_exactly_at_a_low_rate():
    """Prompts no longer than the exact chunks, at the default rate 0.01: every key is a head key, tracked at rate
    1, so the curve is the order itself at each size (the miniatures once took the 1 % hash-sampled keys only,
    about 4 keys in a miniature of 1× here, and were off by 0.2–0.3)."""
    trace = [hashes[:16] for hashes in prefix_trace(random.Random(11), 6000)]
    curves = CurveSet(0.01, 1 << 15, {"l1": CAPACITY // 4}, policy="adaptive")
    for hashes in trace:
        rows = [(h, SALT, MODEL) for h in hashes]
        curves.lookup(MODEL, SALT, 1, [(row, HEAD, MISS, 1) for row in rows])
        curves.store(MODEL, SIZE, [row for row in rows if row[0] % SAMPLE_MODULUS < 0.01 * SAMPLE_MODULUS])
    [curve] = [c for c in curves.curves() if (c["model_name"], c["cache_salt"]) == (ALL, ALL)]
    predicted = {point["capacity_bytes"]: point["hit_ratio"] for point in curve["points"]}
    for factor in (0.5, 1.0, 2.0):
        size = round(CAPACITY // 4 * factor)
        mini, hits, looked = MiniCache("adaptive", size), 0, 0
        for hashes in trace:  # the order run over every key at full size, apart from the curve code
            found = mini.lookup([((h, SALT, MODEL), SIZE) for h in hashes])
            hits, looked = hits + sum(found), looked + len(found)
        assert 0.1 < hits / looked < 0.9
        assert abs(predicted[size] - hits / looked) <= 0.005, (factor, predicted[size], hits / looked)


@pytest.mark.parametrize("policy", ["arc", "adaptive"])
def test_a_key_repeated_in_one_lookup_is_judged_as_its_first_and_held_once(policy):
    """A lookup naming a key twice (a repeated hash, as L1 writes once): resident, both are hits and it stays
    resident; new, both are misses and it takes its bytes once."""
    mini = MiniCache(policy, 10 * SIZE)
    a, b = ((MODEL, 1), SIZE), ((MODEL, 2), SIZE)
    assert [False] == mini.lookup([a])
    assert ([True, True], [False, False]) == (mini.lookup([a, a]), mini.lookup([b, b]))
    assert (2 * SIZE, 2, [True, True]) == (mini.used, len(mini.order), mini.lookup([a, b]))



def test_a_ghost_of_no_bytes_coming_back_is_a_ghost_hit_without_failing():
    """An object of 0 bytes (a lookup whose size is unknown) evicted, its ghost the only one, stored again: the
    ghost hit is taken (it comes back seen again, T2), no division by the ghost list's 0 bytes."""
    order = eviction_order.build("adaptive", SIZE, {}.get)
    first, again = _Entry(0), _Entry(0)
    order.new("k", first, None)
    order.lists[first.tier]["k"] = first
    assert ("k", first) == order.victim()
    order.new("k", again, None)
    assert 1 == again.tier


def test_the_store_after_a_refused_lookup_is_the_store_the_lookup_made_so_it_stays_refused():
    """A miniature's lookup stores its misses (the engine's store); the store event that follows is that same
    store, not a second one: under ``adaptive`` a refused key stays out until the next lookup of it (whose
    store is admitted, the key refused before), as L1 stores once per lookup.  Storing it again at once would
    let the remembered refusal admit it, evicting what the order kept.  A key that did not fit (the lookup's
    own keys were all there was to evict: L1 holds them until its store is done) stays out too; a store no
    lookup made gives it space."""
    mini = MiniCache("adaptive", 3 * SIZE)
    unfit = [((MODEL, n), SIZE) for n in range(10, 14)]
    assert [False] * 4 == mini.lookup(unfit)
    mini.store(unfit)
    assert (unfit[3][0] not in mini.entries, 3 * SIZE) == (True, mini.used)
    mini.store(unfit[3:])
    assert unfit[3][0] in mini.entries
    mini = _learned(MiniCache("adaptive", 3 * SIZE))
    held = [((MODEL, n), SIZE) for n in range(3)]
    for key in held:
        mini.lookup([key])
        mini.lookup([key])  # seen again: T2, which now fills the miniature, T1 empty
    new = ((MODEL, 9), SIZE)
    assert [True] == mini.lookup(held[:1])  # found in T2: the order may refuse a store for it
    assert [False] == mini.lookup([new])
    mini.store([new])
    assert ({key for key, _ in held}, [False]) == (set(mini.entries), mini.lookup([new]))
    assert new[0] in mini.entries and 3 * SIZE == mini.used
    other = ((MODEL, 8), SIZE)
    mini.store([other])  # a key no lookup failed to store is given space as before
    assert other[0] in mini.entries


def test_a_miniature_refuses_a_store_whole_where_l1_does():
    """The scene of L1's test of refusals whole, in a miniature: 1 and 2 seen again and in use, 3 seen once, one
    slot free.  The lookup of 5, 6, 7 stores none of them (3 is kept); looked up again, all three are stored."""
    mini = _learned(MiniCache("adaptive", 4 * SIZE))
    held = [((MODEL, n), SIZE) for n in (1, 2)]
    for key in held:
        mini.lookup([key])
        mini.lookup([key])
        mini.lookup([key])  # in use in T2
    mini.lookup([((MODEL, 3), SIZE)])
    new = [((MODEL, n), SIZE) for n in (5, 6, 7)]
    assert [False] * 3 == mini.lookup(new)
    assert {(MODEL, n) for n in (1, 2, 3)} == set(mini.entries)
    assert [False] * 3 == mini.lookup(new)
    assert {(MODEL, n) for n in (5, 6, 7)} <= set(mini.entries)


def test_refused_keys_of_float_bytes_trimmed_to_an_empty_t2s_bytes_leave_no_residue_to_trim():
    """A miniature's keys are scaled (float bytes): refused keys of 0.1 and 0.2 bytes sum to more than the 0.1 and
    0.2 taken off again, so trimming them to T2's bytes (0: it holds an object of unknown size) once ran past
    the last key and failed; the store is refused and nothing is remembered past T2's bytes."""
    entries: dict = {}
    order = eviction_order.build("adaptive", SIZE, entries.get)
    order.split()  # past the recency phase: ARC's lists and second-sight admission
    entries["held"] = held = _Entry(0)
    order.new("held", held, None)
    order.promote(held)  # seen again: T2, 0 bytes
    order.lists[held.tier]["held"] = held
    order.reused = True
    order.admitting(["a", "b"], [0.1, 0.2])
    assert (None, 1) == (order.victim(), len(order.lists[1]))
    order.admitting(None)
    order.reused = True  # T2 in use again: "a" is refused again, none of its bytes remembered past T2's 0
    order.admitting(["a"], [0.1])
    assert order.victim() is None


def test_the_order_says_a_store_was_refused_only_when_it_kept_an_object_it_could_have_evicted():
    """A miniature locks nothing, so ``victim`` giving None means a refusal or an empty order; ``refusing``
    tells them apart (what the miniature records as refused), and is reset by the store's end."""
    entries: dict = {}
    order = eviction_order.build("adaptive", SIZE, entries.get)
    order.split()  # past the recency phase: ARC's lists and second-sight admission
    order.admitting(["a"], [1])
    assert (None, False) == (order.victim(), order.refusing)  # nothing to evict: no refusal
    order.admitting(None)
    entries["held"] = held = _Entry(1)
    order.new("held", held, None)
    order.promote(held)  # seen again: T2
    order.lists[held.tier]["held"] = held
    order.reused = True
    order.admitting(["a"], [1])
    assert (None, True) == (order.victim(), order.refusing)
    order.admitting(None)
    assert not order.refusing
    assert not eviction_order.build("lru", SIZE, entries.get).refusing


@pytest.mark.parametrize("asked_first, kept", [("evicted", {1, 2, 3, 4}), ("admitted", {3, 4, 10, 20})])
def test_a_miniature_s_frequency_gate_decides_as_l1_s(asked_first, kept):
    """L1's frequency-gate scene in a miniature: four objects asked for five times each (T2); 10, stored on its
    second sight while the gate is off, evicts 1.  If 1 is asked for again before 10, the gate has proved right
    and 20 is refused on its second sight too; if 10 is asked for first, 20 is admitted and evicts T2's least
    recently used object (2)."""
    mini = _learned(MiniCache("adaptive", 4 * SIZE))

    def key(number: int) -> tuple[tuple[int, str, str], int]:
        return (number, SALT, MODEL), SIZE  # a row as producers ship it: (chunk hash, salt, model)

    for number in (1, 2, 3, 4):
        for _ in range(5):
            mini.lookup([key(number)])

    def second_sight(number: int, used: tuple[int, ...]) -> list[bool]:
        stored = []
        for _ in range(2):
            for other in used:
                mini.lookup([key(other)])
            mini.lookup([key(number)])
            stored.append((number, SALT, MODEL) in mini.entries)
        return stored

    assert [False, True] == second_sight(10, (2,))
    assert {(n, SALT, MODEL) for n in (2, 3, 4, 10)} == set(mini.entries)
    if asked_first == "evicted":
        mini.lookup([key(1)])
        assert [False, False] == second_sight(20, (1, 2, 3, 4))
    else:
        mini.lookup([key(10)])
        assert [False, True] == second_sight(20, (2, 3, 4, 10))
    assert {(n, SALT, MODEL) for n in kept} == set(mini.entries)


def test_a_miniature_stamps_each_key_s_last_use_as_l1_does_so_a_join_orders_by_it():
    """a and b stored (lookups 1, 2), a found (3), c stored (4), b found (5), d stored (6).  Split, T1 holds c, d and
    T2 a, b; joined, one list in their last uses, a, c, b, d (as L1's own test of the same scene)."""
    mini = MiniCache("adaptive", 8.0)
    for key in ("a", "b", "a", "c", "b", "d"):
        mini.lookup([(key, 1.0)])
    order = mini.order
    order.split()
    assert (["c", "d"], ["a", "b"]) == (list(order.lists[0]), list(order.lists[1]))
    order.join()
    assert ["a", "c", "b", "d"] == list(order.lists[0])


def _accounts_add_up(mini: MiniCache) -> bool:
    """Every resident key in its tier's list, the miniature's bytes the sum of the resident entries', and the
    order's bytes of each tier the sum of that tier's."""
    entries, order = mini.entries, mini.order
    total = sum(entry.size for entry in entries.values())
    return (len(entries) == len(order) and all(key in order.lists[entry.tier] for key, entry in entries.items())
            and mini.used == pytest.approx(total)
            and all(size == pytest.approx(sum(entry.size for entry in entries.values() if entry.tier == tier))
                    for tier, size in enumerate(order.sizes)))


def test_two_resident_tail_segments_merge_into_one_entry_of_both_bytes_whose_children_follow_it():
    """A tail's segments a → b → c stored by one lookup (each the parent of the next): merging a and b leaves one
    entry, a's, of both their bytes, no byte counted twice or lost, and c its child, as it was b's."""
    mini = MiniCache("adaptive", 100 * SIZE)
    a, b, c = ((MODEL, 1), 3.0 * SIZE), ((MODEL, 2), 5.0 * SIZE), ((MODEL, 3), 2.0 * SIZE)
    assert [False] * 3 == mini.lookup([a, b, c])
    mini.merge(a[0], b[0], 5.0 * SIZE)
    assert ({a[0], c[0]}, 8.0 * SIZE, 10.0 * SIZE) == (set(mini.entries), mini.entries[a[0]].size, mini.used)
    assert _accounts_add_up(mini)
    kept, child = mini.entries[a[0]], mini.entries[c[0]]
    assert (child.parent, kept.children) == (kept, c[0])


def test_a_segment_merged_with_the_next_one_evicted_grows_and_the_lookup_that_follows_makes_the_room():
    """Only the first of two segments resident (the order evicted the tail's end): it grows by the second's
    bytes, and the lookup that follows, holding its own keys out of the order, evicts what else it takes to fit,
    never the grown segment, though it is the least recently used (once it evicted itself, and came back as a
    ghost hit)."""
    mini = MiniCache("adaptive", 10 * SIZE)
    first, other = ((MODEL, 1), 4.0 * SIZE), ((MODEL, 9), 4.0 * SIZE)
    mini.lookup([first])
    mini.lookup([other])
    mini.merge(first[0], (MODEL, 2), 3.0 * SIZE)
    assert (7.0 * SIZE, 11.0 * SIZE) == (mini.entries[first[0]].size, mini.used)
    assert [True] == mini.lookup([first])
    assert ({first[0]}, 7.0 * SIZE) == (set(mini.entries), mini.used)
    assert _accounts_add_up(mini)


@pytest.mark.parametrize("policy", ["arc", "adaptive"])
def test_a_segment_merged_into_one_not_resident_goes_and_its_children_are_evicted_first(policy):
    """Only the second of two segments resident: it goes (the lookup stores the merged one whole), and under a
    prefix-aware order its children, no parent's now, are the first evicted."""
    mini = MiniCache(policy, 100 * SIZE)
    chain = [((MODEL, n), float(SIZE)) for n in (2, 3, 4)]
    mini.lookup(chain)
    mini.merge((MODEL, 1), (MODEL, 2), float(SIZE))
    assert ({(MODEL, 3), (MODEL, 4)}, 2.0 * SIZE) == (set(mini.entries), mini.used) and _accounts_add_up(mini)
    child = mini.entries[(MODEL, 3)]
    assert child.parent is None and (2 if policy == "adaptive" else 0) == child.tier


def growing_sessions(rng: random.Random, requests: int, sessions: int = 12, longest: int = 200) -> list[list[int]]:
    """Agent sessions behind one 8-chunk system prompt, each request the next turn of one (the most recent most
    often), 1–4 chunks longer than its last; a session longer than ``longest`` chunks starts over."""
    system = [rng.getrandbits(64) for _ in range(8)]
    live = [system + [rng.getrandbits(64) for _ in range(rng.randint(9, 12))] for _ in range(sessions)]
    out = []
    for _ in range(requests):
        index = len(live) - 1 - min(int(rng.expovariate(0.25)), len(live) - 1)
        grown = live.pop(index) + [rng.getrandbits(64) for _ in range(rng.randint(1, 4))]
        live.append(grown if len(grown) <= longest else system + [rng.getrandbits(64) for _ in range(9)])
        out.append(list(live[-1]))
    return out


def feed_sessions(curves: CurveSet, trace: list[list[int]]) -> None:
    """Each request of ``trace`` to ``curves`` as the cache process ships it at rate 0.01 (``mrc_accuracy``'s feed:
    its 16 head chunks, the hash-sampled rest, the tail's count and marks, then the store of its sampled keys, of
    that benchmark's ``CHUNK_BYTES`` each)."""
    mrc_accuracy.feed(curves, [(MODEL, SALT, hashes) for hashes in trace], 0.01, 16)


@pytest.mark.parametrize("seed", [2, 3, 5])
def test_tails_longer_than_a_head_key_s_segments_keep_the_curve_of_the_order_within_0_01(seed):
    """Tails of up to 184 objects, 1–4 new a turn, at rate 0.01: more than ``SEGMENTS_PER_HEAD`` segments a head
    key, so segments merge.  The curve stays within 0.01 of L1 running the order at each octave from ¼× to 2×.
    Merging the first two under the first's key, its resident bytes left as they were, held the merged
    objects in a fraction of their bytes (0.034 high at 2×, seed 3); merging them into one giant first segment,
    which a miniature keeps or evicts whole where L1 cuts a chain anywhere, read 0.014 low at ½×; merging the
    two of fewest objects in the history but not in the miniatures, 0.015 off (seed 2)."""
    from mpcache.telemetry.mrc.history import SEGMENTS_PER_HEAD

    trace = growing_sessions(random.Random(seed), 1500)
    assert max(len(hashes) for hashes in trace) - 16 > 2 * SEGMENTS_PER_HEAD  # merges at one or four new a turn
    objects = 600  # L1's capacity in objects: the curves' of CHUNK_BYTES each, L1's of SIZE
    curves = CurveSet(0.01, 1 << 15, {"l1": objects * CHUNK_BYTES}, policy="adaptive")
    feed_sessions(curves, trace)
    [curve] = [c for c in curves.curves() if (c["model_name"], c["cache_salt"]) == (ALL, ALL)]
    predicted = {point["capacity_bytes"]: point["hit_ratio"] for point in curve["points"]}
    measured = {factor: l1_hit_ratio(trace, "adaptive", round(objects * SIZE * factor)) for factor in (0.25, 0.5, 1, 2)}
    assert 0.2 < measured[0.25] and measured[2] < 0.95  # the sizes span the curve
    assert {factor: True for factor in measured} == {
        factor: abs(predicted[round(objects * CHUNK_BYTES * factor)] - ratio) <= 0.01
        for factor, ratio in measured.items()}, (predicted, measured)


def test_no_merge_joins_a_tail_s_new_objects_to_a_segment_the_last_tail_left():
    """Merging the two segments of fewest objects never joins a lookup's first new segment to the last one it
    shares with the last tail: the new objects, never seen, would be judged by whether a miniature holds the old
    one (once, 122 merges over this trace).  Merges there are, hundreds of them."""
    from mpcache.telemetry.mrc import history as history_module

    curves = CurveSet(0.01, 1 << 15, {"l1": 600 * CHUNK_BYTES}, policy="adaptive")
    history = curves._histories[0]
    merges: list[tuple[int, int, int]] = []  # (the segment merged into, the one merged, the last old one's number)
    last_old = [0]
    mini = history.minis[0]
    merge, simulate = mini.merge, history._simulate_tail
    mini.merge = lambda first, second, nbytes: (merges.append((first[1], second[1], last_old[0])),
                                                merge(first, second, nbytes))[1]

    def watched(*args, **kwargs):
        last_old[0] = history._segment  # the segments made before this lookup
        return simulate(*args, **kwargs)

    history._simulate_tail = watched
    feed_sessions(curves, growing_sessions(random.Random(3), 1500))
    assert len(merges) > 300 and history_module.SEGMENTS_PER_HEAD == 64
    assert [] == [(first, second) for first, second, before in merges if first <= before < second]
