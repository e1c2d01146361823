"""L0↔L1 throughput: START/END pairing on (session_id, device) per direction, and expiry of lone STARTs."""

from __future__ import annotations

from mpcache.contract.events import EventType as E
from mpcache.telemetry import buffered
from mpcache.telemetry.bus import EventBus
from mpcache.telemetry.subscribers.metrics.l0_l1_throughput import (
    L0L1ThroughputSubscriber,
)

T0 = 1_700_000_000 * 10**9
MS = 10**6
ATTRS = {"engine_id": "3", "device": "cuda:0", "model_name": "llama"}


def store(pipeline, session, device, start_ms, end_ms, nbytes):
    if start_ms is not None:
        pipeline.publish(E.MP_STORE_START, (device, 3, "llama"), session_id=session, timestamp_ns=T0 + start_ms * MS)
    pipeline.publish(E.MP_STORE_END, (device, 3, "llama", 4, nbytes, 1024), session_id=session,
                     timestamp_ns=T0 + end_ms * MS)


def test_store_and_load_pairs_record_bytes_over_duration_in_gbs(pipeline, metrics):
    """1 GB stored in 100 ms is 10 GB/s; 2 GB loaded in 1 s is 2 GB/s, each in its own histogram."""
    pipeline.subscribe(L0L1ThroughputSubscriber(metrics.meter))
    store(pipeline, "req", "cuda:0", 0, 100, 10**9)
    pipeline.publish(E.MP_RETRIEVE_START, ("cuda:0", 3, "llama"), session_id="req", timestamp_ns=T0)
    pipeline.deliver()
    pipeline.publish(E.MP_RETRIEVE_END, ("cuda:0", 3, "llama", "salt", 8, 2 * 10**9, 2048), session_id="req",
                     timestamp_ns=T0 + 1000 * MS)
    pipeline.deliver()
    assert ((1, 10.0), (1, 2.0)) == (
        metrics.histogram_values("lmcache_mp.l0_l1_store_throughput", **ATTRS),
        metrics.histogram_values("lmcache_mp.l0_l1_load_throughput", **ATTRS))


def test_same_request_on_two_devices_pairs_per_device(pipeline, metrics):
    """Two devices copying for one request id each get their own sample (1 and 4 GB/s), tagged by device."""
    pipeline.subscribe(L0L1ThroughputSubscriber(metrics.meter))
    pipeline.publish(E.MP_STORE_START, ("cuda:0", 3, "llama"), session_id="req", timestamp_ns=T0)
    pipeline.publish(E.MP_STORE_START, ("cuda:1", 3, "llama"), session_id="req", timestamp_ns=T0)
    store(pipeline, "req", "cuda:1", None, 250, 10**9)
    store(pipeline, "req", "cuda:0", None, 1000, 10**9)
    pipeline.deliver()
    assert ((1, 1.0), (1, 4.0)) == (
        metrics.histogram_values("lmcache_mp.l0_l1_store_throughput", **ATTRS),
        metrics.histogram_values("lmcache_mp.l0_l1_store_throughput", **{**ATTRS, "device": "cuda:1"}))


def test_unpaired_empty_or_instant_copies_record_nothing(pipeline, metrics):
    """END without START, 0 bytes, and zero duration are all dropped."""
    pipeline.subscribe(L0L1ThroughputSubscriber(metrics.meter))
    store(pipeline, "orphan", "cuda:0", None, 100, 10**9)
    store(pipeline, "empty", "cuda:0", 0, 100, 0)
    store(pipeline, "instant", "cuda:0", 50, 50, 10**9)
    pipeline.deliver()
    assert {} == metrics.series("lmcache_mp.l0_l1_store_throughput")


def test_starts_without_end_expire_on_tick(pipeline, metrics):
    """A START older than the TTL is forgotten at the next tick, so its late END records nothing."""
    subscriber = L0L1ThroughputSubscriber(metrics.meter, pending_ttl_s=60)
    pipeline.subscribe(subscriber)
    pipeline.publish(E.MP_STORE_START, ("cuda:0", 3, "llama"), session_id="old", timestamp_ns=T0)
    pipeline.publish(E.MP_STORE_START, ("cuda:0", 3, "llama"), session_id="new", timestamp_ns=T0 + 30_000 * MS)
    pipeline.deliver()
    pipeline.bus.tick(T0 + 60_000 * MS)
    pending_after_tick = subscriber.pending
    store(pipeline, "old", "cuda:0", None, 61_000, 10**9)
    pipeline.deliver()
    assert (1, {}) == (pending_after_tick, metrics.series("lmcache_mp.l0_l1_store_throughput"))


def test_pending_starts_are_bounded(pipeline, metrics):
    """With max_pending=3, ten STARTs without END leave three pending."""
    subscriber = L0L1ThroughputSubscriber(metrics.meter, max_pending=3)
    pipeline.subscribe(subscriber)
    for i in range(10):
        pipeline.publish(E.MP_STORE_START, ("cuda:0", 3, "llama"), session_id=f"r{i}", timestamp_ns=T0 + i)
    pipeline.deliver()
    assert 3 == subscriber.pending


def test_buffered_rates_wait_for_the_flush_and_a_full_buffer_does_not(monkeypatch, pipeline, metrics):
    """On a buffered meter the rates of a batch reach the SDK at the bus's flush, per series in one call and
    in order (the sum is that of the samples); a buffer that holds MAX_HELD_SAMPLES samples is flushed after
    the dispatch that filled it, though the interval (an hour, on a clock standing still) has not passed."""
    monkeypatch.setattr(buffered, "MAX_HELD_SAMPLES", 4)
    buffer = buffered.InstrumentBuffer()
    pipeline.bus = EventBus(flush_interval_s=3600.0, clock=lambda: 0.0)
    pipeline.bus.add_flusher(buffer.flush, buffer.full)
    pipeline.subscribe(L0L1ThroughputSubscriber(buffered.BufferedMeter(metrics.meter, buffer)))
    for index, (end_ms, nbytes) in enumerate(((100, 10**9), (1000, 10**9), (50, 10**9))):
        store(pipeline, f"r{index}", "cuda:0", 0, end_ms, nbytes)
    pipeline.deliver()
    held = metrics.histogram_values("lmcache_mp.l0_l1_store_throughput", **ATTRS)
    store(pipeline, "r3", "cuda:0", 0, 500, 10**9)
    pipeline.deliver()
    assert ((0, 0.0), (4, 10.0 + 1.0 + 20.0 + 2.0), 0) == (
        held, metrics.histogram_values("lmcache_mp.l0_l1_store_throughput", **ATTRS), buffer.held_samples)
