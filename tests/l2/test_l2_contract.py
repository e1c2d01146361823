"""The L2Adapter contract, checked against every adapter (fs, mock, redis).

Chunks are 1000 bytes and capacities multiples of that, so "room for N
chunks" is exact.
"""

from __future__ import annotations

from concurrent.futures import wait as wait_all

import numpy as np
from support.l2 import TIMEOUT_S, key, payload, wait

from mpcache.cache.l2.base import LoadResult, StoreResult, Usage


def store(adapter, indexes, size=1000) -> StoreResult:
    return wait(adapter.submit_store([(key(i), payload(i, size)) for i in indexes]))


def load(adapter, indexes, size=1000) -> tuple[LoadResult, list[bytearray]]:
    buffers = [bytearray(size) for _ in indexes]
    result = wait(adapter.submit_load([key(i) for i in indexes], [memoryview(b) for b in buffers]))
    return result, buffers


def test_name_is_the_type_name(make_adapter, request):
    """``name`` is the adapter's type name, as --l2 spells it."""
    adapter = make_adapter()

    assert request.node.callspec.params["make_adapter"] == adapter.name


def test_store_lookup_load_round_trip_is_byte_exact(make_adapter):
    """Stored chunks are reported stored, found by lookup, and load back byte for byte."""
    adapter = make_adapter(capacity_bytes=4000)

    result = store(adapter, [1, 2, 3])
    found = wait(adapter.lookup([key(1), key(2), key(3), key(4)]))
    loaded, buffers = load(adapter, [3, 1, 2])

    assert StoreResult([key(1), key(2), key(3)], [], [], 3000, []) == result
    assert [True, True, True, False] == found
    assert LoadResult([key(3), key(1), key(2)], []) == loaded
    assert [payload(3), payload(1), payload(2)] == [bytes(b) for b in buffers]


def test_keys_differing_only_in_model_or_salt_are_distinct_chunks(make_adapter):
    """The same chunk hash under another model or salt is another chunk."""
    adapter = make_adapter()
    keys = [key(7, "m1", "s1"), key(7, "m2", "s1"), key(7, "m1", "s2")]
    wait(adapter.submit_store([(k, payload(n)) for n, k in enumerate(keys)]))

    buffers = [bytearray(1000) for _ in keys]
    result = wait(adapter.submit_load(keys, [memoryview(b) for b in buffers]))

    assert keys == result.loaded
    assert [payload(0), payload(1), payload(2)] == [bytes(b) for b in buffers]


def test_present_keys_are_skipped_and_excluded_from_bytes_written(make_adapter):
    """Re-storing present keys does not rewrite them: they are skipped and not counted in bytes_written."""
    adapter = make_adapter(capacity_bytes=4000)
    store(adapter, [1, 2])

    result = wait(adapter.submit_store([(key(1), b"x" * 1000), (key(3), payload(3)), (key(2), b"y" * 1000)]))
    _, buffers = load(adapter, [1])

    assert StoreResult([key(3)], [key(1), key(2)], [], 1000, []) == result
    assert payload(1) == bytes(buffers[0])


def test_eviction_removes_least_recently_stored_first_and_reports_it(make_adapter):
    """A store that exceeds capacity evicts the oldest chunks, in LRU order, and lists them in ``evicted``."""
    adapter = make_adapter(capacity_bytes=3000)
    store(adapter, [1])
    store(adapter, [2])
    store(adapter, [3])

    result = store(adapter, [4, 5])

    assert [key(1), key(2)] == result.evicted
    assert [False, False, True, True, True] == wait(adapter.lookup([key(i) for i in range(1, 6)]))


def test_lookup_counts_as_an_access(make_adapter):
    """A lookup hit makes a chunk most recently used, so the next eviction takes another one."""
    adapter = make_adapter(capacity_bytes=3000)
    store(adapter, [1, 2, 3])
    wait(adapter.lookup([key(1)]))

    result = store(adapter, [4])

    assert [key(2)] == result.evicted


def test_load_counts_as_an_access(make_adapter):
    """Loading a chunk makes it most recently used."""
    adapter = make_adapter(capacity_bytes=3000)
    store(adapter, [1, 2, 3])
    load(adapter, [1, 2])

    result = store(adapter, [4, 5])

    assert [key(3), key(1)] == result.evicted


