"""Buffered instruments: subscribers' counter and histogram calls accumulate, and each flush makes one SDK
call per (instrument, attribute set), because an SDK call costs 5–20 µs whatever it carries.
"""

from __future__ import annotations

from typing import Any

from mpcache.telemetry.histograms import record_many


class InstrumentBuffer:
    """Pending counter sums and histogram samples, per (instrument, attribute set)."""

    def __init__(self) -> None:
        self._sums: dict[tuple[Any, tuple], float] = {}
        self._samples: dict[tuple[Any, tuple], list[float]] = {}

    def add(self, counter: Any, amount: float, attributes: dict | None) -> None:
        key = (counter, tuple(attributes.items()) if attributes else ())
        self._sums[key] = self._sums.get(key, 0) + amount

    def record(self, histogram: Any, value: float, attributes: dict | None) -> None:
        key = (histogram, tuple(attributes.items()) if attributes else ())
        samples = self._samples.get(key)
        if samples is None:
            self._samples[key] = [value]
        else:
            samples.append(value)

    def flush(self) -> None:
        sums, self._sums = self._sums, {}
        samples, self._samples = self._samples, {}
        for (counter, attributes), amount in sums.items():
            counter.add(amount, dict(attributes))
        for (histogram, attributes), values in samples.items():
            record_many(histogram, dict(attributes), values)


class _BufferedCounter:
    __slots__ = ("_counter", "_buffer", "name")

    def __init__(self, counter: Any, buffer: InstrumentBuffer) -> None:
        self._counter, self._buffer, self.name = counter, buffer, counter.name

    def add(self, amount: float, attributes: dict | None = None) -> None:
        self._buffer.add(self._counter, amount, attributes)


class _BufferedHistogram:
    __slots__ = ("_histogram", "_buffer", "name")

    def __init__(self, histogram: Any, buffer: InstrumentBuffer) -> None:
        self._histogram, self._buffer, self.name = histogram, buffer, histogram.name

    def record(self, value: float, attributes: dict | None = None) -> None:
        self._buffer.record(self._histogram, value, attributes)


class BufferedMeter:
    """A meter whose counters and histograms write into ``buffer``; everything else is the real meter's."""

    def __init__(self, meter: Any, buffer: InstrumentBuffer) -> None:
        self._meter = meter
        self._buffer = buffer

    def create_counter(self, *args: Any, **kwargs: Any) -> _BufferedCounter:
        return _BufferedCounter(self._meter.create_counter(*args, **kwargs), self._buffer)

    def create_histogram(self, *args: Any, **kwargs: Any) -> _BufferedHistogram:
        return _BufferedHistogram(self._meter.create_histogram(*args, **kwargs), self._buffer)

    def create_observable_gauge(self, *args: Any, **kwargs: Any) -> Any:
        return self._meter.create_observable_gauge(*args, **kwargs)

    def create_observable_counter(self, *args: Any, **kwargs: Any) -> Any:
        return self._meter.create_observable_counter(*args, **kwargs)

    def create_observable_up_down_counter(self, *args: Any, **kwargs: Any) -> Any:
        return self._meter.create_observable_up_down_counter(*args, **kwargs)
