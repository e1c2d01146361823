"""Miss-ratio curves and miss reasons (mpcache.telemetry.mrc) against independent computations: a brute-force
recency list for the stack distances, and byte-capacity LRU caches simulated at every point of the curve."""

from __future__ import annotations

import random
import subprocess
import sys
from collections import OrderedDict

import msgpack
import pytest

from mpcache.contract.keys import SAMPLE_MODULUS
from mpcache.telemetry.mrc.curves import (
    AFTER_GAP,
    ALL,
    HEAD,
    L1_HIT,
    L2_HIT,
    MISS,
    OVERFLOW,
    POINT_RATIOS,
    SAMPLED,
    CurveSet,
)
from mpcache.telemetry.mrc.stack import ReuseStack

MODEL, SALT = "m", "s"


def test_stack_distances_equal_a_brute_force_recency_list_across_renumberings():
    """Bytes above each key equal the sum over a plain most-recent-first list, over enough touches to
    renumber the Fenwick slots many times, with removals and changing sizes."""
    rng = random.Random(5)
    stack, recency = ReuseStack(max_keys=16), []  # recency: [(key, bytes)], most recent last
    checked = 0
    for _ in range(5000):
        key = rng.randrange(20)
        known = [k for k, _ in recency]
        if key in known:
            above = sum(b for k, b in recency[known.index(key) + 1:])
            assert above == stack.weighted_above(stack.get(key)[0], [1.0])
            checked += 1
            recency.pop(known.index(key))
        if rng.random() < 0.05 and key in stack:
            stack.remove(key)
            continue
        size = rng.choice((1, 2, 7))
        stack.touch(key, size)
        recency.append((key, size))
    assert checked > 3000 and [sum(b for _, b in recency)] == stack.total_bytes


def lru_hit_ratio(trace: list[tuple[str, int, int]], capacity: int) -> float:
    """Hits over lookups of a byte LRU cache of ``capacity``: a lookup hit touches; a store inserts (evicting
    least recently used objects until it fits) or touches.  (Each request's store follows its lookup.)"""
    return shared_lru_hit_ratios([(op, (MODEL, SALT), key, size) for op, key, size in trace], capacity)[(ALL, ALL)]


def shared_lru_hit_ratios(trace, capacity):
    """Per tenant, per model across tenants (model, ALL), per cache_salt across models (ALL, salt), and ALL:
    hits over lookups in one byte LRU cache shared by every tenant."""
    cache, used, hits, looks = OrderedDict(), 0, {}, {}
    for op, tenant, key, size in trace:
        if op == "lookup":
            curves = (tenant, (tenant[0], ALL), (ALL, tenant[1]), (ALL, ALL))
            for curve in curves:
                looks[curve] = looks.get(curve, 0) + 1
            if key in cache:
                cache.move_to_end(key)
                for curve in curves:
                    hits[curve] = hits.get(curve, 0) + 1
            continue
        if key in cache:
            cache.move_to_end(key)
            continue
        while cache and used + size > capacity:
            used -= cache.popitem(last=False)[1]
        if size <= capacity:
            cache[key] = size
            used += size
    return {curve: hits.get(curve, 0) / looks[curve] for curve in looks}


def engine_trace(rng: random.Random, requests: int, keys: int, size: int) -> list[tuple[str, int, int]]:
    """An engine's pattern: every request looks up its chunks, then stores them (prefill writes what missed)."""
    trace = []
    hashes = [rng.getrandbits(64) for _ in range(keys)]  # chunk keys are content hashes: uniform
    for _ in range(requests):
        chunks = [hashes[int(rng.paretovariate(1.1) * 1000) % keys] for _ in range(rng.randint(1, 6))]
        trace += [("lookup", c, size) for c in chunks] + [("store", c, size) for c in chunks]
    return trace


def feed(curves: CurveSet, trace: list[tuple[str, int, int]], head: int = 4) -> None:
    """The trace as the telemetry process gets it: one lookup event per request (its first ``head`` keys in
    the exact stratum; all said missing: the curve does not use the lookup's own outcome), one store."""
    position = 0
    while position < len(trace):
        lookups = []
        while position < len(trace) and trace[position][0] == "lookup":
            lookups.append(((trace[position][1], SALT, MODEL), HEAD if len(lookups) < head else SAMPLED, MISS, 1))
            position += 1
        curves.lookup(MODEL, SALT, 1, lookups)
        stores, size = [], 0
        while position < len(trace) and trace[position][0] == "store":
            stores.append((trace[position][1], SALT, MODEL))
            size = trace[position][2]
            position += 1
        curves.store(MODEL, size, stores)


def test_at_rate_one_every_point_equals_a_simulated_lru_cache_of_that_size():
    size, capacity = 1000, 50_000
    trace = engine_trace(random.Random(1), 3000, 400, size)
    curves = CurveSet(1.0, 8192, {"l1": capacity})
    feed(curves, trace)
    [curve] = [c for c in curves.curves() if (c["model_name"], c["cache_salt"]) == (ALL, ALL)]
    expected = [round(lru_hit_ratio(trace, round(capacity * ratio)), 6) for ratio in POINT_RATIOS]
    assert expected == [point["hit_ratio"] for point in curve["points"]]
    assert sum(op == "lookup" for op, _, _ in trace) == curve["sampled_accesses"]
    assert 0.005 < expected[0] < 0.5 < expected[-1] < 1.0  # the workload exercises the curve from bottom to top


def test_fixed_size_mode_stays_within_max_keys_and_stays_close_to_exact():
    """10× more keys than the sampled stratum tracks (half of max_keys): its rate drops so that no more are
    tracked, and the curve stays within 0.03 of the simulated caches (mean absolute error over the points)."""
    size, capacity = 1000, 400_000
    trace = engine_trace(random.Random(2), 20_000, 4000, size)
    curves = CurveSet(1.0, 800, {"l1": capacity})
    feed(curves, trace, head=0)  # these keys have no fixed position in their requests: sampled only
    [curve] = [c for c in curves.curves() if (c["model_name"], c["cache_salt"]) == (ALL, ALL)]
    exact = [lru_hit_ratio(trace, round(capacity * ratio)) for ratio in POINT_RATIOS[::4]]
    got = [point["hit_ratio"] for point in curve["points"][::4]]
    assert curves.tracked_keys <= 400 and curves.rate < 0.5
    assert sum(abs(a - b) for a, b in zip(exact, got)) / len(exact) < 0.03


