"""Metrics subscribers: events and shared state → OpenTelemetry instruments.

The plain counters are computed from the metric table by one table-driven
subscriber per section (:mod:`.counters`); histograms and observable instruments,
whose logic is more than a table row, have one module per concern (their
sources are declared in the table all the same).  Counter subscribers
aggregate a whole batch column-wise; their counters and histograms are buffered
(:mod:`mpcache.telemetry.buffered`), so the SDK sees one call per (metric,
attribute set) per flush of the bus, not per batch or per event;
subscribers with per-key state keep it bounded and expire it in ``on_tick``.
Every instrument is created from :mod:`mpcache.telemetry.metric_table`.
"""

from __future__ import annotations

from opentelemetry.metrics import MeterProvider

from mpcache.config import Config
from mpcache.shm.gauges import GaugeBoardReader
from mpcache.telemetry.buffered import BufferedMeter, InstrumentBuffer
from mpcache.telemetry.bus import EventBus, Subscriber, subscribe_all
from mpcache.telemetry.checkpoint import Checkpoint
from mpcache.telemetry.pump import Pump
from mpcache.telemetry.subscribers.metrics.counters import counter_subscribers
from mpcache.telemetry.subscribers.metrics.event_bus import (
    EventBusSelfMetricsSubscriber,
)
from mpcache.telemetry.subscribers.metrics.gauges import L1StateGaugesSubscriber
from mpcache.telemetry.subscribers.metrics.kv_feed import KVFeedSubscriber, RelayCounts
from mpcache.telemetry.subscribers.metrics.l0_l1_throughput import (
    L0L1ThroughputSubscriber,
)
from mpcache.telemetry.subscribers.metrics.l0_lifecycle import L0LifecycleSubscriber
from mpcache.telemetry.subscribers.metrics.l1_lifecycle import L1LifecycleSubscriber
from mpcache.telemetry.subscribers.metrics.l2_gauges import L2StateGaugesSubscriber
from mpcache.telemetry.subscribers.metrics.l2_throughput import L2ThroughputSubscriber
from mpcache.telemetry.subscribers.metrics.lmcache_requests import LMCacheRequestTimesSubscriber
from mpcache.telemetry.subscribers.metrics.mrc import MissRatioSubscriber
from mpcache.telemetry.subscribers.metrics.processes import ProcessesSubscriber
from mpcache.telemetry.subscribers.metrics.service import ServiceStateSubscriber
from mpcache.telemetry.subscribers.metrics.sm_lifecycle import SMLifecycleSubscriber

METER_NAME = "mpcache"


def build_metrics_subscribers(
    config: Config,
    meter_provider: MeterProvider,
    *,
    pump: Pump,
    bus: EventBus,
    gauge_reader: GaugeBoardReader | None,
    readiness: GaugeBoardReader | None = None,
    checkpoint: Checkpoint | None = None,
    kv_relay: RelayCounts | None = None,
) -> list[Subscriber]:
    """Every metrics subscriber, instruments created on ``meter_provider``, subscribed to ``bus`` (which flushes
    their buffer).

    Without a ``gauge_reader`` (tests) the gauge-board gauges are not created, without ``readiness`` (the
    reader whose staleness decides "ready") the service's gauges and its processes'.  With a ``checkpoint`` the
    subscribers go on from the state it holds, and every flush of the bus writes it.
    """
    buffer = InstrumentBuffer(started_ns=checkpoint.started_ns if checkpoint is not None else None)
    meter = BufferedMeter(meter_provider.get_meter(METER_NAME), buffer)
    cap = config.cache_salt_cap
    l2_names = [config.l2_name(index) for index in range(len(config.l2))]
    series = config.metric_series_cap
    subscribers: list[Subscriber] = [*counter_subscribers(meter, cap, l2_names, series)]
    subscribers += [
        L1LifecycleSubscriber(meter),
        SMLifecycleSubscriber(meter, cap),
        L0L1ThroughputSubscriber(meter, series_cap=series),
        L2ThroughputSubscriber(meter),
        L0LifecycleSubscriber(meter, series_cap=series),
        EventBusSelfMetricsSubscriber(meter, pump, bus, checkpoint),
        LMCacheRequestTimesSubscriber(meter),
        MissRatioSubscriber(meter, config),
    ]
    if gauge_reader is not None:
        subscribers.append(L1StateGaugesSubscriber(meter, gauge_reader))
        subscribers.append(L2StateGaugesSubscriber(meter, gauge_reader, l2_names))
    if readiness is not None:
        subscribers.append(ServiceStateSubscriber(meter, readiness))
        subscribers.append(KVFeedSubscriber(meter, readiness, relay=kv_relay))
        subscribers.append(ProcessesSubscriber(meter, readiness))
    subscribe_all(bus, subscribers)  # before the checkpoint reads the rings on for them
    if checkpoint is not None:
        checkpoint.bind(pump, bus, buffer, subscribers)  # and flushes: the zero-valued counters exist from start-up
    else:
        bus.add_flusher(buffer.flush, buffer.full)
        buffer.flush()  # the zero-valued counters exist from start-up
    return subscribers
