"""``bin/start-cache --demo`` with an fs and a mock L2 tier: /metrics serves every L2 metric, with values
that agree with what the demo saw."""

from __future__ import annotations

import json

import pytest
from mpcache_service import Service, wait_for

pytestmark = pytest.mark.slow

# Every L2 row of metrics.tsv, by Prometheus sample name (histograms by their _count).
L2_COUNTERS = [
    "lmcache_mp_l2_store_submitted_requests_total",
    "lmcache_mp_l2_store_submitted_objects_chunks_total",
    "lmcache_mp_l2_store_completed_requests_total",
    "lmcache_mp_l2_store_completed_objects_chunks_total",
    "lmcache_mp_l2_prefetch_lookup_requests_total",
    "lmcache_mp_l2_prefetch_lookup_objects_chunks_total",
    "lmcache_mp_l2_prefetch_hit_chunks_total",
    "lmcache_mp_l2_prefetch_load_submitted_requests_total",
    "lmcache_mp_l2_prefetch_load_submitted_objects_chunks_total",
    "lmcache_mp_l2_prefetch_load_completed_chunks_total",
    "lmcache_mp_l2_load_completed_requests_total",
    "lmcache_mp_l2_evicted_chunks_total",
    "lmcache_mp_l2_prefetch_failure_chunks_total",
]
L2_HISTOGRAMS = ["lmcache_mp_l2_store_throughput_GBs", "lmcache_mp_l2_load_throughput_GBs"]
L2_GAUGES = [
    "lmcache_mp_l2_usage_bytes",
    "lmcache_mp_num_inflight_l2_stores",
    "lmcache_mp_num_inflight_l2_loads",
    "lmcache_mp_inflight_load_memory_usage_bytes",
]


def as_floats(counts: dict) -> dict[str, float]:
    return {key: float(value) for key, value in counts.items()}


def test_demo_with_fs_and_mock_tiers_serves_every_l2_metric(start_service, tmp_path) -> None:
    """With --l2 fs (small, so it evicts) and --l2 mock (larger, 10 % injected failures), after the demo's
    load ends and telemetry drains: every L2 counter is non-zero, both throughput histograms have samples
    for both adapters, the gauges have one series per adapter, L1 writes equal the demo's stores plus its
    L2 landings, the L2 share of lookup hits equals the demo's own count, and the hit rate is in [0, 1]."""
    fs = '{"type": "fs", "path": "%s", "capacity_gb": 0.008}' % (tmp_path / "l2fs")
    mock = '{"type": "mock", "capacity_gb": 0.05, "failure_rate": 0.1, "seed": 3}'
    service = start_service("--demo", "--demo-seconds", "10", "--workers", "2", "--l2", fs, "--l2", mock)
    tally = wait_for(lambda: service.tally_path.exists() and service.tally(), 120, "the demo tally")
    l1_writes = {salt: float(tally["stored_chunks"].get(salt, 0) + tally["prefetched_chunks"].get(salt, 0))
                 for salt in set(tally["stored_chunks"]) | set(tally["prefetched_chunks"])}

    def drained_and_consistent():
        scrape = service.scrape()
        idle = (scrape.total("lmcache_mp_event_bus_queue_depth") == 0
                and scrape.total("lmcache_mp_num_inflight_l2_stores") == 0
                and scrape.total("lmcache_mp_num_inflight_l2_loads") == 0)
        written = scrape.by_label("lmcache_mp_l1_write_chunks_total", "cache_salt")
        return scrape if idle and written == l1_writes else None

    scrape = wait_for(drained_and_consistent, 30, "/metrics to agree with the demo tally")
    assert [] == [name for name in L2_COUNTERS if scrape.total(name) <= 0]
    per_adapter = {name: {(labels.get("l2_name"), labels.get("adapter_index")) for labels, _ in scrape.samples[name]}
                   for name in L2_GAUGES[1:]}
    assert {name: {("fs", "0"), ("mock", "1")} for name in L2_GAUGES[1:]} == per_adapter
    assert {"fs", "mock"} == set(scrape.by_label("lmcache_mp_l2_usage_bytes", "l2_name"))
    assert 0 < scrape.total("lmcache_mp_l2_usage_bytes", l2_name="fs")
    assert {name: {"fs", "mock"} for name in L2_HISTOGRAMS} == {
        name: {labels["l2_name"] for labels, value in scrape.samples[name + "_count"] if value > 0}
        for name in L2_HISTOGRAMS}
    assert {"fs", "mock"} == set(scrape.by_label("lmcache_mp_l2_store_completed_requests_total", "l2_name"))
    assert 0 < scrape.total("lmcache_mp_l2_prefetch_failure_chunks_total", reason="not_found")
    assert as_floats(tally["l2_hit_tokens"]) == scrape.by_label("lmcache_mp_lookup_hit_l2_tokens_total", "cache_salt")
    assert as_floats(tally["hit_tokens"]) == scrape.by_label("lmcache_mp_lookup_hit_tokens_total", "cache_salt")
    hit_rate = (scrape.total("lmcache_mp_lookup_hit_tokens_total")
                / scrape.total("lmcache_mp_lookup_requested_tokens_total"))
    assert 0.0 <= hit_rate <= 1.0
    assert 0 == scrape.total("lmcache_mp_event_bus_dropped_events_total")
    assert 0 == service.stop()