def flooded_trace(rng: random.Random, requests: int, size: int) -> list[tuple[str, int, int]]:
    """Each request: a few of 40 hot keys, then two keys never seen again (fresh questions)."""
    hot = [rng.getrandbits(64) for _ in range(40)]
    trace = []
    for _ in range(requests):
        chunks = [hot[int(rng.paretovariate(1.2)) % len(hot)] for _ in range(rng.randint(1, 3))]
        chunks += [rng.getrandbits(64) for _ in range(2)]
        trace += [("lookup", c, size) for c in chunks] + [("store", c, size) for c in chunks]
    return trace


def test_keys_deeper_than_every_capacity_are_forgotten_so_the_rate_stays_exact():
    """A flood of one-shot keys, 15× what the curves may track: keys deeper than the largest point (16× the
    tier) can never hit at any point, so they are forgotten instead of the sampling rate being lowered.
    Both strata keep rate 1, and every point still equals a simulated LRU cache of that size."""
    size, capacity = 1000, 8000
    trace = flooded_trace(random.Random(3), 3000, size)
    curves = CurveSet(1.0, 400, {"l1": capacity})
    feed(curves, trace, head=2)
    [curve] = [c for c in curves.curves() if (c["model_name"], c["cache_salt"]) == (ALL, ALL)]
    expected = [round(lru_hit_ratio(trace, round(capacity * ratio)), 6) for ratio in POINT_RATIOS]
    assert (1.0, 1.0) == (curves.rate, curves.head_rate) and curves.tracked_keys <= 400
    assert expected == [point["hit_ratio"] for point in curve["points"]]
    assert len({key for _, key, _ in trace}) > 15 * 400 and 0.05 < expected[8] < expected[-1] < 0.9  # 1×: mid-curve


def test_a_key_forgotten_for_depth_is_evicted_when_asked_again_not_cold():
    """A stored key pushed below the deepest point by a flood of new keys leaves the stack, but the curves
    remember it was stored: asked for again, it is an eviction (and regret), and only the flood is cold."""
    curves = CurveSet(1.0, 64, {"l1": 100})
    curves.store(MODEL, 100, [(1, SALT, MODEL)])
    for key in range(1000, 1100):  # 100 keys of 100 bytes: key 1 falls far below 16 × 100 bytes
        curves.lookup(MODEL, SALT, 1, [((key, SALT, MODEL), SAMPLED, MISS, 1)])
        curves.store(MODEL, 100, [(key, SALT, MODEL)])
    assert (1, SALT, MODEL) not in curves._histories[0].stack and curves.rate == 1.0
    curves.lookup(MODEL, SALT, 1, [((1, SALT, MODEL), SAMPLED, MISS, 1)])
    misses, regret = curves.take_counts()
    assert ({("cold", MODEL, SALT): 100.0, ("evicted", MODEL, SALT): 1.0}, {(MODEL, SALT): 1.0}) == (
        dict(misses), dict(regret))


def test_a_key_named_twice_in_one_lookup_keeps_its_stratum_and_the_budget_holds():
    """A corrupt lookup that names one key as a head chunk and again as a sampled key: the key stays in the
    stratum it entered, so each stratum's count stays true and fixed-size mode keeps within the budget."""
    curves = CurveSet(1.0, 64, {"l1": 10**12})  # a tier so large that no key is deep enough to be forgotten
    for key in range(500):
        row = (key, SALT, MODEL)
        curves.lookup(MODEL, SALT, 1, [(row, HEAD, MISS, 1), (row, SAMPLED, MISS, 1)])
    assert [len(curves._histories[0].stack.keys_in(HEAD)), len(curves._histories[0].stack.keys_in(SAMPLED))] == [
        stratum.keys for stratum in curves._histories[0].strata]
    assert 0 < curves.tracked_keys <= 64 and curves.head_rate < 1.0


def test_miss_reasons_and_eviction_regret_at_rate_one():
    """Cold: never stored; evicted: stored, then missed; after_gap: said so by the cache process; L2 hits and
    evicted misses of keys stored before are eviction regret.  Per chunk (÷ ranks)."""
    curves = CurveSet(1.0, 8192, {"l1": 10_000})
    curves.store(MODEL, 100, [(1, SALT, MODEL), (2, SALT, MODEL), (3, SALT, MODEL)])
    curves.lookup(MODEL, SALT, 1, [((1, SALT, MODEL), HEAD, L1_HIT, 1), ((2, SALT, MODEL), HEAD, L2_HIT, 1),
                                   ((4, SALT, MODEL), SAMPLED, AFTER_GAP, 1), ((3, SALT, MODEL), SAMPLED, MISS, 1),
                                   ((9, SALT, MODEL), SAMPLED, MISS, 1)])
    misses, regret = curves.take_counts()
    assert ({("after_gap", MODEL, SALT): 1.0, ("evicted", MODEL, SALT): 1.0, ("cold", MODEL, SALT): 1.0},
            {(MODEL, SALT): 2.0}) == (dict(misses), dict(regret))
    curves.lookup(MODEL, SALT, 2, [((7, SALT, MODEL), SAMPLED, MISS, 1), ((8, SALT, MODEL), SAMPLED, MISS, 1)])
    assert ({("cold", MODEL, SALT): 1.0}, {}) == tuple(dict(c) for c in curves.take_counts())  # 2 ranks, 1 chunk


def test_a_key_looked_up_but_never_stored_stays_cold_until_a_store_or_a_hit_shows_it_stored():
    """docs/METRICS.md: ``cold`` is never stored in the sampled history.  A key asked for again and again whose
    store never came (the engine did not store it, or the store was refused) misses ``cold`` every time, and is
    no eviction regret; once a store names it, or a lookup finds it (in L1, in L2, or held past the gap: it was
    stored), its next miss is ``evicted``."""
    curves = CurveSet(1.0, 8192, {"l1": 10_000})
    never, hit_once, gap_once, l2_once = ((value, SALT, MODEL) for value in (9, 10, 11, 12))
    curves.lookup(MODEL, SALT, 1, [(never, SAMPLED, MISS, 1)])
    curves.lookup(MODEL, SALT, 1, [(never, SAMPLED, MISS, 1)])  # asked for before, never stored
    assert ({("cold", MODEL, SALT): 2.0}, {}) == tuple(dict(c) for c in curves.take_counts())
    curves.store(MODEL, 100, [never])
    curves.lookup(MODEL, SALT, 1, [(hit_once, HEAD, L1_HIT, 1), (l2_once, HEAD, L2_HIT, 1),
                                   (gap_once, SAMPLED, AFTER_GAP, 1)])  # first seen found: stored, no store seen
    curves.take_counts()
    curves.lookup(MODEL, SALT, 1, [(key, HEAD, MISS, 1) for key in (never, hit_once, l2_once, gap_once)])
    assert ({("evicted", MODEL, SALT): 4.0}, {(MODEL, SALT): 4.0}) == tuple(dict(c) for c in curves.take_counts())


