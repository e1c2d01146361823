"""Observable instruments: gauge-board gauges and bus self-monitoring, plus the full subscriber set."""

from __future__ import annotations

import dataclasses

import pytest

from mpcache.contract.events import MRC_HEAD_FIELDS, MRC_TAIL_MARK_FIELDS
from mpcache.contract.events import EventType as E
from mpcache.shm import layout
from mpcache.shm.gauges import GaugeBoardReader, GaugeSlot, format_gauge_board
from mpcache.telemetry import metric_table
from mpcache.telemetry.bus import Subscriber
from mpcache.telemetry.kvpub import FeedCounts
from mpcache.telemetry.subscribers.metrics import build_metrics_subscribers
from mpcache.telemetry.subscribers.metrics.event_bus import (
    EventBusSelfMetricsSubscriber,
)
from mpcache.telemetry.subscribers.metrics.gauges import L1StateGaugesSubscriber
from mpcache.telemetry.subscribers.metrics.service import ServiceStateSubscriber

NOW = 1_700_000_100 * 10**9


@pytest.fixture
def board(segment_factory):
    """A 3-slot gauge board: slots 0 and 1 alive, slot 2 with a stale heartbeat."""
    segment = segment_factory(layout.gauge_board_size(3))
    format_gauge_board(segment, 3)
    values = {0: (100, 1000, 2, NOW), 1: (300, 1000, 1, NOW - 1), 2: (999, 999, 9, NOW - 60 * 10**9)}
    for slot, (used, capacity, prefetch, beat) in values.items():
        writer = GaugeSlot(segment, slot, clock_ns=lambda beat=beat: beat)
        writer.set(layout.G_L1_USED, used)
        writer.set(layout.G_L1_CAPACITY, capacity)
        writer.set(layout.G_ACTIVE_PREFETCH, prefetch)
        writer.heartbeat(pid=1000 + slot)
    return GaugeBoardReader(segment, stale_after_s=5.0, clock_ns=lambda: NOW)


def _two_live_one_stale(segment_factory, words: dict[int, dict[int, int]]):
    """A 3-slot gauge board with each slot's ``words``: slots 0 and 1 with fresh heartbeats, slot 2 a minute old."""
    segment = segment_factory(layout.gauge_board_size(3))
    format_gauge_board(segment, 3)
    beats = {0: NOW, 1: NOW - 1, 2: NOW - 60 * 10**9}
    for slot, values in words.items():
        writer = GaugeSlot(segment, slot, clock_ns=lambda beat=beats[slot]: beat)
        for word, value in values.items():
            writer.set(word, value)
        writer.heartbeat(pid=1000 + slot)
    return segment


def test_l1_gauges_sum_live_slots_only(board, metrics):
    """Usage ratio 400/2000, 400 bytes and 3 prefetch jobs: the stale slot is left out."""
    L1StateGaugesSubscriber(metrics.meter, board)
    assert (0.2, 400, 3) == (metrics.value("lmcache_mp.l1_usage_ratio"),
                             metrics.value("lmcache_mp.l1_memory_usage_bytes"),
                             metrics.value("lmcache_mp.active_prefetch_jobs"))


def test_usage_ratio_is_zero_without_live_slots(segment_factory, metrics):
    """A board where no cache process is running reports a usage ratio of 0, not a division error."""
    segment = segment_factory(layout.gauge_board_size(2))
    format_gauge_board(segment, 2)
    L1StateGaugesSubscriber(metrics.meter, GaugeBoardReader(segment, clock_ns=lambda: NOW))
    assert 0.0 == metrics.value("lmcache_mp.l1_usage_ratio")


