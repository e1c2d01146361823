"""The L2 tier inside a cache process: store and prefetch controllers, L2 eviction, and the L2 metrics
they produce when the real telemetry subscribers read the ring.

Servers run in-process (``cache`` fixture) with real adapters: a mock (failures drawn from a seeded
generator, one draw per key per store or load task, in submission order) and an fs tier.
"""

from __future__ import annotations

import hashlib
import os
import random
import struct

import numpy as np
import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader
from support.cache_harness import CHUNK_BYTES, CHUNK_TOKENS, MODEL, CapturedLog, fill_blocks, fs_spec, l2_idle
from support.waiting import wait_for

from mpcache.contract.events import EventType as E
from mpcache.contract.keys import ChunkKey
from mpcache.telemetry.bus import EventBus
from mpcache.telemetry.pump import Pump, RingSource
from mpcache.telemetry.subscribers.metrics import build_metrics_subscribers

SEED = 331  # see test_the_seed_draws_the_failures_the_script_expects
FAILURE_RATE = 0.2
# Mock draws, in submission order: store A (6 keys), store B (8), load for A (5), load for B (2); True = fails.
DRAWS = [False, False, True, False, False, False] + [False] * 8 + [False, False, False, True, False] + [False, False]
FS_CAPACITY_CHUNKS = 12


def mock_spec(**extra) -> dict:
    return {"type": "mock", "capacity_gb": 1.0, "failure_rate": FAILURE_RATE, "seed": SEED, **extra}


class Telemetry:
    """The telemetry process's metrics side, in-process: a pump over the server's ring feeding every
    metrics subscriber, an InMemoryMetricReader to read the instruments."""

    def __init__(self, harness) -> None:
        self.reader = InMemoryMetricReader()
        self.provider = MeterProvider(metric_readers=[self.reader])
        events = harness.events
        bus = EventBus()
        self.pump = Pump([RingSource(0, events.segment, events.reader, events.names)], bus)
        build_metrics_subscribers(harness.config, self.provider, pump=self.pump, bus=bus, gauge_reader=harness.board)

    def drain(self) -> dict[str, dict[frozenset, object]]:
        self.pump.drain()
        out: dict[str, dict[frozenset, object]] = {}
        for resource_metrics in self.reader.get_metrics_data().resource_metrics:
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    points = out.setdefault(metric.name, {})
                    for point in metric.data.data_points:
                        key = frozenset((point.attributes or {}).items())
                        points[key] = point.count if isinstance(point, HistogramDataPoint) else point.value
        return out

    def close(self) -> None:
        self.provider.shutdown()


def by(**attributes: str) -> frozenset:
    return frozenset(attributes.items())


def nonzero(series: dict) -> dict:
    return {k: v for k, v in series.items() if v}


def test_the_seed_draws_the_failures_the_script_expects():
    """The mock's failure draws for SEED are the ones the scripted workload's expectations were worked out for."""
    rng = random.Random(SEED)
    assert DRAWS == [rng.random() < FAILURE_RATE for _ in DRAWS]


