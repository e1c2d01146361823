"""The one table of every metric mpcache exports.

Each row says what an instrument is called (OTel and Prometheus), what kind of
instrument it is, its unit and attributes, the events it is computed from and,
for histograms, its explicit bucket boundaries.  Instruments are created from
this table (:func:`mpcache.telemetry.otel.create_instrument`), a test checks it
row for row against ``spec/metrics.tsv``, and ``docs/METRICS.md`` is generated
from it::

    python -m mpcache.telemetry.metric_table --markdown > docs/METRICS.md

The Prometheus name is not computed here: it is what the OTel Prometheus
exporter derives from the OTel name and unit (dots → underscores, the unit as
a suffix, ``_total`` for counters), written out so that a test can hold the
exporter to it.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass

COUNTER = "counter"
HISTOGRAM = "histogram"
OBSERVABLE_GAUGE = "observable_gauge"
OBSERVABLE_COUNTER = "observable_counter"

# Seconds-scale lifecycle buckets.  300 s is an edge because the L1
# evict→reuse gap is capped there ("not reused within 5 minutes" is recorded
# as exactly 300 s); without the edge those samples smear into (250, 500] and
# quantiles interpolate up to 500 s.
LIFECYCLE_SECONDS_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 180.0, 240.0,
    300.0, 600.0, 1800.0, 3600.0, 14400.0, 86400.0,
)
# GB/s: from a slow network adapter to host↔GPU copies over PCIe 5 / NVLink-C2C.
THROUGHPUT_GBS_BUCKETS = (
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0, 100.0, 200.0, 400.0,
)
# Chunk accesses of one cache_salt between two accesses of the same chunk.
REUSE_GAP_OBJECTS_BUCKETS = (
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1_000.0, 2_000.0, 5_000.0, 10_000.0, 20_000.0,
    50_000.0, 100_000.0, 200_000.0, 500_000.0, 1_000_000.0, 10_000_000.0,
)


@dataclass(frozen=True)
class MetricSpec:
    otel_name: str
    prometheus_name: str
    instrument: str
    unit: str
    attributes: tuple[str, ...]
    source_events: str  # as in metrics.tsv: comma-separated event types, or "(… state)"
    meaning: str
    buckets: tuple[float, ...] | None = None

    @property
    def tsv_row(self) -> tuple[str, ...]:
        """This row in the column order of ``spec/metrics.tsv``."""
        return (self.otel_name, self.prometheus_name, self.instrument, self.unit, ",".join(self.attributes),
                self.source_events)


def _m(otel: str, prom: str, kind: str, unit: str, attrs: str, sources: str, meaning: str,
       buckets: tuple[float, ...] | None = None) -> MetricSpec:
    return MetricSpec(otel, prom, kind, unit, tuple(a for a in attrs.split(",") if a), sources, meaning, buckets)


_S, _G, _O = LIFECYCLE_SECONDS_BUCKETS, THROUGHPUT_GBS_BUCKETS, REUSE_GAP_OBJECTS_BUCKETS
_L1W = "L1_WRITE_FINISHED,L1_WRITE_FINISHED_AND_READ_RESERVED"
_SM = "SM_READ_PREFETCHED_FINISHED,SM_WRITE_FINISHED"
_L0 = "MP_VLLM_BLOCK_ALLOCATION,MP_VLLM_END_SESSION"

METRICS: tuple[MetricSpec, ...] = (
    # L1 counters
    _m("lmcache_mp.l1_read", "lmcache_mp_l1_read_chunks_total", COUNTER, "chunks", "cache_salt", "L1_READ_FINISHED",
       "Chunks read from L1 (counted when the read locks are released)."),
    _m("lmcache_mp.l1_write", "lmcache_mp_l1_write_chunks_total", COUNTER, "chunks", "cache_salt", _L1W,
       "Chunks committed to L1, by client stores and by L2→L1 prefetch alike."),
    _m("lmcache_mp.l1_evicted", "lmcache_mp_l1_evicted_chunks_total", COUNTER, "chunks", "cache_salt",
       "L1_KEYS_EVICTED", "Chunks removed from L1 by eviction."),
    _m("lmcache_mp.l1_eviction_loop_ticks", "lmcache_mp_l1_eviction_loop_ticks_total", COUNTER, "", "",
       "L1_EVICTION_LOOP_TICK", "Iterations of the L1 eviction loop (shows the loop is alive)."),
    _m("lmcache_mp.l1_eviction_loop_triggered", "lmcache_mp_l1_eviction_loop_triggered_total", COUNTER, "", "",
       "L1_EVICTION_LOOP_TICK", "Eviction-loop iterations that found usage above the watermark and evicted."),
    _m("lmcache_mp.l1_usage_ratio", "lmcache_mp_l1_usage_ratio", OBSERVABLE_GAUGE, "", "", "(L1 state)",
       "L1 bytes in use over L1 capacity, over all live cache processes, at scrape time."),
    _m("lmcache_mp.l1_allocation_failure", "lmcache_mp_l1_allocation_failure_chunks_total", COUNTER, "chunks",
       "during,model_name", "L1_ALLOCATION_FAILED",
       "Chunks L1 had no room for, split by whether a client store or an L2 prefetch asked."),
    _m("lmcache_mp.l1_read_failure", "lmcache_mp_l1_read_failure_chunks_total", COUNTER, "chunks",
       "during,reason,model_name", "L1_READ_FAILED",
       "Chunks that lookup reported present but could not be read (a race or unexpected eviction, not a miss)."),
    _m("lmcache_mp.timeouts", "lmcache_mp_timeouts_total", COUNTER, "", "exception_type", "TIMEOUT_RAISED",
       "Timeout errors raised, by exception class."),
    # L1 chunk lifecycle (sampled)
    _m("lmcache_mp.l1_chunk_lifetime", "lmcache_mp_l1_chunk_lifetime_seconds", HISTOGRAM, "seconds", "",
       "L1_KEYS_EVICTED", "Eviction time minus allocation time of each sampled L1 chunk.", _S),
    _m("lmcache_mp.l1_chunk_idle_before_evict", "lmcache_mp_l1_chunk_idle_before_evict_seconds", HISTOGRAM,
       "seconds", "", "L1_KEYS_EVICTED", "Eviction time minus last access time of each sampled L1 chunk.", _S),
    _m("lmcache_mp.l1_chunk_reuse_gap", "lmcache_mp_l1_chunk_reuse_gap_seconds", HISTOGRAM, "seconds", "",
       "L1_READ_FINISHED," + _L1W, "Time between consecutive touches (read or write) of a sampled live L1 chunk.",
       _S),
    _m("lmcache_mp.l1_chunk_evict_reuse_gap", "lmcache_mp_l1_chunk_evict_reuse_gap_seconds", HISTOGRAM, "seconds",
       "", "L1_KEYS_EVICTED,L1_WRITE_FINISHED",
       "Time from a sampled chunk's eviction to its next write into L1, capped at 300 s (never rewritten = 300 s).",
       _S),
    _m("lmcache_mp.real_reuse_gap", "lmcache_mp_real_reuse_gap_seconds", HISTOGRAM, "seconds", "cache_salt", _SM,
       "Time between a sampled chunk's previous access (read or write) and its next read, per cache_salt.", _S),
    _m("lmcache_mp.real_reuse_gap_objects", "lmcache_mp_real_reuse_gap_objects_chunks", HISTOGRAM, "chunks",
       "cache_salt", _SM,
       "Chunk accesses of the same cache_salt between a sampled chunk's previous access and its next read.", _O),
    # L2 counters
    _m("lmcache_mp.l2_store_submitted", "lmcache_mp_l2_store_submitted_requests_total", COUNTER, "requests", "",
       "L2_STORE_SUBMITTED", "Store tasks submitted to L2 adapters."),
    _m("lmcache_mp.l2_store_submitted_objects", "lmcache_mp_l2_store_submitted_objects_chunks_total", COUNTER,
       "chunks", "cache_salt", "L2_STORE_SUBMITTED", "Chunks in store tasks submitted to L2 adapters."),
    _m("lmcache_mp.l2_store_completed", "lmcache_mp_l2_store_completed_requests_total", COUNTER, "requests",
       "l2_name", "L2_STORE_COMPLETED", "Store tasks an L2 adapter finished, by adapter type."),
    _m("lmcache_mp.l2_store_completed_objects", "lmcache_mp_l2_store_completed_objects_chunks_total", COUNTER,
       "chunks", "cache_salt", "L2_STORE_COMPLETED", "Chunks an L2 adapter stored successfully."),
    _m("lmcache_mp.l2_prefetch_lookup", "lmcache_mp_l2_prefetch_lookup_requests_total", COUNTER, "requests", "",
       "L2_PREFETCH_LOOKUP_SUBMITTED", "Prefetch lookups that asked the L2 adapters which keys they hold."),
    _m("lmcache_mp.l2_prefetch_lookup_objects", "lmcache_mp_l2_prefetch_lookup_objects_chunks_total", COUNTER,
       "chunks", "cache_salt", "L2_PREFETCH_LOOKUP_SUBMITTED", "Chunks asked about by prefetch lookups."),
    _m("lmcache_mp.l2_prefetch_hit", "lmcache_mp_l2_prefetch_hit_chunks_total", COUNTER, "chunks", "",
       "L2_PREFETCH_LOOKUP_COMPLETED", "Chunks of the contiguous prefix that prefetch lookups found in L2."),
    _m("lmcache_mp.l2_prefetch_load_submitted", "lmcache_mp_l2_prefetch_load_submitted_requests_total", COUNTER,
       "requests", "", "L2_PREFETCH_LOAD_SUBMITTED", "Per-adapter load tasks submitted for prefetches."),
    _m("lmcache_mp.l2_prefetch_load_submitted_objects", "lmcache_mp_l2_prefetch_load_submitted_objects_chunks_total",
       COUNTER, "chunks", "cache_salt", "L2_PREFETCH_LOAD_SUBMITTED", "Chunks submitted for loading from L2."),
    _m("lmcache_mp.l2_prefetch_load_completed", "lmcache_mp_l2_prefetch_load_completed_chunks_total", COUNTER,
       "chunks", "cache_salt", "L2_PREFETCH_LOAD_COMPLETED", "Chunks loaded from L2 into L1 by prefetches."),
    _m("lmcache_mp.l2_load_completed", "lmcache_mp_l2_load_completed_requests_total", COUNTER, "requests", "l2_name",
       "L2_LOAD_TASK_COMPLETED", "Load tasks an L2 adapter finished, by adapter type."),
    _m("lmcache_mp.l2_evicted", "lmcache_mp_l2_evicted_chunks_total", COUNTER, "chunks", "cache_salt",
       "L2_KEYS_EVICTED", "Chunks removed from L2 adapters by L2 eviction."),
    # lookup hit rate
    _m("lmcache_mp.lookup_requested", "lmcache_mp_lookup_requested_tokens_total", COUNTER, "tokens",
       "model_name,cache_salt", "MP_LOOKUP_PREFETCH_END", "Chunk-aligned tokens asked for by completed lookups."),
    _m("lmcache_mp.lookup_hit", "lmcache_mp_lookup_hit_tokens_total", COUNTER, "tokens", "model_name,cache_salt",
       "MP_LOOKUP_PREFETCH_END", "Tokens of the contiguous prefix that completed lookups found in L1 or L2."),
    _m("lmcache_mp.l2_prefetch_failure", "lmcache_mp_l2_prefetch_failure_chunks_total", COUNTER, "chunks",
       "reason,model_name", "L2_PREFETCH_FAILED",
       "Chunks an L2 prefetch could not land in L1, by reason: l1_oom, not_found, integrity (a record that "
       "failed its MAC check: corrupt or forged), l2_error (a load's I/O error or timeout) or lookup_error "
       "(a lookup that could not ask its tier)."),
    # L0 block lifecycle (sampled)
    _m("lmcache_mp.l0_block_lifetime", "lmcache_mp_l0_block_lifetime_seconds", HISTOGRAM, "seconds",
       "instance_id,model_name", _L0,
       "Time from a sampled GPU block's allocation to the reallocation that evicted its contents.", _S),
    _m("lmcache_mp.l0_block_idle_before_evict", "lmcache_mp_l0_block_idle_before_evict_seconds", HISTOGRAM,
       "seconds", "instance_id,model_name", _L0,
       "Time from a sampled GPU block's last access to the reallocation that evicted its contents.", _S),
    _m("lmcache_mp.l0_block_reuse_gap", "lmcache_mp_l0_block_reuse_gap_seconds", HISTOGRAM, "seconds",
       "instance_id,model_name", _L0, "Time between consecutive uses of a sampled GPU block's cached contents.", _S),
    # throughput
    _m("lmcache_mp.l0_l1_store_throughput", "lmcache_mp_l0_l1_store_throughput_GBs", HISTOGRAM, "GBs",
       "engine_id,device,model_name", "MP_STORE_START,MP_STORE_END",
       "Bytes over duration of each client KV buffer → L1 copy, in GB/s.", _G),
    _m("lmcache_mp.l0_l1_load_throughput", "lmcache_mp_l0_l1_load_throughput_GBs", HISTOGRAM, "GBs",
       "engine_id,device,model_name", "MP_RETRIEVE_START,MP_RETRIEVE_END",
       "Bytes over duration of each L1 → client KV buffer copy, in GB/s.", _G),
    _m("lmcache_mp.l2_store_throughput", "lmcache_mp_l2_store_throughput_GBs", HISTOGRAM, "GBs", "l2_name",
       "L2_STORE_SUBMITTED,L2_STORE_COMPLETED",
       "Bytes actually written over submit→complete time of each L2 store task, in GB/s (end to end).", _G),
    _m("lmcache_mp.l2_load_throughput", "lmcache_mp_l2_load_throughput_GBs", HISTOGRAM, "GBs", "l2_name",
       "L2_LOAD_TASK_SUBMITTED,L2_LOAD_TASK_COMPLETED",
       "Submitted bytes over submit→complete time of each L2 load task, in GB/s (end to end).", _G),
    _m("lmcache_mp.num_chunks_loaded", "lmcache_mp_num_chunks_loaded_total", COUNTER, "",
       "worker_id,model_name,cache_salt", "MP_RETRIEVE_END", "Chunks delivered into each client worker's KV buffer."),
    # bus self-monitoring
    _m("lmcache_mp.event_bus.queue_depth", "lmcache_mp_event_bus_queue_depth", OBSERVABLE_GAUGE, "", "",
       "(bus state)", "Event records published but not yet consumed, over all rings."),
    _m("lmcache_mp.event_bus.drain_lag_seconds", "lmcache_mp_event_bus_drain_lag_seconds", OBSERVABLE_GAUGE, "", "",
       "(bus state)", "Age of the oldest unconsumed event record (0 when every ring is drained)."),
    _m("lmcache_mp.event_bus.dropped_events_total", "lmcache_mp_event_bus_dropped_events_total", OBSERVABLE_COUNTER,
       "", "", "(bus state)", "Event records lost: ring full at the producer, torn by a dead producer, or malformed."),
    _m("lmcache_mp.event_bus.subscriber_exceptions", "lmcache_mp_event_bus_subscriber_exceptions_total",
       OBSERVABLE_COUNTER, "", "subscriber_name", "(bus state)", "Subscriber callbacks that raised, by class name."),
    # state gauges
    _m("lmcache_mp.active_prefetch_jobs", "lmcache_mp_active_prefetch_jobs", OBSERVABLE_GAUGE, "", "",
       "(server state)", "Prefetch jobs in flight, over all live cache processes."),
    _m("lmcache_mp.l1_memory_usage_bytes", "lmcache_mp_l1_memory_usage_bytes", OBSERVABLE_GAUGE, "", "",
       "(L1 state)", "Bytes held in L1, over all live cache processes."),
    _m("lmcache_mp.l2_usage_bytes", "lmcache_mp_l2_usage_bytes", OBSERVABLE_GAUGE, "", "l2_name", "(L2 state)",
       "Bytes held by each L2 adapter type."),
    _m("lmcache_mp.num_inflight_l2_stores", "lmcache_mp_num_inflight_l2_stores", OBSERVABLE_GAUGE, "",
       "l2_name,adapter_index", "(L2 state)", "L2 store tasks in flight, per adapter."),
    _m("lmcache_mp.num_inflight_l2_loads", "lmcache_mp_num_inflight_l2_loads", OBSERVABLE_GAUGE, "",
       "l2_name,adapter_index", "(L2 state)", "L2 load tasks in flight, per adapter."),
    _m("lmcache_mp.inflight_load_memory_usage_bytes", "lmcache_mp_inflight_load_memory_usage_bytes",
       OBSERVABLE_GAUGE, "", "l2_name,adapter_index", "(L2 state)",
       "L1 bytes reserved by in-flight L2 loads, per adapter."),
    # cache blending
    _m("lmcache_blend.lookup_requests", "lmcache_blend_lookup_requests_total", COUNTER, "", "", "CB_LOOKUP_START",
       "Blend lookups started."),
    _m("lmcache_blend.lookup_requested_tokens", "lmcache_blend_lookup_requested_tokens_total", COUNTER, "", "",
       "CB_LOOKUP_END", "Chunk-aligned tokens asked for by finished blend lookups."),
    _m("lmcache_blend.lookup_hit_tokens", "lmcache_blend_lookup_hit_tokens_total", COUNTER, "", "", "CB_LOOKUP_END",
       "Tokens finished blend lookups could serve."),
    _m("lmcache_blend.lookup_fingerprint_hits", "lmcache_blend_lookup_fingerprint_hits_total", COUNTER, "", "",
       "CB_LOOKUP_END", "Chunks blend lookups matched in the fingerprint table."),
    _m("lmcache_blend.lookup_storage_hits", "lmcache_blend_lookup_storage_hits_total", COUNTER, "", "",
       "CB_LOOKUP_END", "Fingerprint matches that blend lookups confirmed in storage."),
    _m("lmcache_blend.lookup_stale_chunks", "lmcache_blend_lookup_stale_chunks_total", COUNTER, "", "",
       "CB_LOOKUP_END", "Fingerprint matches whose chunks were gone from storage (stale)."),
    _m("lmcache_blend.lookup_no_gpu_context_errors", "lmcache_blend_lookup_no_gpu_context_errors_total", COUNTER, "",
       "", "CB_LOOKUP_END", "Blend lookups that found no GPU context."),
    _m("lmcache_blend.retrieve_requests", "lmcache_blend_retrieve_requests_total", COUNTER, "", "",
       "CB_RETRIEVE_START", "Blend retrieves started."),
    _m("lmcache_blend.retrieve_chunks", "lmcache_blend_retrieve_chunks_total", COUNTER, "", "", "CB_RETRIEVE_START",
       "Chunks asked for by blend retrieves."),
    _m("lmcache_blend.retrieve_failures", "lmcache_blend_retrieve_failures_total", COUNTER, "", "", "CB_RETRIEVE_END",
       "Blend retrieves that failed."),
    _m("lmcache_blend.store_pre_computed_requests", "lmcache_blend_store_pre_computed_requests_total", COUNTER, "",
       "", "CB_STORE_PRE_COMPUTED_START", "Pre-computed blend stores started."),
    _m("lmcache_blend.store_pre_computed_chunks", "lmcache_blend_store_pre_computed_chunks_total", COUNTER, "", "",
       "CB_STORE_PRE_COMPUTED_END", "Chunks written by pre-computed blend stores."),
    _m("lmcache_blend.store_pre_computed_failures", "lmcache_blend_store_pre_computed_failures_total", COUNTER, "",
       "", "CB_STORE_PRE_COMPUTED_END", "Pre-computed blend stores that failed."),
    _m("lmcache_blend.store_final_requests", "lmcache_blend_store_final_requests_total", COUNTER, "", "",
       "CB_STORE_FINAL_START", "Final blend stores started."),
    _m("lmcache_blend.store_final_chunks", "lmcache_blend_store_final_chunks_total", COUNTER, "", "",
       "CB_STORE_FINAL_END", "Chunks committed by final blend stores."),
    _m("lmcache_blend.store_final_failures", "lmcache_blend_store_final_failures_total", COUNTER, "", "",
       "CB_STORE_FINAL_END", "Final blend stores that failed."),
    _m("lmcache_blend.fingerprints_registered", "lmcache_blend_fingerprints_registered_total", COUNTER, "", "",
       "CB_FINGERPRINTS_REGISTERED", "Chunks newly indexed into the blend fingerprint table."),
    _m("lmcache_blend.chunks_evicted", "lmcache_blend_chunks_evicted_total", COUNTER, "", "", "CB_CHUNKS_EVICTED",
       "Stale entries removed from the blend fingerprint table."),
)

# Not in spec/metrics.tsv: the L1 / L2 split of lookup_hit, which the reference
# system also exports.  lookup_hit = lookup_hit_l1 + lookup_hit_l2.
EXTRA_METRICS: tuple[MetricSpec, ...] = (
    _m("lmcache_mp.lookup_hit_l1", "lmcache_mp_lookup_hit_l1_tokens_total", COUNTER, "tokens",
       "model_name,cache_salt", "MP_LOOKUP_PREFETCH_END", "Tokens of completed lookups' hits that were in L1."),
    _m("lmcache_mp.lookup_hit_l2", "lmcache_mp_lookup_hit_l2_tokens_total", COUNTER, "tokens",
       "model_name,cache_salt", "MP_LOOKUP_PREFETCH_END", "Tokens of completed lookups' hits that were in L2."),
)

ALL_METRICS: tuple[MetricSpec, ...] = METRICS + EXTRA_METRICS
BY_NAME: dict[str, MetricSpec] = {spec.otel_name: spec for spec in ALL_METRICS}
assert len(BY_NAME) == len(ALL_METRICS), "duplicate OTel name in the metric table"

_DEVIATION_NOTE = """\
**Deliberate deviation from the specification's text.** The specification's row for L2
eviction names the OTel instrument `lmcache_mp.l2_evicted_objects` but the Prometheus series
`lmcache_mp_l2_evicted_chunks_total`; no unit turns the first name into the second (unit
`chunks` on `l2_evicted_objects` would give `lmcache_mp_l2_evicted_objects_chunks_total`).
Dashboards and alerts use the Prometheus name, so mpcache keeps it and names the OTel
instrument `lmcache_mp.l2_evicted` (unit `chunks`). OTLP consumers see `lmcache_mp.l2_evicted`.
"""


def _cell(text: str) -> str:
    return text.replace("|", "\\|") if text else "—"


def render_markdown() -> str:
    """The text of ``docs/METRICS.md``."""
    lines = [
        "# mpcache metrics",
        "",
        "Generated by `python -m mpcache.telemetry.metric_table --markdown` from",
        "`mpcache/telemetry/metric_table.py`; do not edit by hand.",
        "",
        "Every metric is computed in the telemetry process from the events of `spec/EVENTS.md`",
        "(or, for observable instruments, from bus and gauge-board state at collection time).",
        "Every datapoint carries the resource attributes `service.name=mpcache` and",
        "`service.instance.id` (on Prometheus: the `target_info` series). Counters without",
        "attributes are exported from start-up with value 0. Lifecycle histograms are sampled",
        "(`--metrics-sample-rate`, default 1 %); counters count every event. `cache_salt` is capped",
        "per metric (`--cache-salt-cap`): values beyond the cap are reported as `__overflow__`.",
        "",
        _DEVIATION_NOTE,
        "| OTel name | Prometheus name | Instrument | Unit | Attributes | Source events | Meaning |",
        "|---|---|---|---|---|---|---|",
    ]
    for spec in METRICS:
        lines.append(_row(spec))
    lines += [
        "",
        "## Additional metrics (not in the specification's table)",
        "",
        "| OTel name | Prometheus name | Instrument | Unit | Attributes | Source events | Meaning |",
        "|---|---|---|---|---|---|---|",
    ]
    lines += [_row(spec) for spec in EXTRA_METRICS]
    lines += ["", "## Histogram buckets", ""]
    grids = {LIFECYCLE_SECONDS_BUCKETS: "seconds (lifecycle; 300 s, the evict→reuse cap, is an edge)",
             THROUGHPUT_GBS_BUCKETS: "GB/s (throughput)",
             REUSE_GAP_OBJECTS_BUCKETS: "chunks (reuse gap in accesses)"}
    for grid, label in grids.items():
        users = ", ".join(f"`{spec.otel_name}`" for spec in ALL_METRICS if spec.buckets == grid)
        lines += [f"- {label}: {', '.join(f'{edge:g}' for edge in grid)} — {users}"]
    return "\n".join(lines) + "\n"


def _row(spec: MetricSpec) -> str:
    cells = (f"`{spec.otel_name}`", f"`{spec.prometheus_name}`", spec.instrument.replace("_", " "), spec.unit,
             ", ".join(spec.attributes), spec.source_events.replace(",", ", "), spec.meaning)
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mpcache.telemetry.metric_table", description=__doc__.split("\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print docs/METRICS.md")
    args = parser.parse_args(argv)
    if not args.markdown:
        parser.print_help()
        return 2
    sys.stdout.write(render_markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
