"""The metric table: every series mpcache exports, one row each, in sections.

The sections of the specification (``spec/metrics.tsv``, whose rows they hold in its order) come first, each
followed by mpcache's rows that extend it; then mpcache's own sections.  A row is a :class:`MetricSpec`; its
:class:`Source` says what the value and the attributes are computed from.
"""

from __future__ import annotations

from mpcache.contract.events import EventType as E
from mpcache.telemetry.metric_table.grids import (
    LIFECYCLE_SECONDS_BUCKETS,
    REQUEST_SECONDS_BUCKETS,
    REUSE_GAP_OBJECTS_BUCKETS,
    THROUGHPUT_GBS_BUCKETS,
)
from mpcache.telemetry.metric_table.kvfeed import KV_EVENTS
from mpcache.telemetry.metric_table.model import (
    COUNTER,
    HISTOGRAM,
    OBSERVABLE_COUNTER,
    OBSERVABLE_GAUGE,
    Derivation,
    Label,
    Origin,
    Section,
    Source,
    State,
)
from mpcache.telemetry.metric_table.processes import EXPORTER, PROCESSES
from mpcache.telemetry.metric_table.service import SERVICE
from mpcache.telemetry.metric_table.vocabulary import (
    _ADAPTER,
    _GROUP_MODEL,
    _KEY_MODEL,
    _KEY_SALT,
    _L2_NAME,
    _SALT,
    _count,
    _f,
    _failed,
    _false,
    _m,
    _salts,
    _state,
    _sum,
    _true,
)

_BUS = Source(Derivation.BUS_STATE, state=State.BUS)
_L1R, _L1W, _L1WR, _L1E = (E.L1_READ_FINISHED, E.L1_WRITE_FINISHED, E.L1_WRITE_FINISHED_AND_READ_RESERVED,
                           E.L1_KEYS_EVICTED)
_SMR, _SMW = E.SM_READ_PREFETCHED_FINISHED, E.SM_WRITE_FINISHED
_L0 = (E.MP_VLLM_BLOCK_ALLOCATION, E.MP_VLLM_END_SESSION)
_L0_SOURCE = Source(Derivation.BLOCK_SECONDS, (E.MP_VLLM_BLOCK_ALLOCATION,), since=_L0,
                    labels=(_f("instance_id", event=E.MP_VLLM_BLOCK_ALLOCATION),
                            _f("model_name", event=E.MP_VLLM_BLOCK_ALLOCATION)))
_LOOKUP_LABELS = (_f("model_name"), _f("cache_salt"))
_L0_L1_LABELS = (_f("engine_id"), _f("device"), _f("model_name"))
_PER_ADAPTER = (_L2_NAME, _ADAPTER)

_S, _G, _O = LIFECYCLE_SECONDS_BUCKETS, THROUGHPUT_GBS_BUCKETS, REUSE_GAP_OBJECTS_BUCKETS
_MRC_KEY = (_KEY_MODEL, _KEY_SALT)

