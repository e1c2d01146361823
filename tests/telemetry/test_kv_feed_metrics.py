"""The KV event feed's metrics: per model and tier, the capacity KV_CAPACITY events carry (through a real ring),
summed over cache processes and dropped once a process stops publishing; and the feed's gauge-board words per
cache process, as the cache process writes them."""

from __future__ import annotations

import numpy as np

from mpcache.contract.events import EventType as E
from mpcache.shm import layout
from mpcache.shm.gauges import GaugeBoardReader, GaugeSlot, format_gauge_board
from mpcache.telemetry.batch import EventBatch
from mpcache.telemetry.subscribers.metrics.kv_feed import STALE_S, KVFeedSubscriber


def test_capacity_is_the_newest_per_process_summed_and_forgotten_when_stale(pipeline, metrics, segment_factory):
    segment = segment_factory(layout.gauge_board_size(2))
    format_gauge_board(segment, 2)
    now = [100.0]
    subscriber = KVFeedSubscriber(metrics.meter, GaugeBoardReader(segment), clock=lambda: now[0])
    pipeline.subscribe(subscriber)
    publish = pipeline.publish
    publish(E.KV_CAPACITY, ("org/m", "L1", 1 << 30, 4096))
    publish(E.KV_CAPACITY, ("org/m", "L1", 2 << 30, 8192))  # the newer one of the same process counts
    publish(E.KV_CAPACITY, ("org/m", "L2:fs0", 10 << 30, 0))
    pipeline.deliver()
    # a second cache process's event (producer 1), as the pump hands its ring's batches over
    pipeline.publish(E.KV_CAPACITY, ("org/m", "L1", 1 << 30, 4096))
    cells = pipeline.ring.reader.read_batch()
    pipeline.bus.dispatch(EventBatch(1, np.asarray(cells), pipeline.ring.names))
    assert (3 << 30, 12288, 10 << 30, 0) == (
        metrics.value("mpcache.kv_capacity_bytes", model_name="org/m", tier="L1"),
        metrics.value("mpcache.kv_capacity_tokens", model_name="org/m", tier="L1"),
        metrics.value("mpcache.kv_capacity_bytes", model_name="org/m", tier="L2:fs0"),
        metrics.value("mpcache.kv_capacity_tokens", model_name="org/m", tier="L2:fs0"))
    now[0] += STALE_S + 1
    subscriber.on_tick(0)
    assert {} == metrics.series("mpcache.kv_capacity_bytes")


def test_the_feeds_words_are_read_per_cache_process(metrics, segment_factory):
    segment = segment_factory(layout.gauge_board_size(2))
    format_gauge_board(segment, 2)
    KVFeedSubscriber(metrics.meter, GaugeBoardReader(segment))
    slot = GaugeSlot(segment, 1)
    for word, value in ((layout.G_KV_SUBSCRIBERS, 2), (layout.G_KV_LAG, 17), (layout.G_KV_RECORDS, 900),
                        (layout.G_KV_SKIPPED, 40), (layout.G_KV_RESYNCS, 3)):
        slot.set(word, value)
    assert [(0, 2), (0, 17), (0, 900), (0, 40), (0, 3)] == [
        (metrics.value(name, worker="0"), metrics.value(name, worker="1"))
        for name in ("mpcache.kv_event_subscribers", "mpcache.kv_event_lag_records", "mpcache.kv_event_records",
                     "mpcache.kv_event_skipped_records", "mpcache.kv_event_resyncs")]
    slot.clear()  # a cache process gone: its gauges drop, its counts stay
    assert [0, 0, 900, 40, 3] == [metrics.value(name, worker="1") for name in (
        "mpcache.kv_event_subscribers", "mpcache.kv_event_lag_records", "mpcache.kv_event_records",
        "mpcache.kv_event_skipped_records", "mpcache.kv_event_resyncs")]