def test_service_gauges_read_slots_heartbeats_restarts_and_refusals(segment_factory, metrics):
    """3 slots configured, 2 ready (fresh heartbeats); cache restarts summed over every slot (the stale one
    too), telemetry restarts from the board's header; refused and unidentified LMCache connections and segments
    recreated and buffers refused per slot, stale or not; L1 fragmentation over the ready slots only."""
    segment = _two_live_one_stale(segment_factory, {slot: {
        layout.G_RESTARTS: restarts, layout.G_LMCACHE_REFUSED: refused, layout.G_LMCACHE_UNIDENTIFIED: 10 * refused + 7,
        layout.G_SEGMENTS_RECREATED: restarts, layout.G_BUFFERS_REFUSED: 3 * refused + 1,
        layout.G_L1_FRAGMENTATION: fragmentation}
        for slot, (restarts, refused, fragmentation) in {0: (1, 0, 64), 1: (0, 4, 32), 2: (2, 1, 999)}.items()})
    segment.buf[layout.GAUGE_OFF_TELEMETRY_RESTARTS:layout.GAUGE_OFF_TELEMETRY_RESTARTS + 8] = (5).to_bytes(8, "little")
    ServiceStateSubscriber(metrics.meter, GaugeBoardReader(segment, stale_after_s=2.0, clock_ns=lambda: NOW))
    worker = [frozenset({("worker", str(slot))}) for slot in range(3)]
    assert (3, 2, {frozenset({("role", "cache")}): 3, frozenset({("role", "telemetry")}): 5},
            {worker[0]: 0, worker[1]: 4, worker[2]: 1}, {worker[0]: 7, worker[1]: 47, worker[2]: 17},
            {worker[0]: 1, worker[1]: 0, worker[2]: 2}, {worker[0]: 1, worker[1]: 13, worker[2]: 4}, 96) == (
        metrics.value("mpcache.cache_processes"), metrics.value("mpcache.cache_processes_ready"),
        metrics.series("mpcache.child_restarts"), metrics.series("mpcache.lmcache_refused_connections"),
        metrics.series("mpcache.lmcache_unidentified_connections"), metrics.series("mpcache.segments_recreated"),
        metrics.series("mpcache.buffers_refused"), metrics.value("mpcache.l1_fragmentation_bytes"))


def test_l1_admission_reads_the_chance_weighted_by_capacity_and_the_refusals_per_slot(segment_factory, metrics):
    """Two live slots, one of 3,000 bytes admitting every store and one of 1,000 admitting a quarter: 3,250 of
    4,000 bytes admit, 0.8125; the stale slot (chance 0) is left out of the chance, its refusals still shown."""
    segment = _two_live_one_stale(segment_factory, {
        slot: {layout.G_L1_CAPACITY: capacity, layout.G_L1_ADMITTING: admitting, layout.G_L1_REFUSED: refused}
        for slot, (capacity, admitting, refused) in {0: (3000, 3000, 0), 1: (1000, 250, 96), 2: (5000, 0, 7)}.items()})
    ServiceStateSubscriber(metrics.meter, GaugeBoardReader(segment, stale_after_s=2.0, clock_ns=lambda: NOW))
    worker = [frozenset({("worker", str(slot))}) for slot in range(3)]
    assert (0.8125, {worker[0]: 0, worker[1]: 96, worker[2]: 7}) == (
        metrics.value("mpcache.l1_admission_chance"), metrics.series("mpcache.l1_refused"))


def test_l1_admission_chance_holds_each_slot_within_its_capacity(segment_factory, metrics):
    """Torn or cleared words never take the chance out of 0..1: a slot admitting more than its capacity counts its
    capacity, one below 0 counts 0, and one whose capacity reads 0 (being cleared) is left out: 1,000 of 2,000."""
    segment = _two_live_one_stale(segment_factory, {
        0: {layout.G_L1_CAPACITY: 1000, layout.G_L1_ADMITTING: 5000},
        1: {layout.G_L1_CAPACITY: 1000, layout.G_L1_ADMITTING: -3}})
    GaugeSlot(segment, 2, clock_ns=lambda: NOW).heartbeat(pid=1002)  # live, its capacity word 0
    GaugeSlot(segment, 2).set(layout.G_L1_ADMITTING, 800)
    ServiceStateSubscriber(metrics.meter, GaugeBoardReader(segment, stale_after_s=2.0, clock_ns=lambda: NOW))
    assert 0.5 == metrics.value("mpcache.l1_admission_chance")


def test_l1_admission_chance_has_no_value_without_a_live_slot(segment_factory, metrics):
    """No cache process running: no chance to report (not a division error, nor a made-up 0 or 1)."""
    segment = segment_factory(layout.gauge_board_size(2))
    format_gauge_board(segment, 2)
    ServiceStateSubscriber(metrics.meter, GaugeBoardReader(segment, clock_ns=lambda: NOW))
    assert {} == metrics.series("mpcache.l1_admission_chance")


