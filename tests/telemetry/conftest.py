"""Fixtures for the telemetry tests: an in-memory OTel reader and a real ring → bus pipeline.

Events are published with :class:`mpcache.shm.publish.Publisher` into a real
shared-memory ring, read back with :class:`~mpcache.shm.ring_reader.RingReader` and
dispatched through a real :class:`~mpcache.telemetry.bus.EventBus`, so every
test covers encoding and decoding too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import HistogramDataPoint, InMemoryMetricReader

from mpcache.config import Config
from mpcache.telemetry.batch import EventBatch
from mpcache.telemetry.bus import EventBus, Subscriber
from mpcache.telemetry.pump import Pump, RingSource


class Metrics:
    """What an InMemoryMetricReader collected, by OTel name and attribute set."""

    def __init__(self, reader: InMemoryMetricReader, provider: MeterProvider) -> None:
        self.reader = reader
        self.provider = provider
        self.meter = provider.get_meter("test")

    def collect(self) -> dict[str, dict[frozenset, Any]]:
        """{metric name: {frozenset(attribute items): value or HistogramDataPoint}}."""
        out: dict[str, dict[frozenset, Any]] = {}
        data = self.reader.get_metrics_data()
        for resource_metrics in data.resource_metrics if data else ():
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    points = out.setdefault(metric.name, {})
                    for point in metric.data.data_points:
                        key = frozenset((point.attributes or {}).items())
                        points[key] = point if isinstance(point, HistogramDataPoint) else point.value
        return out

    def series(self, name: str) -> dict[frozenset, Any]:
        return self.collect().get(name, {})

    def value(self, name: str, **attributes: str) -> Any:
        return self.series(name).get(frozenset(attributes.items()))

    def histogram_values(self, name: str, **attributes: str) -> tuple[int, float]:
        """(count, sum) of one histogram series, (0, 0.0) when it has none."""
        point = self.series(name).get(frozenset(attributes.items()))
        return (point.count, point.sum) if point is not None else (0, 0.0)


@pytest.fixture
def metrics() -> Iterator[Metrics]:
    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    yield Metrics(reader, provider)
    provider.shutdown()


@pytest.fixture
def config(tmp_path) -> Config:
    return Config(instance_id="test-instance", supervisor_pid=os.getpid(), runtime_dir=str(tmp_path),
                  prometheus_port=0, cache_salt_cap=1000)


@dataclass
class Pipeline:
    """Publisher → ring → batches → bus."""

    ring: Any
    bus: EventBus = field(default_factory=EventBus)

    @property
    def publish(self):
        return self.ring.publisher.emit

    def subscribe(self, *subscribers: Subscriber) -> None:
        for subscriber in subscribers:
            self.bus.subscribe(subscriber)

    def deliver(self) -> int:
        """Dispatch everything published so far; returns the number of records."""
        delivered = 0
        while len(cells := self.ring.reader.read_batch()):
            batch = EventBatch(0, cells, self.ring.names)
            self.bus.dispatch(batch)
            delivered += len(batch)
        return delivered

    def pump(self, clock_ns=lambda: 0) -> Pump:
        """A pump over this pipeline's ring and bus (for the self-monitoring metrics)."""
        source = RingSource(0, self.ring.segment, self.ring.reader, self.ring.names)
        return Pump([source], self.bus, clock_ns=clock_ns)


@pytest.fixture
def pipeline(ring_factory) -> Pipeline:
    return Pipeline(ring_factory(capacity=8192, intern_capacity=256))


class CountingCounter:
    """Records every ``add`` call, to count how many reach the SDK."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []

    def add(self, amount, attributes=None) -> None:
        self.calls.append((amount, attributes))


class CountingMeter:
    """A meter whose counters are :class:`CountingCounter` (``counters`` by name)."""

    def __init__(self) -> None:
        self.counters: dict[str, CountingCounter] = {}

    def create_counter(self, name, unit="", description=""):
        return self.counters.setdefault(name, CountingCounter())


@pytest.fixture
def counting_meter() -> CountingMeter:
    return CountingMeter()