def test_a_found_key_the_threshold_drops_as_it_is_tracked_is_not_kept_stored():
    """A key found in a lookup whose insert lowers its stratum's threshold past the key itself is not tracked: it
    is not kept as stored either, so ``stored`` stays within the stack, and the history a restarted telemetry process
    checks is accepted (a stored key the stack does not hold made it refuse the whole checkpoint).  A client can
    aim at that: the threshold is what ``/mrc``'s head rate says, and its keys are the chunk hashes it sends."""
    curves = CurveSet(0.01, 256, {"l1": 64 << 30})
    history = curves._histories[0]
    for number in range(256):  # a full head stratum of ordinary keys, each found
        curves.lookup(MODEL, SALT, 1, [(((number + 1) * 2048, SALT, MODEL), HEAD, L1_HIT, 1)])
    for number in range(300):  # each just under the threshold: the highest tracked, the first its insert drops
        residue = round(curves.head_rate * SAMPLE_MODULUS) - 1
        curves.lookup(MODEL, SALT, 1, [((residue + (number + 1) * SAMPLE_MODULUS, SALT, MODEL), HEAD, L1_HIT, 1)])
    assert history.stored <= {row for row, _ in history.stack.entries()}
    saved = msgpack.unpackb(msgpack.packb(curves.save_history(), use_bin_type=True), raw=False)
    curves.load_state(curves.save_curves(), saved)()


def test_keys_above_the_threshold_are_ignored_and_estimates_scale_by_one_over_the_rate():
    rate = 0.25
    curves = CurveSet(rate, 8192, {"l1": 10_000})
    inside = next(h for h in range(1, 10**6) if h % SAMPLE_MODULUS < rate * SAMPLE_MODULUS)
    outside = next(h for h in range(1, 10**6) if h % SAMPLE_MODULUS >= rate * SAMPLE_MODULUS)
    curves.lookup(MODEL, SALT, 1, [((inside, SALT, MODEL), SAMPLED, MISS, 1),
                                   ((outside, SALT, MODEL), SAMPLED, MISS, 1),
                                   ((outside + 1, SALT, MODEL), HEAD, MISS, 1)])  # the exact stratum: every key
    assert {("cold", MODEL, SALT): 5.0} == dict(curves.take_counts()[0])


def test_the_sampling_rule_is_the_same_in_another_process():
    """A fresh interpreter (another process, another PYTHONHASHSEED) samples exactly the keys that
    ``hash mod 1_000_003 < rate × 1_000_003`` names."""
    code = ("from mpcache.cache.mrc.accesses import AccessSampler\n"
            "class P:\n    def emit(self, etype, fields=(), **kw): print(sorted(h for h, _, _ in kw['sampled']))\n"
            "    def fields_emitter(self, etype): return lambda fields, session_id: True\n"
            "AccessSampler(P(), 0.01).store('m', 's', list(range(0, 10**7, 997)), 1)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", "PATH": "/usr/bin"}).stdout
    expected = sorted(h for h in range(0, 10**7, 997) if h % 1_000_003 < 0.01 * 1_000_003)
    assert expected == eval(out) and len(expected) > 50


@pytest.mark.parametrize("rate", [-0.1, 1.5])
def test_a_rate_outside_zero_to_one_is_refused(rate):
    from mpcache.cache.mrc.accesses import AccessSampler

    with pytest.raises(ValueError, match="sample rate"):
        AccessSampler(object(), rate)  # type: ignore[arg-type]


def test_rate_zero_publishes_no_access_event():
    from mpcache.cache.mrc.accesses import AccessSampler

    class Recorder:
        emitted: list = []

        def emit(self, *args, **kwargs):
            self.emitted.append(args)

        def fields_emitter(self, etype):
            return lambda fields, session_id: self.emitted.append((etype, fields))

    recorder = Recorder()
    sampler = AccessSampler(recorder, 0.0)  # type: ignore[arg-type]
    sampler.store("m", "s", [1, 2, 3], 4096)
    sampler.lookup(None, "m", "s", [1, 2, 3], 1, 0, 0)  # type: ignore[arg-type]
    assert [] == recorder.emitted
    AccessSampler(recorder, 1.0).store("m", "s", [1, 2, 3], 4096)  # type: ignore[arg-type]
    assert 1 == len(recorder.emitted)


def test_a_lookup_event_maps_back_to_each_keys_stratum_and_outcome():
    """The head keys' outcomes follow from their chunk (found, l1_hits in objects of ``ranks`` per chunk, the
    after-gap mask) and each stands for the chunk's ranks; the sampled keys' from the class counts."""
    from mpcache.contract.events import MRC_EXACT_GAP_SHIFT
    from mpcache.telemetry.subscribers.metrics.mrc import lookup_accesses

    fields = {"ranks": 2, "found": 4, "l1_hits": 2, "exact": 4 | 0b1000 << MRC_EXACT_GAP_SHIFT,
              "sampled_l1_hits": 1, "sampled_l2_hits": 0, "sampled_after_gap": 1,
              "head_0": 10, "head_1": 11, "head_2": 12, "head_3": -1}
    rows = [(i, SALT, MODEL) for i in range(3)]
    assert [(10, HEAD, L1_HIT, 2), (11, HEAD, L2_HIT, 2), (12, HEAD, MISS, 2), (2**64 - 1, HEAD, AFTER_GAP, 2),
            (0, SAMPLED, L1_HIT, 1), (1, SAMPLED, AFTER_GAP, 1), (2, SAMPLED, MISS, 1)] == [
        (row[0], stratum, found, objects)
        for row, stratum, found, objects in lookup_accesses(MODEL, SALT, rows, fields)]