def test_scripted_workload_gives_exact_l2_counters(cache, tmp_path):
    """A scripted workload over [mock (seeded failures), fs (12 chunks)] and an 8-slot L1 yields, after the
    telemetry side drained the ring, exactly the hand-computed value of every L2 counter per cache_salt and
    l2_name, the L2 throughput sample counts, the lookup L1/L2 split, and L2 gauges that match the adapters."""
    # the script's evictions are LRU's
    harness = cache(l2=[mock_spec(), fs_spec(tmp_path / "fs", FS_CAPACITY_CHUNKS)], l1_policy="lru")
    telemetry = Telemetry(harness)
    client = harness.client()
    kv = client.register_buffer(8, CHUNK_BYTES)
    a_hashes, b_hashes = [1, 2, 3, 4, 5, 6], [101, 102, 103, 104, 105, 106, 107, 108]

    # 1. store A (salt a, 6 chunks): mock fails A3 (draw 3); fs stores all 6.
    fill_blocks(kv, 1)
    a_data = kv.blocks[:6].copy()
    assert 6 == client.store(kv, request_id="w1", model_name=MODEL, cache_salt="a", chunk_hashes=a_hashes,
                             block_ids=list(range(6))).stored
    l2_idle(harness)
    # 2. store B (salt b, 8 chunks): L1 evicts A1..A6; mock stores all 8; fs (12 chunks) evicts A1, A2.
    fill_blocks(kv, 2)
    assert 8 == client.store(kv, request_id="w2", model_name=MODEL, cache_salt="b", chunk_hashes=b_hashes,
                             block_ids=list(range(8))).stored
    l2_idle(harness)
    # 3. prefetch A: L1 has none; L2 holds all 6 (A1, A2, A4-A6 mock; A3-A6 fs) -> prefix_hit_count 6.
    #    Loads: mock gets A1, A2, A4, A5, A6 (its draws fail A5), fs gets A3.  Landed: all but A5;
    #    the contiguous run is A1..A4 (found 4); A6 stays in L1 unlocked.  L1 evicts B1..B6 to make room.
    job_a = client.lookup_prefetch(request_id="r-a", model_name=MODEL, cache_salt="a", chunk_hashes=a_hashes)
    status_a = client.wait_prefetch(job_a)
    # 4. prefetch B while job A still holds A1..A4: L1 = B7, B8 (ready), A1..A4 (locked), A6, one free slot.
    #    L2 prefix 8.  B7, B8 are already in L1 (read-locked, no load); B1..B6 need 6 slots: A6 is evicted,
    #    B1, B2 get the 2 free slots, B3..B6 fail (l1_oom 4) and B7, B8 are unlocked again.
    #    B1, B2 load from mock (first adapter holding them): both land -> found 2.
    job_b = client.lookup_prefetch(request_id="r-b", model_name=MODEL, cache_salt="b", chunk_hashes=b_hashes)
    status_b = client.wait_prefetch(job_b)
    out = client.register_buffer(8, CHUNK_BYTES)
    assert 4 == client.retrieve(out, request_id="r-a", job_id=job_a, block_ids=[0, 1, 2, 3]).retrieved
    np.testing.assert_array_equal(a_data[:4], out.blocks[:4])
    assert 2 == client.retrieve(out, request_id="r-b", job_id=job_b, block_ids=[0, 1]).retrieved
    client.end_session("r-a")
    client.end_session("r-b")
    l2_idle(harness)

    chunk_tokens = CHUNK_TOKENS
    assert ((True, 4, 0, 4 * chunk_tokens, 5), (True, 2, 0, 2 * chunk_tokens, 2)) == tuple(
        (s.done, s.found_count, s.l1_hit_tokens, s.l2_hit_tokens, s.l2_loaded_count)
        for s in (status_a, status_b))

    m = telemetry.drain()
    salt_a, salt_b = by(cache_salt="a"), by(cache_salt="b")
    mock, fs = by(l2_name="mock"), by(l2_name="fs")
    expected = {
        "lmcache_mp.l2_store_submitted": {by(): 4},
        "lmcache_mp.l2_store_submitted_objects": {salt_a: 12, salt_b: 16},
        "lmcache_mp.l2_store_completed": {mock: 1, fs: 2},  # mock's store of A failed A3: failed, not completed
        "mpcache.l2_store_failed": {mock: 1, fs: 0},
        "mpcache.l2_store_failed_chunks": {mock: 1, fs: 0},
        "lmcache_mp.l2_store_completed_objects": {salt_a: 5 + 6, salt_b: 8 + 8},
        "lmcache_mp.l2_prefetch_lookup": {by(): 2},
        "lmcache_mp.l2_prefetch_lookup_objects": {salt_a: 6, salt_b: 8},
        "lmcache_mp.l2_prefetch_hit": {by(): 6 + 8},
        "lmcache_mp.l2_prefetch_load_submitted": {by(): 2 + 1},
        "lmcache_mp.l2_prefetch_load_submitted_objects": {salt_a: 6, salt_b: 2},
        "lmcache_mp.l2_prefetch_load_completed": {salt_a: 5, salt_b: 2},
        "lmcache_mp.l2_load_completed": {mock: 1, fs: 1},  # mock's load for A failed A5
        "mpcache.l2_load_failed": {mock: 1, fs: 0},
        "mpcache.l2_load_failed_chunks": {mock: 1, fs: 0},
        "lmcache_mp.l2_evicted": {salt_a: 2},
        "lmcache_mp.l2_prefetch_failure": {by(reason="l1_oom", model_name=MODEL): 4,
                                           by(reason="not_found", model_name=MODEL): 1},
        "lmcache_mp.l2_store_throughput": {mock: 2, fs: 2},
        "lmcache_mp.l2_load_throughput": {mock: 2, fs: 1},
        "lmcache_mp.lookup_hit_l1": {by(model_name=MODEL, cache_salt="a"): 0, by(model_name=MODEL, cache_salt="b"): 0},
        "lmcache_mp.lookup_hit_l2": {by(model_name=MODEL, cache_salt="a"): 4 * chunk_tokens,
                                     by(model_name=MODEL, cache_salt="b"): 2 * chunk_tokens},
        "lmcache_mp.lookup_hit": {by(model_name=MODEL, cache_salt="a"): 4 * chunk_tokens,
                                  by(model_name=MODEL, cache_salt="b"): 2 * chunk_tokens},
        "lmcache_mp.l1_write": {salt_a: 6 + 5, salt_b: 8 + 2},
        "lmcache_mp.l1_allocation_failure": {by(during="l2_prefetch", model_name=MODEL): 4},
        "lmcache_mp.l1_evicted": {salt_a: 6 + 1, salt_b: 6},
    }
    assert expected == {name: m.get(name, {}) for name in expected}
    mock_gauge, fs_gauge = by(l2_name="mock", adapter_index="0"), by(l2_name="fs", adapter_index="1")
    assert ({mock: (5 + 8) * CHUNK_BYTES, fs: FS_CAPACITY_CHUNKS * CHUNK_BYTES},
            {mock_gauge: 0, fs_gauge: 0}, {mock_gauge: 0, fs_gauge: 0}, {mock_gauge: 0, fs_gauge: 0}) == (
        m["lmcache_mp.l2_usage_bytes"], m["lmcache_mp.num_inflight_l2_stores"],
        m["lmcache_mp.num_inflight_l2_loads"], m["lmcache_mp.inflight_load_memory_usage_bytes"])
    telemetry.close()


