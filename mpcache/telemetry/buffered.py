"""Buffered instruments: subscribers' counter and histogram calls accumulate, and each flush makes one SDK
call per (instrument, attribute set), because an SDK call costs 5–20 µs whatever it carries.  Bucket counts
a producer aggregated (:func:`~mpcache.telemetry.histograms.record_buckets`) are merged per attribute set too.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

from mpcache.telemetry.histograms import record_buckets, record_many

if TYPE_CHECKING:  # types only: importing this module must not import OpenTelemetry
    from opentelemetry.metrics import (
        CallbackT,
        Counter,
        Histogram,
        Meter,
        ObservableCounter,
        ObservableGauge,
        ObservableUpDownCounter,
    )
    from opentelemetry.util.types import Attributes, AttributeValue

    _AttributesKey = tuple[tuple[str, AttributeValue], ...]


class CounterLike(Protocol):
    """A counter as subscribers use it: the SDK's, or a :class:`BufferedMeter`'s."""

    def add(self, amount: int | float, attributes: Attributes = None, /) -> None: ...


class HistogramLike(Protocol):
    """A histogram as subscribers use it: the SDK's, or a :class:`BufferedMeter`'s."""

    def record(self, amount: int | float, attributes: Attributes = None, /) -> None: ...


class MeterLike(Protocol):
    """What subscribers need of a meter (through :func:`mpcache.telemetry.otel.create_instrument`).

    An OpenTelemetry ``Meter`` is one, and so is a :class:`BufferedMeter`.
    """

    def create_counter(self, name: str, unit: str = "", description: str = "") -> CounterLike: ...

    def create_histogram(
        self,
        name: str,
        unit: str = "",
        description: str = "",
        *,
        explicit_bucket_boundaries_advisory: Sequence[float] | None = None,
    ) -> HistogramLike: ...

    def create_observable_gauge(
        self, name: str, callbacks: Sequence[CallbackT] | None = None, unit: str = "", description: str = ""
    ) -> ObservableGauge: ...

    def create_observable_counter(
        self, name: str, callbacks: Sequence[CallbackT] | None = None, unit: str = "", description: str = ""
    ) -> ObservableCounter: ...


class _Named(Protocol):
    name: str  # the SDK's instruments have it (lower-cased); the API's abstract classes do not declare it


MAX_HELD_SAMPLES = 1 << 16  # histogram samples a buffer holds before it asks for a flush (~2 MiB)


class InstrumentBuffer:
    """Pending counter sums and histogram samples, per (instrument, attribute set)."""

    def __init__(self) -> None:
        self.held_samples = 0  # histogram samples since the last flush
        self._sums: dict[tuple[Counter, _AttributesKey], float] = {}
        self._samples: dict[tuple[Histogram, _AttributesKey], list[float]] = {}
        # (histogram, attributes, edges) -> [bucket counts, sum, min, max] of the samples counted so far
        self._buckets: dict[tuple[Histogram, _AttributesKey, tuple[float, ...]], list[Any]] = {}

    def add(self, counter: Counter, amount: float, attributes: Attributes) -> None:
        key = (counter, tuple(attributes.items()) if attributes else ())
        self._sums[key] = self._sums.get(key, 0) + amount

    def record(self, histogram: Histogram, value: float, attributes: Attributes) -> None:
        key = (histogram, tuple(attributes.items()) if attributes else ())
        self.held_samples += 1
        samples = self._samples.get(key)
        if samples is None:
            self._samples[key] = [value]
        else:
            samples.append(value)

    def record_many(self, histogram: Histogram, values: Sequence[float], attributes: Attributes) -> None:
        key = (histogram, tuple(attributes.items()) if attributes else ())
        self.held_samples += len(values)
        samples = self._samples.get(key)
        if samples is None:
            self._samples[key] = list(values)
        else:
            samples.extend(values)

    def full(self) -> bool:
        """Holds ``MAX_HELD_SAMPLES`` histogram samples or more: flush it now, whatever the interval."""
        return self.held_samples >= MAX_HELD_SAMPLES

    def add_buckets(self, histogram: Histogram, attributes: Attributes, edges: Sequence[float],
                    counts: Sequence[int], total: float, low: float, high: float) -> None:
        """Samples counted in ``edges`` (see :func:`~mpcache.telemetry.histograms.record_buckets`), merged with
        those of the same attribute set since the last flush: counts added, sums added, extremes kept."""
        key = (histogram, tuple(attributes.items()) if attributes else (), tuple(edges))
        pending = self._buckets.get(key)
        if pending is None:
            self._buckets[key] = [list(counts), total, low, high]
            return
        pending[0] = [mine + theirs for mine, theirs in zip(pending[0], counts)]
        pending[1] += total
        pending[2] = min(pending[2], low)
        pending[3] = max(pending[3], high)

    def flush(self) -> None:
        sums, self._sums = self._sums, {}
        samples, self._samples = self._samples, {}
        buckets, self._buckets = self._buckets, {}
        self.held_samples = 0
        for (counter, attributes), amount in sums.items():
            counter.add(amount, dict(attributes))
        for (histogram, attributes), values in samples.items():
            record_many(histogram, dict(attributes), values)
        for (histogram, attributes, edges), (counts, total, low, high) in buckets.items():
            record_buckets(histogram, dict(attributes), edges, counts, total, low, high)


class _BufferedCounter:
    __slots__ = ("_counter", "_buffer", "name")

    def __init__(self, counter: Counter, buffer: InstrumentBuffer) -> None:
        self._counter, self._buffer, self.name = counter, buffer, cast(_Named, counter).name

    def add(self, amount: float, attributes: Attributes = None) -> None:
        self._buffer.add(self._counter, amount, attributes)


class _BufferedHistogram:
    __slots__ = ("_histogram", "_buffer", "name")

    def __init__(self, histogram: Histogram, buffer: InstrumentBuffer) -> None:
        self._histogram, self._buffer, self.name = histogram, buffer, cast(_Named, histogram).name

    def record(self, value: float, attributes: Attributes = None) -> None:
        self._buffer.record(self._histogram, value, attributes)

    def record_many(self, attributes: Attributes, values: Sequence[float]) -> None:
        """``record`` of every value of ``values``, in order, with one call."""
        self._buffer.record_many(self._histogram, values, attributes)

    def record_buckets(self, attributes: Attributes, edges: Sequence[float], counts: Sequence[int], total: float,
                       low: float, high: float) -> None:
        """Bucket counts a producer aggregated, as :func:`~mpcache.telemetry.histograms.record_buckets` adds
        them, merged in the buffer until the flush."""
        self._buffer.add_buckets(self._histogram, attributes, edges, counts, total, low, high)


class BufferedMeter:
    """A meter whose counters and histograms write into ``buffer``; everything else is the real meter's."""

    def __init__(self, meter: Meter, buffer: InstrumentBuffer) -> None:
        self._meter = meter
        self._buffer = buffer

    def create_counter(self, name: str, unit: str = "", description: str = "") -> _BufferedCounter:
        return _BufferedCounter(self._meter.create_counter(name, unit, description), self._buffer)

    def create_histogram(
        self,
        name: str,
        unit: str = "",
        description: str = "",
        *,
        explicit_bucket_boundaries_advisory: Sequence[float] | None = None,
    ) -> _BufferedHistogram:
        histogram = self._meter.create_histogram(
            name, unit, description, explicit_bucket_boundaries_advisory=explicit_bucket_boundaries_advisory
        )
        return _BufferedHistogram(histogram, self._buffer)

    def create_observable_gauge(
        self, name: str, callbacks: Sequence[CallbackT] | None = None, unit: str = "", description: str = ""
    ) -> ObservableGauge:
        return self._meter.create_observable_gauge(name, callbacks, unit, description)

    def create_observable_counter(
        self, name: str, callbacks: Sequence[CallbackT] | None = None, unit: str = "", description: str = ""
    ) -> ObservableCounter:
        return self._meter.create_observable_counter(name, callbacks, unit, description)

    def create_observable_up_down_counter(
        self, name: str, callbacks: Sequence[CallbackT] | None = None, unit: str = "", description: str = ""
    ) -> ObservableUpDownCounter:
        return self._meter.create_observable_up_down_counter(name, callbacks, unit, description)
