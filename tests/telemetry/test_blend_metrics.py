"""Cache-blending counters: each lmcache_blend.* metric from its source events, as column sums."""

from __future__ import annotations

from mpcache.contract.events import EventType as E
from mpcache.telemetry import metric_table
from mpcache.telemetry.metric_table import SECTIONS_BY_KEY
from mpcache.telemetry.subscribers.metrics.counters import TableCountersSubscriber

BLEND_METRICS = [spec.otel_name for spec in metric_table.METRICS if spec.otel_name.startswith("lmcache_blend.")]


def publish_script(pipeline) -> None:
    """Three lookups (two finished, one without GPU context), two retrieves (one failed), two pre-computed
    stores (one failed), one final store, two fingerprint registrations and one eviction."""
    publish = pipeline.publish
    for session in ("r1", "r2", "r3"):
        publish(E.CB_LOOKUP_START, (512,), session_id=session)
    publish(E.CB_LOOKUP_END, (512, 512, 256, 4, 3, 1, False), session_id="r1")
    publish(E.CB_LOOKUP_END, (300, 256, 0, 0, 0, 0, True), session_id="r2")
    publish(E.CB_RETRIEVE_START, (1, 4, 0), session_id="r1")
    publish(E.CB_RETRIEVE_START, (1, 6, -1), session_id="r2")
    publish(E.CB_RETRIEVE_END, (1, 4, True, 0), session_id="r1")
    publish(E.CB_RETRIEVE_END, (1, 6, False, -1), session_id="r2")
    publish(E.CB_STORE_PRE_COMPUTED_START, (1, 256), session_id="r1")
    publish(E.CB_STORE_PRE_COMPUTED_START, (1, 512), session_id="r2")
    publish(E.CB_STORE_PRE_COMPUTED_END, (1, 256, 2, True), session_id="r1")
    publish(E.CB_STORE_PRE_COMPUTED_END, (1, 512, 0, False), session_id="r2")
    publish(E.CB_STORE_FINAL_START, (1, 512), session_id="r1")
    publish(E.CB_STORE_FINAL_END, (1, 512, 4, True), session_id="r1")
    publish(E.CB_FINGERPRINTS_REGISTERED, (3, 768))
    publish(E.CB_FINGERPRINTS_REGISTERED, (2, 512))
    publish(E.CB_CHUNKS_EVICTED, (7,))
    publish(E.CB_REQUEST_END, session_id="r1")  # no metric


def test_every_blend_counter_from_its_source_events(pipeline, metrics):
    """Requests count STARTs; lookup tokens/hits/stale sum LOOKUP_END; failures count success=false ENDs."""
    pipeline.subscribe(TableCountersSubscriber(metrics.meter, SECTIONS_BY_KEY["Blend"]))
    publish_script(pipeline)
    pipeline.deliver()
    expected = {
        "lookup_requests": 3, "lookup_requested_tokens": 768, "lookup_hit_tokens": 256,
        "lookup_fingerprint_hits": 4, "lookup_storage_hits": 3, "lookup_stale_chunks": 1,
        "lookup_no_gpu_context_errors": 1, "retrieve_requests": 2, "retrieve_chunks": 10, "retrieve_failures": 1,
        "store_pre_computed_requests": 2, "store_pre_computed_chunks": 2, "store_pre_computed_failures": 1,
        "store_final_requests": 1, "store_final_chunks": 4, "store_final_failures": 0,
        "fingerprints_registered": 5, "chunks_evicted": 7,
    }
    assert expected == {name: metrics.value(f"lmcache_blend.{name}") for name in expected}


def test_all_eighteen_counters_read_zero_from_start_up(metrics):
    """Before any event, every lmcache_blend counter of the table is exported, unlabelled, as 0."""
    TableCountersSubscriber(metrics.meter, SECTIONS_BY_KEY["Blend"])
    assert (18, {name: {frozenset(): 0} for name in BLEND_METRICS}) == (
        len(BLEND_METRICS), {name: metrics.series(name) for name in BLEND_METRICS})


def test_counts_accumulate_across_batches(pipeline, metrics):
    """The same script delivered twice doubles every counter (5 → 10 fingerprints, 3 → 6 lookups)."""
    pipeline.subscribe(TableCountersSubscriber(metrics.meter, SECTIONS_BY_KEY["Blend"]))
    publish_script(pipeline)
    pipeline.deliver()
    publish_script(pipeline)
    pipeline.deliver()
    assert (10, 6) == (metrics.value("lmcache_blend.fingerprints_registered"),
                       metrics.value("lmcache_blend.lookup_requests"))


class _CountingCounter:
    def __init__(self):
        self.calls = []

    def add(self, amount, attributes=None):
        self.calls.append(amount)


class _CountingMeter:
    def __init__(self):
        self.counters = {}

    def create_counter(self, name, unit="", description=""):
        return self.counters.setdefault(name, _CountingCounter())


def test_one_add_per_metric_per_batch_and_none_for_zero(pipeline):
    """100 failed retrieves in one batch reach OTel as one add of 100 (after the start-up 0); metrics the batch
    does not move get no add."""
    meter = _CountingMeter()
    pipeline.subscribe(TableCountersSubscriber(meter, SECTIONS_BY_KEY["Blend"]))
    for _ in range(100):
        pipeline.publish(E.CB_RETRIEVE_END, (1, 4, False, 0))
    pipeline.deliver()
    assert ([0, 100], [0]) == (meter.counters["lmcache_blend.retrieve_failures"].calls,
                               meter.counters["lmcache_blend.retrieve_requests"].calls)