class Exploding(Subscriber):
    event_types = (E.L1_READ_FINISHED,)

    def on_batch(self, batch):
        raise RuntimeError("boom")


def test_bus_self_metrics_report_ring_and_bus_state(pipeline, metrics):
    """3 records unconsumed for 2.5 s and 2 drops are reported; after delivery, 1 exception for the raising class."""
    published_ns = pipeline.ring.timestamp_ns  # the fixture publisher's fixed clock
    pump = pipeline.pump(clock_ns=lambda: published_ns + 2_500_000_000)
    EventBusSelfMetricsSubscriber(metrics.meter, pump, pipeline.bus)
    pipeline.subscribe(Exploding())
    for _ in range(3):
        pipeline.publish(E.L1_READ_FINISHED, salt_counts={("a", "m"): 1})
    pipeline.ring.writer.count_drop()
    pipeline.ring.writer.count_drop()
    before = [metrics.value(f"lmcache_mp.event_bus.{name}")
              for name in ("queue_depth", "drain_lag_seconds", "dropped_events_total")]
    pipeline.deliver()
    after = (metrics.value("lmcache_mp.event_bus.queue_depth"),
             metrics.series("lmcache_mp.event_bus.subscriber_exceptions"))
    assert ([3, 2.5, 2], (0, {frozenset({("subscriber_name", "Exploding")}): 1})) == (before, after)


class Quiet(Subscriber):
    event_types = (E.L1_READ_FINISHED,)

    def on_batch(self, batch):
        return None


def test_subscriber_exceptions_has_a_zero_series_per_subscriber_from_start_up(pipeline, metrics):
    """Before anything is published, every subscribed subscriber reports subscriber_exceptions = 0."""
    EventBusSelfMetricsSubscriber(metrics.meter, pipeline.pump(), pipeline.bus)
    pipeline.subscribe(Quiet(), Exploding())
    expected = {frozenset({("subscriber_name", "Quiet")}): 0, frozenset({("subscriber_name", "Exploding")}): 0}
    assert expected == metrics.series("lmcache_mp.event_bus.subscriber_exceptions")


# Every OTel instrument of the table but the exporter's own (build info), which MetricsExport creates.
EVERY_METRIC = {spec.otel_name for spec in metric_table.METRICS
                if spec.otel_name and not spec.source.derivation.exporter_made}


