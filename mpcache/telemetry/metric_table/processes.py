"""The metric table's process-level sections: the service's own processes, sampled with psutil by the
telemetry process at collection time (never by a cache process), and the exporter's own series (target_info,
and prometheus_client's ``process_*`` of the telemetry process)."""

from __future__ import annotations

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
from mpcache.telemetry.metric_table.vocabulary import _m

# the supervisor, telemetry and every live cache process (worker: the cache process's index)
_SAMPLED = Source(Derivation.PROCESS_SAMPLE, state=State.PROCESSES,
                  labels=(Label("role", Origin.CHILD), Label("worker", Origin.SLOT)))
_PER = "of each of the service's processes: the supervisor, telemetry and every live cache process (worker)"

PROCESSES = Section("Processes", "The service's processes", False, (
    _m("mpcache.process_cpu", "mpcache_process_cpu_seconds_total", OBSERVABLE_COUNTER, "seconds", _SAMPLED,
       f"CPU time (user and system) {_PER}; a restarted process starts again from 0."),
    _m("mpcache.process_resident_memory", "mpcache_process_resident_memory_bytes", OBSERVABLE_GAUGE, "bytes",
       _SAMPLED, f"Resident memory {_PER} (a cache process's L1 pages count where it touched them)."),
    _m("mpcache.process_open_fds", "mpcache_process_open_fds", OBSERVABLE_GAUGE, "", _SAMPLED,
       f"Open file descriptors {_PER}."),
    _m("mpcache.process_max_fds", "mpcache_process_max_fds", OBSERVABLE_GAUGE, "", _SAMPLED,
       f"The soft limit on open file descriptors (RLIMIT_NOFILE) {_PER}: past it, accept() and open() fail."),
    _m("mpcache.process_voluntary_context_switches", "mpcache_process_voluntary_context_switches_total",
       OBSERVABLE_COUNTER, "", _SAMPLED, f"Voluntary context switches (waits for I/O or a lock) {_PER}."),
    _m("mpcache.process_involuntary_context_switches", "mpcache_process_involuntary_context_switches_total",
       OBSERVABLE_COUNTER, "", _SAMPLED, f"Involuntary context switches (preempted for lack of CPU) {_PER}."),
))

# prometheus_client's ProcessCollector: its series, of the telemetry process, as it names and describes them.
_PROCESS = Source(Derivation.PROCESS, state=State.PROCESS)
_PROCESS_SERIES = (
    ("process_cpu_seconds_total", OBSERVABLE_COUNTER, "seconds", "Total user and system CPU time spent in seconds."),
    ("process_max_fds", OBSERVABLE_GAUGE, "", "Maximum number of open file descriptors."),
    ("process_open_fds", OBSERVABLE_GAUGE, "", "Number of open file descriptors."),
    ("process_resident_memory_bytes", OBSERVABLE_GAUGE, "bytes", "Resident memory size in bytes."),
    ("process_start_time_seconds", OBSERVABLE_GAUGE, "seconds",
     "Start time of the process since unix epoch in seconds."),
    ("process_virtual_memory_bytes", OBSERVABLE_GAUGE, "bytes", "Virtual memory size in bytes."),
)

EXPORTER = Section("Exporter", "The exporters' own series (Prometheus only)", False, (
    _m("", "target_info", OBSERVABLE_GAUGE, "",
       Source(Derivation.RESOURCE, state=State.RESOURCE, labels=tuple(
           Label(name, Origin.RESOURCE) for name in ("host_name", "service_instance_id", "service_name"))),
       "Always 1: the OTel resource every datapoint carries (service.name, service.instance.id, host.name, "
       "and the attributes of OTEL_RESOURCE_ATTRIBUTES)."),
    *(_m("", name, kind, unit, _PROCESS, meaning) for name, kind, unit, meaning in _PROCESS_SERIES),
))
