"""Buffered instruments: subscribers' counter and histogram calls accumulate, and each flush folds them into
the series as exported and writes each changed series into the SDK once (an SDK call costs 5–20 µs whatever it
carries).  Bucket counts a producer aggregated (:func:`~mpcache.telemetry.histograms.record_buckets`) are
merged per attribute set too.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol, cast

from mpcache.telemetry.series import HistogramSeries, Series, SumSeries, boundaries_of, bucket_values, bucketed

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

log = logging.getLogger(__name__)


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


# (instrument, attributes, the series now, what changed): what a flush gives the SDK
Change = tuple[Any, "_AttributesKey", Series, "float | HistogramSeries | None"]


class InstrumentBuffer:
    """Pending counter sums and histogram samples, per (instrument, attribute set), and every series as it is
    exported (:attr:`series`): a flush folds the pending part into the series, then writes each series it
    changed into the SDK (:mod:`mpcache.telemetry.sdkstate`).  So the telemetry process's checkpoint saves
    exactly what the SDK exports, and a restart that loads it exports the same series, start times included."""

    def __init__(self, clock_ns: Callable[[], int] = time.time_ns, started_ns: int | None = None) -> None:
        self.held_samples = 0  # histogram samples since the last flush
        self._clock_ns = clock_ns
        # the start of every series (counted from zero then): this process's, or that of the checkpoint it goes on
        # from, so that a series a restart creates again (exported after the last record) keeps its start time
        self.started_ns = clock_ns() if started_ns is None else started_ns
        self._sums: dict[tuple[Counter, _AttributesKey], float] = {}
        self._samples: dict[tuple[Histogram, _AttributesKey], list[float]] = {}
        # (histogram, attributes, edges) -> [bucket counts, sum, min, max] of the samples counted so far
        self._buckets: dict[tuple[Histogram, _AttributesKey, tuple[float, ...]], list[Any]] = {}
        self.series: dict[tuple[Any, _AttributesKey], Series] = {}
        self.instruments: dict[str, Any] = {}  # the SDK's counters and histograms a BufferedMeter made, by name
        self._started: set[tuple[int, _AttributesKey]] = set()  # observable series started at started_ns
        self._direct = True  # False once the SDK refused a direct write (logged once)

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
        self.publish(self.fold())

    def fold(self) -> list[Change]:
        """Add what is pending to :attr:`series` (what the SDK's own calls would drop is dropped: negative or
        non-finite values); returns what changed, for :meth:`publish`."""
        sums, self._sums = self._sums, {}
        samples, self._samples = self._samples, {}
        buckets, self._buckets = self._buckets, {}
        self.held_samples = 0
        start = self.started_ns
        changes: list[Change] = []
        for (counter, attributes), amount in sums.items():
            if not 0 <= amount < math.inf:
                continue
            series = self.series.get((counter, attributes))
            if series is None:
                series = self.series[(counter, attributes)] = SumSeries(start, 0)
            series.value += amount  # type: ignore[union-attr]
            changes.append((counter, attributes, series, amount))
        for (histogram, attributes), values in samples.items():
            self._fold_histogram(changes, start, histogram, attributes, bucketed(boundaries_of(histogram), values))
        for (histogram, attributes, edges), (counts, total, low, high) in buckets.items():
            bounds = boundaries_of(histogram)
            if sum(counts) > 0:
                delta = (HistogramSeries(0, bounds, list(counts), total, low, high) if edges == bounds
                         else bucketed(bounds, bucket_values(edges, counts, low, high), total))
                self._fold_histogram(changes, start, histogram, attributes, delta)
        return changes

    def _fold_histogram(self, changes: list[Change], start: int, histogram: Histogram, attributes: _AttributesKey,
                        delta: HistogramSeries | None) -> None:
        if delta is None:
            return
        series = self.series.get((histogram, attributes))
        if series is None:
            series = self.series[(histogram, attributes)] = HistogramSeries(
                start, delta.boundaries, [0] * len(delta.counts), 0.0, math.inf, -math.inf)
        series.merge(delta)  # type: ignore[union-attr]
        changes.append((histogram, attributes, series, delta))

    def publish(self, changes: list[Change], restored: bool = False) -> None:
        """Write each changed series into the SDK.  ``restored``: the series were loaded from a checkpoint
        (delta readers have exported them already; an SDK that takes no direct writes gets them whole)."""
        from mpcache.telemetry import sdkstate
        from mpcache.telemetry.histograms import record_buckets

        for instrument, key, series, delta in changes:
            attributes: dict[str, Any] = dict(key)
            if self._direct:
                if isinstance(series, SumSeries):
                    written = sdkstate.write_sum(instrument, attributes, series, 0.0 if restored else float(
                        cast(float, delta)))
                else:
                    written = sdkstate.write_histogram(instrument, attributes, series,
                                                       None if restored else cast(HistogramSeries, delta))
                if written:
                    continue
                self._direct = False
                log.warning("series written through the SDK's calls: a restart resets their start times")
            if isinstance(series, SumSeries):
                instrument.add(series.value if restored else delta, attributes)
            else:
                whole = series if restored else cast(HistogramSeries, delta)
                record_buckets(instrument, attributes, whole.boundaries, whole.counts, whole.total, whole.low,
                               whole.high)

    def save_series(self) -> list[list[Any]]:
        """Every series, for a checkpoint: [name, attributes, start, value] of a counter, [name, attributes,
        start, bucket counts, sum, min, max] of a histogram."""
        out: list[list[Any]] = []
        for (instrument, key), series in self.series.items():
            if isinstance(series, SumSeries):
                out.append([instrument.name, key, series.start_ns, series.value])
            else:
                out.append([instrument.name, key, series.start_ns, series.counts, series.total, series.low,
                            series.high])
        return out

    def load_series(self, saved: object) -> Callable[[], None]:
        """Check :meth:`save_series` of a buffer with these instruments; returns the step that adopts the series
        (:meth:`publish_restored` writes them into the SDK)."""
        from mpcache.telemetry import statecheck

        series: dict[tuple[Any, _AttributesKey], Series] = {}
        for row in statecheck.items(saved, "l"):
            name, key = row[0], tuple(tuple(pair) for pair in statecheck.rows(row[1], "ss"))
            instrument = self.instruments[name]
            if not hasattr(instrument, "record"):  # a counter
                start, value = statecheck.rows([row[2:]], "if")[0]
                if not 0 <= value < math.inf:
                    raise ValueError(f"{name}: not a counter's value")
                series[(instrument, key)] = SumSeries(start, value)
                continue
            start, counts, total, low, high = statecheck.rows([row[2:]], "ilfff")[0]
            bounds = boundaries_of(instrument)
            if len(counts) != len(bounds) + 1 or not all(type(n) is int and n >= 0 for n in counts) or not sum(counts):
                raise ValueError(f"{name}: not bucket counts of its grid")
            series[(instrument, key)] = HistogramSeries(start, bounds, counts, total, low, high)

        def adopt() -> None:
            self.series = series
        return adopt

    def publish_restored(self) -> None:
        """Write every series into the SDK whole: they were loaded from a checkpoint (and read on as far as the
        process gone had exported), so delta readers have exported them already."""
        self.publish([(instrument, key, one, None) for (instrument, key), one in self.series.items()], restored=True)

    def restart_series(self) -> None:
        """Every series starts now (a reset: the checkpoint was not loaded)."""
        self.started_ns = self._clock_ns()
        self._started.clear()

    def start_observed(self, instrument: Any, observations: list[Any]) -> None:
        """Start the series of an observable counter's ``observations`` at :attr:`started_ns` (the first time
        each is seen; nothing where the SDK takes no direct writes)."""
        for observation in observations:
            key = tuple(observation.attributes.items()) if observation.attributes else ()
            if self._direct and (id(instrument), key) not in self._started:
                from mpcache.telemetry import sdkstate

                if sdkstate.start_series(instrument, dict(key), self.started_ns):
                    self._started.add((id(instrument), key))


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
        counter = self._meter.create_counter(name, unit, description)
        self._buffer.instruments[name] = counter
        return _BufferedCounter(counter, self._buffer)

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
        self._buffer.instruments[name] = histogram
        return _BufferedHistogram(histogram, self._buffer)

    def create_observable_gauge(
        self, name: str, callbacks: Sequence[CallbackT] | None = None, unit: str = "", description: str = ""
    ) -> ObservableGauge:
        return self._meter.create_observable_gauge(name, callbacks, unit, description)

    def create_observable_counter(
        self, name: str, callbacks: Sequence[CallbackT] | None = None, unit: str = "", description: str = ""
    ) -> ObservableCounter:
        """One whose value outlives the telemetry process (``Derivation.outlives_telemetry``) has its series
        begin at the buffer's ``started_ns``, in this process and in every one that loads its checkpoint (each
        callback's observations start their series before the SDK takes them); another's begin with the
        process, as its values do."""
        from mpcache.telemetry.metric_table import BY_NAME

        spec = BY_NAME.get(name)
        if spec is None or not spec.source.derivation.outlives_telemetry:
            return self._meter.create_observable_counter(name, callbacks, unit, description)
        made: list[ObservableCounter] = []

        def starting(callback: Any) -> Callable[[Any], list[Any]]:
            def observe(options: Any) -> list[Any]:
                observations = list(callback(options))
                self._buffer.start_observed(made[0], observations)
                return observations
            return observe

        made.append(self._meter.create_observable_counter(name, [starting(c) for c in callbacks or ()], unit,
                                                          description))
        return made[0]

    def create_observable_up_down_counter(
        self, name: str, callbacks: Sequence[CallbackT] | None = None, unit: str = "", description: str = ""
    ) -> ObservableUpDownCounter:
        return self._meter.create_observable_up_down_counter(name, callbacks, unit, description)