def test_built_subscribers_cover_every_metric(pipeline, metrics, config, board):
    """build_metrics_subscribers wires every metric of the table: one event of each kind shows all of them (the
    KV event relay's counts as the telemetry process hands them over with --kv-events-endpoint)."""
    config = dataclasses.replace(config, l2=[{"type": "fs"}, {"type": "mock"}])
    build_metrics_subscribers(config, metrics.provider, pump=pipeline.pump(), bus=pipeline.bus, gauge_reader=board,
                              readiness=board, kv_relay=lambda: [FeedCounts()])
    pipeline.subscribe(Exploding())
    chunk = (7, "a", "m")
    publish = pipeline.publish
    t0 = pipeline.ring.timestamp_ns
    publish(E.L1_WRITE_FINISHED, salt_counts={("a", "m"): 1}, sampled=[chunk], timestamp_ns=t0)
    publish(E.L1_READ_FINISHED, salt_counts={("a", "m"): 1}, sampled=[chunk], timestamp_ns=t0 + 1)
    publish(E.L1_KEYS_EVICTED, salt_counts={("a", "m"): 1}, sampled=[chunk], timestamp_ns=t0 + 2)
    publish(E.L1_WRITE_FINISHED, salt_counts={("a", "m"): 1}, sampled=[chunk], timestamp_ns=t0 + 3)
    publish(E.L1_EVICTION_LOOP_TICK, (0.9, 0.8, True))
    publish(E.L1_ALLOCATION_FAILED, ("l1_store",), salt_counts={("a", "m"): 1})
    publish(E.L1_READ_FAILED, ("l1_retrieve", "write_locked"), salt_counts={("a", "m"): 1})
    publish(E.TIMEOUT_RAISED, ("L2Timeout",), texts=("slow", ""))
    publish(E.SM_WRITE_FINISHED, (0,), salt_counts={("a", "m"): 1}, sampled=[chunk], timestamp_ns=t0)
    publish(E.SM_READ_PREFETCHED_FINISHED, (0,), salt_counts={("a", "m"): 1}, sampled=[chunk],
            timestamp_ns=t0 + 5)
    publish(E.MP_LOOKUP_PREFETCH_END, ("m", "a", 1, 256, 256, 256, 0, "", 256, 256, 1, 0))
    for start, end, fields in ((E.MP_STORE_START, E.MP_STORE_END, ("cuda:0", 1, "m", 1, 4096, 256)),
                               (E.MP_RETRIEVE_START, E.MP_RETRIEVE_END, ("cuda:0", 1, "m", "a", 1, 4096, 256))):
        publish(E.MP_STORE_SUBMITTED if start is E.MP_STORE_START else E.MP_RETRIEVE_SUBMITTED, ("cuda:0",),
                session_id="r", timestamp_ns=t0)
        publish(start, ("cuda:0", 1, "m"), session_id="r", timestamp_ns=t0)
        publish(end, fields, session_id="r", timestamp_ns=t0 + 1000)
    # L2
    publish(E.L2_STORE_SUBMITTED, (0, 1, "fs", 1, 4096), salt_counts={("a", "m"): 1}, timestamp_ns=t0)
    publish(E.L2_STORE_COMPLETED, (0, 1, "fs", 4096, 1, 0), salt_counts={("a", "m"): 1}, timestamp_ns=t0 + 1000)
    publish(E.L2_PREFETCH_LOOKUP_SUBMITTED, (9, 1, 1), salt_counts={("a", "m"): 1})
    publish(E.L2_PREFETCH_LOOKUP_COMPLETED, (9, 1))
    publish(E.L2_PREFETCH_LOAD_SUBMITTED, (9, 1, 1), salt_counts={("a", "m"): 1})
    publish(E.L2_LOAD_TASK_SUBMITTED, (9, 0, 2, "fs", 1, 4096), timestamp_ns=t0)
    publish(E.L2_LOAD_TASK_COMPLETED, (9, 0, 2, "fs", 1, 0), timestamp_ns=t0 + 1000)
    publish(E.L2_LOAD_ORIGIN, (0, "fs", "self", 1))
    publish(E.L2_PREFETCH_LOAD_COMPLETED, (9, 1, 0), salt_counts={("a", "m"): 1})
    publish(E.L2_PREFETCH_FAILED, ("not_found",), salt_counts={("a", "m"): 1})
    publish(E.L2_KEYS_EVICTED, (0, "fs", 1), salt_counts={("a", "m"): 1})
    # L0: allocate, release, reuse (reuse gap), reallocate with other tokens (lifetime, idle)
    publish(E.MP_VLLM_BLOCK_ALLOCATION, (3, "m", 1, 1), blocks=[("r1", 5, 111)], timestamp_ns=t0)
    publish(E.MP_VLLM_END_SESSION, session_id="r1", timestamp_ns=t0 + 1)
    publish(E.MP_VLLM_BLOCK_ALLOCATION, (3, "m", 1, 1), blocks=[("r2", 5, 111)], timestamp_ns=t0 + 2)
    publish(E.MP_VLLM_BLOCK_ALLOCATION, (3, "m", 1, 1), blocks=[("r3", 5, 222)], timestamp_ns=t0 + 3)
    publish(E.LMCACHE_REQUEST_TIMES, ("lookup", 1, 2000, 2000, 2000, *[1] + [0] * 14))
    publish(E.KV_CAPACITY, ("m", "L1", 1 << 30, 4096))
    # a sampled store, then a lookup that misses it (evicted, eviction regret) and a key never stored (cold)
    publish(E.MRC_STORE_SAMPLED, ("m", "a", 1, 4096), sampled=[chunk])
    publish(E.MRC_LOOKUP_SAMPLED, ("m", "a", 1, 0, 0, 0, 0, 0, 0, *[0] * len(MRC_HEAD_FIELDS + MRC_TAIL_MARK_FIELDS)),
            sampled=[chunk, (8, "a", "m")])
    pipeline.deliver()
    # blend counters and the gauges read 0 without events
    assert set() == EVERY_METRIC - {name for name, points in metrics.collect().items() if points}
