"""Series written straight into the OpenTelemetry SDK's aggregations: a cumulative series takes the value, bucket
counts and start time the telemetry process keeps (:mod:`mpcache.telemetry.buffered`), so what the SDK exports
is exactly that state, also after a restart that loaded it from a checkpoint.  Everything that knows the SDK's
internals is here (and in :mod:`mpcache.telemetry.histograms`); where they are not what this expects, callers
fall back to the SDK's public calls.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from opentelemetry.sdk.metrics._internal._view_instrument_match import _hash_attributes
from opentelemetry.sdk.metrics._internal.aggregation import (
    _ExplicitBucketHistogramAggregation,
    _SumAggregation,
)

if TYPE_CHECKING:
    from mpcache.telemetry.series import HistogramSeries, SumSeries


def _matches(instrument: Any) -> list[Any] | None:
    """Every view match of ``instrument`` in every reader's storage; None where a view filters attributes."""
    matches = []
    for storage in instrument._measurement_consumer._reader_storages.values():
        for match in storage._get_or_init_view_instrument_match(instrument):
            if match._view._attribute_keys is not None:
                return None
            matches.append(match)
    return matches


def write_sum(counter: Any, attributes: dict[str, Any], series: SumSeries, delta: float) -> bool:
    """Make the counter's series read ``series`` (delta readers get ``delta``); False, and nothing changed, if
    the SDK differs."""
    return _write(counter, attributes, lambda agg: type(agg) is _SumAggregation,
                  lambda agg, cumulative: _set_sum(agg, series, delta, cumulative))


def write_histogram(histogram: Any, attributes: dict[str, Any], series: HistogramSeries,
                    delta: HistogramSeries | None) -> bool:
    """Make the histogram's series read ``series`` (delta readers get ``delta``); False, and nothing changed, if
    the SDK differs (its bucket grid included)."""
    return _write(histogram, attributes,
                  lambda agg: type(agg) is _ExplicitBucketHistogramAggregation
                  and tuple(agg._boundaries) == series.boundaries,
                  lambda agg, cumulative: _set_histogram(agg, series, delta, cumulative))


def start_series(instrument: Any, attributes: dict[str, Any], start_ns: int) -> bool:
    """An observable counter's series begins at ``start_ns`` (created now where it does not exist yet: it holds
    nothing until its callback reports); False if the SDK differs."""
    def begin(agg: Any, cumulative: bool) -> None:
        if cumulative:
            agg._start_time_unix_nano = start_ns

    return _write(instrument, attributes, lambda agg: type(agg) is _SumAggregation, begin)


def _write(instrument: Any, attributes: dict[str, Any], fits: Callable[[Any], bool],
           apply: Callable[[Any, bool], None]) -> bool:
    """``apply(aggregation, cumulative)`` to the series' aggregation in every reader's storage (created where
    missing), once every one of them ``fits``."""
    matches = _matches(instrument)
    if not matches:
        return False
    key = _hash_attributes(attributes)
    found = []
    for match in matches:
        with match._lock:
            aggregation = match._get_or_create_aggregation(key, attributes)
        if not fits(aggregation):
            return False
        # past the SDK's cardinality limit the series is its overflow series: only deltas belong there
        found.append((aggregation, not match._reset_on_collect and key in match._attributes_aggregation))
    for aggregation, cumulative in found:
        with aggregation._lock:
            apply(aggregation, cumulative)
    return True


def _set_sum(agg: Any, series: SumSeries, delta: float, cumulative: bool) -> None:
    if cumulative:
        agg._start_time_unix_nano = series.start_ns
        agg._previous_value = series.value
        agg._value = None
    elif delta:
        agg._value = (agg._value or 0) + delta
def _set_histogram(agg: Any, series: HistogramSeries, delta: HistogramSeries | None, cumulative: bool) -> None:
    if cumulative:
        agg._start_time_unix_nano = series.start_ns
        agg._previous_value = list(series.counts)
        agg._previous_sum = series.total
        agg._previous_min, agg._previous_max = series.low, series.high
        agg._value = None
        agg._sum, agg._min, agg._max = 0, math.inf, -math.inf
    elif delta is not None:
        if agg._value is None:
            agg._value = agg._get_empty_bucket_counts()
        for index, count in enumerate(delta.counts):
            agg._value[index] += count
        agg._sum += delta.total
        agg._min, agg._max = min(agg._min, delta.low), max(agg._max, delta.high)