SECTIONS: tuple[Section, ...] = (
    Section("L1", "L1 reads, writes and evictions", True, (
        _m("lmcache_mp.l1_read", "lmcache_mp_l1_read_chunks_total", COUNTER, "chunks", _salts((_L1R,), _SALT),
           "Chunks read from L1 (counted when the read locks are released)."),
        _m("lmcache_mp.l1_write", "lmcache_mp_l1_write_chunks_total", COUNTER, "chunks", _salts((_L1W, _L1WR), _SALT),
           "Chunks committed to L1, by client stores and by L2→L1 prefetch alike."),
        _m("lmcache_mp.l1_evicted", "lmcache_mp_l1_evicted_chunks_total", COUNTER, "chunks", _salts((_L1E,), _SALT),
           "Chunks removed from L1 by eviction."),
        _m("lmcache_mp.l1_eviction_loop_ticks", "lmcache_mp_l1_eviction_loop_ticks_total", COUNTER, "",
           _count(E.L1_EVICTION_LOOP_TICK), "Ticks of the L1 eviction loop (shows the loop is alive)."),
        _m("lmcache_mp.l1_eviction_loop_triggered", "lmcache_mp_l1_eviction_loop_triggered_total", COUNTER, "",
           _true(E.L1_EVICTION_LOOP_TICK, "triggered"),
           "Eviction-loop ticks after which stores had evicted to make room (L1 full) since the previous tick."),
        _m("lmcache_mp.l1_usage_ratio", "lmcache_mp_l1_usage_ratio", OBSERVABLE_GAUGE, "",
           _state(Derivation.GAUGE_RATIO, State.L1, "G_L1_USED", "G_L1_CAPACITY"),
           "L1 bytes in use over L1 capacity, over all live cache processes, at scrape time."),
    )),
    Section("L1Failures", "L1 failures and timeouts", True, (
        _m("lmcache_mp.l1_allocation_failure", "lmcache_mp_l1_allocation_failure_chunks_total", COUNTER, "chunks",
           _salts((E.L1_ALLOCATION_FAILED,), _f("during"), _GROUP_MODEL),
           "Chunks L1 had no room for (or, under --l1-policy adaptive, refused a store seen once), split by "
           "whether a client store or an L2 prefetch asked."),
        _m("lmcache_mp.l1_read_failure", "lmcache_mp_l1_read_failure_chunks_total", COUNTER, "chunks",
           _salts((E.L1_READ_FAILED,), _f("during"), _f("reason"), _GROUP_MODEL),
           "Chunks that lookup reported present but could not be read (a race or unexpected eviction, not a miss)."),
        _m("lmcache_mp.timeouts", "lmcache_mp_timeouts_total", COUNTER, "",
           _count(E.TIMEOUT_RAISED, _f("exception_type")),
           "Timeout errors raised, by exception class."),
    )),
    Section("L1Lifecycle", "L1 chunk lifecycle (sampled)", True, (
        _m("lmcache_mp.l1_chunk_lifetime", "lmcache_mp_l1_chunk_lifetime_seconds", HISTOGRAM, "seconds",
           Source(Derivation.SAMPLED_KEY_SECONDS, (_L1E,), since=(_L1W, _L1WR), listed=(_L1E,)),
           "Eviction time minus allocation time of each sampled L1 chunk.", _S),
        _m("lmcache_mp.l1_chunk_idle_before_evict", "lmcache_mp_l1_chunk_idle_before_evict_seconds", HISTOGRAM,
           "seconds", Source(Derivation.SAMPLED_KEY_SECONDS, (_L1E,), since=(_L1R, _L1W, _L1WR), listed=(_L1E,)),
           "Eviction time minus last access time of each sampled L1 chunk.", _S),
        _m("lmcache_mp.l1_chunk_reuse_gap", "lmcache_mp_l1_chunk_reuse_gap_seconds", HISTOGRAM, "seconds",
           Source(Derivation.SAMPLED_KEY_SECONDS, (_L1R, _L1W, _L1WR), since=(_L1R, _L1W, _L1WR)),
           "Time between consecutive touches (read or write) of a sampled live L1 chunk.", _S),
        _m("lmcache_mp.l1_chunk_evict_reuse_gap", "lmcache_mp_l1_chunk_evict_reuse_gap_seconds", HISTOGRAM, "seconds",
           Source(Derivation.SAMPLED_KEY_SECONDS, (_L1W, _L1WR), since=(_L1E,), listed=(_L1E, _L1W)),
           "Time from a sampled chunk's eviction to its next write into L1, capped at 300 s (never rewritten = 300 s).",
           _S),
        _m("lmcache_mp.real_reuse_gap", "lmcache_mp_real_reuse_gap_seconds", HISTOGRAM, "seconds",
           Source(Derivation.SAMPLED_KEY_SECONDS, (_SMR,), since=(_SMR, _SMW), labels=(_KEY_SALT,)),
           "Time between a sampled chunk's previous access (read or write) and its next read, per cache_salt.", _S),
        _m("lmcache_mp.real_reuse_gap_objects", "lmcache_mp_real_reuse_gap_objects_chunks", HISTOGRAM, "chunks",
           Source(Derivation.SAMPLED_KEY_ACCESSES, (_SMR,), since=(_SMR, _SMW), labels=(_KEY_SALT,)),
           "Chunk accesses of the same cache_salt between a sampled chunk's previous access and its next read.", _O),
    )),
    Section("L2", "L2 stores, prefetches and evictions", True, (
        _m("lmcache_mp.l2_store_submitted", "lmcache_mp_l2_store_submitted_requests_total", COUNTER, "requests",
           _count(E.L2_STORE_SUBMITTED), "Store tasks submitted to L2 adapters."),
        _m("lmcache_mp.l2_store_submitted_objects", "lmcache_mp_l2_store_submitted_objects_chunks_total", COUNTER,
           "chunks", _salts((E.L2_STORE_SUBMITTED,), _SALT), "Chunks in store tasks submitted to L2 adapters."),
        _m("lmcache_mp.l2_store_completed", "lmcache_mp_l2_store_completed_requests_total", COUNTER, "requests",
           _failed(E.L2_STORE_COMPLETED, False),
           "Store tasks an L2 adapter finished with every chunk stored, by adapter type (a task with a failed "
           "chunk counts in mpcache_l2_store_failed_requests_total instead)."),
        _m("lmcache_mp.l2_store_completed_objects", "lmcache_mp_l2_store_completed_objects_chunks_total", COUNTER,
           "chunks", _salts((E.L2_STORE_COMPLETED,), _SALT), "Chunks an L2 adapter stored successfully."),
        _m("lmcache_mp.l2_prefetch_lookup", "lmcache_mp_l2_prefetch_lookup_requests_total", COUNTER, "requests",
           _count(E.L2_PREFETCH_LOOKUP_SUBMITTED), "Prefetch lookups that asked the L2 adapters which keys they hold."),
        _m("lmcache_mp.l2_prefetch_lookup_objects", "lmcache_mp_l2_prefetch_lookup_objects_chunks_total", COUNTER,
           "chunks", _salts((E.L2_PREFETCH_LOOKUP_SUBMITTED,), _SALT), "Chunks asked about by prefetch lookups."),
        _m("lmcache_mp.l2_prefetch_hit", "lmcache_mp_l2_prefetch_hit_chunks_total", COUNTER, "chunks",
           _sum(E.L2_PREFETCH_LOOKUP_COMPLETED, "prefix_hit_count"),
           "Chunks of the contiguous prefix that prefetch lookups found in L2."),
        _m("lmcache_mp.l2_prefetch_load_submitted", "lmcache_mp_l2_prefetch_load_submitted_requests_total", COUNTER,
           "requests", _sum(E.L2_PREFETCH_LOAD_SUBMITTED, "adapter_count"),
           "Per-adapter load tasks submitted for prefetches."),
        _m("lmcache_mp.l2_prefetch_load_submitted_objects",
           "lmcache_mp_l2_prefetch_load_submitted_objects_chunks_total", COUNTER, "chunks",
           _salts((E.L2_PREFETCH_LOAD_SUBMITTED,), _SALT), "Chunks submitted for loading from L2."),
        _m("lmcache_mp.l2_prefetch_load_completed", "lmcache_mp_l2_prefetch_load_completed_chunks_total", COUNTER,
           "chunks", _salts((E.L2_PREFETCH_LOAD_COMPLETED,), _SALT), "Chunks loaded from L2 into L1 by prefetches."),
        _m("lmcache_mp.l2_load_completed", "lmcache_mp_l2_load_completed_requests_total", COUNTER, "requests",
           _failed(E.L2_LOAD_TASK_COMPLETED, False),
           "Load tasks an L2 adapter finished with every chunk loaded, by adapter type (a task with a failed "
           "chunk counts in mpcache_l2_load_failed_requests_total instead)."),
        _m("lmcache_mp.l2_evicted", "lmcache_mp_l2_evicted_chunks_total", COUNTER, "chunks",
           _salts((E.L2_KEYS_EVICTED,), _SALT), "Chunks removed from L2 adapters by L2 eviction."),
    )),
    Section("Lookup", "Lookup hit rates", True, (
        _m("lmcache_mp.lookup_requested", "lmcache_mp_lookup_requested_tokens_total", COUNTER, "tokens",
           _sum(E.MP_LOOKUP_PREFETCH_END, "requested_tokens", *_LOOKUP_LABELS),
           "Chunk-aligned tokens asked for by completed lookups."),
        _m("lmcache_mp.lookup_hit", "lmcache_mp_lookup_hit_tokens_total", COUNTER, "tokens",
           _sum(E.MP_LOOKUP_PREFETCH_END, "hit_tokens", *_LOOKUP_LABELS),
           "Tokens of the contiguous prefix that completed lookups found in L1 or L2."),
    )),
    Section("LookupTiers", "Lookup hits by tier (L1 / L2)", False, (
        _m("lmcache_mp.lookup_hit_l1", "lmcache_mp_lookup_hit_l1_tokens_total", COUNTER, "tokens",
           _sum(E.MP_LOOKUP_PREFETCH_END, "l1_hit_tokens", *_LOOKUP_LABELS),
           "Tokens of completed lookups' hits that were in L1."),
        _m("lmcache_mp.lookup_hit_l2", "lmcache_mp_lookup_hit_l2_tokens_total", COUNTER, "tokens",
           _sum(E.MP_LOOKUP_PREFETCH_END, "l2_hit_tokens", *_LOOKUP_LABELS),
           "Tokens of completed lookups' hits that were in L2."),
    )),
    Section("LookupRequests", "Request-level hit rate (the engine's prefix cache and this cache)", False, (
        _m("lmcache_mp.lookup_prompt", "lmcache_mp_lookup_prompt_tokens_total", COUNTER, "tokens",
           _sum(E.MP_LOOKUP_PREFETCH_END, "prompt_tokens", *_LOOKUP_LABELS),
           "Whole prompts of completed lookups, a partial last chunk included: the request-level hit rate's "
           "denominator (LMCache 0.5.7's series)."),
        _m("lmcache_mp.lookup_request_hit", "lmcache_mp_lookup_request_hit_tokens_total", COUNTER, "tokens",
           _sum(E.MP_LOOKUP_PREFETCH_END, "request_hit_tokens", *_LOOKUP_LABELS),
           "Prefix of those prompts the engine's own prefix cache or this cache serves, the longer of the two "
           "(LMCache 0.5.7's series; lookup_requested and lookup_hit leave out the prefix a 0.5.7 lookup starts "
           "past)."),
    )),
    Section("Compatibility", "Series LMCache's own server exports beyond the specification", False, (
        _m("lmcache_mp.lookups", "lmcache_mp_lookups_requests_total", COUNTER, "requests",
           _count(E.MP_LOOKUP_PREFETCH_END, *_LOOKUP_LABELS), "Completed lookups."),
        _m("lmcache_mp.lookup_hit_l1_keys", "lmcache_mp_lookup_hit_l1_keys_total", COUNTER, "keys",
           _sum(E.MP_LOOKUP_PREFETCH_END, "l1_hit_keys", *_LOOKUP_LABELS),
           "Objects (one per chunk and KV rank) of completed lookups' hits that L1 already held."),
        _m("lmcache_mp.lookup_hit_l2_keys", "lmcache_mp_lookup_hit_l2_keys_total", COUNTER, "keys",
           _sum(E.MP_LOOKUP_PREFETCH_END, "l2_hit_keys", *_LOOKUP_LABELS),
           "Objects of completed lookups' hits that were loaded from L2."),
        _m("lmcache_mp.l2_evicted_objects", "lmcache_mp_l2_evicted_objects_chunks_total", COUNTER, "chunks",
           _salts((E.L2_KEYS_EVICTED,)), "Chunks removed from L2 adapters by L2 eviction, all tenants together."),
        _m("lmcache_mp.num_submitted_stores", "lmcache_mp_num_submitted_stores_total", COUNTER, "",
           _count(E.MP_STORE_SUBMITTED, _f("device")), "Stores from an engine's memory into L1 begun, by device."),
        _m("lmcache_mp.num_finished_stores", "lmcache_mp_num_finished_stores_total", COUNTER, "",
           _count(E.MP_STORE_END, _f("device")),
           "Stores from an engine's memory into L1 ended, however many chunks they committed, by device."),
        _m("lmcache_mp.num_submitted_retrieves", "lmcache_mp_num_submitted_retrieves_total", COUNTER, "",
           _count(E.MP_RETRIEVE_SUBMITTED, _f("device")),
           "Retrieves from L1 into an engine's memory begun, by device."),
        _m("lmcache_mp.num_finished_retrieves", "lmcache_mp_num_finished_retrieves_total", COUNTER, "",
           _count(E.MP_RETRIEVE_END, _f("device")),
           "Retrieves from L1 into an engine's memory ended, however many chunks they moved, by device."),
    )),
    Section("L2Failures", "L2 prefetch failures", True, (
        _m("lmcache_mp.l2_prefetch_failure", "lmcache_mp_l2_prefetch_failure_chunks_total", COUNTER, "chunks",
           _salts((E.L2_PREFETCH_FAILED,), _f("reason"), _GROUP_MODEL),
           "Chunks an L2 prefetch could not land in L1, by reason: l1_oom, not_found, integrity (a record that "
           "failed its MAC check: corrupt or forged), l2_error (a load's I/O error or timeout), lookup_error "
           "(a lookup that could not ask its tier) or l1_lost (L1's pool truncated by another process meanwhile)."),
    )),
    Section("L2Outcomes", "L2 tasks that failed (an outage at a glance)", False, (
        _m("mpcache.l2_store_failed", "mpcache_l2_store_failed_requests_total", COUNTER, "requests",
           _failed(E.L2_STORE_COMPLETED, True), "Store tasks an L2 adapter finished with at least one chunk not "
           "stored (I/O error, timeout, unreachable or full tier), by adapter type."),
        _m("mpcache.l2_store_failed_chunks", "mpcache_l2_store_failed_chunks_total", COUNTER, "chunks",
           _sum(E.L2_STORE_COMPLETED, "failed_count", _f("l2_name")),
           "Chunks L2 store tasks failed to store, by adapter type."),
        _m("mpcache.l2_load_failed", "mpcache_l2_load_failed_requests_total", COUNTER, "requests",
           _failed(E.L2_LOAD_TASK_COMPLETED, True), "Load tasks an L2 adapter finished with at least one chunk not "
           "loaded (missing, rejected, I/O error or timeout), by adapter type."),
        _m("mpcache.l2_load_failed_chunks", "mpcache_l2_load_failed_chunks_total", COUNTER, "chunks",
           _sum(E.L2_LOAD_TASK_COMPLETED, "failed_count", _f("l2_name")),
           "Chunks L2 load tasks failed to load into L1, by adapter type."),
    )),
    Section("L0Lifecycle", "L0 (GPU) block lifecycle (sampled)", True, (
        _m("lmcache_mp.l0_block_lifetime", "lmcache_mp_l0_block_lifetime_seconds", HISTOGRAM, "seconds", _L0_SOURCE,
           "Time from a sampled GPU block's allocation to the reallocation that evicted its contents.", _S),
        _m("lmcache_mp.l0_block_idle_before_evict", "lmcache_mp_l0_block_idle_before_evict_seconds", HISTOGRAM,
           "seconds", _L0_SOURCE,
           "Time from a sampled GPU block's last access to the reallocation that evicted its contents.", _S),
        _m("lmcache_mp.l0_block_reuse_gap", "lmcache_mp_l0_block_reuse_gap_seconds", HISTOGRAM, "seconds", _L0_SOURCE,
           "Time between consecutive uses of a sampled GPU block's cached contents.", _S),
    )),
    Section("Throughput", "L0 ↔ L1 and L1 ↔ L2 throughput", True, (
        _m("lmcache_mp.l0_l1_store_throughput", "lmcache_mp_l0_l1_store_throughput_GBs", HISTOGRAM, "GBs",
           Source(Derivation.THROUGHPUT, (E.MP_STORE_END,), since=(E.MP_STORE_START,), field="total_bytes",
                  labels=_L0_L1_LABELS),
           "Bytes over duration of each client KV buffer → L1 copy, in GB/s.", _G),
        _m("lmcache_mp.l0_l1_load_throughput", "lmcache_mp_l0_l1_load_throughput_GBs", HISTOGRAM, "GBs",
           Source(Derivation.THROUGHPUT, (E.MP_RETRIEVE_END,), since=(E.MP_RETRIEVE_START,), field="total_bytes",
                  labels=_L0_L1_LABELS),
           "Bytes over duration of each L1 → client KV buffer copy, in GB/s.", _G),
        _m("lmcache_mp.l2_store_throughput", "lmcache_mp_l2_store_throughput_GBs", HISTOGRAM, "GBs",
           Source(Derivation.THROUGHPUT, (E.L2_STORE_COMPLETED,), since=(E.L2_STORE_SUBMITTED,),
                  field="bytes_transferred", labels=(_f("l2_name", event=E.L2_STORE_COMPLETED),)),
           "Bytes actually written over submit→complete time of each L2 store task, in GB/s (end to end).", _G),
        _m("lmcache_mp.l2_load_throughput", "lmcache_mp_l2_load_throughput_GBs", HISTOGRAM, "GBs",
           Source(Derivation.THROUGHPUT, (E.L2_LOAD_TASK_COMPLETED,), since=(E.L2_LOAD_TASK_SUBMITTED,),
                  field="total_bytes", field_event=E.L2_LOAD_TASK_SUBMITTED,
                  labels=(_f("l2_name", event=E.L2_LOAD_TASK_COMPLETED),)),
           "Submitted bytes over submit→complete time of each L2 load task, in GB/s (end to end).", _G),
    )),
    Section("Engine", "Engine counters", True, (
        _m("lmcache_mp.num_chunks_loaded", "lmcache_mp_num_chunks_loaded_total", COUNTER, "",
           Source(Derivation.POSITIVE_FIELD_SUM, (E.MP_RETRIEVE_END,), field="retrieved_count",
                  labels=(_f("worker_id", "engine_id"), _f("model_name"), _f("cache_salt"))),
           "Chunks delivered into each client worker's KV buffer."),
    )),
    Section("EventBus", "Event bus health", True, (
        _m("lmcache_mp.event_bus.queue_depth", "lmcache_mp_event_bus_queue_depth", OBSERVABLE_GAUGE, "", _BUS,
           "Event records published but not yet consumed, over all rings."),
        _m("lmcache_mp.event_bus.drain_lag_seconds", "lmcache_mp_event_bus_drain_lag_seconds", OBSERVABLE_GAUGE, "",
           _BUS,
           "Age of the oldest unconsumed event record (0 when every ring is drained)."),
        _m("lmcache_mp.event_bus.dropped_events_total", "lmcache_mp_event_bus_dropped_events_total", OBSERVABLE_COUNTER,
           "", _BUS, "Event records lost: ring full at the producer, torn by a dead producer, or malformed."),
        _m("lmcache_mp.event_bus.subscriber_exceptions", "lmcache_mp_event_bus_subscriber_exceptions_total",
           OBSERVABLE_COUNTER, "",
           Source(Derivation.BUS_STATE, state=State.BUS, labels=(Label("subscriber_name", Origin.BUS),)),
           "Subscriber callbacks that raised, by subscriber name (its class name, or the name of a table section's "
           "counters subscriber)."),
    )),
    Section("Checkpoint", "The telemetry process's checkpoint", False, (
        _m("mpcache.telemetry_checkpoint_refused", "mpcache_telemetry_checkpoint_refused_total", OBSERVABLE_COUNTER,
           "", Source(Derivation.CHECKPOINT, state=State.TELEMETRY, labels=(Label("reason", Origin.CHECKPOINT),)),
           "Checkpoints a starting telemetry process found and did not load, by reason (format: not a state "
           "segment of this build; corrupt: no record passes its checksum; foreign: written by another build or "
           "configuration; invalid: does not decode; stale: older than what the rings already released): it "
           "started from zero, a reset of every counter."),
        _m("mpcache.telemetry_checkpoint_failures", "mpcache_telemetry_checkpoint_failures_total",
           OBSERVABLE_COUNTER, "", Source(Derivation.CHECKPOINT, state=State.TELEMETRY),
           "Checkpoints that could not be written (the state outgrew --telemetry-state-size): a restart before the "
           "next one that is starts from zero."),
        _m("mpcache.telemetry_checkpoint_bytes", "mpcache_telemetry_checkpoint_bytes", OBSERVABLE_GAUGE, "bytes",
           Source(Derivation.CHECKPOINT, state=State.TELEMETRY),
           "Size of the last checkpoint written, against --telemetry-state-size."),
    )),
    Section("State", "Server, L1 and L2 state", True, (
        _m("lmcache_mp.active_prefetch_jobs", "lmcache_mp_active_prefetch_jobs", OBSERVABLE_GAUGE, "",
           _state(Derivation.GAUGE_SUM, State.SERVER, "G_ACTIVE_PREFETCH"),
           "Prefetch jobs in flight, over all live cache processes."),
        _m("lmcache_mp.l1_memory_usage_bytes", "lmcache_mp_l1_memory_usage_bytes", OBSERVABLE_GAUGE, "",
           _state(Derivation.GAUGE_SUM, State.L1, "G_L1_USED"), "Bytes held in L1, over all live cache processes."),
        _m("lmcache_mp.l2_usage_bytes", "lmcache_mp_l2_usage_bytes", OBSERVABLE_GAUGE, "",
           _state(Derivation.GAUGE_SUM, State.L2, "G_L2_USAGE", labels=(_L2_NAME,)),
           "Bytes held by each L2 adapter type."),
        _m("lmcache_mp.num_inflight_l2_stores", "lmcache_mp_num_inflight_l2_stores", OBSERVABLE_GAUGE, "",
           _state(Derivation.GAUGE_SUM, State.L2, "G_L2_INFLIGHT_STORES", labels=_PER_ADAPTER),
           "L2 store tasks in flight, per adapter."),
        _m("lmcache_mp.num_inflight_l2_loads", "lmcache_mp_num_inflight_l2_loads", OBSERVABLE_GAUGE, "",
           _state(Derivation.GAUGE_SUM, State.L2, "G_L2_INFLIGHT_LOADS", labels=_PER_ADAPTER),
           "L2 load tasks in flight, per adapter."),
        _m("lmcache_mp.inflight_load_memory_usage_bytes", "lmcache_mp_inflight_load_memory_usage_bytes",
           OBSERVABLE_GAUGE, "",
           _state(Derivation.GAUGE_SUM, State.L2, "G_L2_INFLIGHT_LOAD_BYTES", labels=_PER_ADAPTER),
           "L1 bytes reserved by in-flight L2 loads, per adapter."),
    )),
    Section("Blend", "Cache blending", True, (
        _m("lmcache_blend.lookup_requests", "lmcache_blend_lookup_requests_total", COUNTER, "",
           _count(E.CB_LOOKUP_START), "Blend lookups started."),
        _m("lmcache_blend.lookup_requested_tokens", "lmcache_blend_lookup_requested_tokens_total", COUNTER, "",
           _sum(E.CB_LOOKUP_END, "requested_tokens"), "Chunk-aligned tokens asked for by finished blend lookups."),
        _m("lmcache_blend.lookup_hit_tokens", "lmcache_blend_lookup_hit_tokens_total", COUNTER, "",
           _sum(E.CB_LOOKUP_END, "hit_tokens"), "Tokens finished blend lookups could serve."),
        _m("lmcache_blend.lookup_fingerprint_hits", "lmcache_blend_lookup_fingerprint_hits_total", COUNTER, "",
           _sum(E.CB_LOOKUP_END, "fingerprint_hits"), "Chunks blend lookups matched in the fingerprint table."),
        _m("lmcache_blend.lookup_storage_hits", "lmcache_blend_lookup_storage_hits_total", COUNTER, "",
           _sum(E.CB_LOOKUP_END, "storage_hits"), "Fingerprint matches that blend lookups confirmed in storage."),
        _m("lmcache_blend.lookup_stale_chunks", "lmcache_blend_lookup_stale_chunks_total", COUNTER, "",
           _sum(E.CB_LOOKUP_END, "stale_chunks"), "Fingerprint matches whose chunks were gone from storage (stale)."),
        _m("lmcache_blend.lookup_no_gpu_context_errors", "lmcache_blend_lookup_no_gpu_context_errors_total",
           COUNTER, "",
           _true(E.CB_LOOKUP_END, "no_gpu_context"), "Blend lookups that found no GPU context."),
        _m("lmcache_blend.retrieve_requests", "lmcache_blend_retrieve_requests_total", COUNTER, "",
           _count(E.CB_RETRIEVE_START), "Blend retrieves started."),
        _m("lmcache_blend.retrieve_chunks", "lmcache_blend_retrieve_chunks_total", COUNTER, "",
           _sum(E.CB_RETRIEVE_START, "num_chunks"), "Chunks asked for by blend retrieves."),
        _m("lmcache_blend.retrieve_failures", "lmcache_blend_retrieve_failures_total", COUNTER, "",
           _false(E.CB_RETRIEVE_END, "success"), "Blend retrieves that failed."),
        _m("lmcache_blend.store_pre_computed_requests", "lmcache_blend_store_pre_computed_requests_total", COUNTER, "",
           _count(E.CB_STORE_PRE_COMPUTED_START), "Pre-computed blend stores started."),
        _m("lmcache_blend.store_pre_computed_chunks", "lmcache_blend_store_pre_computed_chunks_total", COUNTER, "",
           _sum(E.CB_STORE_PRE_COMPUTED_END, "stored_chunks"), "Chunks written by pre-computed blend stores."),
        _m("lmcache_blend.store_pre_computed_failures", "lmcache_blend_store_pre_computed_failures_total", COUNTER, "",
           _false(E.CB_STORE_PRE_COMPUTED_END, "success"), "Pre-computed blend stores that failed."),
        _m("lmcache_blend.store_final_requests", "lmcache_blend_store_final_requests_total", COUNTER, "",
           _count(E.CB_STORE_FINAL_START), "Final blend stores started."),
        _m("lmcache_blend.store_final_chunks", "lmcache_blend_store_final_chunks_total", COUNTER, "",
           _sum(E.CB_STORE_FINAL_END, "stored_chunks"), "Chunks committed by final blend stores."),
        _m("lmcache_blend.store_final_failures", "lmcache_blend_store_final_failures_total", COUNTER, "",
           _false(E.CB_STORE_FINAL_END, "success"), "Final blend stores that failed."),
        _m("lmcache_blend.fingerprints_registered", "lmcache_blend_fingerprints_registered_total", COUNTER, "",
           _sum(E.CB_FINGERPRINTS_REGISTERED, "num_chunks"), "Chunks newly indexed into the blend fingerprint table."),
        _m("lmcache_blend.chunks_evicted", "lmcache_blend_chunks_evicted_total", COUNTER, "",
           _sum(E.CB_CHUNKS_EVICTED, "num_chunks"), "Stale entries removed from the blend fingerprint table."),
    )),
    Section("L2Origin", "L2 loads by origin (a shared L2)", False, (
        _m("mpcache.l2_load", "mpcache_l2_load_chunks_total", COUNTER, "chunks",
           _sum(E.L2_LOAD_ORIGIN, "chunk_count", _f("l2_name"), _f("origin")),
           "Chunks loaded from L2, by who stored them: origin self (this service instance) or peer (another one)."),
    )),
    Section("LMCache", "The LMCache front end", False, (
        _m("mpcache.lmcache.request", "mpcache_lmcache_request_seconds", HISTOGRAM, "seconds",
           Source(Derivation.PRODUCER_BUCKETS, (E.LMCACHE_REQUEST_TIMES,), labels=(_f("op"),)),
           "Server-side service time of each LMCache-protocol request, from its receipt to its reply sent, by "
           "operation (`invalid`: a request naming no known operation; `wait_prefetch_status` includes its wait).",
           REQUEST_SECONDS_BUCKETS),
    )),
    Section("MissRatio", "Capacity planning and miss reasons (docs/MRC.md)", False, (
        _m("mpcache.mrc_hit_ratio", "mpcache_mrc_hit_ratio", OBSERVABLE_GAUGE, "",
           Source(Derivation.MRC_HIT_RATIO, (E.MRC_LOOKUP_SAMPLED,), since=(E.MRC_STORE_SAMPLED,),
                  labels=(Label("tier", Origin.ANALYSIS), *_MRC_KEY, Label("capacity_ratio", Origin.ANALYSIS))),
           "Hit ratio a tier of capacity_ratio × its configured capacity would have had on the sampled "
           "lookups under --l1-policy's order (lru by reuse distance, arc and adaptive by miniature simulation) "
           "(tier l1: L1 of all cache processes; l1_l2: L1 plus every L2 tier); model_name and "
           "cache_salt \"*\": every lookup."),
        _m("mpcache.lookup_miss", "mpcache_lookup_miss_chunks_total", COUNTER, "chunks",
           Source(Derivation.SAMPLED_MISSES, (E.MRC_LOOKUP_SAMPLED,), since=(E.MRC_STORE_SAMPLED,),
                  labels=(Label("reason", Origin.ANALYSIS), *_MRC_KEY)),
           "Chunks a lookup asked for and did not get, by reason: cold (never stored in the sampled history), "
           "evicted (stored before, gone), after_gap (in L1 but past the first missing chunk); estimates at a "
           "sample rate below 1, exact at 1."),
        _m("mpcache.l1_evicted_reused", "mpcache_l1_evicted_reused_chunks_total", COUNTER, "chunks",
           Source(Derivation.SAMPLED_MISSES, (E.MRC_LOOKUP_SAMPLED,), since=(E.MRC_STORE_SAMPLED,), labels=_MRC_KEY),
           "Chunks a lookup asked for after L1 had evicted them (found in L2 or missed): eviction regret."),
    )),
SERVICE,
    KV_EVENTS,
    PROCESSES,
    EXPORTER,
)
