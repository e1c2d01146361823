"""The metric table's section on the service itself: its build, its processes' count, readiness and restarts, the
per-cache-process counters of what it refused or recreated, and L1's state (fragmentation, admission)."""

from __future__ import annotations

from mpcache.eviction.admission import CHANCE
from mpcache.telemetry.metric_table.model import (
    OBSERVABLE_COUNTER,
    OBSERVABLE_GAUGE,
    Derivation,
    Label,
    Origin,
    Section,
    Source,
    State,
)
from mpcache.telemetry.metric_table.vocabulary import _m, _per_worker, _state

SERVICE = Section("Service", "The service", False, (
        _m("mpcache.build_info", "mpcache_build_info", OBSERVABLE_GAUGE, "",
           Source(Derivation.BUILD, state=State.BUILD,
                  labels=(Label("version", Origin.BUILD), Label("publish_path", Origin.BUILD))),
           "Always 1: the mpcache version and the ring writer the cache processes use (compiled or python)."),
        _m("mpcache.cache_processes", "mpcache_cache_processes", OBSERVABLE_GAUGE, "",
           Source(Derivation.SLOT_COUNT, state=State.SUPERVISOR), "Cache processes configured (--workers)."),
        _m("mpcache.cache_processes_ready", "mpcache_cache_processes_ready", OBSERVABLE_GAUGE, "", _state(
           Derivation.LIVE_SLOT_COUNT, State.SUPERVISOR, "G_HEARTBEAT"), "Cache processes with a fresh heartbeat."),
        _m("mpcache.child_restarts", "mpcache_child_restarts_total", OBSERVABLE_COUNTER, "",
           _state(Derivation.RESTART_COUNT, State.SUPERVISOR, "G_RESTARTS", labels=(Label("role", Origin.CHILD),)),
           "Restarts of the service's child processes, by role (cache, telemetry), since the supervisor started."),
        _m("mpcache.lmcache_refused_connections", "mpcache_lmcache_refused_connections_total", OBSERVABLE_COUNTER,
           "", _per_worker(State.SERVER, "G_LMCACHE_REFUSED"), "LMCache front-end connections refused because "
           "their peer's uid is not allowed, per cache process (kept across its restarts)."),
        _m("mpcache.lmcache_unidentified_connections", "mpcache_lmcache_unidentified_connections_total",
           OBSERVABLE_COUNTER, "", _per_worker(State.SERVER, "G_LMCACHE_UNIDENTIFIED"), "LMCache TCP connections "
           "closed by their peer before its uid was known (a health probe's connect-and-close), closed unanswered "
           "and never counted as refused, per cache process (kept across its restarts)."),
        _m("mpcache.segments_recreated", "mpcache_segments_recreated_total", OBSERVABLE_COUNTER, "", _per_worker(
           State.SUPERVISOR, "G_SEGMENTS_RECREATED"), "A cache process's ring or L1 pool found damaged after it died "
           "and recreated empty (its L1 lost), per cache process (kept across its restarts)."),
        _m("mpcache.l1_lost_copies", "mpcache_l1_lost_copies_total", OBSERVABLE_COUNTER, "", _per_worker(
           State.SERVER, "G_L1_LOST_COPIES"), "Objects whose copy into or out of L1's pool, or whose reserved "
           "space, its loss voided (a peer truncated the pool): failed, never served or stored as if valid, per "
           "cache process since it started."),
        _m("mpcache.buffers_refused", "mpcache_buffers_refused_total", OBSERVABLE_COUNTER, "", _per_worker(
           State.SERVER, "G_BUFFERS_REFUSED"), "Client KV buffers refused by their connection's or the cache "
           "process's budget of buffers and mapped bytes, per cache process (kept across its restarts)."),
        _m("mpcache.l1_fragmentation_bytes", "mpcache_l1_fragmentation_bytes", OBSERVABLE_GAUGE, "", _state(
           Derivation.GAUGE_SUM, State.L1, "G_L1_FRAGMENTATION"), "Bytes L1's allocators hold in slabs that no "
           "object uses (free spots, alignment padding, slab tails), summed over the live cache processes."),
        _m("mpcache.l1_admission_chance", "mpcache_l1_admission_chance", OBSERVABLE_GAUGE, "", _state(
           Derivation.GAUGE_RATIO, State.L1, "G_L1_ADMITTING", "G_L1_CAPACITY"), "The chance L1 admits a store "
           "seen first while it needs room, by chance alone (adaptive's second-sight rule refuses some at any "
           "chance: mpcache_l1_refused_chunks_total), weighted by L1 capacity over the live cache processes: "
           f"each process's is 1 (lru, arc, and adaptive unless admitting by chance pays) or {CHANCE} (adaptive "
           "while it does, docs/ARCHITECTURE.md)."),
        _m("mpcache.l1_refused", "mpcache_l1_refused_chunks_total", OBSERVABLE_COUNTER, "chunks", _per_worker(
           State.L1, "G_L1_REFUSED"), "Chunks of client stores L1's eviction order refused where it could have "
           "made room (adaptive: a store seen once that would evict what was seen again, or was asked for less "
           "often than what it would evict, or by chance, or whose room would evict what was used within its age "
           "floor, or large while large stores return less often), per "
           "cache process (kept across its restarts); they are in lmcache_mp_l1_allocation_failure_chunks_total "
           "too, which this tells from a full L1."),
    ))
