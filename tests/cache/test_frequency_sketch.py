"""The adaptive order's frequency sketch, against exact counts kept beside it."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

from mpcache.contract.keys import ChunkKey
from mpcache.eviction.frequency import COUNTERS_PER_COUNT, MIN_WIDTH, SATURATED, FrequencySketch

REPO = Path(__file__).resolve().parents[2]


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


def test_a_wider_window_gets_wider_empty_rows_and_one_that_fits_keeps_the_counts():
    sketch = FrequencySketch(10)
    sketch.add("a")
    sketch.resize(MIN_WIDTH // COUNTERS_PER_COUNT)  # rows of MIN_WIDTH still hold it
    assert 1 == sketch.estimate("a")
    sketch.resize(MIN_WIDTH)
    assert (0, MIN_WIDTH) == (sketch.estimate("a"), sketch.window)


def test_keys_are_counted_by_their_code():
    """Two keys of one code share their counters (the code, not the key's own hash, places them)."""
    sketch = FrequencySketch(100, code=len)
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
print(json.dumps([found, hashlib.sha256(rows).hexdigest(), l1._order.gate_score]))
"""


def test_l1_counts_and_decides_the_same_in_every_process():
    """The same trace through L1 in processes whose string hashes differ (PYTHONHASHSEED): the same sketch,
    counter for counter, the same gate score and the same prefix found per request (a key's strings, hashed,
    would place its counts differently in each)."""
    runs = [subprocess.run([sys.executable, "-c", REPLAY], capture_output=True, text=True, check=True, timeout=120,
                           cwd=REPO, env={**os.environ, "PYTHONHASHSEED": seed}).stdout for seed in ("1", "2")]
    first = json.loads(runs[0])
    assert sum(first[0]) > 0 and runs[0] == runs[1]


def test_a_code_counts_in_the_counters_its_mixed_64_bit_word_names():
    """Codes of every sign and size (a chunk hash may be negative or wider than 64 bits): each count lands in the
    counter of the first row named by the low bits of (code × 0x9E3779B97F4A7C15) mod 2^64, and of the second row
    by its bits from 32 up, as a reference computed here from that word finds."""
    rng = random.Random(11)
    codes = [rng.randrange(-(1 << 70), 1 << 70) for _ in range(300)] + [0, -1, 1, (1 << 64) - 1, -(1 << 63)]
    sketch = FrequencySketch(1 << 20, code=lambda key: key)
    width = len(sketch._rows[0])
    expected = (Counter(), Counter())
    for code in codes:
        sketch.add(code)
        word = (code * 0x9E3779B97F4A7C15) % (1 << 64)
        expected[0][word % width] += 1
        expected[1][(word >> 32) % width] += 1
    for row, counts in zip(sketch._rows, expected):
        assert {index: count for index, count in enumerate(row) if count} == dict(counts)
