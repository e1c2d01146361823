"""L2 counters: store tasks, prefetch lookups and loads, evictions and prefetch failures."""

from __future__ import annotations

from mpcache.contract.events import EventType as E
from mpcache.telemetry.cardinality import OVERFLOW_SALT
from mpcache.telemetry.metric_table import SECTIONS_BY_KEY
from mpcache.telemetry.subscribers.metrics.counters import TableCountersSubscriber


def salt(name: str) -> frozenset:
    return frozenset({("cache_salt", name)})


def l2(name: str) -> frozenset:
    return frozenset({("l2_name", name)})


UNLABELLED = frozenset()


def test_store_counters_count_tasks_and_chunks(pipeline, metrics):
    """Store tasks count +1 per event, per l2_name once completed — only those that stored every chunk: one
    with a failed chunk counts as failed, never as completed; chunks sum salt_counts per cache_salt (stored
    ones once completed) and failed_count per l2_name."""
    pipeline.subscribe(TableCountersSubscriber(metrics.meter, SECTIONS_BY_KEY["L2"], salt_cap=10))
    pipeline.subscribe(TableCountersSubscriber(metrics.meter, SECTIONS_BY_KEY["L2Outcomes"]))
    pipeline.publish(E.L2_STORE_SUBMITTED, (0, 1, "fs", 7, 7000), salt_counts={("a", "llama"): 4, ("b", "llama"): 3})
    pipeline.publish(E.L2_STORE_SUBMITTED, (1, 1, "mock", 2, 2000), salt_counts={("a", "qwen"): 2})
    pipeline.publish(E.L2_STORE_COMPLETED, (0, 1, "fs", 6000, 6, 1), salt_counts={("a", "llama"): 4, ("b", "llama"): 2})
    pipeline.publish(E.L2_STORE_COMPLETED, (1, 1, "mock", 2000, 2, 0), salt_counts={("a", "qwen"): 2})
    pipeline.publish(E.L2_STORE_COMPLETED, (2, 5, "fs", 0, 0, 3))  # a failed task: no succeeded keys
    pipeline.deliver()
    assert ({UNLABELLED: 2}, {salt("a"): 6, salt("b"): 3}, {l2("fs"): 0, l2("mock"): 1},
            {salt("a"): 6, salt("b"): 2}) == (
        metrics.series("lmcache_mp.l2_store_submitted"), metrics.series("lmcache_mp.l2_store_submitted_objects"),
        metrics.series("lmcache_mp.l2_store_completed"), metrics.series("lmcache_mp.l2_store_completed_objects"))
    assert ({l2("fs"): 2, l2("mock"): 0}, {l2("fs"): 4, l2("mock"): 0}) == (
        metrics.series("mpcache.l2_store_failed"), metrics.series("mpcache.l2_store_failed_chunks"))


def test_prefetch_counters_follow_the_reference_calculations(pipeline, metrics):
    """Lookups +1 each, hits +prefix_hit_count, load submissions +adapter_count, chunks per salt, tasks per l2_name
    (a load task with a failed chunk as failed, not completed)."""
    pipeline.subscribe(TableCountersSubscriber(metrics.meter, SECTIONS_BY_KEY["L2"], salt_cap=10))
    pipeline.subscribe(TableCountersSubscriber(metrics.meter, SECTIONS_BY_KEY["L2Outcomes"]))
    pipeline.publish(E.L2_PREFETCH_LOOKUP_SUBMITTED, (1, 8, 2), salt_counts={("a", "m"): 8})
    pipeline.publish(E.L2_PREFETCH_LOOKUP_SUBMITTED, (2, 5, 2), salt_counts={("b", "m"): 5})
    pipeline.publish(E.L2_PREFETCH_LOOKUP_COMPLETED, (1, 6))
    pipeline.publish(E.L2_PREFETCH_LOOKUP_COMPLETED, (2, 0))
    pipeline.publish(E.L2_PREFETCH_LOAD_SUBMITTED, (1, 6, 2), salt_counts={("a", "m"): 6})
    pipeline.publish(E.L2_LOAD_TASK_SUBMITTED, (1, 0, 10, "fs", 4, 4096))
    pipeline.publish(E.L2_LOAD_TASK_SUBMITTED, (1, 1, 11, "mock", 2, 2048))
    pipeline.publish(E.L2_LOAD_TASK_COMPLETED, (1, 0, 10, "fs", 4, 0))
    pipeline.publish(E.L2_LOAD_TASK_COMPLETED, (1, 1, 11, "mock", 1, 1))
    pipeline.publish(E.L2_PREFETCH_LOAD_COMPLETED, (1, 5, 1), salt_counts={("a", "m"): 5})
    pipeline.deliver()
    assert ({UNLABELLED: 2}, {salt("a"): 8, salt("b"): 5}, {UNLABELLED: 6}, {UNLABELLED: 2}, {salt("a"): 6},
            {salt("a"): 5}, {l2("fs"): 1, l2("mock"): 0}) == tuple(metrics.series(f"lmcache_mp.{name}") for name in (
                "l2_prefetch_lookup", "l2_prefetch_lookup_objects", "l2_prefetch_hit", "l2_prefetch_load_submitted",
                "l2_prefetch_load_submitted_objects", "l2_prefetch_load_completed", "l2_load_completed"))
    assert ({l2("fs"): 0, l2("mock"): 1}, {l2("fs"): 0, l2("mock"): 1}) == (
        metrics.series("mpcache.l2_load_failed"), metrics.series("mpcache.l2_load_failed_chunks"))


