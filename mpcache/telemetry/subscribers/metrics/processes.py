"""The service's processes as the metric table's "Processes" section: CPU seconds, resident memory, open
descriptors against their limit and context switches of the supervisor, the telemetry process and every live
cache process, read with psutil at collection time.

Sampled here, outside the cache processes: reading another process's ``/proc`` costs it nothing.  Which
processes: the supervisor (this process's parent), this process, and the pid each live cache process wrote
into its gauge-board slot.  A process that is gone between the two reads, or whose ``/proc`` cannot be read,
is left out of that collection.  The callbacks run on the exporter's thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import psutil
from opentelemetry.metrics import CallbackOptions, Observation

from mpcache.shm import layout
from mpcache.shm.gauges import GaugeBoardReader
from mpcache.telemetry.buffered import MeterLike
from mpcache.telemetry.bus import Subscriber
from mpcache.telemetry.otel import create_instrument

Reading = Callable[[psutil.Process], float]

_READINGS: dict[str, Reading] = {
    "mpcache.process_cpu": lambda p: sum(p.cpu_times()[:2]),
    "mpcache.process_resident_memory": lambda p: p.memory_info().rss,
    "mpcache.process_open_fds": lambda p: p.num_fds(),
    "mpcache.process_max_fds": lambda p: p.rlimit(psutil.RLIMIT_NOFILE)[0],
    "mpcache.process_voluntary_context_switches": lambda p: p.num_ctx_switches().voluntary,
    "mpcache.process_involuntary_context_switches": lambda p: p.num_ctx_switches().involuntary,
}


class ProcessesSubscriber(Subscriber):
    """Creates the "Processes" section's instruments; consumes no events."""

    def __init__(self, meter: MeterLike, board: GaugeBoardReader) -> None:
        self._board = board
        self._known: dict[int, psutil.Process] = {}  # by pid; a Process also tells a reused pid apart
        for name, reading in _READINGS.items():
            create_instrument(meter, name, [self._callback(reading)])

    def processes(self) -> list[tuple[dict[str, str], psutil.Process]]:
        """(attributes, process) of the supervisor, this process and every live cache process."""
        wanted = [({"role": "supervisor"}, os.getppid()), ({"role": "telemetry"}, os.getpid())]
        wanted += [({"role": "cache", "worker": str(slot)}, self._board.word(slot, layout.G_PID))
                   for slot in self._board.live_slots()]
        found = []
        for attributes, pid in wanted:
            process = self._known.get(pid)
            try:
                if process is None or not process.is_running():
                    process = self._known[pid] = psutil.Process(pid)
            except psutil.Error:
                continue
            found.append((attributes, process))
        alive = {process.pid for _, process in found}
        self._known = {pid: process for pid, process in self._known.items() if pid in alive}
        return found

    def _callback(self, reading: Reading) -> Callable[[CallbackOptions], list[Observation]]:
        def observe(_options: CallbackOptions) -> list[Observation]:
            observed = []
            for attributes, process in self.processes():
                try:
                    observed.append(Observation(reading(process), attributes))
                except psutil.Error:
                    continue
            return observed
        return observe