def test_usage_tracks_stores_evictions_and_deletes(make_adapter):
    """get_usage gives payload bytes, the capacity and the key count after each kind of change."""
    adapter = make_adapter(capacity_bytes=3000)
    seen = [adapter.get_usage()]
    store(adapter, [1, 2])
    seen.append(adapter.get_usage())
    store(adapter, [3, 4])
    seen.append(adapter.get_usage())
    wait(adapter.delete([key(3), key(99)]))
    seen.append(adapter.get_usage())

    assert [Usage(0, 3000, 0), Usage(2000, 3000, 2), Usage(3000, 3000, 3), Usage(2000, 3000, 2)] == seen


def test_delete_returns_how_many_were_present(make_adapter):
    """delete removes the keys it holds and counts only those."""
    adapter = make_adapter()
    store(adapter, [1, 2])

    removed = wait(adapter.delete([key(1), key(2), key(3)]))

    assert 2 == removed
    assert [False, False] == wait(adapter.lookup([key(1), key(2)]))


def test_missing_keys_fail_to_load_and_leave_their_destination_untouched(make_adapter):
    """A key the adapter does not hold is ``failed``; its destination keeps its bytes."""
    adapter = make_adapter()
    store(adapter, [1])
    buffers = [bytearray(b"\xee" * 1000), bytearray(1000)]

    result = wait(adapter.submit_load([key(2), key(1)], [memoryview(b) for b in buffers]))

    assert LoadResult([key(1)], [key(2)]) == result
    assert [b"\xee" * 1000, payload(1)] == [bytes(b) for b in buffers]


def test_a_destination_of_another_size_is_never_written(make_adapter):
    """A chunk loads only into a destination of exactly its size; a smaller or larger one fails untouched."""
    adapter = make_adapter()
    store(adapter, [1, 2])
    backing = bytearray(b"\xee" * 3000)
    small, large = memoryview(backing)[:999], memoryview(backing)[1000:3000]

    result = wait(adapter.submit_load([key(1), key(2)], [small, large]))

    assert LoadResult([], [key(1), key(2)]) == result
    assert b"\xee" * 3000 == bytes(backing)


def test_typed_buffers_round_trip_by_their_bytes(make_adapter):
    """Non-byte buffers (a float32 array, a 2-D view) store and load by their raw bytes."""
    adapter = make_adapter()
    source = np.arange(250, dtype=np.float32)
    destination = np.zeros((10, 25), dtype=np.float32)

    wait(adapter.submit_store([(key(1), memoryview(source))]))
    result = wait(adapter.submit_load([key(1)], [memoryview(destination)]))

    assert [key(1)] == result.loaded
    assert source.tolist() == destination.ravel().tolist()


def test_empty_operations_complete_with_empty_results(make_adapter):
    """Empty lists give empty results, not errors."""
    adapter = make_adapter()

    assert StoreResult() == wait(adapter.submit_store([]))
    assert [] == wait(adapter.lookup([]))
    assert LoadResult() == wait(adapter.submit_load([], []))
    assert 0 == wait(adapter.delete([]))


def test_concurrent_stores_never_exceed_capacity(make_adapter):
    """Store tasks racing on the adapter's threads keep usage within capacity and account every key once."""
    adapter = make_adapter(capacity_bytes=5000)
    futures = [adapter.submit_store([(key(t * 10 + i), payload(i)) for i in range(4)]) for t in range(8)]
    done, pending = wait_all(futures, timeout=TIMEOUT_S)
    results = [f.result() for f in futures]

    stored = [k for r in results for k in r.stored]
    evicted = [k for r in results for k in r.evicted]
    held = [k for k, hit in zip(stored, wait(adapter.lookup(stored))) if hit]

    assert set() == pending
    assert 32 == len(stored) + sum(len(r.failed) for r in results)
    assert sorted(stored) == sorted(held + evicted)
    assert Usage(1000 * len(held), 5000, len(held)) == adapter.get_usage()
    assert len(held) <= 5


def test_close_waits_for_tasks_in_flight(make_adapter):
    """close() returns only after submitted tasks have completed."""
    adapter = make_adapter()
    futures = [adapter.submit_store([(key(i), payload(i))]) for i in range(4)]

    adapter.close()

    assert [True] * 4 == [f.done() for f in futures]