def test_evictions_count_chunks_per_salt(pipeline, metrics):
    """l2_evicted sums L2_KEYS_EVICTED salt_counts per cache_salt over adapters and models."""
    pipeline.subscribe(TableCountersSubscriber(metrics.meter, SECTIONS_BY_KEY["L2"], salt_cap=10))
    pipeline.publish(E.L2_KEYS_EVICTED, (0, "fs", 3), salt_counts={("a", "llama"): 3})
    pipeline.publish(E.L2_KEYS_EVICTED, (1, "mock", 5), salt_counts={("a", "qwen"): 1, ("b", "qwen"): 4})
    pipeline.deliver()
    assert {salt("a"): 4, salt("b"): 4} == metrics.series("lmcache_mp.l2_evicted")


def test_chunk_counters_cap_salts_per_metric(pipeline, metrics):
    """With a cap of 1, a second salt's evicted chunks are counted under __overflow__."""
    pipeline.subscribe(TableCountersSubscriber(metrics.meter, SECTIONS_BY_KEY["L2"], salt_cap=1))
    pipeline.publish(E.L2_KEYS_EVICTED, (0, "fs", 3), salt_counts={("a", "m"): 3})
    pipeline.deliver()
    pipeline.publish(E.L2_KEYS_EVICTED, (0, "fs", 9), salt_counts={("b", "m"): 2, ("c", "m"): 7})
    pipeline.deliver()
    assert {salt("a"): 3, salt(OVERFLOW_SALT): 9} == metrics.series("lmcache_mp.l2_evicted")


def test_task_counters_are_zero_from_start_up(metrics):
    """Before any event the unlabelled counters and the per-l2_name ones of configured adapters read 0."""
    TableCountersSubscriber(metrics.meter, SECTIONS_BY_KEY["L2"], salt_cap=10, l2_names=["fs", "mock", "fs"])
    assert ({UNLABELLED: 0}, {UNLABELLED: 0}, {UNLABELLED: 0}, {UNLABELLED: 0}, {l2("fs"): 0, l2("mock"): 0},
            {l2("fs"): 0, l2("mock"): 0}) == tuple(metrics.series(f"lmcache_mp.{name}") for name in (
                "l2_store_submitted", "l2_prefetch_lookup", "l2_prefetch_hit", "l2_prefetch_load_submitted",
                "l2_store_completed", "l2_load_completed"))


def test_one_add_per_attribute_set_per_batch(pipeline, counting_meter):
    """300 completed store tasks over two adapter types reach OTel as one add per l2_name, after the start-up 0s."""
    meter = counting_meter
    pipeline.subscribe(TableCountersSubscriber(meter, SECTIONS_BY_KEY["L2"], salt_cap=10, l2_names=["fs"]))
    for task in range(300):
        pipeline.publish(E.L2_STORE_COMPLETED, (task % 2, task, "fs" if task % 2 else "mock", 10, 1, 0))
    pipeline.deliver()
    assert [(0, {"l2_name": "fs"}), (150, {"l2_name": "fs"}), (150, {"l2_name": "mock"})] == sorted(
        meter.counters["lmcache_mp.l2_store_completed"].calls, key=lambda call: (call[1]["l2_name"], call[0]))


def test_prefetch_failures_count_chunks_per_reason_and_model(pipeline, metrics):
    """l2_prefetch_failure adds each event's chunks per (reason, model_name), over salts."""
    pipeline.subscribe(TableCountersSubscriber(metrics.meter, SECTIONS_BY_KEY["L2Failures"]))
    pipeline.publish(E.L2_PREFETCH_FAILED, ("l1_oom",), salt_counts={("a", "llama"): 3, ("b", "llama"): 2})
    pipeline.publish(E.L2_PREFETCH_FAILED, ("not_found",), salt_counts={("a", "llama"): 1, ("a", "qwen"): 4})
    pipeline.publish(E.L2_PREFETCH_FAILED, ("l1_oom",), salt_counts={("c", "llama"): 1})
    pipeline.deliver()
    assert {frozenset({("reason", "l1_oom"), ("model_name", "llama")}): 6,
            frozenset({("reason", "not_found"), ("model_name", "llama")}): 1,
            frozenset({("reason", "not_found"), ("model_name", "qwen")}): 4} == metrics.series(
        "lmcache_mp.l2_prefetch_failure")