def test_l2_events_pair_and_carry_their_fields(cache, tmp_path):
    """One store and one prefetch from L2: L2_STORE_SUBMITTED/COMPLETED pair on (adapter_index, task_id) with
    bytes_transferred = bytes written; the prefetch's lookup, load and task events share its request_id and a
    load task's total_bytes is the L1 bytes it lands into; a re-store of keys an adapter holds transfers 0 bytes."""
    harness = cache(l2=[fs_spec(tmp_path / "fs", chunks=100)])
    client = harness.client()
    kv = client.register_buffer(8, CHUNK_BYTES)
    fill_blocks(kv, 3)
    client.store(kv, request_id="w", model_name=MODEL, cache_salt="s", chunk_hashes=[1, 2, 3], block_ids=[0, 1, 2])
    l2_idle(harness)
    client.store(kv, request_id="w2", model_name=MODEL, cache_salt="s", chunk_hashes=[4, 5, 6, 7, 8, 9, 10, 11],
                 block_ids=list(range(8)))  # evicts 1..3 from L1
    l2_idle(harness)
    harness.events.take()
    job = client.lookup_prefetch(request_id="r", model_name=MODEL, cache_salt="s", chunk_hashes=[1, 2, 3, 99])
    assert 3 == client.wait_prefetch(job).found_count
    batch = harness.events.take()

    def fields(etype):
        return [e.fields for e in batch.events([etype])]

    assert [{"request_id": job, "key_count": 4, "adapter_count": 1}] == fields(E.L2_PREFETCH_LOOKUP_SUBMITTED)
    assert [{"request_id": job, "prefix_hit_count": 3}] == fields(E.L2_PREFETCH_LOOKUP_COMPLETED)
    assert [{"request_id": job, "key_count": 3, "adapter_count": 1}] == fields(E.L2_PREFETCH_LOAD_SUBMITTED)
    (submitted,) = fields(E.L2_LOAD_TASK_SUBMITTED)
    assert {"request_id": job, "adapter_index": 0, "l2_name": "fs", "key_count": 3,
            "total_bytes": 3 * CHUNK_BYTES} == {k: v for k, v in submitted.items() if k != "task_id"}
    assert [{"request_id": job, "adapter_index": 0, "task_id": submitted["task_id"], "l2_name": "fs",
             "succeeded_count": 3, "failed_count": 0}] == fields(E.L2_LOAD_TASK_COMPLETED)
    assert [{"request_id": job, "loaded_count": 3, "failed_count": 0}] == fields(E.L2_PREFETCH_LOAD_COMPLETED)
    assert [[("s", MODEL, 3)]] == [e.salt_counts for e in batch.events([E.L1_WRITE_FINISHED_AND_READ_RESERVED])]

    harness.events.take()
    client.store(kv, request_id="w3", model_name=MODEL, cache_salt="s", chunk_hashes=[20, 21], block_ids=[0, 1])
    l2_idle(harness)
    first = harness.events.take()
    client.end_session("r")
    client.store(kv, request_id="w4", model_name=MODEL, cache_salt="s", chunk_hashes=[1, 2],
                 block_ids=[0, 1])  # 1 and 2 are in L1 again: nothing new to store
    assert [] == [e for e in harness.events.take().events() if e.etype is E.L2_STORE_SUBMITTED]
    (sub,) = [e.fields for e in first.events([E.L2_STORE_SUBMITTED])]
    (done,) = [e.fields for e in first.events([E.L2_STORE_COMPLETED])]
    assert ({"adapter_index": 0, "l2_name": "fs", "key_count": 2, "total_bytes": 2 * CHUNK_BYTES},
            {"adapter_index": 0, "task_id": sub["task_id"], "l2_name": "fs", "bytes_transferred": 2 * CHUNK_BYTES,
             "succeeded_count": 2, "failed_count": 0}) == ({k: v for k, v in sub.items() if k != "task_id"}, done)

    adapter = harness.server.storage.adapters[0]
    result = adapter.submit_store([(ChunkKey(MODEL, "s", 20), bytes(CHUNK_BYTES))]).result(5)
    assert (0, 1) == (result.bytes_written, len(result.skipped))  # what a COMPLETED reports for a held key


