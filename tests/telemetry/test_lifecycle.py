"""L1 chunk lifecycle and storage-manager reuse-gap histograms, from sampled keys of real events."""

from __future__ import annotations

from mpcache.contract.events import EventType as E
from mpcache.telemetry.subscribers.metrics.l1_lifecycle import L1LifecycleSubscriber
from mpcache.telemetry.subscribers.metrics.sm_lifecycle import SMLifecycleSubscriber

T0 = 1_700_000_000 * 10**9
S = 10**9
CHUNK = (0xFEDCBA9876543210, "tenant", "llama")  # (hash, cache_salt, model_name); hash uses the top bit
OTHER = (42, "tenant", "llama")


def emit_keys(pipeline, etype, at_s, keys, **extra):
    pipeline.publish(etype, extra.pop("fields", ()),
                     salt_counts=extra.pop("salt_counts", {("tenant", "llama"): len(keys)}),
                     sampled=list(keys), timestamp_ns=T0 + int(at_s * S), **extra)


def test_eviction_records_lifetime_and_idle_time(pipeline, metrics):
    """Written at 0 s, read at 4 s, evicted at 10 s: lifetime 10 s, idle 6 s, one reuse gap of 4 s."""
    pipeline.subscribe(L1LifecycleSubscriber(metrics.meter))
    emit_keys(pipeline, E.L1_WRITE_FINISHED, 0, [CHUNK])
    emit_keys(pipeline, E.L1_READ_FINISHED, 4, [CHUNK])
    emit_keys(pipeline, E.L1_KEYS_EVICTED, 10, [CHUNK])
    pipeline.deliver()
    assert [(1, 10.0), (1, 6.0), (1, 4.0)] == [
        metrics.histogram_values(f"lmcache_mp.{name}")
        for name in ("l1_chunk_lifetime", "l1_chunk_idle_before_evict", "l1_chunk_reuse_gap")]


def test_rewrite_after_eviction_records_the_evict_reuse_gap(pipeline, metrics):
    """Evicted at 10 s and written again at 25 s (through L2 prefetch): one evict→reuse gap of 15 s."""
    pipeline.subscribe(L1LifecycleSubscriber(metrics.meter))
    emit_keys(pipeline, E.L1_WRITE_FINISHED, 0, [CHUNK])
    emit_keys(pipeline, E.L1_KEYS_EVICTED, 10, [CHUNK])
    pipeline.deliver()
    emit_keys(pipeline, E.L1_WRITE_FINISHED_AND_READ_RESERVED, 25, [CHUNK])
    pipeline.deliver()
    assert (1, 15.0) == metrics.histogram_values("lmcache_mp.l1_chunk_evict_reuse_gap")


def test_evictions_not_reused_within_the_cap_are_recorded_at_the_cap_on_tick(pipeline, metrics):
    """A tick past eviction + 300 s records exactly 300 s for that chunk only, and forgets it."""
    subscriber = L1LifecycleSubscriber(metrics.meter)
    pipeline.subscribe(subscriber)
    emit_keys(pipeline, E.L1_KEYS_EVICTED, 0, [CHUNK])
    emit_keys(pipeline, E.L1_KEYS_EVICTED, 100, [OTHER])
    pipeline.deliver()
    pipeline.bus.tick(T0 + 299 * S)
    before = metrics.histogram_values("lmcache_mp.l1_chunk_evict_reuse_gap")
    pipeline.bus.tick(T0 + 300 * S)
    emit_keys(pipeline, E.L1_WRITE_FINISHED, 500, [CHUNK])  # too late: already recorded at the cap
    pipeline.deliver()
    assert ((0, 0.0), (1, 300.0), 2) == (
        before, metrics.histogram_values("lmcache_mp.l1_chunk_evict_reuse_gap"), subscriber.tracked)


def test_late_rewrite_before_the_tick_is_capped(pipeline, metrics):
    """A rewrite 400 s after eviction that arrives before any tick records the cap, not 400 s."""
    pipeline.subscribe(L1LifecycleSubscriber(metrics.meter))
    emit_keys(pipeline, E.L1_KEYS_EVICTED, 0, [CHUNK])
    emit_keys(pipeline, E.L1_WRITE_FINISHED, 400, [CHUNK])
    pipeline.deliver()
    assert (1, 300.0) == metrics.histogram_values("lmcache_mp.l1_chunk_evict_reuse_gap")


def test_tracked_keys_are_bounded(pipeline, metrics):
    """With max_tracked=4, 50 distinct chunks written leave 4 live entries; 50 evicted leave 4 waiting evictions."""
    subscriber = L1LifecycleSubscriber(metrics.meter, max_tracked=4)
    pipeline.subscribe(subscriber)
    keys = [(i, "tenant", "llama") for i in range(50)]
    emit_keys(pipeline, E.L1_WRITE_FINISHED, 0, keys[:25])
    emit_keys(pipeline, E.L1_WRITE_FINISHED, 1, keys[25:])
    pipeline.deliver()
    after_writes = subscriber.tracked
    emit_keys(pipeline, E.L1_KEYS_EVICTED, 2, keys)
    pipeline.deliver()
    assert (4, 4) == (after_writes, subscriber.tracked)


