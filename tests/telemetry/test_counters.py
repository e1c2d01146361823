"""Table-driven counters: L1 counters, eviction loop, failures, timeouts, lookups, chunks loaded."""

from __future__ import annotations

from mpcache.contract.events import EventType as E
from mpcache.telemetry.cardinality import OVERFLOW_SALT
from mpcache.telemetry.metric_table import SECTIONS_BY_KEY
from mpcache.telemetry.subscribers.metrics.counters import TableCountersSubscriber


def test_l1_counters_sum_salt_counts_per_cache_salt(pipeline, metrics):
    """l1_read/l1_write/l1_evicted add every event's salt_counts per cache_salt; both write events are writes."""
    pipeline.subscribe(TableCountersSubscriber(metrics.meter, SECTIONS_BY_KEY["L1"], salt_cap=10))
    pipeline.publish(E.L1_WRITE_FINISHED, salt_counts={("a", "llama"): 16, ("b", "llama"): 2})
    pipeline.publish(E.L1_WRITE_FINISHED_AND_READ_RESERVED, salt_counts={("a", "qwen"): 4})
    pipeline.publish(E.L1_READ_FINISHED, salt_counts={("a", "llama"): 7})
    pipeline.publish(E.L1_KEYS_EVICTED, salt_counts={("b", "llama"): 3})
    pipeline.publish(E.L1_READ_RESERVED, salt_counts={("a", "llama"): 100})  # no metric
    pipeline.deliver()
    assert ({frozenset({("cache_salt", "a")}): 20, frozenset({("cache_salt", "b")}): 2},
            {frozenset({("cache_salt", "a")}): 7},
            {frozenset({("cache_salt", "b")}): 3}) == (
        metrics.series("lmcache_mp.l1_write"), metrics.series("lmcache_mp.l1_read"),
        metrics.series("lmcache_mp.l1_evicted"))


def test_salts_beyond_the_cap_are_counted_as_overflow(pipeline, metrics):
    """With a cap of 1, a second salt's chunks are still counted, under cache_salt=__overflow__."""
    pipeline.subscribe(TableCountersSubscriber(metrics.meter, SECTIONS_BY_KEY["L1"], salt_cap=1))
    pipeline.publish(E.L1_READ_FINISHED, salt_counts={("a", "m"): 1})
    pipeline.deliver()
    pipeline.publish(E.L1_READ_FINISHED, salt_counts={("b", "m"): 5, ("c", "m"): 6, ("a", "m"): 2})
    pipeline.deliver()
    assert {frozenset({("cache_salt", "a")}): 3, frozenset({("cache_salt", OVERFLOW_SALT)}): 11} == metrics.series(
        "lmcache_mp.l1_read")


def test_one_add_per_attribute_set_per_batch(pipeline, counting_meter):
    """500 write events over two salts reach OTel as exactly two adds, one per salt."""
    meter = counting_meter
    pipeline.subscribe(TableCountersSubscriber(meter, SECTIONS_BY_KEY["L1"], salt_cap=10))
    for i in range(500):
        pipeline.publish(E.L1_WRITE_FINISHED, salt_counts={("a" if i % 2 else "b", "m"): 1})
    pipeline.deliver()
    assert [(250, {"cache_salt": "a"}), (250, {"cache_salt": "b"})] == sorted(
        meter.counters["lmcache_mp.l1_write"].calls, key=lambda call: call[1]["cache_salt"])


def test_eviction_loop_counters_start_at_zero_and_count_ticks_and_triggers(pipeline, metrics):
    """Both loop counters are exported as 0 before any tick; then +1 per tick and +1 per triggered tick."""
    pipeline.subscribe(TableCountersSubscriber(metrics.meter, SECTIONS_BY_KEY["L1"]))
    before = (metrics.value("lmcache_mp.l1_eviction_loop_ticks"),
              metrics.value("lmcache_mp.l1_eviction_loop_triggered"))
    for triggered in (True, False, True, False, False):
        pipeline.publish(E.L1_EVICTION_LOOP_TICK, (0.9 if triggered else 0.5, 0.8, triggered))
    pipeline.deliver()
    after = (metrics.value("lmcache_mp.l1_eviction_loop_ticks"), metrics.value("lmcache_mp.l1_eviction_loop_triggered"))
    assert ((0, 0), (5, 2)) == (before, after)


def test_failure_counters_group_by_fields_and_model(pipeline, metrics):
    """Allocation failures count chunks by (during, model_name); read failures by (during, reason, model_name)."""
    pipeline.subscribe(TableCountersSubscriber(metrics.meter, SECTIONS_BY_KEY["L1Failures"]))
    pipeline.publish(E.L1_ALLOCATION_FAILED, ("l1_store",), salt_counts={("a", "llama"): 3, ("b", "llama"): 1})
    pipeline.publish(E.L1_ALLOCATION_FAILED, ("l2_prefetch",), salt_counts={("a", "qwen"): 2})
    pipeline.publish(E.L1_READ_FAILED, ("l1_retrieve", "not_found"), salt_counts={("a", "llama"): 5})
    pipeline.deliver()
    assert ({frozenset({("during", "l1_store"), ("model_name", "llama")}): 4,
             frozenset({("during", "l2_prefetch"), ("model_name", "qwen")}): 2},
            {frozenset({("during", "l1_retrieve"), ("reason", "not_found"), ("model_name", "llama")}): 5}) == (
        metrics.series("lmcache_mp.l1_allocation_failure"), metrics.series("lmcache_mp.l1_read_failure"))


