"""Observable gauges of the L2 adapters, read from the gauge board at collection time.

Each cache process keeps, per adapter (its position in ``--l2``), the bytes it
holds, its in-flight store and load tasks and the L1 bytes reserved by its
in-flight loads (:data:`mpcache.shm.layout.G_L2_USAGE` and following).  Values
are summed over the live slots (recent heartbeat), and every configured
adapter is reported from start-up, with 0 until it has work:

* ``l2_usage_bytes`` {l2_name}: the table gives it only ``l2_name``, so
  adapters of the same type are summed into one series;
* ``num_inflight_l2_stores``, ``num_inflight_l2_loads``,
  ``inflight_load_memory_usage_bytes`` {l2_name, adapter_index}: one series
  per configured adapter.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from opentelemetry.metrics import CallbackOptions, Observation

from mpcache.shm import layout
from mpcache.shm.gauges import GaugeBoardReader
from mpcache.telemetry.buffered import MeterLike
from mpcache.telemetry.bus import Subscriber
from mpcache.telemetry.otel import create_instrument

_PER_ADAPTER = {
    "lmcache_mp.num_inflight_l2_stores": layout.G_L2_INFLIGHT_STORES,
    "lmcache_mp.num_inflight_l2_loads": layout.G_L2_INFLIGHT_LOADS,
    "lmcache_mp.inflight_load_memory_usage_bytes": layout.G_L2_INFLIGHT_LOAD_BYTES,
}


class L2StateGaugesSubscriber(Subscriber):
    """The four L2 state gauges; consumes no events.  ``l2_names[i]`` is adapter ``i``'s type name."""

    def __init__(self, meter: MeterLike, board: GaugeBoardReader, l2_names: Sequence[str]) -> None:
        if len(l2_names) > layout.MAX_ADAPTERS:
            raise ValueError(f"at most {layout.MAX_ADAPTERS} L2 adapters, got {len(l2_names)}")
        self._board = board
        self._names = list(l2_names)
        create_instrument(meter, "lmcache_mp.l2_usage_bytes", [self._usage])
        for name, which in _PER_ADAPTER.items():
            create_instrument(meter, name, [self._per_adapter_callback(which)])

    def _per_adapter_callback(self, which: int) -> Callable[[CallbackOptions], list[Observation]]:
        return lambda _options: self._per_adapter(which)

    def _adapter_totals(self, which: int) -> list[int]:
        """Per configured adapter, the word ``which`` summed over the live slots."""
        board = self._board
        slots = board.live_slots()
        return [sum(board.adapter_word(slot, index, which) for slot in slots) for index in range(len(self._names))]

    def _usage(self, _options: CallbackOptions) -> list[Observation]:
        by_name: dict[str, int] = {}
        for name, used in zip(self._names, self._adapter_totals(layout.G_L2_USAGE)):
            by_name[name] = by_name.get(name, 0) + used
        return [Observation(used, {"l2_name": name}) for name, used in by_name.items()]

    def _per_adapter(self, which: int) -> list[Observation]:
        return [
            Observation(value, {"l2_name": name, "adapter_index": str(index)})
            for index, (name, value) in enumerate(zip(self._names, self._adapter_totals(which)))
        ]