def test_unsampled_events_record_nothing(pipeline, metrics):
    """Events without sampled keys (the common case) leave every lifecycle histogram empty."""
    pipeline.subscribe(L1LifecycleSubscriber(metrics.meter))
    for at in range(3):
        pipeline.publish(E.L1_WRITE_FINISHED, salt_counts={("tenant", "llama"): 8}, timestamp_ns=T0 + at * S)
        pipeline.publish(E.L1_KEYS_EVICTED, salt_counts={("tenant", "llama"): 8}, timestamp_ns=T0 + at * S)
    pipeline.deliver()
    assert {} == {name: points for name, points in metrics.collect().items() if points}


def test_real_reuse_gap_is_recorded_on_reads_with_the_salts_access_distance(pipeline, metrics):
    """Write at 0 s, 30 unsampled chunk accesses, read at 5 s: one sample of 5 s and 31 accesses (the write's own
    chunk plus 30) for that salt; the write itself records nothing, another salt's traffic does not count."""
    pipeline.subscribe(SMLifecycleSubscriber(metrics.meter, salt_cap=10))
    emit_keys(pipeline, E.SM_WRITE_FINISHED, 0, [CHUNK], fields=(0,), salt_counts={("tenant", "llama"): 1})
    pipeline.deliver()
    after_write = metrics.histogram_values("lmcache_mp.real_reuse_gap", cache_salt="tenant")
    pipeline.publish(E.SM_WRITE_FINISHED, (0,), salt_counts={("tenant", "llama"): 20, ("other", "llama"): 99})
    pipeline.publish(E.SM_READ_PREFETCHED_FINISHED, (0,), salt_counts={("tenant", "qwen"): 10})
    emit_keys(pipeline, E.SM_READ_PREFETCHED_FINISHED, 5, [CHUNK], fields=(0,), salt_counts={("tenant", "llama"): 1})
    pipeline.deliver()
    assert ((0, 0.0), (1, 5.0), (1, 31.0)) == (
        after_write, metrics.histogram_values("lmcache_mp.real_reuse_gap", cache_salt="tenant"),
        metrics.histogram_values("lmcache_mp.real_reuse_gap_objects", cache_salt="tenant"))


def test_each_salt_s_access_distance_counts_its_own_accesses_in_a_batch_of_many_salts(pipeline, metrics):
    """Six salts in one batch, their records interleaved: each writes its key, has 3 × its number of unsampled
    accesses among the others' traffic, then reads its key at 2 s: one sample each of 1 + 3 × its number accesses
    (its own alone, however the records interleave)."""
    pipeline.subscribe(SMLifecycleSubscriber(metrics.meter, salt_cap=10))
    salts = [f"tenant-{number}" for number in range(6)]
    for number, salt in enumerate(salts):
        emit_keys(pipeline, E.SM_WRITE_FINISHED, 0, [(number + 1, salt, "llama")], fields=(0,),
                  salt_counts={(salt, "llama"): 1})
    for round_ in range(3):
        for number, salt in enumerate(salts):
            pipeline.publish(E.SM_WRITE_FINISHED, (0,), salt_counts={(salt, "llama"): number,
                                                                      ("bystander", "llama"): round_ + 1})
    for number, salt in reversed(list(enumerate(salts))):
        emit_keys(pipeline, E.SM_READ_PREFETCHED_FINISHED, 2, [(number + 1, salt, "llama")], fields=(0,),
                  salt_counts={(salt, "llama"): 1})
    pipeline.deliver()
    assert [(1, 1.0 + 3 * number) for number in range(6)] == [
        metrics.histogram_values("lmcache_mp.real_reuse_gap_objects", cache_salt=salt) for salt in salts]


def test_real_reuse_gap_counts_a_key_repeated_in_one_event_once(pipeline, metrics):
    """A key listed four times in one read (tensor-parallel fan-out) yields one sample, not four."""
    pipeline.subscribe(SMLifecycleSubscriber(metrics.meter, salt_cap=10))
    emit_keys(pipeline, E.SM_WRITE_FINISHED, 0, [CHUNK] * 4, fields=(0,), salt_counts={("tenant", "llama"): 4})
    emit_keys(pipeline, E.SM_READ_PREFETCHED_FINISHED, 2, [CHUNK] * 4, fields=(0,),
              salt_counts={("tenant", "llama"): 4})
    pipeline.deliver()
    assert ((1, 2.0), (1, 4.0)) == (
        metrics.histogram_values("lmcache_mp.real_reuse_gap", cache_salt="tenant"),
        metrics.histogram_values("lmcache_mp.real_reuse_gap_objects", cache_salt="tenant"))
