"""The mock adapter: seeded failure injection, latency and bandwidth (through an injected sleep)."""

from __future__ import annotations

import random
import threading

from support.l2 import key, payload, wait

from mpcache.cache.l2.base import LoadResult


def expected_failures(seed: int, rate: float, keys: list) -> list:
    """The documented rule: one ``random.Random(seed)`` draw per key in submission order, fail if < rate."""
    rng = random.Random(seed)
    return [k for k in keys if rng.random() < rate]


def test_store_failures_are_exactly_the_seeded_draws(make_mock):
    """With failure_rate 0.3 and seed 7, the keys that fail to store are the ones the seeded RNG picks."""
    keys = [key(i) for i in range(40)]
    adapter = make_mock(capacity_bytes=100_000, failure_rate=0.3, seed=7)

    result = wait(adapter.submit_store([(k, payload(i, 100)) for i, k in enumerate(keys)]))

    assert expected_failures(7, 0.3, keys) == result.failed
    assert [k for k in keys if k not in result.failed] == result.stored
    assert 100 * len(result.stored) == result.bytes_written


def test_load_failures_continue_the_same_seeded_sequence(make_mock):
    """Load draws follow store draws in submission order, so the failed loads are seed-determined too."""
    keys = [key(i) for i in range(20)]
    rng = random.Random(3)
    store_draws = [rng.random() < 0.25 for _ in keys]
    load_draws = [rng.random() < 0.25 for _ in keys]
    adapter = make_mock(capacity_bytes=100_000, failure_rate=0.25, seed=3)
    wait(adapter.submit_store([(k, payload(i, 100)) for i, k in enumerate(keys)]))

    buffers = [bytearray(100) for _ in keys]
    result = wait(adapter.submit_load(keys, [memoryview(b) for b in buffers]))

    not_stored = {k for k, fail in zip(keys, store_draws) if fail}
    assert [k for k, fail in zip(keys, load_draws) if fail or k in not_stored] == result.failed
    assert [k for k, fail in zip(keys, load_draws) if not fail and k not in not_stored] == result.loaded


def test_the_same_seed_fails_the_same_keys(make_mock):
    """Two adapters with one seed fail the same keys; another seed fails others."""
    items = [(key(i), payload(i, 10)) for i in range(64)]
    runs = [wait(make_mock(100_000, failure_rate=0.5, seed=s).submit_store(items)).failed for s in (11, 11, 12)]

    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_failure_rate_one_fails_every_key_and_zero_none(make_mock):
    """failure_rate 1 fails every store; 0 fails none."""
    items = [(key(i), payload(i, 10)) for i in range(10)]

    assert [k for k, _ in items] == wait(make_mock(failure_rate=1.0).submit_store(items)).failed
    assert [] == wait(make_mock(failure_rate=0.0).submit_store(items)).failed


def test_each_task_sleeps_latency_plus_bytes_over_bandwidth(make_mock):
    """A store or load task sleeps latency_s + bytes / bandwidth in its worker thread (lookup: latency only)."""
    slept = []
    lock = threading.Lock()

    def sleep(seconds: float) -> None:
        with lock:
            slept.append((threading.current_thread().name.startswith("l2-mock"), round(seconds, 9)))

    adapter = make_mock(capacity_bytes=100_000, latency_s=0.002, bandwidth_bytes_per_s=1e6, sleep=sleep, threads=1)
    wait(adapter.submit_store([(key(1), payload(1, 3000)), (key(2), payload(2, 1000))]))
    wait(adapter.submit_load([key(1)], [memoryview(bytearray(3000))]))
    wait(adapter.lookup([key(1)]))

    assert [(True, 0.006), (True, 0.005), (True, 0.002)] == slept


def test_stored_bytes_are_a_copy(make_mock):
    """The mock keeps its own copy: changing the caller's buffer after the store completes changes nothing."""
    adapter = make_mock()
    source = bytearray(payload(1))
    wait(adapter.submit_store([(key(1), memoryview(source))]))
    source[:] = b"\0" * len(source)

    destination = bytearray(1000)
    result = wait(adapter.submit_load([key(1)], [memoryview(destination)]))

    assert (LoadResult([key(1)], []), payload(1)) == (result, bytes(destination))
