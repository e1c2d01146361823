"""The redis adapter against a real redis-server: sharing, cross-process capacity, bad values, lost server."""

from __future__ import annotations

import pytest
import redis
from support.l2 import MAC_KEY, key, payload, wait
from support.ports import free_port

from mpcache.cache.l2.base import (
    L2LookupError,
    LoadResult,
    StoreResult,
    Usage,
    decode_record,
    key_digest,
)


def data_key(prefix: str, chunk_key) -> str:
    return f"{prefix}c:{key_digest(chunk_key)}"


def test_two_adapters_on_one_server_share_chunks(make_redis):
    """What one adapter stores, another on the same server and prefix finds, loads, and skips re-storing."""
    writer, reader = make_redis(), make_redis()
    wait(writer.submit_store([(key(1), payload(1)), (key(2), payload(2))]))

    found = wait(reader.lookup([key(1), key(2), key(3)]))
    buffers = [bytearray(1000), bytearray(1000)]
    loaded = wait(reader.submit_load([key(2), key(1)], [memoryview(b) for b in buffers]))
    again = wait(reader.submit_store([(key(1), payload(1)), (key(3), payload(3))]))

    assert [True, True, False] == found
    assert (LoadResult([key(2), key(1)], []), [payload(2), payload(1)]) == (loaded, [bytes(b) for b in buffers])
    assert StoreResult([key(3)], [key(1)], [], 1000, []) == again


def test_adapters_with_other_prefixes_do_not_see_each_other(make_redis, redis_prefix):
    """Different key prefixes on one server are separate tiers."""
    first, second = make_redis(key_prefix=redis_prefix + "one:"), make_redis(key_prefix=redis_prefix + "two:")
    wait(first.submit_store([(key(1), payload(1))]))

    assert [False] == wait(second.lookup([key(1)]))


def test_capacity_holds_across_adapters_and_eviction_reports_the_other_adapters_keys(make_redis):
    """A store through one adapter evicts the least recently used chunk whoever stored it, and reports it."""
    first, second = make_redis(capacity_bytes=3000), make_redis(capacity_bytes=3000)
    wait(first.submit_store([(key(1), payload(1)), (key(2), payload(2))]))

    result = wait(second.submit_store([(key(3), payload(3)), (key(4), payload(4))]))

    assert [key(1)] == result.evicted
    assert [False, True, True, True] == wait(first.lookup([key(i) for i in range(1, 5)]))
    assert Usage(3000, 3000, 3) == second.get_usage() == first.refresh_usage()


def test_values_are_chunk_records(make_redis, redis_server, redis_prefix):
    """The server holds each chunk as the same MAC'd record fs writes to a file."""
    adapter = make_redis()
    wait(adapter.submit_store([(key(1), payload(1))]))

    value = redis.Redis.from_url(redis_server).get(data_key(redis_prefix, key(1)))
    decoded = decode_record(value, MAC_KEY)

    assert (key(1), payload(1)) == (decoded[0], bytes(decoded[1]))


def test_a_corrupted_value_is_never_loaded_and_is_dropped(make_redis, redis_server, redis_prefix):
    """A value with a flipped byte fails to load, leaves the destination untouched, and leaves the tier."""
    adapter = make_redis()
    wait(adapter.submit_store([(key(1), payload(1)), (key(2), payload(2))]))
    client = redis.Redis.from_url(redis_server)
    value = bytearray(client.get(data_key(redis_prefix, key(1))))
    value[-1] ^= 0x01
    client.set(data_key(redis_prefix, key(1)), bytes(value))

    destination = bytearray(b"\xee" * 1000)
    result = wait(adapter.submit_load([key(1)], [memoryview(destination)]))

    assert (LoadResult([], [key(1)], [key(1)]), b"\xee" * 1000) == (result, bytes(destination))
    assert {"integrity": 1} == adapter.failures.totals()
    assert ([False, True], Usage(1000, 4000, 1)) == (wait(adapter.lookup([key(1), key(2)])), adapter.get_usage())


def test_a_value_removed_behind_the_adapters_back_fails_and_leaves_the_index(make_redis, redis_server, redis_prefix):
    """If the server loses a value (its own eviction, a manual DEL), the load fails and the key stops being a hit."""
    adapter = make_redis()
    wait(adapter.submit_store([(key(1), payload(1))]))
    redis.Redis.from_url(redis_server).delete(data_key(redis_prefix, key(1)))

    result = wait(adapter.submit_load([key(1)], [memoryview(bytearray(1000))]))

    assert LoadResult([], [key(1)]) == result
    assert ([False], Usage(0, 4000, 0)) == (wait(adapter.lookup([key(1)])), adapter.get_usage())


