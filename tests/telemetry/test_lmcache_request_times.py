"""``mpcache.lmcache.request``: service times counted in the cache process (RequestTimes), carried by
LMCACHE_REQUEST_TIMES events through a real ring, added to the histogram — the same data point as recording
every sample with the SDK, on edges and between them."""

from __future__ import annotations

import random

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from mpcache.cache.lmcache.timing import RequestTimes
from mpcache.contract.events import EventType as E
from mpcache.contract.request_times import BUCKET_FIELDS, BUCKETS_NS, BUCKETS_S
from mpcache.telemetry import histograms
from mpcache.telemetry.buffered import BufferedMeter, InstrumentBuffer
from mpcache.telemetry.subscribers.metrics.lmcache_requests import MAX_OPS, LMCacheRequestTimesSubscriber

NAME = "mpcache.lmcache.request"
# on every edge, one past it, one short of it, the extremes of the grid, and random values (ns)
SAMPLES = sorted({*BUCKETS_NS, *(e + 1 for e in BUCKETS_NS), *(e - 1 for e in BUCKETS_NS), 1, 3_000_000_000,
                  *random.Random(7).sample(range(1, 2_000_000_000), 200)})


def _point(metrics, **attributes):
    return metrics.series(NAME)[frozenset(attributes.items())]


def _expected(values_ns: list[int]) -> tuple:
    """The data point of recording each sample (seconds) with the SDK itself."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    histogram = provider.get_meter("t").create_histogram(NAME, explicit_bucket_boundaries_advisory=BUCKETS_S)
    for value in values_ns:
        histogram.record(value / 1e9, {"op": "x"})
    (point,) = reader.get_metrics_data().resource_metrics[0].scope_metrics[0].metrics[0].data.data_points
    provider.shutdown()
    return point.count, point.sum, point.min, point.max, list(point.bucket_counts)


def _as_tuple(point) -> tuple:
    return point.count, point.sum, point.min, point.max, list(point.bucket_counts)


def test_counted_times_reach_the_histogram_as_if_each_sample_were_recorded(pipeline, metrics):
    """Samples on, beside and between the edges, recorded by RequestTimes for two operations, flushed twice,
    through the ring in two batches, held by the buffered meter until its flush: counts per bucket, count,
    min and max are those of per-sample recording, and the sum agrees to float rounding (it is added in
    one step)."""
    buffer = InstrumentBuffer()
    subscriber = LMCacheRequestTimesSubscriber(BufferedMeter(metrics.meter, buffer))
    pipeline.subscribe(subscriber)
    times = RequestTimes(pipeline.ring.publisher)
    lookups, stores = SAMPLES[::2], SAMPLES[1::2]
    for value in lookups[:50]:
        times.record("lookup", value)
    times.flush()
    assert 1 == pipeline.deliver()
    for value in lookups[50:]:
        times.record("lookup", value)
    for value in stores:
        times.record("prepare_store", value)
    times.flush()
    times.flush()  # nothing new: no event
    assert 2 == pipeline.deliver()
    assert {} == metrics.series(NAME)  # merged in the buffer, not yet in the SDK
    buffer.flush()
    for op, values in (("lookup", lookups), ("prepare_store", stores)):
        count, total, low, high, buckets = _as_tuple(_point(metrics, op=op))
        want_count, want_sum, want_low, want_high, want_buckets = _expected(values)
        assert (count, low, high, buckets) == (want_count, want_low, want_high, want_buckets)
        assert abs(total - want_sum) < 1e-9 * want_count
    assert 0 == subscriber.rejected
    assert histograms._fast_path_ok  # the counts were added, not replayed sample by sample


def test_one_sample_and_two_samples_keep_exact_extremes(pipeline, metrics):
    pipeline.subscribe(LMCacheRequestTimesSubscriber(metrics.meter))
    times = RequestTimes(pipeline.ring.publisher)
    times.record("ping", 40_000)
    times.record("noop", 100_000)
    times.record("noop", 100_001)
    times.flush()
    pipeline.deliver()
    assert _as_tuple(_point(metrics, op="ping")) == _expected([40_000])
    assert _as_tuple(_point(metrics, op="noop")) == _expected([100_000, 100_001])


def test_events_whose_numbers_do_not_add_up_are_rejected(pipeline, metrics):
    """A producer's (or a corrupt ring's) event whose counts disagree with its count, or whose extremes are
    inverted or negative, records nothing and is counted."""
    subscriber = LMCacheRequestTimesSubscriber(metrics.meter)
    pipeline.subscribe(subscriber)
    buckets = [0] * len(BUCKET_FIELDS)
    buckets[3] = 2
    for fields in (("lookup", 3, 10, 1, 5, *buckets), ("lookup", 2, 10, 6, 5, *buckets),
                   ("lookup", 2, 10, -1, 5, *buckets), ("lookup", 0, 0, 0, 0, *[0] * len(BUCKET_FIELDS))):
        pipeline.publish(E.LMCACHE_REQUEST_TIMES, fields)
    pipeline.deliver()
    assert (4, {}) == (subscriber.rejected, metrics.series(NAME))


def test_op_values_past_the_cap_are_reported_as_overflow(pipeline, metrics):
    pipeline.subscribe(LMCacheRequestTimesSubscriber(metrics.meter))
    times = RequestTimes(pipeline.ring.publisher)
    for index in range(MAX_OPS + 3):
        times.record(f"op{index}", 1000)
    times.flush()
    pipeline.deliver()
    series = metrics.series(NAME)
    assert MAX_OPS + 1 == len(series)
    assert 3 == series[frozenset({("op", "__overflow__")})].count


def test_the_fallback_keeps_counts_and_extremes(monkeypatch, pipeline, metrics):
    """Where the SDK internals do not fit, each sample is recorded at its bucket's upper edge (held to the
    extremes): every bucket count, the count, min and max still agree."""
    monkeypatch.setattr(histograms, "_add_counts", lambda *args: False)
    monkeypatch.setattr(histograms, "_fast_path_ok", True)
    pipeline.subscribe(LMCacheRequestTimesSubscriber(metrics.meter))
    times = RequestTimes(pipeline.ring.publisher)
    for value in SAMPLES:
        times.record("lookup", value)
    times.flush()
    pipeline.deliver()
    count, _, low, high, buckets = _as_tuple(_point(metrics, op="lookup"))
    want = _expected(SAMPLES)
    assert (count, low, high, buckets) == (want[0], want[2], want[3], want[4])
    assert not histograms._fast_path_ok