def test_prefetch_lands_byte_exact_data_from_l2(cache, tmp_path):
    """Chunks evicted from L1 come back from L2 with the bytes that were stored, and the lookup's END
    splits the hit into l1_hit_tokens (chunks found in L1) and l2_hit_tokens (chunks loaded from L2),
    summing to hit_tokens."""
    harness = cache(l2=[fs_spec(tmp_path / "fs", chunks=100)])
    client = harness.client()
    kv = client.register_buffer(8, CHUNK_BYTES)
    fill_blocks(kv, 11)
    first = kv.blocks[:6].copy()
    hashes = [31, 32, 33, 34, 35, 36]
    client.store(kv, request_id="w1", model_name=MODEL, cache_salt="s", chunk_hashes=hashes, block_ids=list(range(6)))
    l2_idle(harness)
    client.store(kv, request_id="w2", model_name=MODEL, cache_salt="s", chunk_hashes=[41, 42, 43, 44],
                 block_ids=[0, 1, 2, 3])  # L1 (8 slots) evicts 31, 32
    l2_idle(harness)
    harness.events.take()
    # The L1 prefix is empty (31 is gone); L2 holds all 6: 31, 32 are loaded, 33..36 are still in L1
    # (read-locked in place, no load), so they count as L1 hits.
    job = client.lookup_prefetch(request_id="r", model_name=MODEL, cache_salt="s", chunk_hashes=hashes)
    status = client.wait_prefetch(job)
    out = client.register_buffer(8, CHUNK_BYTES)
    assert 6 == client.retrieve(out, request_id="r", job_id=job, block_ids=list(range(6))).retrieved
    np.testing.assert_array_equal(first, out.blocks[:6])
    (end,) = [e.fields for e in harness.events.take().events([E.MP_LOOKUP_PREFETCH_END])]
    assert (6 * CHUNK_TOKENS, 4 * CHUNK_TOKENS, 2 * CHUNK_TOKENS, 2) == (
        end["hit_tokens"], end["l1_hit_tokens"], end["l2_hit_tokens"], status.l2_loaded_count)


