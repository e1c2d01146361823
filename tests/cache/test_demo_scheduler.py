"""The demo's engine scheduler (mpcache.demo.scheduler): its block pool, and that it fills the L0 histograms."""

from __future__ import annotations

import numpy as np
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from support.cache_harness import MODEL

from mpcache.demo import scheduler as demo_scheduler
from mpcache.demo.scheduler import BlockPool, Scheduler
from mpcache.telemetry.bus import EventBus
from mpcache.telemetry.subscribers.metrics.l0_lifecycle import L0LifecycleSubscriber


def test_block_pool_shares_reuses_and_reallocates_least_recently_released_first():
    """Key 1 taken twice is one block (sharing); released and taken again it is the same block (reuse);
    a new key takes the least recently released free block and evicts what it held."""
    pool = BlockPool(2)
    first = [pool.take(1), pool.take(1)]
    pool.release(first)
    reused = pool.take(1)
    other = pool.take(2)  # block 1 was never used: the oldest free block
    pool.release([reused])
    pool.release([other])
    evicting = pool.take(3)  # block 0 (released before block 1) loses key 1
    assert ([0, 0], 0, 1, 0, None) == (first, reused, other, evicting, pool.cached.get(1))


def test_a_dry_pool_preempts_the_oldest_request(monkeypatch):
    """With 4 blocks and no decoding, a second 3-block prompt takes the last free block, then preempts the
    first request and reallocates its blocks in release order; the preempted request's end_session is sent
    after the step's report, so the cache never sees an allocation after its request ended."""
    calls = []

    class Client:
        def report_block_allocations(self, instance_id, model_name, records):
            calls.append(("report", [(rid, blocks) for rid, blocks, _ in records]))

        def end_session(self, request_id):
            calls.append(("end", request_id))

    monkeypatch.setattr(demo_scheduler, "DECODE_BLOCK_PROBABILITY", 0.0)
    monkeypatch.setattr(demo_scheduler, "DECODE_STEPS", (5, 6))
    scheduler = Scheduler(Client(), 1, MODEL, 2, np.random.default_rng(0), num_blocks=4)
    scheduler.step(np.arange(6))
    scheduler.step(np.arange(100, 106))
    assert [("report", [("sched-1-1", [0, 1, 2])]), ("report", [("sched-1-2", [3, 0, 1])]), ("end", "sched-1-1")] \
        == calls


def test_the_scheduler_fills_all_three_l0_histograms_through_the_server(cache):
    """Driven with demo-like prompts (shared system prompts, Zipf-popular documents) at sample rate 0.1,
    one scheduler's reports, through a real server, give samples in lifetime, idle-before-evict and reuse gap."""
    harness = cache(metrics_sample_rate=0.1)
    client = harness.client()
    rng = np.random.default_rng(3)
    system = rng.integers(0, 32000, size=128)
    documents = [rng.integers(0, 32000, size=int(rng.integers(4, 12)) * 64) for _ in range(48)]
    scheduler = Scheduler(client, 9, MODEL, 16, np.random.default_rng(4), num_blocks=256)
    for _ in range(400):
        doc = documents[min(int(rng.zipf(1.3)) - 1, 47)]
        scheduler.step(np.concatenate((system, doc, rng.integers(0, 32000, size=64))))
    scheduler.close()

    reader = InMemoryMetricReader()
    provider = MeterProvider(metric_readers=[reader])
    bus = EventBus()
    bus.subscribe(L0LifecycleSubscriber(provider.get_meter("test")))
    bus.dispatch(harness.events.take())
    counts = {m.name: sum(p.count for p in m.data.data_points)
              for rm in reader.get_metrics_data().resource_metrics for sm in rm.scope_metrics for m in sm.metrics}
    provider.shutdown()
    names = ("lmcache_mp.l0_block_lifetime", "lmcache_mp.l0_block_idle_before_evict", "lmcache_mp.l0_block_reuse_gap")
    assert [True, True, True] == [counts.get(name, 0) > 0 for name in names], counts
