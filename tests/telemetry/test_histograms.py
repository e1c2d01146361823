"""Buffered histogram recording equals recording each sample (the SDK internals it relies on are pinned here)."""

from __future__ import annotations

import bisect

from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader

from mpcache.telemetry import histograms, sdkstate
from mpcache.telemetry.buffered import InstrumentBuffer

BOUNDS = [0.5, 1.0, 2.0, 4.0, 8.0]
VALUES = [0.1, 0.5, 0.7, 1.0, 3.3, 3.3, 9.0, 100.0, 0.0, 2.0]


def _points(record) -> list[tuple]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    histogram = provider.get_meter("t").create_histogram("h", explicit_bucket_boundaries_advisory=BOUNDS)
    record(histogram)
    points = []
    for resource_metrics in reader.get_metrics_data().resource_metrics:
        for scope_metrics in resource_metrics.scope_metrics:
            for metric in scope_metrics.metrics:
                for p in metric.data.data_points:
                    points.append((dict(p.attributes), p.count, p.sum, p.min, p.max, list(p.bucket_counts)))
    provider.shutdown()
    return sorted(points, key=lambda point: sorted(point[0].items()))


def _batched(histogram) -> None:
    buffer = InstrumentBuffer()
    for i, value in enumerate(VALUES):
        buffer.record(histogram, value, {"device": "cpu", "model_name": "m" if i % 3 else "n"})
    buffer.flush()


def _batched_in_runs(histogram) -> None:
    """The same samples, each attribute set's in runs given to record_many, between single records."""
    buffer = InstrumentBuffer()
    m = {"device": "cpu", "model_name": "m"}
    n = {"device": "cpu", "model_name": "n"}
    of_m = [value for i, value in enumerate(VALUES) if i % 3]
    of_n = [value for i, value in enumerate(VALUES) if not i % 3]
    buffer.record_many(histogram, of_m[:2], m)
    buffer.record(histogram, of_n[0], n)
    buffer.record_many(histogram, of_m[2:], m)
    buffer.record_many(histogram, of_n[1:], n)
    buffer.flush()


def _one_by_one(histogram) -> None:
    for i, value in enumerate(VALUES):
        histogram.record(value, {"device": "cpu", "model_name": "m" if i % 3 else "n"})


def test_batched_recording_equals_per_sample_recording():
    """Counts, sums, min, max and every bucket agree with one record() per sample, per attribute set."""
    assert histograms._fast_path_ok
    assert _points(_one_by_one) == _points(_batched)
    assert histograms._fast_path_ok  # the batch really took the fast path


def test_samples_given_in_runs_equal_per_sample_recording():
    assert _points(_one_by_one) == _points(_batched_in_runs)
    assert histograms._fast_path_ok


def test_merged_bucket_counts_equal_per_sample_recording():
    """Bucket counts that producers aggregated, three events of one attribute set merged in the buffer and
    added at its flush: the data point of recording every sample, the sum to float rounding."""
    runs = (VALUES[:4], VALUES[4:5], VALUES[5:])

    def merged(histogram) -> None:
        buffer = InstrumentBuffer()
        for run in runs:
            counts = [0] * (len(BOUNDS) + 1)
            for value in run:
                counts[bisect.bisect_left(BOUNDS, value)] += 1
            buffer.add_buckets(histogram, {"op": "x"}, BOUNDS, counts, sum(run), min(run), max(run))
        buffer.flush()

    def one_by_one(histogram) -> None:
        for value in VALUES:
            histogram.record(value, {"op": "x"})

    ((attributes, count, total, low, high, buckets),) = _points(merged)
    ((want_attributes, want_count, want_total, want_low, want_high, want_buckets),) = _points(one_by_one)
    assert (attributes, count, low, high, buckets) == (want_attributes, want_count, want_low, want_high, want_buckets)
    assert abs(total - want_total) < 1e-9
    assert histograms._fast_path_ok


def _record_many(histogram) -> None:
    """The same samples through histograms.record_many, one call per attribute set."""
    for model in ("m", "n"):
        histograms.record_many(histogram, {"device": "cpu", "model_name": model},
                               [value for i, value in enumerate(VALUES) if ("m" if i % 3 else "n") == model])


def test_fallback_records_every_sample(monkeypatch):
    """When the SDK internals do not fit, record_many still records every sample (one call each)."""
    monkeypatch.setattr(histograms, "_fold_into_aggregations", lambda *args: False)
    monkeypatch.setattr(histograms, "_fast_path_ok", True)
    assert _points(_one_by_one) == _points(_record_many)
    assert not histograms._fast_path_ok


def test_a_buffer_whose_direct_writes_are_refused_goes_through_the_sdk_calls(monkeypatch):
    """When the SDK takes no direct write of a series, the buffer's flush makes the SDK's own calls: the same
    points, the sum to float rounding."""
    monkeypatch.setattr(sdkstate, "write_histogram", lambda *args: False)
    points, expected = _points(_batched), _points(_one_by_one)
    assert [p[:2] + p[3:] for p in expected] == [p[:2] + p[3:] for p in points]
    assert all(abs(p[2] - q[2]) < 1e-9 for p, q in zip(points, expected))


def test_buffered_counter_sums_reach_the_sdk_on_flush():
    """InstrumentBuffer adds per (counter, attributes) and makes the SDK calls only on flush."""
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    counter = provider.get_meter("t").create_counter("c")
    buffer = InstrumentBuffer()
    for salt in ("a", "b", "a"):
        buffer.add(counter, 2, {"cache_salt": salt})
    before = reader.get_metrics_data()
    buffer.flush()
    points = {p.attributes["cache_salt"]: p.value for rm in reader.get_metrics_data().resource_metrics
              for sm in rm.scope_metrics for m in sm.metrics for p in m.data.data_points}
    provider.shutdown()
    assert (None, {"a": 4, "b": 2}) == (before, points)
