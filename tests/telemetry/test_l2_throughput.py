"""L2 throughput: store pairs on (adapter_index, task_id) with the written bytes, load pairs on
(request_id, adapter_index) with the submitted bytes, the drop rules, and bounded pending state."""

from __future__ import annotations

from mpcache.contract.events import EventType as E
from mpcache.telemetry.batch import EventBatch
from mpcache.telemetry.subscribers.metrics.l2_throughput import L2ThroughputSubscriber

T0 = 1_700_000_000 * 10**9
MS = 10**6
GB = 10**9
STORE = "lmcache_mp.l2_store_throughput"
LOAD = "lmcache_mp.l2_load_throughput"


def submit_store(pipeline, adapter, task, at_ms, total_bytes=4 * GB, name="fs"):
    pipeline.publish(E.L2_STORE_SUBMITTED, (adapter, task, name, 8, total_bytes), salt_counts={("a", "m"): 8},
                     timestamp_ns=T0 + at_ms * MS)


def complete_store(pipeline, adapter, task, at_ms, written, name="fs"):
    pipeline.publish(E.L2_STORE_COMPLETED, (adapter, task, name, written, 8, 0), salt_counts={("a", "m"): 8},
                     timestamp_ns=T0 + at_ms * MS)


def test_store_throughput_is_written_bytes_over_submit_to_complete_time(pipeline, metrics):
    """4 GB submitted but 1 GB written (the rest already present) in 500 ms is 2 GB/s, not 8."""
    pipeline.subscribe(L2ThroughputSubscriber(metrics.meter))
    submit_store(pipeline, 0, 7, 0)
    pipeline.deliver()
    complete_store(pipeline, 0, 7, 500, 1 * GB)
    pipeline.deliver()
    assert (1, 2.0) == metrics.histogram_values(STORE, l2_name="fs")


def test_store_tasks_pair_on_adapter_and_task_id(pipeline, metrics):
    """Task 7 on adapters 0 and 1 are two tasks: 1 GB in 1 s (fs) and 1 GB in 250 ms (mock), completed out of order."""
    pipeline.subscribe(L2ThroughputSubscriber(metrics.meter))
    submit_store(pipeline, 0, 7, 0)
    submit_store(pipeline, 1, 7, 0, name="mock")
    complete_store(pipeline, 1, 7, 250, 1 * GB, name="mock")
    complete_store(pipeline, 0, 7, 1000, 1 * GB)
    pipeline.deliver()
    assert ((1, 1.0), (1, 4.0)) == (metrics.histogram_values(STORE, l2_name="fs"),
                                    metrics.histogram_values(STORE, l2_name="mock"))


def test_store_samples_without_written_bytes_or_pair_or_duration_are_dropped(pipeline, metrics):
    """0 bytes written, negative bytes, a COMPLETED without SUBMITTED and a zero duration all record nothing."""
    pipeline.subscribe(L2ThroughputSubscriber(metrics.meter))
    submit_store(pipeline, 0, 1, 0)
    complete_store(pipeline, 0, 1, 100, 0)
    submit_store(pipeline, 0, 2, 0)
    complete_store(pipeline, 0, 2, 100, -5)
    complete_store(pipeline, 0, 3, 100, 1 * GB)
    submit_store(pipeline, 0, 4, 100)
    complete_store(pipeline, 0, 4, 100, 1 * GB)
    pipeline.deliver()
    assert {} == metrics.series(STORE)