def test_chunk_the_adapter_cannot_produce_is_a_not_found_failure(cache, tmp_path):
    """A chunk whose fs file vanished after it was stored is still listed by the adapter's index, so the
    lookup counts it; its load fails: L2_PREFETCH_FAILED reason=not_found, and the hit stops before it."""
    harness = cache(l2=[fs_spec(tmp_path / "fs", chunks=100)])
    client = harness.client()
    kv = client.register_buffer(8, CHUNK_BYTES)
    fill_blocks(kv, 5)
    client.store(kv, request_id="w1", model_name=MODEL, cache_salt="s", chunk_hashes=[1, 2, 3], block_ids=[0, 1, 2])
    l2_idle(harness)
    client.store(kv, request_id="w2", model_name=MODEL, cache_salt="s", chunk_hashes=list(range(50, 58)),
                 block_ids=list(range(8)))  # evicts 1..3 from L1
    l2_idle(harness)
    adapter = harness.server.storage.adapters[0]
    os.unlink(adapter.file_path(ChunkKey(MODEL, "s", 2)))
    harness.events.take()
    job = client.lookup_prefetch(request_id="r", model_name=MODEL, cache_salt="s", chunk_hashes=[1, 2, 3])
    status = client.wait_prefetch(job)
    batch = harness.events.take()
    assert ([{"request_id": job, "prefix_hit_count": 3}], [{"request_id": job, "loaded_count": 2, "failed_count": 1}],
            [("not_found", [("s", MODEL, 1)])], 1) == (
        [e.fields for e in batch.events([E.L2_PREFETCH_LOOKUP_COMPLETED])],
        [e.fields for e in batch.events([E.L2_PREFETCH_LOAD_COMPLETED])],
        [(e.fields["reason"], e.salt_counts) for e in batch.events([E.L2_PREFETCH_FAILED])],
        status.found_count)


def test_prefetch_without_room_in_l1_is_an_l1_oom_failure(cache, tmp_path):
    """When L1 cannot hold the chunks L2 has (everything else is read-locked), the surplus is
    L1_ALLOCATION_FAILED during=l2_prefetch and L2_PREFETCH_FAILED reason=l1_oom, for the same chunks."""
    harness = cache(l2=[fs_spec(tmp_path / "fs", chunks=100)])
    client = harness.client()
    kv = client.register_buffer(8, CHUNK_BYTES)
    fill_blocks(kv, 6)
    client.store(kv, request_id="w1", model_name=MODEL, cache_salt="s", chunk_hashes=[1, 2, 3, 4, 5],
                 block_ids=list(range(5)))
    l2_idle(harness)
    client.store(kv, request_id="w2", model_name=MODEL, cache_salt="t", chunk_hashes=list(range(60, 68)),
                 block_ids=list(range(8)))  # L1 now holds only salt t
    l2_idle(harness)
    holder = client.lookup_prefetch(request_id="h", model_name=MODEL, cache_salt="t",
                                    chunk_hashes=list(range(60, 66)))  # locks 6 of the 8 slots
    assert 6 == client.wait_prefetch(holder).found_count
    harness.events.take()
    job = client.lookup_prefetch(request_id="r", model_name=MODEL, cache_salt="s", chunk_hashes=[1, 2, 3, 4, 5])
    assert 2 == client.wait_prefetch(job).found_count
    batch = harness.events.take()
    assert ([("l2_prefetch", [("s", MODEL, 3)])], [("l1_oom", [("s", MODEL, 3)])]) == (
        [(e.fields["during"], e.salt_counts) for e in batch.events([E.L1_ALLOCATION_FAILED])],
        [(e.fields["reason"], e.salt_counts) for e in batch.events([E.L2_PREFETCH_FAILED])])


