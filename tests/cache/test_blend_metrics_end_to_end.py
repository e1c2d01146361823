"""The scripted cache-blending workload, from a real cache server through the real blend subscriber to
Prometheus text: all 18 lmcache_blend counters by exact Prometheus name, with values worked out by hand."""

from __future__ import annotations

import pytest
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.sdk.metrics import MeterProvider
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from support.blend_script import EXPECTED_COUNTERS, L1_SLOTS, run_script
from support.cache_harness import CHUNK_BYTES

from mpcache.telemetry.bus import EventBus
from mpcache.telemetry.metric_table import SECTIONS_BY_KEY
from mpcache.telemetry.subscribers.metrics.counters import TableCountersSubscriber


@pytest.fixture
def prometheus():
    """A MeterProvider read by a PrometheusMetricReader into its own registry (as the telemetry process does)."""
    registry = CollectorRegistry(auto_describe=True)
    provider = MeterProvider(metric_readers=[PrometheusMetricReader(registry=registry, scope_info_enabled=False)])
    yield provider, registry
    provider.shutdown()


def scrape(registry) -> dict[str, float]:
    """{sample name: value} of the unlabelled lmcache_blend samples in the Prometheus text."""
    text = generate_latest(registry).decode()
    return {sample.name: sample.value for family in text_string_to_metric_families(text)
            for sample in family.samples if sample.name.startswith("lmcache_blend_") and not sample.labels}


def test_every_blend_counter_after_the_scripted_workload(cache, prometheus):
    """Registered fingerprints (6), fingerprint hits (9), storage hits (7), stale chunks after the forced
    eviction (2), the failed retrieve into a missing buffer (1), the failed stores (1 + 1), no_gpu_context (1):
    every lmcache_blend_*_total sample equals the hand count, and the blend hit rate is 112 / 208."""
    provider, registry = prometheus
    bus = EventBus()
    bus.subscribe(TableCountersSubscriber(provider.get_meter("test"), SECTIONS_BY_KEY["Blend"]))
    harness = cache(l1_size_bytes=L1_SLOTS * CHUNK_BYTES, l1_policy="lru")  # the script's evictions are LRU's
    harness.events.take()
    run_script(harness)
    bus.dispatch(harness.events.take())
    samples = scrape(registry)
    expected = {f"lmcache_blend_{name}_total": float(value) for name, value in EXPECTED_COUNTERS.items()}
    assert (18, expected) == (len(expected), samples)
    hit_rate = samples["lmcache_blend_lookup_hit_tokens_total"] / samples["lmcache_blend_lookup_requested_tokens_total"]
    assert 112 / 208 == hit_rate