def test_corrupt_access_events_raise_nothing_and_count_nothing_negative(pipeline, metrics, config):
    """Lookup and store events with random field values (a buggy or hostile producer) pass through the
    subscriber without an exception; every estimate stays finite and non-negative, every ratio in [0, 1]."""
    import dataclasses
    import math

    from mpcache.contract.events import MRC_HEAD_FIELDS, MRC_TAIL_MARK_FIELDS, EventType
    from mpcache.telemetry.subscribers.metrics.mrc import MissRatioSubscriber

    rng = random.Random(9)
    subscriber = MissRatioSubscriber(metrics.meter, dataclasses.replace(config, mrc_sample_rate=1.0))
    added: list[float] = []  # what reaches the SDK's counters (which would drop a negative add with a warning)
    for counter in (subscriber._misses, subscriber._regret):
        counter.add = lambda amount, attributes=None, add=counter.add: (added.append(amount), add(amount, attributes))
    pipeline.subscribe(subscriber)
    lookups: list[int] = []  # what reaches the curves (a head field must be a 64-bit hash to be published)
    subscriber.curves.lookup = lambda *args, lookup=subscriber.curves.lookup: (lookups.append(1), lookup(*args))
    values = (-(2**63), -5, -1, 0, 1, 2, 3, 7, 15, 255, 2**40, 2**63 - 1)
    hashes = (0, 1, 2**63 - 1, 2**63, 2**64 - 1)
    published = 0
    for _ in range(400):
        rows = [(rng.getrandbits(64), rng.choice("ab"), "m") for _ in range(rng.randint(0, 5))]
        if rng.random() < 0.5:
            fields = [rng.choice(values) for _ in range(7)]
            fields += [rng.choice((*hashes, rng.getrandbits(64))) for _ in MRC_HEAD_FIELDS + MRC_TAIL_MARK_FIELDS]
            published += pipeline.publish(EventType.MRC_LOOKUP_SAMPLED, ("m", rng.choice("ab"), *fields), sampled=rows)
        else:
            pipeline.publish(EventType.MRC_STORE_SAMPLED, ("m", "a", rng.choice(values), rng.choice(values)),
                             sampled=rows)
        if rng.random() < 0.1:
            pipeline.deliver()
    pipeline.deliver()
    collected = metrics.collect()
    counts = [v for name in ("mpcache.lookup_miss", "mpcache.l1_evicted_reused")
              for v in collected.get(name, {}).values()]
    ratios = list(collected.get("mpcache.mrc_hit_ratio", {}).values())
    assert ({}, True, True) == (pipeline.bus.subscriber_exception_counts(),
                                all(math.isfinite(v) and v >= 0 for v in counts + added),
                                all(0 <= v <= 1 for v in ratios))
    assert counts and ratios and added  # the random events did reach the instruments
    assert published > 150 and len(lookups) > 100  # the lookups themselves reached the curves


def test_the_fixed_size_heaps_stay_bounded_when_depth_pruning_alone_keeps_the_budget():
    """A flood of one-shot keys that depth pruning keeps under the budget (the rate never drops): the heap of
    each stratum's hash values must not keep an entry for every key ever inserted (memory stays bounded)."""
    rng = random.Random(12)
    curves = CurveSet(1.0, 400, {"l1": 8000})
    for _ in range(20_000):
        row = (rng.getrandbits(64), SALT, MODEL)
        curves.lookup(MODEL, SALT, 1, [(row, SAMPLED, MISS, 1)])
        curves.store(MODEL, 1000, [row])
    assert (1.0, True) == (curves.rate, curves.tracked_keys <= 400)
    assert all(len(stratum.heap) <= 2 * stratum.budget + 16 for stratum in curves._histories[0].strata)


def test_a_stratum_threshold_never_rises_within_one_lookup():
    """SHARDS fixed-size: once the threshold drops below a key's hash value, keys at or above it are not
    tracked.  One lookup's later keys were judged at the old threshold; they must not be inserted past the
    new one (which would raise the threshold again when lowered next, and admit keys already dropped)."""
    curves = CurveSet(1.0, 4, {"l1": 10**15})  # nothing is deep enough to prune: fixed-size mode acts
    values = (100, 200, 300, 500, 400)  # hash mod P of each key; the sampled stratum tracks 2 keys
    curves.lookup(MODEL, SALT, 1, [((value, SALT, MODEL), SAMPLED, MISS, 1) for value in values])
    assert curves.rate * SAMPLE_MODULUS == 300  # 300 went first: 500 and 400 are past the threshold
    assert {(100, SALT, MODEL), (200, SALT, MODEL)} == set(curves._histories[0].stack._entry)


def test_a_lookup_whose_trailing_partial_chunk_was_given_back_reports_no_miss_as_an_l1_hit():
    """An L2 prefetch that ends inside a chunk (some KV ranks missing) gives that chunk's objects back, so the
    job's ``found`` shrinks but its ``l1_hits`` does not: the objects past ``found`` are misses, never L1 hits."""
    from mpcache.cache.mrc.accesses import AccessSampler
    from mpcache.cache.prefetch import PrefetchOutcome
    from mpcache.cache.sessions import SessionRegistry

    class L1:  # what the registry and the sampler ask of L1 here: nothing is held
        def __getattr__(self, _name):
            return lambda *args, **kwargs: 0

    class Recorder:
        def __init__(self):
            self.emitted = []

        def emit(self, etype, fields=(), **kwargs):
            self.emitted.append((fields, kwargs))
            return True

        def fields_emitter(self, etype):
            return lambda fields, session_id: self.emit(etype, fields)

    ranks, chunks = 3, 18  # two chunks past the 16 head chunks, their keys sampled at rate 1
    hashes = list(range(10**6, 10**6 + ranks * chunks))
    registry = SessionRegistry(L1(), Recorder())  # type: ignore[arg-type]
    job = registry.add_job("r", MODEL, SALT, hashes, 16 * ranks, ranks=ranks, per_key=True)
    # the prefetch's run: objects 48, 49 were in L1, 50 came from L2, 51, 52 in L1; object 53 is missing
    registry.prefetch_finished(job, PrefetchOutcome(locked=5, l1_hits=4, l2_hits=1, landed=1))
    assert 17 * ranks == job.found
    recorder = Recorder()
    AccessSampler(recorder, 1.0).lookup(L1(), MODEL, SALT, hashes, ranks, job.l1_hits, job.found)  # type: ignore[arg-type]
    [(fields, options)] = recorder.emitted
    sampled_hits = fields[6] + fields[7]  # the sampled keys' L1 and L2 hits
    assert 3 == sampled_hits  # objects 48..50: the rest of the sampled keys (51..53) missed
    assert [h for h, _, _ in options["sampled"][:3]] == hashes[48:51]


TENANTS = [("m1", "a"), ("m1", "b"), ("m2", "a")]


