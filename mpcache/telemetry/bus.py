"""The EventBus of the telemetry process: batches in, subscribers called by type.

A subscriber declares the event types it consumes and receives whole batches
(:meth:`Subscriber.on_batch`), or one decoded event at a time if it only
overrides :meth:`Subscriber.on_event`.  A subscriber that raises is isolated:
the exception is logged and counted under its class name, and every other
subscriber still gets the batch.
"""

from __future__ import annotations

import collections
from typing import Iterable

import structlog

from mpcache.events import EventType
from mpcache.telemetry.batch import Event, EventBatch

log = structlog.get_logger("mpcache.telemetry.bus")


class Subscriber:
    """Base class.  Override ``on_batch`` for vectorised work or ``on_event`` for per-event logic."""

    event_types: tuple[EventType, ...] = ()

    def on_batch(self, batch: EventBatch) -> None:
        for event in batch.events(self.event_types):
            self.on_event(event)

    def on_event(self, event: Event) -> None:
        """Called once per event of ``event_types`` by the default ``on_batch``."""

    def on_tick(self, now_ns: int) -> None:
        """Called about once a second: expire pending state here, never per event."""

    def shutdown(self) -> None:
        """Called once when the telemetry process stops, after the final drain."""


class EventBus:
    def __init__(self) -> None:
        self._subscribers: list[tuple[Subscriber, frozenset[int]]] = []
        self._exceptions: collections.Counter[str] = collections.Counter()
        self.records_delivered = 0

    def subscribe(self, subscriber: Subscriber) -> None:
        self._subscribers.append((subscriber, frozenset(int(e) for e in subscriber.event_types)))

    @property
    def subscribers(self) -> list[Subscriber]:
        return [subscriber for subscriber, _ in self._subscribers]

    def dispatch(self, batch: EventBatch) -> None:
        if not len(batch):
            return
        present = batch.etypes_present
        for subscriber, wanted in self._subscribers:
            if wanted.isdisjoint(present):
                continue
            self._call(subscriber, "on_batch", batch)
        self.records_delivered += len(batch)

    def tick(self, now_ns: int) -> None:
        for subscriber, _ in self._subscribers:
            self._call(subscriber, "on_tick", now_ns)

    def shutdown(self) -> None:
        for subscriber, _ in self._subscribers:
            self._call(subscriber, "shutdown")

    def subscriber_exception_counts(self) -> dict[str, int]:
        """Exceptions raised so far, by subscriber class name (a copy)."""
        return dict(self._exceptions)

    def _call(self, subscriber: Subscriber, method: str, *args: object) -> None:
        try:
            getattr(subscriber, method)(*args)
        except Exception:  # noqa: BLE001 - one subscriber must not take the others down
            name = type(subscriber).__name__
            self._exceptions[name] += 1
            if self._exceptions[name] <= 10 or self._exceptions[name] % 1000 == 0:
                log.exception("subscriber_failed", subscriber=name, method=method, count=self._exceptions[name])


def subscribe_all(bus: EventBus, subscribers: Iterable[Subscriber]) -> None:
    for subscriber in subscribers:
        bus.subscribe(subscriber)
