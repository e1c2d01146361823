"""The service's own gauges, read from the gauge board at collection time: cache processes configured and
ready, restarts by role, refused and unidentified LMCache connections, segments recreated and client buffers
refused per cache process, L1 fragmentation, and L1's admission (its chance, and the chunks its order refused).

``readiness`` is the board reader whose staleness decides "ready" (2 s, as the supervisor's /ready).  The
callbacks run on the exporter's thread; they only read aligned shared-memory words.
"""

from __future__ import annotations

from collections.abc import Callable

from opentelemetry.metrics import CallbackOptions, Observation

from mpcache.shm import layout
from mpcache.shm.gauges import GaugeBoardReader
from mpcache.telemetry.buffered import MeterLike
from mpcache.telemetry.bus import Subscriber
from mpcache.telemetry.otel import create_instrument


class ServiceStateSubscriber(Subscriber):
    """The table's "Service" section but ``mpcache.build_info`` (the exporter's); consumes no events."""

    def __init__(self, meter: MeterLike, readiness: GaugeBoardReader) -> None:
        self._board = readiness
        create_instrument(meter, "mpcache.cache_processes", [self._configured])
        create_instrument(meter, "mpcache.cache_processes_ready", [self._ready])
        create_instrument(meter, "mpcache.child_restarts", [self._restarts])
        create_instrument(meter, "mpcache.lmcache_refused_connections", [self._per_slot(layout.G_LMCACHE_REFUSED)])
        create_instrument(meter, "mpcache.lmcache_unidentified_connections",
                          [self._per_slot(layout.G_LMCACHE_UNIDENTIFIED)])
        create_instrument(meter, "mpcache.segments_recreated", [self._per_slot(layout.G_SEGMENTS_RECREATED)])
        create_instrument(meter, "mpcache.buffers_refused", [self._per_slot(layout.G_BUFFERS_REFUSED)])
        create_instrument(meter, "mpcache.l1_lost_copies", [self._per_slot(layout.G_L1_LOST_COPIES)])
        create_instrument(meter, "mpcache.l1_fragmentation_bytes", [self._fragmentation])
        create_instrument(meter, "mpcache.l1_admission_chance", [self._admission_chance])
        create_instrument(meter, "mpcache.l1_refused", [self._per_slot(layout.G_L1_REFUSED)])

    def _configured(self, _options: CallbackOptions) -> list[Observation]:
        return [Observation(self._board.n_slots)]

    def _ready(self, _options: CallbackOptions) -> list[Observation]:
        return [Observation(len(self._board.live_slots()))]

    def _restarts(self, _options: CallbackOptions) -> list[Observation]:
        return [Observation(count, {"role": role}) for role, count in self._board.restarts().items()]

    def _per_slot(self, word: int) -> Callable[[CallbackOptions], list[Observation]]:
        """A callback observing ``word`` of every slot, live or not, by worker."""
        board = self._board

        def observe(_options: CallbackOptions) -> list[Observation]:
            return [Observation(board.word(slot, word), {"worker": str(slot)}) for slot in range(board.n_slots)]

        return observe

    def _fragmentation(self, _options: CallbackOptions) -> list[Observation]:
        return [Observation(self._board.total(layout.G_L1_FRAGMENTATION))]

    def _admission_chance(self, _options: CallbackOptions) -> list[Observation]:
        """L1's admission chance weighted by capacity over the live cache processes (none live: no observation), each
        slot's two words read together and held within 0..its capacity (a slot being cleared, a word torn)."""
        board = self._board
        capacity = admitting = 0
        for slot in board.live_slots():
            slot_capacity = board.word(slot, layout.G_L1_CAPACITY)
            if slot_capacity > 0:
                capacity += slot_capacity
                admitting += min(max(board.word(slot, layout.G_L1_ADMITTING), 0), slot_capacity)
        return [Observation(admitting / capacity)] if capacity > 0 else []
