"""L1 counters: chunks read, written and evicted per cache_salt; the eviction loop's ticks."""

from __future__ import annotations

from opentelemetry.metrics import Meter

from mpcache.contract.events import EventType as E
from mpcache.telemetry.batch import EventBatch
from mpcache.telemetry.bus import Subscriber
from mpcache.telemetry.otel import create_instrument
from mpcache.telemetry.salts import SaltCap
from mpcache.telemetry.subscribers.metrics._views import grouped_sums, per_salt


class L1CountersSubscriber(Subscriber):
    """``l1_read``, ``l1_write`` (both write events) and ``l1_evicted``, one ``add`` per salt per batch."""

    _SOURCES = {
        "lmcache_mp.l1_read": (E.L1_READ_FINISHED,),
        "lmcache_mp.l1_write": (E.L1_WRITE_FINISHED, E.L1_WRITE_FINISHED_AND_READ_RESERVED),
        "lmcache_mp.l1_evicted": (E.L1_KEYS_EVICTED,),
    }
    event_types = tuple(etype for sources in _SOURCES.values() for etype in sources)

    def __init__(self, meter: Meter, salt_cap: int) -> None:
        self._counters = [
            (create_instrument(meter, name), etypes, SaltCap(salt_cap)) for name, etypes in self._SOURCES.items()
        ]

    def on_batch(self, batch: EventBatch) -> None:
        for counter, etypes, cap in self._counters:
            for salt, count in per_salt(batch.salt_totals(etypes), cap).items():
                counter.add(count, {"cache_salt": salt})


class L1EvictionLoopSubscriber(Subscriber):
    """``l1_eviction_loop_ticks`` (+1 per tick) and ``l1_eviction_loop_triggered`` (+1 when it evicted)."""

    event_types = (E.L1_EVICTION_LOOP_TICK,)

    def __init__(self, meter: Meter) -> None:
        self._ticks = create_instrument(meter, "lmcache_mp.l1_eviction_loop_ticks")
        self._triggered = create_instrument(meter, "lmcache_mp.l1_eviction_loop_triggered")
        self._ticks.add(0)
        self._triggered.add(0)

    def on_batch(self, batch: EventBatch) -> None:
        ticks = batch.count(self.event_types)
        if ticks:
            self._ticks.add(ticks)
            triggered = grouped_sums(batch, E.L1_EVICTION_LOOP_TICK, (), weight="triggered").get((), 0)
            if triggered:
                self._triggered.add(triggered)