def test_load_throughput_pairs_on_request_and_adapter_with_submitted_bytes(pipeline, metrics):
    """Request 5 loads 1 GB from adapter 0 in 250 ms (4 GB/s) and 2 GB from adapter 1 in 1 s (2 GB/s)."""
    pipeline.subscribe(L2ThroughputSubscriber(metrics.meter))
    pipeline.publish(E.L2_LOAD_TASK_SUBMITTED, (5, 0, 10, "fs", 4, 1 * GB), timestamp_ns=T0)
    pipeline.publish(E.L2_LOAD_TASK_SUBMITTED, (5, 1, 11, "mock", 8, 2 * GB), timestamp_ns=T0)
    pipeline.deliver()
    pipeline.publish(E.L2_LOAD_TASK_COMPLETED, (5, 1, 11, "mock", 8, 0), timestamp_ns=T0 + 1000 * MS)
    pipeline.publish(E.L2_LOAD_TASK_COMPLETED, (5, 0, 10, "fs", 3, 1), timestamp_ns=T0 + 250 * MS)
    pipeline.deliver()
    assert ((1, 4.0), (1, 2.0)) == (metrics.histogram_values(LOAD, l2_name="fs"),
                                    metrics.histogram_values(LOAD, l2_name="mock"))


def test_load_samples_without_bytes_or_pair_are_dropped(pipeline, metrics):
    """A load of 0 submitted bytes and a COMPLETED whose request never submitted to that adapter record nothing."""
    pipeline.subscribe(L2ThroughputSubscriber(metrics.meter))
    pipeline.publish(E.L2_LOAD_TASK_SUBMITTED, (5, 0, 10, "fs", 0, 0), timestamp_ns=T0)
    pipeline.publish(E.L2_LOAD_TASK_COMPLETED, (5, 0, 10, "fs", 0, 0), timestamp_ns=T0 + 100 * MS)
    pipeline.publish(E.L2_LOAD_TASK_SUBMITTED, (6, 0, 12, "fs", 4, GB), timestamp_ns=T0)
    pipeline.publish(E.L2_LOAD_TASK_COMPLETED, (6, 1, 12, "fs", 4, 0), timestamp_ns=T0 + 100 * MS)
    pipeline.deliver()
    assert {} == metrics.series(LOAD)


def test_same_task_in_two_cache_processes_pairs_per_producer(pipeline, metrics):
    """Producers 0 and 1 both run task 7 on adapter 0: each COMPLETED pairs with its own process's SUBMITTED."""
    subscriber = L2ThroughputSubscriber(metrics.meter)
    ring = pipeline.ring

    def deliver_as(producer):
        subscriber.on_batch(EventBatch(producer, ring.reader.read_batch(), ring.names))

    submit_store(pipeline, 0, 7, 0)
    deliver_as(0)
    submit_store(pipeline, 0, 7, 500)
    deliver_as(1)
    complete_store(pipeline, 0, 7, 1000, 1 * GB)
    deliver_as(0)
    complete_store(pipeline, 0, 7, 1000, 1 * GB)
    deliver_as(1)
    point = metrics.series(STORE)[frozenset({("l2_name", "fs")})]
    assert (2, 1.0 + 2.0) == (point.count, point.sum)


def test_submissions_without_completion_expire_on_tick(pipeline, metrics):
    """A SUBMITTED older than the TTL is forgotten at the next tick, so its late COMPLETED records nothing."""
    subscriber = L2ThroughputSubscriber(metrics.meter, pending_ttl_s=60)
    pipeline.subscribe(subscriber)
    submit_store(pipeline, 0, 1, 0)
    pipeline.publish(E.L2_LOAD_TASK_SUBMITTED, (5, 0, 2, "fs", 4, GB), timestamp_ns=T0 + 30_000 * MS)
    pipeline.deliver()
    pipeline.bus.tick(T0 + 60_000 * MS)
    pending_after_tick = subscriber.pending
    complete_store(pipeline, 0, 1, 61_000, 1 * GB)
    pipeline.deliver()
    assert (1, {}) == (pending_after_tick, metrics.series(STORE))


def test_pending_submissions_are_bounded(pipeline, metrics):
    """With max_pending=3, ten store submissions without completion leave three pending."""
    subscriber = L2ThroughputSubscriber(metrics.meter, max_pending=3)
    pipeline.subscribe(subscriber)
    for task in range(10):
        submit_store(pipeline, 0, task, task)
    pipeline.deliver()
    assert 3 == subscriber.pending
