"""What the telemetry process exports of one counter or histogram series (its value, bucket counts, start): the
state :mod:`mpcache.telemetry.buffered` keeps, :mod:`mpcache.telemetry.sdkstate` writes into the SDK and the
checkpoint saves.  Samples are counted in a grid the way the SDK counts them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


class SumSeries:
    """A counter's series as exported: its start and its value."""

    __slots__ = ("start_ns", "value")

    def __init__(self, start_ns: int, value: float) -> None:
        self.start_ns, self.value = start_ns, value


class HistogramSeries:
    """A histogram's series as exported: its start, its grid, its bucket counts (one more than ``boundaries``),
    the sum and the extremes of its samples."""

    __slots__ = ("start_ns", "boundaries", "counts", "total", "low", "high")

    def __init__(self, start_ns: int, boundaries: tuple[float, ...], counts: list[int], total: float, low: float,
                 high: float) -> None:
        self.start_ns, self.boundaries, self.counts = start_ns, boundaries, counts
        self.total, self.low, self.high = total, low, high

    def merge(self, other: HistogramSeries) -> None:
        self.counts = [mine + theirs for mine, theirs in zip(self.counts, other.counts)]
        self.total += other.total
        self.low, self.high = min(self.low, other.low), max(self.high, other.high)


Series = SumSeries | HistogramSeries


def boundaries_of(histogram: Any) -> tuple[float, ...]:
    """The bucket grid the SDK gives ``histogram`` (its advice, else the SDK's default)."""
    advisory = getattr(histogram, "_advisory", None)
    boundaries = advisory.explicit_bucket_boundaries if advisory is not None else None
    if boundaries is None:
        from opentelemetry.sdk.metrics._internal.aggregation import (
            _DEFAULT_EXPLICIT_BUCKET_HISTOGRAM_AGGREGATION_BOUNDARIES as DEFAULT,
        )

        boundaries = DEFAULT
    return tuple(boundaries)


def bucketed(bounds: tuple[float, ...], values: Sequence[float], total: float | None = None) -> HistogramSeries | None:
    """``values`` counted in ``bounds`` as the SDK counts a sample (bucket i: (bounds[i-1], bounds[i]]); None
    when none is a value the SDK records."""
    array = np.asarray(values, dtype=np.float64)
    array = array[np.isfinite(array) & (array >= 0)]
    if len(array) == 0:
        return None
    counts = np.bincount(np.searchsorted(bounds, array, side="left"), minlength=len(bounds) + 1)
    return HistogramSeries(0, bounds, counts.tolist(), float(array.sum()) if total is None else total,
                           float(array.min()), float(array.max()))


def bucket_values(edges: Sequence[float], counts: Sequence[int], low: float, high: float) -> list[float]:
    """Samples counted on another grid, each at its bucket's upper edge held to [low, high]."""
    return [min(max(edges[index] if index < len(edges) else high, low), high)
            for index, count in enumerate(counts) for _ in range(count)]
