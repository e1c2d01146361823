"""The telemetry process's EventBus: batches in, subscribers called by the event types they declare; a
subscriber that raises is logged, counted and isolated.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Iterable

import structlog

from mpcache.contract.events import EventType
from mpcache.telemetry.batch import Event, EventBatch

log = structlog.get_logger("mpcache.telemetry.bus")

# How often the telemetry process flushes buffered instrument calls to the SDK (see
# mpcache.telemetry.buffered), and so writes its checkpoint (mpcache.telemetry.checkpoint), besides the flush
# before every /metrics scrape and every OTLP export (Pump.catch_up: what they read is flushed for them), and
# as soon as a buffer is full.  The periodic flush only bounds how long calls stay buffered and how far the
# rings' release lags (each flush costs ~20-40 µs of CPU per series it changes, a checkpoint a few ms with the
# demo's state, on this project's 2-vCPU hosts).
TELEMETRY_FLUSH_INTERVAL_S = 10.0


class Subscriber:
    """Base class.  Override ``on_batch`` for vectorised work or ``on_event`` for per-event logic."""

    event_types: tuple[EventType, ...] = ()

    @property
    def name(self) -> str:
        """What its exceptions are counted under: its class name, unless it says otherwise."""
        return type(self).__name__

    def on_batch(self, batch: EventBatch) -> None:
        for event in batch.events(self.event_types):
            self.on_event(event)

    def on_event(self, event: Event) -> None:
        """Called once per event of ``event_types`` by the default ``on_batch``."""

    def on_tick(self, now_ns: int) -> None:
        """Called about once a second: expire pending state here, never per event."""

    def shutdown(self) -> None:
        """Called once when the telemetry process stops, after the final drain."""

    def save_state(self) -> object:
        """What this subscriber keeps between batches, for the telemetry process's checkpoint (msgpack types:
        lists, dicts with str keys, ints, floats, str, bytes, None); None: nothing."""
        return None

    def load_state(self, state: object) -> Callable[[], None]:
        """Check ``state`` (what :meth:`save_state` returned in a process now gone) and return the step that
        adopts it, which cannot fail; ValueError or TypeError, and nothing changed, when it is not such a
        state."""
        raise ValueError(f"{self.name} keeps no state")


class EventBus:
    """``flush_interval_s``: how often the registered flushers (buffered instruments) run after a
    dispatch — 0 flushes after every batch (tests); the telemetry process uses
    ``TELEMETRY_FLUSH_INTERVAL_S``.  A flusher registered with a ``full`` test also runs after the
    dispatch that fills it."""

    def __init__(self, flush_interval_s: float = 0.0, clock: Callable[[], float] = time.monotonic) -> None:
        self._subscribers: list[tuple[Subscriber, frozenset[int]]] = []
        self._exceptions: collections.Counter[str] = collections.Counter()
        self._flushers: list[Callable[[], None]] = []
        self._full: list[Callable[[], bool]] = []
        self._flush_interval_s = flush_interval_s
        self._clock = clock
        self._last_flush = clock()
        self.records_delivered = 0
        self._saved_exceptions: dict[str, int] | None = None  # with a checkpoint: the counts it holds

    def add_flusher(self, flush: Callable[[], None], full: Callable[[], bool] | None = None) -> None:
        self._flushers.append(flush)
        if full is not None:
            self._full.append(full)

    def flush(self) -> None:
        """Run every flusher now (isolated like subscribers: one that raises is logged and counted)."""
        self._last_flush = self._clock()
        for flush in self._flushers:
            try:
                flush()
            except Exception:  # a broken exporter must not stop the pump
                self._exceptions["flush"] += 1
                log.exception("flush_failed")

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
        if self._flushers and (self._clock() - self._last_flush >= self._flush_interval_s
                               or any(full() for full in self._full)):
            self.flush()

    def tick(self, now_ns: int) -> None:
        for subscriber, _ in self._subscribers:
            self._call(subscriber, "on_tick", now_ns)
        if self._flushers and self._clock() - self._last_flush >= self._flush_interval_s:
            self.flush()  # an idle bus still publishes what the last batches left buffered

    def shutdown(self) -> None:
        for subscriber, _ in self._subscribers:
            self._call(subscriber, "shutdown")
        self.flush()

    def subscriber_exception_counts(self) -> dict[str, int]:
        """Exceptions raised so far, by subscriber name (a copy); with a checkpoint, as far as it holds them (what
        is exported never runs ahead of what a restart would load)."""
        return dict(self._exceptions if self._saved_exceptions is None else self._saved_exceptions)

    def save_exception_counts(self) -> dict[str, int]:
        """The counts a checkpoint takes; they are what :meth:`subscriber_exception_counts` reports from now on."""
        self._saved_exceptions = dict(self._exceptions)
        return self._saved_exceptions

    def load_exception_counts(self, counts: dict[str, int]) -> None:
        """Counts a checkpoint held: counting goes on from them."""
        self._exceptions = collections.Counter(counts)
        self._saved_exceptions = dict(counts)

    def _call(self, subscriber: Subscriber, method: str, *args: object) -> None:
        try:
            getattr(subscriber, method)(*args)
        except Exception:  # one subscriber must not take the others down
            name = subscriber.name
            self._exceptions[name] += 1
            if self._exceptions[name] <= 10 or self._exceptions[name] % 1000 == 0:
                log.exception("subscriber_failed", subscriber=name, method=method, count=self._exceptions[name])


def run_all(steps: Iterable[Callable[[], None]]) -> None:
    """Run every step of a :meth:`Subscriber.load_state` made of several."""
    for step in steps:
        step()


def subscribe_all(bus: EventBus, subscribers: Iterable[Subscriber]) -> None:
    for subscriber in subscribers:
        bus.subscribe(subscriber)