def test_fs_tier_serves_hits_after_a_restart(cache, tmp_path):
    """Chunks stored through an fs tier are found by a new cache process started on the same path
    (its index is rebuilt from the files): its first lookup is an L2 hit."""
    spec = fs_spec(tmp_path / "fs", chunks=100)
    first = cache(l2=[spec])
    client = first.client()
    kv = client.register_buffer(4, CHUNK_BYTES)
    fill_blocks(kv, 9)
    stored = kv.blocks[:4].copy()
    client.store(kv, request_id="w", model_name=MODEL, cache_salt="s", chunk_hashes=[7, 8, 9, 10],
                 block_ids=[0, 1, 2, 3])
    first.stop()  # waits for the L2 stores before closing the adapter
    second = cache(l2=[spec])
    client = second.client()
    job = client.lookup_prefetch(request_id="r", model_name=MODEL, cache_salt="s", chunk_hashes=[7, 8, 9, 10])
    status = client.wait_prefetch(job)
    out = client.register_buffer(4, CHUNK_BYTES)
    assert (4, 0, 4 * CHUNK_TOKENS) == (status.found_count, status.l1_hit_tokens, status.l2_hit_tokens)
    assert 4 == client.retrieve(out, request_id="r", job_id=job, block_ids=[0, 1, 2, 3]).retrieved
    np.testing.assert_array_equal(stored, out.blocks[:4])


def test_pending_prefetch_is_not_done_and_cannot_be_retrieved(cache, tmp_path):
    """While a prefetch's L2 loads are in flight, query_prefetch_status says done=False without publishing
    MP_LOOKUP_PREFETCH_END, and a retrieve is refused; once done, END is published exactly once."""
    harness = cache(l2=[mock_spec(failure_rate=0.0, latency_ms=300)])
    client = harness.client()
    kv = client.register_buffer(8, CHUNK_BYTES)
    fill_blocks(kv, 4)
    client.store(kv, request_id="w1", model_name=MODEL, cache_salt="s", chunk_hashes=[1, 2], block_ids=[0, 1])
    l2_idle(harness)
    client.store(kv, request_id="w2", model_name=MODEL, cache_salt="s", chunk_hashes=list(range(70, 78)),
                 block_ids=list(range(8)))
    l2_idle(harness)
    harness.events.take()
    job = client.lookup_prefetch(request_id="r", model_name=MODEL, cache_salt="s", chunk_hashes=[1, 2])
    pending = client.query_prefetch_status(job)
    with pytest.raises(Exception, match="still loading from L2"):
        client.retrieve(kv, request_id="r", job_id=job, block_ids=[0, 1])
    done = client.wait_prefetch(job)
    client.query_prefetch_status(job)
    ends = harness.events.take().count([E.MP_LOOKUP_PREFETCH_END])
    assert (False, True, 2, 1) == (pending.done, done.done, done.found_count, ends)


