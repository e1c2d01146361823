"""Bus self-monitoring: queue depth, drain lag, dropped records, subscriber exceptions.

Read from ring and bus state at collection time (on the exporter's thread),
not from events.
"""

from __future__ import annotations

from opentelemetry.metrics import CallbackOptions, Observation

from mpcache.telemetry.buffered import MeterLike
from mpcache.telemetry.bus import EventBus, Subscriber
from mpcache.telemetry.otel import create_instrument
from mpcache.telemetry.pump import Pump


class EventBusSelfMetricsSubscriber(Subscriber):
    """Consumes no events; its four observable instruments report on every collection."""

    def __init__(self, meter: MeterLike, pump: Pump, bus: EventBus) -> None:
        self._pump = pump
        self._bus = bus
        create_instrument(meter, "lmcache_mp.event_bus.queue_depth", [self._queue_depth])
        create_instrument(meter, "lmcache_mp.event_bus.drain_lag_seconds", [self._drain_lag])
        create_instrument(meter, "lmcache_mp.event_bus.dropped_events_total", [self._dropped])
        create_instrument(meter, "lmcache_mp.event_bus.subscriber_exceptions", [self._subscriber_exceptions])

    def _queue_depth(self, _options: CallbackOptions) -> list[Observation]:
        return [Observation(self._pump.queue_depth())]

    def _drain_lag(self, _options: CallbackOptions) -> list[Observation]:
        return [Observation(self._pump.drain_lag_seconds())]

    def _dropped(self, _options: CallbackOptions) -> list[Observation]:
        return [Observation(self._pump.dropped_events())]

    def _subscriber_exceptions(self, _options: CallbackOptions) -> list[Observation]:
        """Every subscriber has a series from start-up (0 until it raises), so an alert on
        ``increase(...) > 0`` sees the series before the first failure, not after it."""
        counts = self._bus.subscriber_exception_counts()
        names = {subscriber.name for subscriber in self._bus.subscribers} | set(counts)
        return [Observation(counts.get(name, 0), {"subscriber_name": name}) for name in sorted(names)]