def test_at_rate_one_pruned_curves_of_every_tenant_and_tier_equal_a_shared_simulated_lru_cache():
    """Three tenants share one cache, two tiers, and a flood of one-shot keys 10x what the curves may track:
    depth pruning keeps the rate at 1, and every point of every tenant's curve, of each model's across tenants,
    of each cache_salt's across models and of "*" equals that share's hit ratio in one byte LRU cache of that
    size shared by all of them."""
    rng = random.Random(11)
    size = 1000
    hot = {t: [rng.getrandbits(64) for _ in range(30)] for t in TENANTS}
    trace, requests = [], []
    for _ in range(2500):
        tenant = rng.choice(TENANTS)
        model, salt = tenant
        chunks = [hot[tenant][int(rng.paretovariate(1.2)) % 30] for _ in range(rng.randint(1, 3))]
        chunks += [rng.getrandbits(64) for _ in range(2)]
        rows = [(c, salt, model) for c in chunks]
        requests.append((tenant, rows))
        trace += [("lookup", tenant, r, size) for r in rows] + [("store", tenant, r, size) for r in rows]
    caps = {"l1": 4000, "l1_l2": 10000}
    curves = CurveSet(1.0, 400, caps)
    for (model, salt), rows in requests:
        curves.lookup(model, salt, 1, [(r, HEAD if i < 2 else SAMPLED, MISS, 1) for i, r in enumerate(rows)])
        curves.store(model, size, rows)
    assert (curves.rate, curves.head_rate) == (1.0, 1.0) and curves.tracked_keys <= 400
    assert len({r for _, _, r, _ in trace}) > 10 * 400
    wrong = []
    expected = {tier: {ratio: shared_lru_hit_ratios(trace, round(capacity * ratio)) for ratio in POINT_RATIOS}
                for tier, capacity in caps.items()}
    for curve in curves.curves():
        tenant = (curve["model_name"], curve["cache_salt"])
        for ratio, point in zip(POINT_RATIOS, curve["points"]):
            want = round(expected[curve["tier"]][ratio][tenant], 6)
            if want != point["hit_ratio"]:
                wrong.append((curve["tier"], tenant, ratio, want, point["hit_ratio"]))
    assert not wrong, wrong[:5]
    assert 16 == len(curves.curves())  # "*", three tenants, two models, two salts: two tiers each
    assert 0.05 < expected["l1"][1.0][(ALL, ALL)] < expected["l1_l2"][16.0][(ALL, ALL)] < 0.9  # mid-curve


def test_a_tenant_named_like_the_curve_over_everything_is_counted_in_it_once():
    """A client may name its model or its cache_salt "*": its lookups must count once in the curve over
    everything, never in a marginal curve's name ((model, "*") is that model across tenants), but in the
    overflow curves."""
    curves = CurveSet(1.0, 64, {"l1": 1000})
    curves.store("*", 100, [])
    curves.lookup("*", "*", 1, [((1, "*", "*"), SAMPLED, MISS, 1)])
    curves.lookup(MODEL, "*", 1, [((3, "*", MODEL), SAMPLED, MISS, 1)])
    curves.lookup(MODEL, SALT, 1, [((2, SALT, MODEL), SAMPLED, MISS, 1)])
    assert {(ALL, ALL): 3, (OVERFLOW, OVERFLOW): 2, (OVERFLOW, ALL): 2, (ALL, OVERFLOW): 2, (MODEL, SALT): 1,
            (MODEL, ALL): 1, (ALL, SALT): 1} == {(c["model_name"], c["cache_salt"]): c["sampled_accesses"]
                                                 for c in curves.curves()}


def test_pair_model_and_salt_curves_are_each_capped_and_the_rest_share_the_overflow_curves():
    """At most ``max_tenants`` curves of each kind (pairs, models across salts, salts across models); the
    lookups of the others count in the overflow curve of that kind, so every kind still adds up to the whole."""
    curves = CurveSet(1.0, 64, {"l1": 1000}, max_tenants=2)
    tenants = [(f"m{i}", f"s{j}") for i in range(3) for j in range(3)]
    for key, (model, salt) in enumerate(tenants):
        curves.lookup(model, salt, 1, [((key, salt, model), SAMPLED, MISS, 1)])
    counts = {(c["model_name"], c["cache_salt"]): c["sampled_accesses"] for c in curves.curves()}
    assert {(ALL, ALL): 9, ("m0", "s0"): 1, ("m0", "s1"): 1, (OVERFLOW, OVERFLOW): 7, ("m0", ALL): 3,
            ("m1", ALL): 3, (OVERFLOW, ALL): 3, (ALL, "s0"): 3, (ALL, "s1"): 3, (ALL, OVERFLOW): 3} == counts


def test_depth_pruning_keeps_a_key_whose_distance_fits_the_deepest_point_at_a_rate_below_one():
    """A key's distance is the bytes above it, scaled by 1 / rate, and its own bytes once: the key is pruned
    only when that passes the deepest point, not when its own bytes scaled too would."""
    curves = CurveSet(0.5, 8, {"l1": 100})  # deepest point 1600 bytes; the sampled stratum tracks 4 keys
    old, older, first, second, third = ((value, SALT, MODEL) for value in (1, 2, 3, 4, 5))  # all pass rate 0.5
    for row, nbytes in ((older, 500), (old, 500), (first, 300), (second, 400), (third, 200)):
        curves.store(MODEL, nbytes, [row])  # the fifth key prunes: old and older are past 1600 bytes
    assert {first, second, third} == set(curves._histories[0].stack._entry) and 0.5 == curves.rate
    curves.lookup(MODEL, SALT, 1, [(first, SAMPLED, MISS, 1)])  # distance 2 × (400 + 200) + 300 = 1500
    [curve] = [c for c in curves.curves() if (c["model_name"], c["cache_salt"]) == (ALL, ALL)]
    assert 1.0 == curve["points"][-1]["hit_ratio"] and 16 * 100 == curve["points"][-1]["capacity_bytes"]


@pytest.mark.parametrize("policy", ["lru", "adaptive"])
def test_the_mrc_answer_says_which_order_the_curves_model_and_which_l1_runs(metrics, config, policy):
    """``GET /mrc`` names the order the curves simulate (the configured one) beside ``--l1-policy``, so a reader
    (``mpcache-report``) knows they predict this cache, and the report shows its predictions."""
    import dataclasses
    import json

    from mpcache.telemetry.subscribers.metrics.mrc import MissRatioSubscriber, mrc_routes
    from mpcache.tools.report import check, render

    subscriber = MissRatioSubscriber(metrics.meter, dataclasses.replace(config, l1_policy=policy, mrc_sample_rate=1.0))
    row = (7, SALT, MODEL)
    for _ in range(2):  # one key stored, then asked for twice: the second lookup hits at every size
        subscriber.curves.store(MODEL, 64, [row])
        subscriber.curves.lookup(MODEL, SALT, 1, [(row, SAMPLED, MISS, 1)])
    status, body, _ = mrc_routes([subscriber])["/mrc"]()
    document = json.loads(body)
    assert (200, policy, policy) == (status, document["curves_model"], document["l1_policy"])
    report = render(check(document), 0.8)
    assert "no hit ratio or capacity is predicted" not in report  # the report predicts the policy that runs
    assert any(line.startswith("l1 ") and " 1.000 " in line for line in report.splitlines()), report