def read_config(service) -> dict:
    path = service.runtime_dir / "config.json"
    return {"mode": path.stat().st_mode & 0o777, **json.loads(path.read_text())}


def test_a_redis_only_service_warns_that_its_secret_is_per_run_and_never_logs_it(start_service, tmp_path) -> None:
    """Without --l2-secret-file and without an fs tier, start-cache makes a key for this run and warns, once,
    that redis records will not be readable after a restart and that --l2-secret-file fixes it.  The key
    reaches the children only through the 0600 config file: it is in no log line."""
    redis_flag = '{"type": "redis", "url": "redis://127.0.0.1:1/0", "capacity_gb": 1}'
    service = start_service("--workers", "1", "--l2", redis_flag)
    wait_for(lambda: any(line.get("event") == "cache.ready" for line in service.log_lines()), 60, "cache.ready")
    config = read_config(service)
    assert 0 == service.stop()
    lines = service.log_lines()
    warnings = [line for line in lines if line.get("event") == "supervisor.l2_secret_per_run"]
    everything = service.log_path.read_text() + (tmp_path / "stderr.log").read_text()

    assert (0o600, 64, "per-run") == (config["mode"], len(config["l2_secret"]), config["l2_secret_source"])
    assert [("warning", True, True)] == [(line["level"], "not be readable after a restart" in line["message"],
                                          "--l2-secret-file" in line["message"]) for line in warnings]
    assert config["l2_secret"] not in everything


def test_an_fs_tier_keeps_the_same_key_across_service_restarts(tmp_path) -> None:
    """Two runs on one fs path resolve the same key from <path>/.mpcache-l2-secret (0600), with no warning."""
    fs = '{"type": "fs", "path": "%s", "capacity_gb": 0.01}' % (tmp_path / "l2fs")
    keys = []
    for run in range(2):
        (tmp_path / f"run{run}").mkdir()
        service = Service(tmp_path / f"run{run}", "--workers", "1", "--l2", fs)
        try:
            wait_for(lambda service=service: any(line.get("event") == "cache.ready" for line in service.log_lines()),
                     60,
                     "cache.ready")
            keys.append(read_config(service)["l2_secret"])
            assert 0 == service.stop()
        finally:
            service.kill()
        assert [] == [line for line in service.log_lines() if line.get("event") == "supervisor.l2_secret_per_run"]

    secret = tmp_path / "l2fs" / ".mpcache-l2-secret"
    assert (keys[0], 0o600) == (keys[1], secret.stat().st_mode & 0o777)