def test_an_unreachable_server_fails_keys_and_counts_them(make_redis):
    """With nothing listening, stores and loads list every key as failed (loads as errors), lookups fail with
    L2LookupError (a failure, not a miss), deletes remove 0, and every one of them is counted."""
    port = free_port()  # nothing listens there (probed), and below the ephemeral range nothing will by chance
    adapter = make_redis(url=f"redis://127.0.0.1:{port}/0", retries=0, connect_timeout_s=1.0)

    stored = wait(adapter.submit_store([(key(1), payload(1)), (key(2), payload(2))]))
    with pytest.raises(L2LookupError):
        wait(adapter.lookup([key(1)]))
    loaded = wait(adapter.submit_load([key(1)], [memoryview(bytearray(1000))]))
    deleted = wait(adapter.delete([key(1)]))

    assert StoreResult([], [], [key(1), key(2)], 0, []) == stored
    assert (LoadResult([], [key(1)], [], [key(1)]), 0) == (loaded, deleted)
    assert Usage(0, 4000, 0) == adapter.get_usage()
    totals = adapter.failures.totals()
    totals.pop("usage_error", None)  # the start-up usage refresh, if it ran before the rest
    assert {"store_error": 2, "lookup_error": 1, "load_error": 1, "delete_error": 1} == totals


def test_a_new_adapter_learns_the_tiers_usage_from_the_server(make_redis):
    """refresh_usage (also run once at start-up) reports what other adapters already stored."""
    wait(make_redis().submit_store([(key(1), payload(1)), (key(2), payload(2))]))

    assert Usage(2000, 4000, 2) == make_redis().refresh_usage()


def test_a_usage_refresh_answered_before_a_store_does_not_undo_the_stores_usage(make_redis):
    """A refresh whose reply left the server before a store's, but is applied after it (the adapter starts one
    in the background), must not set usage back: it lost a race to newer news (seen as a flaky 0 under load)."""
    adapter = make_redis(capacity_bytes=3000)
    adapter.refresh_usage()  # the background refresh from construction is superseded by this one
    real_run = adapter._calls.run
    raced: list[StoreResult] = []
    refreshing = [True]

    def run_then_let_a_store_overtake(calls):
        replies = real_run(calls)
        if refreshing:  # the refresh's own call: its replies are now stale
            refreshing.clear()
            raced.append(wait(adapter.submit_store([(key(1), payload(1))])))
        return replies

    adapter._calls.run = run_then_let_a_store_overtake
    adapter.refresh_usage()
    adapter._calls.run = real_run

    assert [StoreResult([key(1)], [], [], 1000, [])] == raced
    assert Usage(1000, 3000, 1) == adapter.get_usage()


@pytest.mark.parametrize(("field", "value"), [("used", "abc"), ("used", "-5"), ("clock", "abc")])
def test_a_tampered_stats_field_is_repaired_and_the_shard_keeps_serving(make_redis, redis_server, redis_prefix,
                                                                       field, value):
    """``HSET …stats used abc`` (or a negative ``used``, or a ``clock`` that is not a number) disabled the shard
    until someone repaired the key ("attempt to perform arithmetic on local 'used'"): now the next store
    recomputes ``used`` from the chunks' sizes (a clock restarts at 0), stores, and the tier's usage is right."""
    adapter = make_redis(capacity_bytes=3000)
    wait(adapter.submit_store([(key(1), payload(1))]))
    redis.Redis.from_url(redis_server).hset(f"{redis_prefix}stats", field, value)

    stored = wait(adapter.submit_store([(key(2), payload(2))]))

    assert (StoreResult([key(2)], [], [], 1000, []), {}) == (stored, adapter.failures.totals())
    assert ([True, True], Usage(2000, 3000, 2)) == (wait(adapter.lookup([key(1), key(2)])), adapter.get_usage())


def test_garbage_names_of_evicted_chunks_are_skipped_and_counted_and_the_batch_is_stored(make_redis, redis_server,
                                                                                          redis_prefix):
    """A name entry of the index overwritten with garbage reached an unguarded decode when its chunk was
    evicted and failed the whole store batch: now that name is skipped and counted (``index``), the chunks
    are stored, and the well-formed evicted name is reported."""
    adapter = make_redis(capacity_bytes=3000)
    wait(adapter.submit_store([(key(1), payload(1)), (key(2), payload(2)), (key(3), payload(3))]))
    redis.Redis.from_url(redis_server).hset(f"{redis_prefix}name", key_digest(key(1)), b"\x01")

    result = wait(adapter.submit_store([(key(4), payload(4)), (key(5), payload(5))]))

    assert StoreResult([key(4), key(5)], [], [], 2000, [key(2)]) == result
    assert {"index": 1} == adapter.failures.totals()
