"""Bus self-monitoring: queue depth, drain lag, dropped records, subscriber exceptions, and the telemetry
process's checkpoint (refused, failed, its size).

Read from ring, bus and checkpoint state at collection time (on the exporter's thread), not from events.
"""

from __future__ import annotations

from opentelemetry.metrics import CallbackOptions, Observation

from mpcache.telemetry.buffered import MeterLike
from mpcache.telemetry.bus import EventBus, Subscriber
from mpcache.telemetry.checkpoint import REFUSAL_REASONS, Checkpoint
from mpcache.telemetry.otel import create_instrument
from mpcache.telemetry.pump import Pump


class EventBusSelfMetricsSubscriber(Subscriber):
    """Consumes no events; its observable instruments report on every collection (the checkpoint's 0 without
    one)."""

    def __init__(self, meter: MeterLike, pump: Pump, bus: EventBus, checkpoint: Checkpoint | None = None) -> None:
        self._pump = pump
        self._bus = bus
        self._checkpoint = checkpoint
        create_instrument(meter, "lmcache_mp.event_bus.queue_depth", [self._queue_depth])
        create_instrument(meter, "lmcache_mp.event_bus.drain_lag_seconds", [self._drain_lag])
        create_instrument(meter, "lmcache_mp.event_bus.dropped_events_total", [self._dropped])
        create_instrument(meter, "lmcache_mp.event_bus.subscriber_exceptions", [self._subscriber_exceptions])
        create_instrument(meter, "mpcache.telemetry_checkpoint_refused", [self._refused])
        create_instrument(meter, "mpcache.telemetry_checkpoint_failures", [self._failures])
        create_instrument(meter, "mpcache.telemetry_checkpoint_bytes", [self._checkpoint_bytes])

    def _queue_depth(self, _options: CallbackOptions) -> list[Observation]:
        return [Observation(self._pump.queue_depth())]

    def _drain_lag(self, _options: CallbackOptions) -> list[Observation]:
        return [Observation(self._pump.drain_lag_seconds())]

    def _loading(self) -> bool:
        """A checkpoint is being loaded: the counts are not yet those it holds (an export now would show them
        going down)."""
        return self._checkpoint is not None and not self._checkpoint.bound

    def _dropped(self, _options: CallbackOptions) -> list[Observation]:
        return [] if self._loading() else [Observation(self._pump.dropped_events())]

    def _subscriber_exceptions(self, _options: CallbackOptions) -> list[Observation]:
        """Every subscriber has a series from start-up (0 until it raises), so an alert on
        ``increase(...) > 0`` sees the series before the first failure, not after it."""
        if self._loading():
            return []
        counts = self._bus.subscriber_exception_counts()
        names = {subscriber.name for subscriber in self._bus.subscribers} | set(counts)
        return [Observation(counts.get(name, 0), {"subscriber_name": name}) for name in sorted(names)]

    def _refused(self, _options: CallbackOptions) -> list[Observation]:
        """A series per reason from start-up (0 until a checkpoint is refused for it, and without one)."""
        if self._loading():
            return []
        refused = self._checkpoint.refused if self._checkpoint else dict.fromkeys(REFUSAL_REASONS, 0)
        return [Observation(count, {"reason": reason}) for reason, count in refused.items()]

    def _failures(self, _options: CallbackOptions) -> list[Observation]:
        return [] if self._loading() else [Observation(self._checkpoint.failures if self._checkpoint else 0)]

    def _checkpoint_bytes(self, _options: CallbackOptions) -> list[Observation]:
        return [Observation(self._checkpoint.last_bytes if self._checkpoint else 0)]