class ByteLru:
    """A byte-capacity LRU cache as one cache process's L1 runs it: a lookup hit touches, a store inserts
    (evicting the least recently used until it fits) or touches."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.used, self.keys = capacity, 0, OrderedDict()

    def lookup(self, key) -> bool:
        if key in self.keys:
            self.keys.move_to_end(key)
            return True
        return False

    def store(self, key, size: int) -> None:
        if key in self.keys:
            self.keys.move_to_end(key)
            return
        while self.keys and self.used + size > self.capacity:
            self.used -= self.keys.popitem(last=False)[1]
        if size <= self.capacity:
            self.keys[key] = size
            self.used += size


def test_two_cache_processes_curves_equal_two_simulated_lru_caches_fed_the_same_routing():
    """Two cache processes, each an L1 of its own (half the tier), and a router that sends some prefixes to
    both: at rate 1 every point of the curve equals the hits of two byte LRU caches of half that capacity fed
    the same routing, over all lookups; the measured hit ratio (what the lookups found, here as the 1× caches
    found it) equals their hit ratio at 1×, and so does the curve's point there."""
    rng = random.Random(21)
    size, capacity = 1000, 40_000  # the tier over both processes: 20 kB each
    hashes = [rng.getrandbits(64) for _ in range(300)]
    requests = []
    for _ in range(2500):
        chunks = list(dict.fromkeys(hashes[int(rng.paretovariate(1.1) * 10) % 300] for _ in range(rng.randint(1, 5))))
        process = chunks[0] % 2 if rng.random() < 0.8 else rng.randrange(2)  # 20 %: the other process too
        requests.append((process, [(c, SALT, MODEL) for c in chunks]))
    now = [ByteLru(capacity // 2) for _ in range(2)]
    curves = CurveSet(1.0, 8192, {"l1": capacity}, processes=2)
    for process, rows in requests:
        found = [now[process].lookup(row) for row in rows]
        curves.lookup(MODEL, SALT, 1, [(row, HEAD, L1_HIT if hit else MISS, 1) for row, hit in zip(rows, found)],
                      process)
        for row in rows:
            now[process].store(row, size)
        curves.store(MODEL, size, rows, process)
    expected = []
    for ratio in POINT_RATIOS:
        caches, hits = [ByteLru(round(capacity / 2 * ratio)) for _ in range(2)], 0
        for process, rows in requests:
            hits += sum(caches[process].lookup(row) for row in rows)
            for row in rows:
                caches[process].store(row, size)
        expected.append(round(hits / sum(len(rows) for _, rows in requests), 6))
    [curve] = [c for c in curves.curves() if (c["model_name"], c["cache_salt"]) == (ALL, ALL)]
    assert expected == [point["hit_ratio"] for point in curve["points"]]
    assert expected[POINT_RATIOS.index(1.0)] == curve["measured_hit_ratio"]
    assert 0.05 < expected[0] < expected[-1] < 0.95 and curves.processes == 2  # the workload spans the curve


def test_each_ring_is_its_own_cache_process_for_the_curves_and_the_miss_reasons(ring_factory, metrics, config):
    """The subscriber judges a ring's events against that cache process's history: a key stored by process 0
    and asked for in process 1 is cold there (process 1 never stored it) and evicted in process 0; /mrc says
    the two processes, and the capacities are the tier's over both."""
    import dataclasses
    import json

    from mpcache.contract.events import MRC_HEAD_FIELDS, MRC_TAIL_MARK_FIELDS, EventType
    from mpcache.telemetry.batch import EventBatch
    from mpcache.telemetry.subscribers.metrics.mrc import MissRatioSubscriber, mrc_routes

    config = dataclasses.replace(config, workers=2, mrc_sample_rate=1.0)
    subscriber = MissRatioSubscriber(metrics.meter, config)
    rings = [ring_factory(capacity=256, intern_capacity=64) for _ in range(2)]
    row = (12345, SALT, MODEL)
    empty = (0,) * len(MRC_HEAD_FIELDS + MRC_TAIL_MARK_FIELDS)

    def deliver(producer: int, etype: EventType, fields: tuple) -> None:
        rings[producer].publisher.emit(etype, fields, sampled=[row])
        subscriber.on_batch(EventBatch(producer, rings[producer].reader.read_batch(), rings[producer].names))

    deliver(0, EventType.MRC_STORE_SAMPLED, (MODEL, SALT, 1, 64))
    for producer in (1, 0):  # a sampled key that missed (no sampled hits): ranks 1, found 0, no head chunks
        deliver(producer, EventType.MRC_LOOKUP_SAMPLED, (MODEL, SALT, 1, 0, 0, 0, 0, 0, 0, *empty))
    collected = metrics.collect()["mpcache.lookup_miss"]
    assert {"cold": 1, "evicted": 1} == {dict(attributes)["reason"]: value for attributes, value in collected.items()}
    document = json.loads(mrc_routes([subscriber])["/mrc"]()[1])
    assert (2, 2 * config.l1_pool_bytes) == (document["processes"], document["curves"][0]["capacity_bytes"])


def long_prompt_trace(rng: random.Random, requests: int, size: int) -> tuple[list[tuple[str, int, int]], list[int]]:
    """Retrieval over long documents: a system prompt of 2 chunks, one of 60 Zipf-popular documents of 20–50
    chunks, a fresh question; each chunk's key stands for its whole prefix.  Returns the trace and each request's
    chunk count."""
    system = [rng.getrandbits(63) for _ in range(2)]
    documents = [[rng.getrandbits(63) for _ in range(rng.randint(20, 50))] for _ in range(60)]
    trace, lengths = [], []
    for _ in range(requests):
        chunks = system + documents[min(int(rng.paretovariate(1.2)) - 1, 59)] + [rng.getrandbits(63)]
        trace += [("lookup", c, size) for c in chunks] + [("store", c, size) for c in chunks]
        lengths.append(len(chunks))
    return trace, lengths


def order_hit_ratio(trace: list[tuple[str, int, int]], policy: str, capacity: int) -> float:
    """Hits over lookups of one L1 of ``capacity`` running ``policy`` over every key (each request a lookup)."""
    from mpcache.telemetry.mrc.mini import MiniCache

    cache, hits, looks, request = MiniCache(policy, capacity), 0, 0, []
    for op, key, size in trace + [("store", 0, 0)]:
        if op == "lookup":
            request.append(((key, SALT, MODEL), size))
        elif request:
            found = cache.lookup(request)
            hits, looks, request = hits + sum(found), looks + len(found), []
    return hits / looks


@pytest.mark.parametrize("policy", ["lru", "adaptive"])
def test_long_prompts_tails_judged_from_their_head_key_keep_the_curve_within_0_01_at_rate_0_01(policy):
    """Most accesses lie past the 16 head chunks, where 1 % of a few thousand keys is sampled: weighing only
    those (as before the tail count was sent) puts the curve off by more than 0.02; judging every tail object
    from its head key's last tail, as much of it as the marks say is shared, with the sampled keys correcting
    where a tail changed, keeps it within 0.01 of the simulated caches (mean absolute error over ¼×–4×; at ¼×
    this L1 holds about one document, where ``adaptive``'s miniatures, holding a tail in segments of 8 objects
    or more, were 0.05 low)."""
    from mpcache.contract import tail_marks

    size, capacity = 1000, 200_000
    trace, lengths = long_prompt_trace(random.Random(11), 1500, size)
    ratios = (0.25, 0.5, 1.0, 2.0, 4.0)
    if policy == "lru":
        exact = [lru_hit_ratio(trace, round(capacity * ratio)) for ratio in ratios]
    else:
        exact = [order_hit_ratio(trace, policy, round(capacity * ratio)) for ratio in ratios]
    errors = {}
    for with_tail in (False, True):
        curves = CurveSet(0.01, 32768, {"l1": capacity}, policy=policy)
        position = 0
        for length in lengths:
            keys = [(key, SALT, MODEL) for _, key, _ in trace[position:position + length]]
            curves.lookup(MODEL, SALT, 1, [(row, HEAD if index < 16 else SAMPLED, MISS, 1)
                                           for index, row in enumerate(keys)],
                          tail=max(0, length - 16) if with_tail else 0,
                          marks=tail_marks.pack([key for key, _, _ in keys], 16, 1))
            curves.store(MODEL, size, keys)
            position += 2 * length
        [curve] = [c for c in curves.curves() if (c["model_name"], c["cache_salt"]) == (ALL, ALL)]
        points = {round(ratio, 6): point["hit_ratio"] for ratio, point in zip(POINT_RATIOS, curve["points"])}
        errors[with_tail] = sum(abs(exact[ratios.index(ratio)] - points[ratio]) for ratio in ratios) / len(ratios)
    assert 0.1 < exact[0] and exact[-1] < 0.95  # the capacities span the curve
    assert errors[False] > 0.02 and errors[True] <= 0.01, errors


def feed_long_prompts(curves: CurveSet, trace: list[tuple[str, int, int]], lengths: list[int], size: int) -> None:
    """Each request of a :func:`long_prompt_trace` to ``curves``: its lookup (16 head chunks and a tail, no marks),
    then its store."""
    position = 0
    for length in lengths:
        keys = [(key, SALT, MODEL) for _, key, _ in trace[position:position + length]]
        curves.lookup(MODEL, SALT, 1, [(row, HEAD if index < 16 else SAMPLED, MISS, 1)
                                       for index, row in enumerate(keys)], tail=length - 16)
        curves.store(MODEL, size, keys)
        position += 2 * length


def test_at_rate_one_a_lookup_with_a_tail_is_judged_key_by_key_so_every_point_stays_exact():
    """Above ``TAIL_MAX_RATE`` the sampled keys judge a tail alone: at rate 1 the long-prompt curve equals the
    simulated LRU caches at every point, the tail count given or not."""
    size, capacity = 1000, 200_000
    trace, lengths = long_prompt_trace(random.Random(3), 300, size)
    curves = CurveSet(1.0, 32768, {"l1": capacity})
    feed_long_prompts(curves, trace, lengths, size)
    [curve] = [c for c in curves.curves() if (c["model_name"], c["cache_salt"]) == (ALL, ALL)]
    assert [round(lru_hit_ratio(trace, round(capacity * ratio)), 6) for ratio in POINT_RATIOS] == [
        point["hit_ratio"] for point in curve["points"]]


def test_at_rate_one_the_adaptive_curve_is_the_order_replayed_at_each_octave():
    """A miniature that sees every key is the order it models: the ``adaptive`` curve at rate 1 equals L1's order
    replayed over the whole trace at every octave, where the miniatures run (the first lookup, before the model's
    first store names its object size, a miss at every capacity).  Two ways it once was not: the store after a
    lookup stored again what the lookup's store had found no room for (every evictable object was the lookup's
    own: 0.056 low at ¼× on a RAG-shaped trace), and a lookup before the model's first store put its keys in the
    miniatures at no bytes, for as long as they stayed (0.033 high there)."""
    from mpcache.telemetry.mrc.curves import MINI_RATIOS

    size, capacity = 1000, 200_000
    trace, lengths = long_prompt_trace(random.Random(5), 400, size)
    curves = CurveSet(1.0, 32768, {"l1": capacity}, policy="adaptive")
    feed_long_prompts(curves, trace, lengths, size)
    [curve] = [c for c in curves.curves() if (c["model_name"], c["cache_salt"]) == (ALL, ALL)]
    points = dict(zip(POINT_RATIOS, (point["hit_ratio"] for point in curve["points"])))
    replayed = [round(order_hit_ratio(trace, "adaptive", round(capacity * ratio)), 6) for ratio in MINI_RATIOS]
    assert replayed == [round(points[ratio], 6) for ratio in MINI_RATIOS]
    assert replayed[0] < 0.5 < replayed[-1]  # the octaves span the curve


def test_before_the_first_store_a_lookup_with_a_tail_is_a_miss_at_every_capacity_as_it_was_found():
    """A lookup before its model's first store (no object size yet) under ``adaptive``: each head key, and each of
    its tail's objects (not its sampled keys, which the tail's objects stand for), a miss at every capacity, each
    judged as the lookup found it (the tail's L1 and L2 hits placed by the found counts); the miniatures take none
    of its keys."""
    from mpcache.telemetry.mrc.history import History

    history = History(0.01, 32768, [1000, 2000, 4000], "adaptive")
    heads = [((n, SALT, MODEL), HEAD, L1_HIT if n < 5 else MISS, 1) for n in range(16)]
    sampled = [((SAMPLE_MODULUS * 7, SALT, MODEL), SAMPLED, MISS, 1)]  # passes the sampling rule at any rate
    curve, _ = history.lookup(heads + sampled, 0, tail=24, tail_found=(5, 7), marks=(1, 2))
    beyond = len(history.edges)
    found: dict[str, float] = {}
    for weight, kind, bucket, changes in curve:
        assert (bucket, changes) == (beyond, None)
        found[kind] = found.get(kind, 0.0) + weight
    assert {L1_HIT: 5 + 5, L2_HIT: 7, MISS: 11 + 12} == found
    assert all(not mini.entries for mini in history.minis or ())


def test_a_tail_s_new_objects_go_to_the_miniatures_in_segments_no_finer_than_their_smallest_capacity_allows():
    """Up to 16 segments of at least one object, and of at least 1/512 of the smallest miniature's capacity: an L1
    of a few dozen objects gets a segment an object (a coarser one is a sizeable share of it); one of a million
    objects gets segments of at least 1,000,000 / 8 / 512 = 244 (a miniature's entries stay bounded)."""
    from mpcache.telemetry.mrc import history as history_module
    from mpcache.telemetry.mrc.curves import MINI_RATIOS

    for l1_objects, tail, first in ((40, 12, 1), (40, 400, 25), (1_000_000, 12, 12), (1_000_000, 2000, 244),
                                    (1_000_000, 8000, 500)):
        capacity = l1_objects * 1000
        edges = sorted({round(capacity * ratio) for ratio in POINT_RATIOS})
        history = history_module.History(0.01, 32768, edges, "adaptive", sorted({round(capacity * ratio)
                                                                                  for ratio in MINI_RATIOS}))
        keys = [((n, SALT, MODEL), HEAD, MISS, 1) for n in range(16)]
        history.lookup(keys, 1000, tail=tail, tail_found=(0, 0), marks=(0, 0))
        [seen] = history.tails.values()
        sizes = [objects for _, objects in seen.segments]
        assert sum(sizes) == tail and len(sizes) <= history_module.SEGMENT_PIECES
        assert sizes[0] == first, (l1_objects, sizes)


def test_a_segment_a_tail_shares_in_part_stands_for_that_part_so_the_next_tail_s_objects_line_up():
    """A tail of 40 objects in segments of 3, then one of 30 that shares its first 10 (its marks part there): the
    segment holding objects 10–12 stands for object 10 only now, so the new tail's segments hold its 30 objects
    (they once added up to 32, and each later tail's objects were judged by the segment two places on)."""
    from mpcache.contract import tail_marks
    from mpcache.telemetry.mrc import history as history_module
    from mpcache.telemetry.mrc.curves import MINI_RATIOS

    capacity = 400 * 1000
    history = history_module.History(0.01, 32768, sorted({round(capacity * r) for r in POINT_RATIOS}), "adaptive",
                                     sorted({round(capacity * ratio) for ratio in MINI_RATIOS}))
    rng = random.Random(4)
    head = [rng.getrandbits(64) for _ in range(16)]
    first, parted = [rng.getrandbits(64) for _ in range(40)], [rng.getrandbits(64) for _ in range(20)]
    keys = [((h, SALT, MODEL), HEAD, MISS, 1) for h in head]
    history.lookup(keys, 1000, tail=40, tail_found=(0, 0), marks=tail_marks.pack(head + first, 16, 1))
    [seen] = history.tails.values()
    before = list(seen.segments)
    assert [3] * 13 + [1] == [objects for _, objects in before]
    second = first[:10] + parted
    assert 10 == tail_marks.shared_chunks(tail_marks.pack(head + second, 16, 1), 30, seen.marks, 40)
    history.lookup(keys, 1000, tail=30, tail_found=(0, 0), marks=tail_marks.pack(head + second, 16, 1))
    after = history.tails[next(iter(history.tails))].segments
    assert before[:4] == [(key, objects) for key, objects in after[:3]] + [(after[3][0], 3)]
    assert 30 == sum(objects for _, objects in after) and 1 == after[3][1]


def test_a_lookup_s_tail_marks_reach_the_curves_through_the_ring(ring, metrics, config):
    """A lookup with a tail, published by the cache process's sampler into a ring and read by the subscriber: the
    curves get the marks mpcache.contract.tail_marks packs from its keys (two ranks a chunk: each chunk's first)."""
    from mpcache.cache.mrc.accesses import AccessSampler
    from mpcache.contract import tail_marks
    from mpcache.telemetry.batch import EventBatch
    from mpcache.telemetry.subscribers.metrics.mrc import MissRatioSubscriber

    class NoL1:
        def entry_of(self, key):
            return None

        def contains(self, key):
            return False

    rng = random.Random(7)
    hashes = [rng.getrandbits(64) for _ in range(2 * 150)]  # 150 chunks: 16 head chunks and a tail of 134
    subscriber = MissRatioSubscriber(metrics.meter, config)
    seen: list[tuple] = []
    subscriber.curves.lookup = lambda *args: seen.append(args)
    AccessSampler(ring.publisher, 0.01).lookup(NoL1(), MODEL, SALT, hashes, 2, 0, 0)  # type: ignore[arg-type]
    subscriber.on_batch(EventBatch(0, ring.reader.read_batch(), ring.names))
    [args] = seen
    assert (268, tail_marks.pack(hashes, 32, 2)) == (args[5], args[7])
    assert any(tail_marks.pack(hashes, 32, 2))  # marks to carry


def test_a_lookup_event_carries_its_tail_and_where_the_found_prefix_ends_in_it():
    """The cache process sends how many objects lay past the head chunks (the sampled keys' population); the
    telemetry side reads it back with the tail's L1 and L2 hits placed by the found counts."""
    from mpcache.cache.mrc.accesses import AccessSampler
    from mpcache.contract.events import MRC_EXACT_TAIL_SHIFT
    from mpcache.telemetry.subscribers.metrics.mrc import lookup_tail

    class Recorder:
        emitted: list = []

        def emit(self, etype, fields, sampled=()):
            self.emitted.append(fields)

        def fields_emitter(self, etype):
            return lambda fields, session_id: self.emitted.append(fields)

    class NoL1:
        def entry_of(self, key):
            return None

        def contains(self, key):
            return False

    hashes = list(range(1, 2 * 20 + 1))  # 20 chunks of 2 ranks: 16 head chunks, 8 objects past them
    AccessSampler(Recorder(), 0.01).lookup(NoL1(), "m", "s", hashes, 2, 36, 38)  # type: ignore[arg-type]
    [fields] = Recorder.emitted
    assert (8, 16) == (fields[5] >> MRC_EXACT_TAIL_SHIFT, fields[5] & 31)
    named = dict(zip(("ranks", "found", "l1_hits", "exact"), fields[2:6]))
    assert (8, (4, 2)) == lookup_tail(named)  # objects 32..35 in L1, 36..37 in L2
    assert (0, (0, 0)) == lookup_tail({"ranks": 1, "found": 3, "l1_hits": 3, "exact": 3})
