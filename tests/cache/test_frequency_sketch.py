"""The adaptive order's frequency sketch, against exact counts kept beside it."""

from __future__ import annotations

import random
from collections import Counter

from mpcache.contract.keys import ChunkKey
from mpcache.eviction.frequency import MIN_WIDTH, SATURATED, FrequencySketch


def test_the_sketch_never_counts_a_key_less_than_it_was_asked_for_and_seldom_more():
    """10,000 counts of 2,000 keys drawn with a skew (within one window): no estimate below the exact count,
    and with rows wider than the keys few above it."""
    rng = random.Random(7)
    keys = [ChunkKey("m", "", rng.getrandbits(64)) for _ in range(2000)]
    sketch, exact = FrequencySketch(20_000), Counter()
    for _ in range(10_000):
        key = keys[min(int(rng.paretovariate(1.0)) - 1, len(keys) - 1)]
        sketch.add(key)
        exact[key] += 1
    estimates = {key: sketch.estimate(key) for key in keys}
    assert all(estimates[key] >= min(exact[key], SATURATED) for key in keys)
    assert sum(estimates[key] != min(exact[key], SATURATED) for key in keys) < 0.05 * len(keys)


def test_small_integer_keys_spread_over_both_rows():
    """Keys that hash to themselves (the curves' miniatures' integers) get exact counts too."""
    sketch = FrequencySketch(10_000)
    for key in range(1, 301):
        for _ in range(key % 7):
            sketch.add(key)
    assert [key % 7 for key in range(1, 301)] == [sketch.estimate(key) for key in range(1, 301)]


def test_every_count_is_halved_once_a_window_of_counts_is_held():
    """A window of 100: the 100th count halves every counter (and what they hold), so the next halving comes
    after 50 more counts; a counter stops at 255."""
    sketch = FrequencySketch(100)
    ended = [sketch.add("a") for _ in range(99)]
    assert (False, 99) == (any(ended), sketch.estimate("a"))
    assert sketch.add("b") is True
    assert (49, 0) == (sketch.estimate("a"), sketch.estimate("b"))
    assert [False] * 49 + [True] == [sketch.add("c") for _ in range(50)]
    saturated = FrequencySketch(10_000)
    for _ in range(300):
        saturated.add("a")
    assert SATURATED == saturated.estimate("a")


def test_a_wider_window_gets_wider_empty_rows_and_a_narrower_one_keeps_the_counts():
    sketch = FrequencySketch(10)
    sketch.add("a")
    sketch.resize(MIN_WIDTH // 2)
    assert 1 == sketch.estimate("a")
    sketch.resize(4 * MIN_WIDTH)
    assert (0, 4 * MIN_WIDTH) == (sketch.estimate("a"), sketch.window)
