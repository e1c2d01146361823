"""LMCache's in-process event bus, rebuilt for side-by-side measurement: dataclass events in a bounded
deque and a drain thread calling OpenTelemetry per event.  Benchmarks only.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from mpcache.contract.events import SCHEMAS, EventType
from mpcache.contract.events import EventType as E


@dataclass
class RefEvent:
    event_type: EventType
    timestamp: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)
    session_id: str = ""


class InProcessBus:
    """LMCache's in-process bus, reduced to what a publish and a drain do."""

    def __init__(self, handle: Callable[[RefEvent], None], max_queue: int = 10_000) -> None:
        self._queue: collections.deque[RefEvent] = collections.deque()
        self._max = max_queue
        self._wake = threading.Event()
        self._stop = False
        self._handle = handle
        self.dropped = 0
        self.delivered = 0
        self._thread = threading.Thread(target=self._drain, name="EventBus", daemon=True)
        self._thread.start()

    def publish(self, event: RefEvent) -> None:
        if len(self._queue) >= self._max:
            self.dropped += 1
            return
        event.timestamp = time.time()
        self._queue.append(event)
        self._wake.set()

    def pending(self) -> int:
        return len(self._queue)

    def _drain(self) -> None:
        while not self._stop:
            self._wake.wait(0.1)
            self._wake.clear()
            while self._queue:
                self._handle(self._queue.popleft())
                self.delivered += 1

    def close(self) -> None:
        self._stop = True
        self._wake.set()
        self._thread.join()


class ReferenceMetrics:
    """The reference subscribers' OpenTelemetry calls for the events a cache request publishes."""

    COUNTERS = ("l1_read", "l1_write", "l1_evicted", "lookup_requested", "lookup_hit", "lookup_hit_l1",
                "lookup_hit_l2", "lookup_prompt", "lookup_request_hit", "num_chunks_loaded")

    def __init__(self, meter) -> None:
        self.counter = {name: meter.create_counter(f"lmcache_mp.{name}") for name in self.COUNTERS}
        self.histogram = {name: meter.create_histogram(f"lmcache_mp.{name}")
                          for name in ("l0_l1_store_throughput", "l0_l1_load_throughput")}
        self._pending: dict[tuple[str, str, str], float] = {}

    def handle(self, event: RefEvent) -> None:
        etype, meta = event.event_type, event.metadata
        if etype in _SALT_COUNTERS:
            for salt, count in meta["key_count_per_salt"].items():
                self.counter[_SALT_COUNTERS[etype]].add(count, {"cache_salt": salt})
        elif etype is E.MP_LOOKUP_PREFETCH_END:
            attrs = {"model_name": meta["model_name"], "cache_salt": meta["cache_salt"]}
            for name, key in (("lookup_requested", "requested_tokens"), ("lookup_hit", "hit_tokens"),
                              ("lookup_hit_l1", "l1_hit_tokens"), ("lookup_hit_l2", "l2_hit_tokens"),
                              ("lookup_prompt", "prompt_tokens"), ("lookup_request_hit", "request_hit_tokens")):
                self.counter[name].add(meta[key], attrs)
        elif etype in (E.MP_STORE_START, E.MP_RETRIEVE_START):
            self._pending[(etype.name, event.session_id, meta["device"])] = event.timestamp
        elif etype in (E.MP_STORE_END, E.MP_RETRIEVE_END):
            start = "MP_STORE_START" if etype is E.MP_STORE_END else "MP_RETRIEVE_START"
            started = self._pending.pop((start, event.session_id, meta["device"]), None)
            if started is not None and event.timestamp > started and meta["total_bytes"] > 0:
                name = "l0_l1_store_throughput" if etype is E.MP_STORE_END else "l0_l1_load_throughput"
                self.histogram[name].record(meta["total_bytes"] / 1e9 / (event.timestamp - started), {
                    "engine_id": str(meta["engine_id"]), "device": meta["device"], "model_name": meta["model_name"]})
            if etype is E.MP_RETRIEVE_END and meta["retrieved_count"] > 0:
                self.counter["num_chunks_loaded"].add(meta["retrieved_count"], {
                    "worker_id": str(meta["engine_id"]), "model_name": meta["model_name"],
                    "cache_salt": meta["cache_salt"]})


_SALT_COUNTERS = {E.L1_READ_FINISHED: "l1_read", E.L1_WRITE_FINISHED: "l1_write",
                  E.L1_WRITE_FINISHED_AND_READ_RESERVED: "l1_write", E.L1_KEYS_EVICTED: "l1_evicted"}


class InProcessPublisher:
    """Stands in for :class:`mpcache.shm.publish.Publisher` in a cache process that runs the in-process bus."""

    def __init__(self, bus: InProcessBus) -> None:
        self._bus = bus

    def emit(self, etype: EventType, fields: tuple = (), *, salt_counts=None, sampled=(), session_id: str = "",
             texts: tuple[str, ...] = (), blocks=(), timestamp_ns: int | None = None) -> bool:
        metadata = dict(zip(SCHEMAS[etype].field_names, fields))
        if salt_counts:
            per_salt: dict[str, int] = {}
            for (salt, _model), count in salt_counts.items():
                per_salt[salt] = per_salt.get(salt, 0) + count
            metadata["key_count_per_salt"] = per_salt
        self._bus.publish(RefEvent(etype, metadata=metadata, session_id=session_id))
        return True

    def emit_salted(self, etype: EventType, cache_salt: str, model_name: str, count: int) -> bool:
        self._bus.publish(RefEvent(etype, metadata={"key_count_per_salt": {cache_salt: count}}))
        return True

    def fields_emitter(self, etype: EventType) -> Callable[[tuple, str], bool]:
        return lambda fields, session_id: self.emit(etype, fields, session_id=session_id)


def start_inprocess_reference() -> tuple[InProcessPublisher, Callable[[], None]]:
    """A cache process's reference telemetry: (publisher, stop)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    metrics = ReferenceMetrics(provider.get_meter("reference"))
    bus = InProcessBus(metrics.handle)

    def stop() -> None:
        bus.close()
        provider.shutdown()

    return InProcessPublisher(bus), stop
