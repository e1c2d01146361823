"""Recording many histogram samples with one SDK call per attribute set, by folding them into the SDK's
bucket counts (checked against per-sample recording; falls back to it if the SDK differs).
"""

from __future__ import annotations

import logging
from bisect import bisect_left
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from opentelemetry.metrics import Histogram
    from opentelemetry.util.types import AttributeValue

log = logging.getLogger(__name__)

_fast_path_ok = True


def record_many(histogram: Histogram, attributes: dict[str, AttributeValue], values: list[float]) -> None:
    """Record every value of ``values`` with ``attributes``: like ``record`` per value, in one step."""
    global _fast_path_ok
    histogram.record(values[0], attributes)
    rest = values[1:]
    if not rest:
        return
    if _fast_path_ok:
        try:
            if _fold_into_aggregations(histogram, attributes, np.asarray(rest, dtype=np.float64)):
                return
        except (AttributeError, TypeError, KeyError, ValueError):
            pass
        _fast_path_ok = False
        log.warning("histogram batching unavailable with this OpenTelemetry SDK: recording one sample per call")
    for value in rest:
        histogram.record(value, attributes)


def _fold_into_aggregations(histogram: Any, attributes: dict[str, AttributeValue], values: np.ndarray) -> bool:
    """Add ``values`` to every aggregation ``record`` just fed; False if the internals do not fit."""
    from opentelemetry.sdk.metrics._internal._view_instrument_match import (
        _hash_attributes,
    )
    from opentelemetry.sdk.metrics._internal.aggregation import (
        _ExplicitBucketHistogramAggregation,
    )

    values = values[np.isfinite(values) & (values >= 0)]  # what record() itself would drop
    if len(values) == 0:
        return True
    matches = []
    for storage in histogram._measurement_consumer._reader_storages.values():
        for match in storage._instrument_view_instrument_matches.get(histogram, ()):
            if match._view._attribute_keys is not None:
                return False
            aggregation = match._attributes_aggregation.get(_hash_attributes(attributes))
            if type(aggregation) is not _ExplicitBucketHistogramAggregation:
                return False
            matches.append((match, aggregation))
    if not matches:
        return False
    total, low, high = float(values.sum()), float(values.min()), float(values.max())
    for match, aggregation in matches:
        counts = np.bincount(np.searchsorted(aggregation._boundaries, values, side="left"),
                             minlength=len(aggregation._boundaries) + 1)
        with match._lock:  # collect() may swap aggregations out for delta readers
            aggregation = match._attributes_aggregation.get(_hash_attributes(attributes), aggregation)
            with aggregation._lock:
                if aggregation._value is None:
                    aggregation._value = aggregation._get_empty_bucket_counts()
                for index in np.flatnonzero(counts).tolist():
                    aggregation._value[index] += int(counts[index])
                aggregation._sum += total
                if aggregation._record_min_max:
                    aggregation._min = min(aggregation._min, low)
                    aggregation._max = max(aggregation._max, high)
    return True


def record_buckets(histogram: Histogram, attributes: dict[str, AttributeValue], edges: Sequence[float],
                   counts: Sequence[int], total: float, low: float, high: float) -> None:
    """Add samples a producer already counted in ``edges`` (the histogram's own grid): ``counts[i]`` samples
    in bucket i, summing to ``total``, the least ``low`` and the greatest ``high`` — as if each had been
    recorded, with one SDK call.  Where the SDK differs (or the grid does), each sample is recorded as its
    bucket's upper edge held to [low, high], which keeps the counts and the extremes but not the exact sum."""
    global _fast_path_ok
    n = sum(counts)
    if n <= 0:
        return
    histogram.record(low, attributes)  # creates the attribute set's aggregation and sets its minimum
    if n == 1:
        return
    rest = list(counts)
    rest[bisect_left(edges, low)] -= 1
    if _fast_path_ok:
        try:
            if _add_counts(histogram, attributes, edges, rest, total - low, high):
                return
        except (AttributeError, TypeError, KeyError, ValueError):
            pass
        _fast_path_ok = False
        log.warning("histogram batching unavailable with this OpenTelemetry SDK: recording one sample per call")
    histogram.record(high, attributes)
    rest[bisect_left(edges, high)] -= 1
    for index, count in enumerate(rest):
        value = min(max(edges[index] if index < len(edges) else high, low), high)
        for _ in range(count):
            histogram.record(value, attributes)


def _add_counts(histogram: Any, attributes: dict[str, AttributeValue], edges: Sequence[float], counts: list[int],
                total: float, high: float) -> bool:
    """Add bucket counts, their sum and their maximum to every aggregation ``record`` just fed; False if the
    internals or the grid do not fit (the minimum is already right: it was recorded)."""
    from opentelemetry.sdk.metrics._internal._view_instrument_match import (
        _hash_attributes,
    )
    from opentelemetry.sdk.metrics._internal.aggregation import (
        _ExplicitBucketHistogramAggregation,
    )

    key = _hash_attributes(attributes)
    matches = []
    for storage in histogram._measurement_consumer._reader_storages.values():
        for match in storage._instrument_view_instrument_matches.get(histogram, ()):
            if match._view._attribute_keys is not None:
                return False
            aggregation = match._attributes_aggregation.get(key)
            if type(aggregation) is not _ExplicitBucketHistogramAggregation:
                return False
            if tuple(aggregation._boundaries) != tuple(edges):
                return False
            matches.append((match, aggregation))
    if not matches:
        return False
    for match, aggregation in matches:
        with match._lock:
            aggregation = match._attributes_aggregation.get(key, aggregation)
            with aggregation._lock:
                if aggregation._value is None:
                    aggregation._value = aggregation._get_empty_bucket_counts()
                for index, count in enumerate(counts):
                    if count:
                        aggregation._value[index] += count
                aggregation._sum += total
                if aggregation._record_min_max:
                    aggregation._max = max(aggregation._max, high)
    return True
