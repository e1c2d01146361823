"""The adaptive order's frequency sketch, against exact counts kept beside it: the compiled one (``_sketch.c``)
and its Python definition alike, and the two against each other."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from mpcache.contract.keys import ChunkKey
from mpcache.eviction import frequency
from mpcache.eviction.frequency import (
    COUNTERS_PER_COUNT,
    ENDED,
    MIN_WIDTH,
    SAMPLED,
    SATURATED,
    FrequencySketchReference,
)

REPO = Path(__file__).resolve().parents[2]
compiled = pytest.mark.skipif(not frequency.COMPILED, reason="mpcache.eviction._sketch was not built")
WAYS = [pytest.param(FrequencySketchReference, id="python"),
        pytest.param(frequency.FrequencySketch, id="compiled", marks=compiled)]




@pytest.mark.parametrize("sketch_type", WAYS)
def test_the_sketch_never_counts_a_key_less_than_it_was_asked_for_and_seldom_more(sketch_type):
    """10,000 counts of 2,000 keys drawn with a skew (within one window): no estimate below the exact count,
    and with rows wider than the keys few above it."""
    rng = random.Random(7)
    keys = [ChunkKey("m", "", rng.getrandbits(64)) for _ in range(2000)]
    sketch, exact = sketch_type(20_000), Counter()
    for _ in range(10_000):
        key = keys[min(int(rng.paretovariate(1.0)) - 1, len(keys) - 1)]
        sketch.add(key)
        exact[key] += 1
    estimates = {key: sketch.estimate(key) for key in keys}
    assert all(estimates[key] >= min(exact[key], SATURATED) for key in keys)
    assert sum(estimates[key] != min(exact[key], SATURATED) for key in keys) < 0.05 * len(keys)


@pytest.mark.parametrize("sketch_type", WAYS)
def test_small_integer_keys_spread_over_both_rows(sketch_type):
    """Keys that hash to themselves (the curves' miniatures' integers) get exact counts too."""
    sketch = sketch_type(10_000)
    for key in range(1, 301):
        for _ in range(key % 7):
            sketch.add(key)
    assert [key % 7 for key in range(1, 301)] == [sketch.estimate(key) for key in range(1, 301)]


@pytest.mark.parametrize("sketch_type", WAYS)
def test_every_count_is_halved_once_a_window_of_counts_is_held(sketch_type):
    """A window of 100: the 100th count halves every counter (and what they hold), so the next halving comes
    after 50 more counts; a counter stops at 255."""
    sketch = sketch_type(100)
    ended = [sketch.add("a") for _ in range(99)]
    assert (0, 99) == (max(ended), sketch.estimate("a"))
    assert sketch.add("b") == ENDED
    assert (49, 0) == (sketch.estimate("a"), sketch.estimate("b"))
    assert [0] * 49 + [ENDED] == [sketch.add("c") for _ in range(50)]
    saturated = sketch_type(10_000)
    for _ in range(300):
        saturated.add("a")
    assert SATURATED == saturated.estimate("a")


@pytest.mark.parametrize("sketch_type", WAYS)
def test_a_wider_window_gets_wider_empty_rows_and_one_that_fits_keeps_the_counts(sketch_type):
    sketch = sketch_type(10)
    sketch.add("a")
    sketch.resize(MIN_WIDTH // COUNTERS_PER_COUNT)  # rows of MIN_WIDTH still hold it
    assert 1 == sketch.estimate("a")
    sketch.resize(MIN_WIDTH)
    assert (0, MIN_WIDTH) == (sketch.estimate("a"), sketch.window)


@pytest.mark.parametrize("sketch_type", WAYS)
def test_keys_are_counted_by_their_code(sketch_type):
    """Two keys of one code share their counters (the code, not the key's own hash, places them)."""
    sketch = sketch_type(100, code=len)
    for _ in range(3):
        sketch.add("ab")
    assert (3, 3, 0) == (sketch.estimate("ab"), sketch.estimate("xy"), sketch.estimate("xyz"))


REPLAY = """
import hashlib, json, sys
from benchmarks import trace_gen
from benchmarks.null_cache import NullPublisher
import numpy as np
from mpcache.cache.l1 import L1Manager
l1 = L1Manager(np.zeros(20 * 64, dtype=np.uint8), NullPublisher(), 1.0, 64, policy="adaptive")
found = []
for request in trace_gen.rag(800, seed=2):
    found.append(l1.lock_prefix("m", "", request.hashes, publish=False))
    reservation = l1.reserve_write("m", "", request.hashes[found[-1]:])
    l1.commit_write("m", "", [request.hashes[found[-1] + p] for p in reservation.positions], 64)
    l1.release_read("m", "", request.hashes[:found[-1]])
rows = b"".join(l1._order.frequency._rows)
print(json.dumps([found, hashlib.sha256(rows).hexdigest(), l1._order.gate.score]))
"""


def test_l1_counts_and_decides_the_same_in_every_process():
    """The same trace through L1 in processes whose string hashes differ (PYTHONHASHSEED): the same sketch,
    counter for counter, the same gate score and the same prefix found per request (a key's strings, hashed,
    would place its counts differently in each)."""
    runs = [subprocess.run([sys.executable, "-c", REPLAY], capture_output=True, text=True, check=True, timeout=120,
                           cwd=REPO, env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    first = json.loads(runs[0])
    assert sum(first[0]) > 0 and runs[0] == runs[1]


@pytest.mark.parametrize("sketch_type", WAYS)
def test_a_code_counts_in_the_counters_its_mixed_64_bit_word_names(sketch_type):
    """Codes of every sign and size (a chunk hash may be negative or wider than 64 bits): each count lands in the
    counter of the first row named by the low bits of (code × 0x9E3779B97F4A7C15) mod 2^64, and of the second row
    by its bits from 32 up, as a reference computed here from that word finds."""
    rng = random.Random(11)
    codes = [rng.randrange(-(1 << 70), 1 << 70) for _ in range(300)] + [0, -1, 1, (1 << 64) - 1, -(1 << 63)]
    sketch = sketch_type(1 << 20, code=lambda key: key)
    width = len(sketch._rows[0])
    expected = (Counter(), Counter())
    for code in codes:
        sketch.add(code)
        word = (code * 0x9E3779B97F4A7C15) % (1 << 64)
        expected[0][word % width] += 1
        expected[1][(word >> 32) % width] += 1
    for row, counts in zip(sketch._rows, expected):
        assert {index: count for index, count in enumerate(row) if count} == dict(counts)


@pytest.mark.parametrize("sketch_type", WAYS)
def test_a_count_says_whether_the_key_is_sampled_at_the_sample_bits(sketch_type):
    """None at first (-1); every key at 0; at n, a key whose (code × 0x9E3779B97F4A7C15) mod 2^64 has its top n bits
    0, as computed here from that word; what a count says of sampling never changes what it counts."""
    rng = random.Random(5)
    codes = [rng.randrange(-(1 << 70), 1 << 70) for _ in range(3000)] + [0, (1 << 64) - 1]
    sketch = sketch_type(1 << 20, code=lambda key: key)
    assert {sketch.add(code) for code in codes} == {0}
    for bits in (0, 1, 4, 64):
        sketch.sample_bits = bits
        told = [code for code in codes if sketch.add(code) == SAMPLED]
        assert told == [code for code in codes if (code * 0x9E3779B97F4A7C15) % (1 << 64) >> (64 - bits) == 0]
    assert len(told) == 1  # 64 bits: only the code whose word is 0
    assert sketch.estimate(codes[7]) == 5


def _outcome(call, *args):
    try:
        return call(*args)
    except (TypeError, ValueError, OverflowError) as exc:
        return type(exc)


@compiled
def test_the_compiled_sketch_counts_halves_and_answers_as_its_python_definition_does():
    """Random adds, estimates and resizes (keys of every kind: ints of every sign and size, strings, tuples, some
    unhashable; windows that end and rows that widen), by the key's hash, by its item and by a code: the same answer
    or the same exception, the same window and the same counters after every step."""
    rng = random.Random(12)
    for how in ({"code": hash}, {"item": 2},
                {"code": lambda key: key[0] * 3 - (1 << 70) if isinstance(key, tuple) else len(str(key))}):
        sketches = (FrequencySketchReference(50, **how), frequency.FrequencySketch(50, **how))
        keys = ([rng.randrange(-(1 << 80), 1 << 80) for _ in range(40)] + [0, -1, -2, (1 << 64) - 1]
                + [f"key{n}" for n in range(40)] + [(n, "m") for n in range(40)] + [[1], {}]
                + [("m", "t", rng.randrange(-(1 << 70), 1 << 70)) for _ in range(40)] + [("m", "t", "x", 1)]
                + [ChunkKey("m", "t", n) for n in range(40)])
        ended = 0
        for step in range(6000):
            choice, key = rng.random(), rng.choice(keys)
            if choice < 0.7:
                answers = [_outcome(sketch.add, key) for sketch in sketches]
                ended += answers[0] in (ENDED, ENDED | SAMPLED)
            elif choice < 0.995:
                answers = [_outcome(sketch.estimate, key) for sketch in sketches]
            elif choice < 0.997:
                window = rng.choice([0, -3, -(1 << 70), True, 1, 49, 260, 300, 4000, "7", 2.0])
                answers = [_outcome(sketch.resize, window) for sketch in sketches]
            else:
                bits = rng.choice([-(1 << 70), -(1 << 31) - 1, -5, -2, -1, 0, 1, 2, 4, 63, 64, 65, 1 << 31, 1 << 32,
                                   1 << 64, True, 2.0, "3", None])
                answers = [(_outcome(setattr, sketch, "sample_bits", bits), sketch.sample_bits) for sketch in sketches]
            assert answers[0] == answers[1], (step, key, answers)
            assert sketches[0].window == sketches[1].window
            assert bytes(b"".join(sketches[0]._rows)) == b"".join(sketches[1]._rows), step
        assert ended > 10  # windows ended, and rows were halved and widened alike


@compiled
def test_the_compiled_sketch_s_constants_are_its_python_definition_s():
    from mpcache.eviction import _sketch
    assert ((frequency.SATURATED, frequency.MIN_WIDTH, frequency.MAX_WIDTH, frequency.COUNTERS_PER_COUNT,
             frequency.MIX) == (_sketch.SATURATED, _sketch.MIN_WIDTH, _sketch.MAX_WIDTH,
                                 _sketch.COUNTERS_PER_COUNT, _sketch.MIX))


@compiled
def test_a_code_that_raises_or_is_not_an_int_is_an_error_of_the_call_and_counts_nothing():
    """What ``code`` raises reaches the caller; a code that is not an int is a TypeError; no counter moves."""
    def failing(key):
        raise ValueError("no code")

    for code, error in ((failing, ValueError), (str, TypeError)):
        sketch = frequency.FrequencySketch(100, code)
        with pytest.raises(error):
            sketch.add("a")
        with pytest.raises(error):
            sketch.estimate("a")
        assert not any(b"".join(sketch._rows))
    with pytest.raises(TypeError):
        frequency.FrequencySketch(100, code=3)


@pytest.mark.parametrize("sketch_type", WAYS)
def test_a_key_s_item_is_its_code_where_the_sketch_is_told_its_index(sketch_type):
    """``item=2``: a chunk key counts where its chunk hash does (the code L1 gives it), with no call; a key that is no
    tuple that long, or whose item is not an int, is a TypeError; an index that is not an int, below 0, or given
    with a code is refused when the sketch is made."""
    by_item, by_code = sketch_type(1000, item=2), sketch_type(1000, code=lambda key: key.chunk_hash)
    keys = [ChunkKey("m", f"tenant-{n % 3}", n * 7919 - 40) for n in range(300)]
    for key in keys + keys[:100]:
        assert by_item.add(key) == by_code.add(key)
    assert by_item._rows == by_code._rows and by_item.estimate(keys[5]) == by_code.estimate(keys[5]) >= 2
    for key in ("abc", ("m", "t"), [0, 1, 2], ("m", "t", "x")):
        with pytest.raises(TypeError):
            by_item.add(key)
    for index, error in (("2", TypeError), (2.0, TypeError), (-1, ValueError), (1 << 70, OverflowError),
                         (-(1 << 70), OverflowError)):
        with pytest.raises(error):
            sketch_type(100, item=index)
    with pytest.raises(TypeError):
        sketch_type(100, len, item=1)


@compiled
def test_the_compiled_sketch_cannot_be_left_without_its_rows():
    """It is set up when made, never again: made without a window is an error, ``__init__`` called again with a
    window it cannot take changes nothing, and a code that calls back into the sketch counts as the Python one."""
    sketch_type = frequency.FrequencySketch
    with pytest.raises(TypeError):
        sketch_type.__new__(sketch_type)
    sketch = sketch_type(100)
    sketch.__init__(-(1 << 64))  # object's __init__: the arguments were taken when it was made
    sketch.__init__(object())
    assert (0, 1, 100) == (sketch.add(5), sketch.estimate(5), sketch.window)
    answers = []
    for sketch_type in (FrequencySketchReference, frequency.FrequencySketch):
        holder: list = []

        def reentrant(key, holder=holder):
            if key > 0:
                holder[0].add(-key)
            return key

        sketch = sketch_type(100, reentrant)
        holder.append(sketch)
        answers.append(([sketch.add(key) for key in range(1, 60)], sketch.estimate(-3), sketch._rows))
    assert answers[0][:2] == answers[1][:2] and b"".join(answers[0][2]) == b"".join(answers[1][2])


def test_l1_decides_the_same_with_the_compiled_sketch_and_its_python_definition(monkeypatch):
    """The replay below through L1 with each sketch: the same prefixes found, gate score and counters."""
    if not frequency.COMPILED:
        pytest.skip("mpcache.eviction._sketch was not built")
    from mpcache.eviction import order as eviction_order
    runs = []
    for sketch_type in (FrequencySketchReference, frequency.FrequencySketch):
        monkeypatch.setattr(eviction_order, "FrequencySketch", sketch_type)
        namespace: dict = {}
        exec(REPLAY.replace("print(", "result = ("), namespace)
        runs.append(namespace["result"])
    assert sum(json.loads(runs[0])[0]) > 0 and runs[0] == runs[1]