def test_inflight_gauges_follow_tasks(cache, tmp_path):
    """While a slow adapter works, its in-flight store count and in-flight load bytes (the L1 bytes its
    loads will land into) are on the gauge board; both return to 0 when the tasks complete."""
    from mpcache.shm import layout

    harness = cache(l2=[mock_spec(failure_rate=0.0, latency_ms=300)])
    client = harness.client()
    kv = client.register_buffer(8, CHUNK_BYTES)
    fill_blocks(kv, 4)
    client.store(kv, request_id="w1", model_name=MODEL, cache_salt="s", chunk_hashes=[1, 2, 3], block_ids=[0, 1, 2])
    stores_in_flight = harness.board.adapter_word(0, 0, layout.G_L2_INFLIGHT_STORES)
    l2_idle(harness)
    client.store(kv, request_id="w2", model_name=MODEL, cache_salt="s", chunk_hashes=list(range(80, 88)),
                 block_ids=list(range(8)))
    l2_idle(harness)
    job = client.lookup_prefetch(request_id="r", model_name=MODEL, cache_salt="s", chunk_hashes=[1, 2, 3])
    wait_for(lambda: harness.board.adapter_word(0, 0, layout.G_L2_INFLIGHT_LOADS) == 1, 5, "the load task", tolerate=())
    load_bytes = harness.board.adapter_word(0, 0, layout.G_L2_INFLIGHT_LOAD_BYTES)
    client.wait_prefetch(job)
    l2_idle(harness)
    words = [harness.board.adapter_word(0, 0, w) for w in (layout.G_L2_INFLIGHT_STORES, layout.G_L2_INFLIGHT_LOADS,
                                                           layout.G_L2_INFLIGHT_LOAD_BYTES)]
    assert (1, 3 * CHUNK_BYTES, [0, 0, 0]) == (stores_in_flight, load_bytes, words)


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    """A private redis-server on loopback (started by tests/l2's helper), stopped after this module."""
    import importlib.util
    import pathlib

    path = pathlib.Path(__file__).resolve().parents[1] / "l2" / "conftest.py"
    spec = importlib.util.spec_from_file_location("_l2_redis_helpers", path)
    helpers = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(helpers)
    if helpers.REDIS_SERVER is None:
        pytest.skip("redis-server binary not found")
    process, port = helpers._start_redis(str(tmp_path_factory.mktemp("redis")))
    yield f"redis://127.0.0.1:{port}/0"
    process.terminate()
    process.wait(10)


def test_redis_tier_round_trip_through_the_server(cache, redis_url):
    """With a real redis-server as the only L2 tier, chunks stored through one cache process come back
    byte-exact through another (the shared tier), with L2 store and load tasks named l2_name=redis."""
    prefix = f"mpcache-test:{os.getpid()}:{random.getrandbits(32)}:"
    spec = {"type": "redis", "url": redis_url, "capacity_gb": 1.0, "key_prefix": prefix}
    writer = cache(l2=[spec])
    client = writer.client()
    kv = client.register_buffer(4, CHUNK_BYTES)
    fill_blocks(kv, 21)
    stored = kv.blocks[:3].copy()
    client.store(kv, request_id="w", model_name=MODEL, cache_salt="s", chunk_hashes=[5, 6, 7], block_ids=[0, 1, 2])
    l2_idle(writer)
    completed = [e.fields for e in writer.events.take().events([E.L2_STORE_COMPLETED])]
    reader = cache(l2=[spec])
    other = reader.client()
    job = other.lookup_prefetch(request_id="r", model_name=MODEL, cache_salt="s", chunk_hashes=[5, 6, 7, 8])
    status = other.wait_prefetch(job)
    out = other.register_buffer(4, CHUNK_BYTES)
    assert 3 == other.retrieve(out, request_id="r", job_id=job, block_ids=[0, 1, 2]).retrieved
    np.testing.assert_array_equal(stored, out.blocks[:3])
    tasks = [e.fields for e in reader.events.take().events([E.L2_LOAD_TASK_COMPLETED])]
    assert ([("redis", 3 * CHUNK_BYTES, 3)], [("redis", 3, 0)], 3 * CHUNK_TOKENS) == (
        [(f["l2_name"], f["bytes_transferred"], f["succeeded_count"]) for f in completed],
        [(f["l2_name"], f["succeeded_count"], f["failed_count"]) for f in tasks], status.l2_hit_tokens)


