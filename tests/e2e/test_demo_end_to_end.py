"""``bin/start-cache --demo`` end to end: what /metrics serves agrees with what the demo did."""

from __future__ import annotations

import os

import pytest
from support.demo import l1_writes
from support.waiting import wait_for

from mpcache.eviction.admission import CHANCE
from mpcache.shm.ring import PUBLISH_PATH

pytestmark = pytest.mark.slow

# The series the demo's load moves (L1, lookups, failures, chunks loaded, the bus, L0↔L1 throughput), by
# exact Prometheus sample name.
COUNTERS = [
    "lmcache_mp_l1_read_chunks_total",
    "lmcache_mp_l1_write_chunks_total",
    "lmcache_mp_l1_evicted_chunks_total",
    "lmcache_mp_l1_eviction_loop_ticks_total",
    "lmcache_mp_l1_eviction_loop_triggered_total",
    "lmcache_mp_l1_allocation_failure_chunks_total",
    "lmcache_mp_l1_read_failure_chunks_total",
    "lmcache_mp_timeouts_total",
    "lmcache_mp_lookup_requested_tokens_total",
    "lmcache_mp_lookup_hit_tokens_total",
    "lmcache_mp_num_chunks_loaded_total",
    "lmcache_mp_event_bus_dropped_events_total",
    "lmcache_mp_event_bus_subscriber_exceptions_total",
    "mpcache_l1_refused_chunks_total",
]
GAUGES = [
    "lmcache_mp_l1_usage_ratio",
    "lmcache_mp_l1_memory_usage_bytes",
    "lmcache_mp_active_prefetch_jobs",
    "lmcache_mp_event_bus_queue_depth",
    "lmcache_mp_event_bus_drain_lag_seconds",
    "mpcache_l1_admission_chance",
]
HISTOGRAMS = [
    "lmcache_mp_l1_chunk_lifetime_seconds",
    "lmcache_mp_l1_chunk_idle_before_evict_seconds",
    "lmcache_mp_l1_chunk_reuse_gap_seconds",
    "lmcache_mp_l1_chunk_evict_reuse_gap_seconds",
    "lmcache_mp_real_reuse_gap_seconds",
    "lmcache_mp_real_reuse_gap_objects_chunks",
    "lmcache_mp_l0_l1_store_throughput_GBs",
    "lmcache_mp_l0_l1_load_throughput_GBs",
]


def test_demo_metrics_agree_with_the_demo_tally(start_service) -> None:
    """After the demo's load ends and telemetry drains, every per-salt counter equals the demo's own count,
    every foundation metric is served under its exact name, and SIGTERM leaves nothing behind."""
    service = start_service("--demo", "--demo-seconds", "12", "--workers", "2", "--metrics-sample-rate", "0.2")
    tally = wait_for(lambda: service.tally_path.exists() and service.tally(), 120, "the demo tally")

    def comparison(scrape):
        """(what the demo counted, what /metrics says), for every counter the demo tallies."""
        faults = tally["expected_faults"]
        expected = {
            "l1_write": l1_writes(tally),
            "num_chunks_loaded": {k: float(v) for k, v in tally["retrieved_chunks"].items()},
            "lookup_requested": {k: float(v) for k, v in tally["requested_tokens"].items()},
            "lookup_hit": {k: float(v) for k, v in tally["hit_tokens"].items()},
            "timeouts": float(faults.get("timeout", 0)),
            "l1_allocation_failure": float(faults.get("l1_allocation_failed_chunks", 0)),
            "l1_read_failure": float(faults.get("l1_read_failed_chunks", 0)),
            "dropped": 0.0,
        }
        observed = {
            "l1_write": scrape.by_label("lmcache_mp_l1_write_chunks_total", "cache_salt"),
            "num_chunks_loaded": scrape.by_label("lmcache_mp_num_chunks_loaded_total", "cache_salt"),
            "lookup_requested": scrape.by_label("lmcache_mp_lookup_requested_tokens_total", "cache_salt"),
            "lookup_hit": scrape.by_label("lmcache_mp_lookup_hit_tokens_total", "cache_salt"),
            "timeouts": scrape.total("lmcache_mp_timeouts_total", exception_type="MpcacheTimeoutError"),
            "l1_allocation_failure": scrape.total("lmcache_mp_l1_allocation_failure_chunks_total", during="l1_store"),
            "l1_read_failure": scrape.total("lmcache_mp_l1_read_failure_chunks_total", during="l1_retrieve",
                                            reason="not_found"),
            "dropped": scrape.total("lmcache_mp_event_bus_dropped_events_total"),
        }
        return expected, observed

    def settled():
        scrape = service.scrape()
        expected, observed = comparison(scrape)
        return scrape if expected == observed else None

    try:  # wait on every compared counter: an empty queue does not mean the subscribers are done
        scrape = wait_for(settled, 60, "/metrics to agree with the demo tally")
    except AssertionError:
        scrape = service.scrape()  # the assertion below shows the difference
    assert 0 < tally["requests"]
    expected, observed = comparison(scrape)
    assert expected == observed

    # the order's refusals are among the allocation failures the client was told of; the chance is L1's
    assert scrape.total("mpcache_l1_refused_chunks_total") <= observed["l1_allocation_failure"]
    assert CHANCE <= scrape.total("mpcache_l1_admission_chance") <= 1.0
    missing = [n for n in COUNTERS + GAUGES if n not in scrape.samples]
    missing += [n for n in HISTOGRAMS if n + "_count" not in scrape.samples or scrape.total(n + "_count") == 0]
    assert [] == missing
    assert {"cache_salt"} == {k for labels, _ in scrape.samples["lmcache_mp_l1_write_chunks_total"] for k in labels}
    assert {"engine_id", "device", "model_name"} <= {
        k for labels, _ in scrape.samples["lmcache_mp_l0_l1_store_throughput_GBs_count"] for k in labels}
    target_info = scrape.samples["target_info"]
    assert 1 == len(target_info) and target_info[0][0].get("service_instance_id")

    assert 0 == service.stop()
    leftovers = [n for n in os.listdir("/dev/shm") if n.startswith(f"mpcache.{service.process.pid}.")]
    assert [] == leftovers
    assert not service.runtime_dir.exists()
    roles = {line.get("child_role") for line in service.log_lines() if line.get("event") == "child.started"}
    assert {"telemetry", "cache", "demo"} == roles
    [started] = [line for line in service.log_lines() if line.get("event") == "supervisor.started"]
    assert PUBLISH_PATH == started["publish_path"]  # the operator can see which writer publishes
    # The demo's faults are deliberate: counted in its progress and tally, not one warning line each.
    assert sum(service.tally()["injected_faults"].values()) > 0
    assert [] == [line for line in service.log_lines() if line.get("level") == "warning"
                  and line.get("event") in ("client.error", "timeout.raised")]
