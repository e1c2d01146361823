"""Observable gauges read from the gauge board at collection time: L1 usage and prefetch jobs.

Values are summed over the cache processes whose heartbeat is recent (a dead
or hung process stops counting).  The callbacks run on the exporter's thread;
they only read aligned shared-memory words.
"""

from __future__ import annotations

from opentelemetry.metrics import CallbackOptions, Observation

from mpcache.shm import layout
from mpcache.shm.gauges import GaugeBoardReader
from mpcache.telemetry.buffered import MeterLike
from mpcache.telemetry.bus import Subscriber
from mpcache.telemetry.otel import create_instrument


class L1StateGaugesSubscriber(Subscriber):
    """``l1_usage_ratio``, ``l1_memory_usage_bytes`` and ``active_prefetch_jobs``; consumes no events."""

    def __init__(self, meter: MeterLike, board: GaugeBoardReader) -> None:
        self._board = board
        create_instrument(meter, "lmcache_mp.l1_usage_ratio", [self._usage_ratio])
        create_instrument(meter, "lmcache_mp.l1_memory_usage_bytes", [self._used_bytes])
        create_instrument(meter, "lmcache_mp.active_prefetch_jobs", [self._prefetch_jobs])

    def _usage_ratio(self, _options: CallbackOptions) -> list[Observation]:
        slots = self._board.live_slots()
        used = sum(self._board.word(slot, layout.G_L1_USED) for slot in slots)
        capacity = sum(self._board.word(slot, layout.G_L1_CAPACITY) for slot in slots)
        return [Observation(used / capacity if capacity > 0 else 0.0)]

    def _used_bytes(self, _options: CallbackOptions) -> list[Observation]:
        return [Observation(self._board.total(layout.G_L1_USED))]

    def _prefetch_jobs(self, _options: CallbackOptions) -> list[Observation]:
        return [Observation(self._board.total(layout.G_ACTIVE_PREFETCH))]