def unkeyed_record(chunk_key: ChunkKey, data: bytes) -> bytes:
    """A well-formed record (documented layout) whose 16-byte check is blake2b-128 without the key."""
    model, salt = chunk_key.model_name.encode(), chunk_key.cache_salt.encode()
    fixed = struct.pack("<4sHHHxxQQ", b"MPL2", 2, len(model), len(salt), chunk_key.chunk_hash, len(data))
    return fixed + hashlib.blake2b(fixed + model + salt + data, digest_size=16).digest() + model + salt + data


def test_a_forged_redis_record_is_a_miss_through_the_cache(cache, redis_url):
    """Another client of the redis server plants a well-formed record (valid unkeyed checksum, index entries)
    for the chunk a client then looks up: the lookup finds nothing, the client's buffer keeps its bytes, the
    failure is L2_PREFETCH_FAILED reason=integrity (lmcache_mp_l2_prefetch_failure{reason=integrity}) and the
    server logs l2.record_rejected naming a possible forgery."""
    import redis

    from mpcache.cache.l2.base import key_digest

    prefix = f"mpcache-test:{os.getpid()}:{random.getrandbits(32)}:"
    log = CapturedLog()
    harness = cache(server_kwargs={"logger": log},
                    l2=[{"type": "redis", "url": redis_url, "capacity_gb": 1.0, "key_prefix": prefix}])
    telemetry = Telemetry(harness)
    target = ChunkKey(MODEL, "victim", 5)
    digest = key_digest(target)
    attacker = redis.Redis.from_url(redis_url)
    attacker.set(f"{prefix}c:{digest}", unkeyed_record(target, b"\x66" * CHUNK_BYTES))
    attacker.zadd(f"{prefix}lru", {digest: 1})
    attacker.hset(f"{prefix}size", digest, CHUNK_BYTES)
    client = harness.client()
    out = client.register_buffer(1, CHUNK_BYTES)
    out.blocks[0][:] = 0x11

    job = client.lookup_prefetch(request_id="r", model_name=MODEL, cache_salt="victim", chunk_hashes=[5])
    status = client.wait_prefetch(job)
    with pytest.raises(Exception, match="found nothing"):
        client.retrieve(out, request_id="r", job_id=job, block_ids=[0], timeout_s=0.5)
    failures = telemetry.drain().get("lmcache_mp.l2_prefetch_failure", {})  # (the telemetry side reads the ring)
    l2_idle(harness)
    harness.server.storage.report_failures(flush=True)
    telemetry.close()

    assert (0, True) == (status.found_count, bool((out.blocks[0] == 0x11).all()))
    assert {by(reason="integrity", model_name=MODEL): 1} == nonzero(failures)
    assert [("redis", 1, "possible forgery")] == [
        (fields["l2_name"], fields["count"], "possible forgery" if "possible forgery" in fields["hint"] else "")
        for event, fields in log.warnings if event == "l2.record_rejected"]
    assert None is attacker.get(f"{prefix}c:{digest}")


def test_a_hung_redis_tier_answers_lookups_after_its_socket_timeout(cache):
    """With the only L2 tier a server that accepts connections and never answers, a lookup is done after the
    1 s socket timeout at most (at once while the server is taken as down after the start-up usage refresh
    timed out) as a miss, and the failure is L2_PREFETCH_FAILED reason=lookup_error.  ``wait_prefetch`` fails
    the test if the lookup is not done within 10 s (ten socket timeouts): one that waited for the server."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(64)
    try:
        harness = cache(l2=[{"type": "redis", "url": f"redis://127.0.0.1:{listener.getsockname()[1]}/0",
                             "capacity_gb": 1.0}])
        client = harness.client()
        harness.events.take()
        job = client.lookup_prefetch(request_id="r", model_name=MODEL, cache_salt="s", chunk_hashes=[1, 2, 3])
        status = client.wait_prefetch(job, timeout_s=10)
        batch = harness.events.take()
    finally:
        listener.close()

    assert (True, 0) == (status.done, status.found_count)
    assert [("lookup_error", [("s", MODEL, 3)])] == [
        (e.fields["reason"], e.salt_counts) for e in batch.events([E.L2_PREFETCH_FAILED])]