def test_timeouts_count_events_per_exception_type(pipeline, metrics):
    """Each TIMEOUT_RAISED adds one under its exception_type."""
    pipeline.subscribe(TableCountersSubscriber(metrics.meter, SECTIONS_BY_KEY["L1Failures"]))
    for exception_type in ("L2Timeout", "TransferTimeout", "L2Timeout"):
        pipeline.publish(E.TIMEOUT_RAISED, (exception_type,), texts=("slow", "trace"))
    pipeline.deliver()
    assert {frozenset({("exception_type", "L2Timeout")}): 2,
            frozenset({("exception_type", "TransferTimeout")}): 1} == metrics.series("lmcache_mp.timeouts")


def test_lookup_counters_sum_tokens_per_model_and_salt(pipeline, metrics):
    """requested, hit, hit_l1, hit_l2, prompt and request-hit tokens are summed per (model_name, cache_salt)."""
    pipeline.subscribe(*(TableCountersSubscriber(metrics.meter, SECTIONS_BY_KEY[key], salt_cap=10)
                         for key in ("Lookup", "LookupTiers", "LookupRequests")))
    pipeline.publish(E.MP_LOOKUP_PREFETCH_END, ("llama", "a", 3, 1024, 768, 512, 256, "", 1100, 768, 2, 1))
    pipeline.publish(E.MP_LOOKUP_PREFETCH_END, ("llama", "a", 1, 512, 256, 256, 0, "", 800, 512, 1, 0))
    pipeline.publish(E.MP_LOOKUP_PREFETCH_END, ("qwen", "b", 0, 0, 0, 0, 0, "no_context", 100, 0, 0, 0))
    pipeline.deliver()
    llama_a = frozenset({("model_name", "llama"), ("cache_salt", "a")})
    qwen_b = frozenset({("model_name", "qwen"), ("cache_salt", "b")})
    assert ([{llama_a: 1536, qwen_b: 0}, {llama_a: 1024, qwen_b: 0}, {llama_a: 768, qwen_b: 0},
             {llama_a: 256, qwen_b: 0}, {llama_a: 1900, qwen_b: 100}, {llama_a: 1280, qwen_b: 0}]) == [
        metrics.series(f"lmcache_mp.{name}") for name in ("lookup_requested", "lookup_hit", "lookup_hit_l1",
                                                         "lookup_hit_l2", "lookup_prompt", "lookup_request_hit")]


def test_chunks_loaded_counts_positive_retrieves_by_worker(pipeline, metrics):
    """num_chunks_loaded adds retrieved_count per (engine_id as worker_id, model, salt), skipping zero retrieves."""
    pipeline.subscribe(TableCountersSubscriber(metrics.meter, SECTIONS_BY_KEY["Engine"], salt_cap=10))
    pipeline.publish(E.MP_RETRIEVE_END, ("cuda:0", 7, "llama", "a", 4, 4096, 1024), session_id="r1")
    pipeline.publish(E.MP_RETRIEVE_END, ("cuda:0", 7, "llama", "a", 2, 2048, 512), session_id="r2")
    pipeline.publish(E.MP_RETRIEVE_END, ("cuda:1", 8, "llama", "a", 0, 0, 0), session_id="r3")
    pipeline.deliver()
    assert {frozenset({("worker_id", "7"), ("model_name", "llama"), ("cache_salt", "a")}): 6} == metrics.series(
        "lmcache_mp.num_chunks_loaded")


def test_lmcaches_own_series_count_lookups_hit_objects_and_transfers(pipeline, metrics):
    """The Compatibility section: completed lookups and their hit objects per (model, salt), L2 evictions in all,
    transfers begun and ended per device."""
    pipeline.subscribe(TableCountersSubscriber(metrics.meter, SECTIONS_BY_KEY["Compatibility"], salt_cap=10))
    pipeline.publish(E.MP_LOOKUP_PREFETCH_END, ("llama", "a", 3, 1024, 768, 512, 256, "", 1100, 768, 4, 2))
    pipeline.publish(E.MP_LOOKUP_PREFETCH_END, ("llama", "a", 0, 512, 0, 0, 0, "", 600, 0, 0, 0))
    pipeline.publish(E.L2_KEYS_EVICTED, (0, "fs", 5), salt_counts={("a", "llama"): 3, ("b", "llama"): 2})
    for device in ("cpu:0", "cpu:1", "cpu:0"):
        pipeline.publish(E.MP_STORE_SUBMITTED, (device,), session_id="s")
        pipeline.publish(E.MP_RETRIEVE_SUBMITTED, (device,), session_id="r")
    pipeline.publish(E.MP_STORE_END, ("cpu:1", 7, "llama", 0, 0, 0), session_id="s")
    pipeline.publish(E.MP_RETRIEVE_END, ("cpu:0", 7, "llama", "a", 2, 2, 512), session_id="r")
    pipeline.deliver()
    llama_a = frozenset({("model_name", "llama"), ("cache_salt", "a")})
    cpu0, cpu1 = frozenset({("device", "cpu:0")}), frozenset({("device", "cpu:1")})
    assert [{llama_a: 2}, {llama_a: 4}, {llama_a: 2}, {frozenset(): 5}, {cpu0: 2, cpu1: 1}, {cpu1: 1},
            {cpu0: 2, cpu1: 1}, {cpu0: 1}] == [
        metrics.series(f"lmcache_mp.{name}") for name in (
            "lookups", "lookup_hit_l1_keys", "lookup_hit_l2_keys", "l2_evicted_objects", "num_submitted_stores",
            "num_finished_stores", "num_submitted_retrieves", "num_finished_retrieves")]
