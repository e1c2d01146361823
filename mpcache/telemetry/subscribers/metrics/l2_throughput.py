"""``l2_store_throughput`` / ``l2_load_throughput`` {l2_name} in GB/s, end to end (queue + I/O).

* Store tasks pair L2_STORE_SUBMITTED with L2_STORE_COMPLETED on
  (adapter_index, task_id); the sample is the COMPLETED ``bytes_transferred``
  (bytes actually written: keys the adapter skipped as already present do
  not count) over submit→complete time, dropped when those bytes are ≤ 0.
* Load tasks pair L2_LOAD_TASK_SUBMITTED with L2_LOAD_TASK_COMPLETED on
  (request_id, adapter_index); the sample is the SUBMITTED ``total_bytes``
  over submit→complete time, dropped when ≤ 0.

A COMPLETED without its SUBMITTED, or with a duration ≤ 0, records nothing.
Task ids and request ids are numbered by each cache process, so every key is
also qualified by the producer (the ring): two processes' task 7 on adapter 0
are different tasks.  A SUBMITTED whose COMPLETED never comes is forgotten
after ``pending_ttl_s`` (expired in :meth:`on_tick`, oldest first) or when
more than ``max_pending`` are waiting.

The events are read from cell columns (no per-event decoding): per type the
head positions, timestamps and the few fields needed, merged in ring order so
a SUBMITTED and its COMPLETED in one batch pair correctly.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from mpcache.contract.events import EventType as E
from mpcache.shm import layout
from mpcache.telemetry import statecheck
from mpcache.telemetry.batch import EventBatch
from mpcache.telemetry.buffered import HistogramLike, MeterLike
from mpcache.telemetry.bus import Subscriber
from mpcache.telemetry.otel import create_instrument

DEFAULT_PENDING_TTL_S = 300.0
DEFAULT_MAX_PENDING = 65_536

# Per event type: the fields read, in the order they appear in a row after (head, etype, timestamp).
_COLUMNS = {
    E.L2_STORE_SUBMITTED: ("adapter_index", "task_id"),
    E.L2_STORE_COMPLETED: ("adapter_index", "task_id", "l2_name", "bytes_transferred"),
    E.L2_LOAD_TASK_SUBMITTED: ("request_id", "adapter_index", "total_bytes"),
    E.L2_LOAD_TASK_COMPLETED: ("request_id", "adapter_index", "l2_name"),
}
_STORE_SUBMITTED = int(E.L2_STORE_SUBMITTED)
_STORE_COMPLETED = int(E.L2_STORE_COMPLETED)
_LOAD_SUBMITTED = int(E.L2_LOAD_TASK_SUBMITTED)


class L2ThroughputSubscriber(Subscriber):
    event_types = tuple(_COLUMNS)

    def __init__(
        self, meter: MeterLike, *, pending_ttl_s: float = DEFAULT_PENDING_TTL_S, max_pending: int = DEFAULT_MAX_PENDING
    ) -> None:
        self._store = create_instrument(meter, "lmcache_mp.l2_store_throughput")
        self._load = create_instrument(meter, "lmcache_mp.l2_load_throughput")
        self._ttl_ns = int(pending_ttl_s * 1e9)
        self._max_pending = max_pending
        # ("store", producer, adapter_index, task_id) -> (submitted ns, 0)
        # ("load", producer, request_id, adapter_index) -> (submitted ns, total_bytes)
        # insertion order ≈ time order
        self._pending: OrderedDict[tuple[str | int, ...], tuple[int, int]] = OrderedDict()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def on_batch(self, batch: EventBatch) -> None:
        producer = batch.producer
        names: dict[int, str] = {}
        pending = self._pending
        store, load = self._store, self._load
        for row in _rows_in_ring_order(batch):
            etype, now_ns = row[1], row[2]
            if etype == _STORE_SUBMITTED:
                self._remember(("store", producer, row[3], row[4]), now_ns, 0)
            elif etype == _LOAD_SUBMITTED:
                self._remember(("load", producer, row[3], row[4]), now_ns, row[5])
            elif etype == _STORE_COMPLETED:
                started = pending.pop(("store", producer, row[3], row[4]), None)
                if started is not None:
                    _add(store, row[6], now_ns - started[0], _name(batch, names, row[5]))
            else:
                started = pending.pop(("load", producer, row[3], row[4]), None)
                if started is not None:
                    _add(load, started[1], now_ns - started[0], _name(batch, names, row[5]))

    def on_tick(self, now_ns: int) -> None:
        pending = self._pending
        while pending:
            key, (started_ns, _) = next(iter(pending.items()))
            if started_ns + self._ttl_ns > now_ns:
                break
            del pending[key]

    def save_state(self) -> object:
        """The SUBMITTEDs waiting for their COMPLETED, oldest first."""
        return list(self._pending.items())

    def load_state(self, state: object) -> Callable[[], None]:
        pending = OrderedDict(statecheck.entries(state, "siii", "ii"))
        if len(pending) > self._max_pending or not {key[0] for key in pending} <= {"store", "load"}:
            raise ValueError("not the pending tasks of this subscriber")
        return lambda: setattr(self, "_pending", pending)

    def _remember(self, key: tuple[str | int, ...], now_ns: int, nbytes: int) -> None:
        pending = self._pending
        pending.pop(key, None)
        pending[key] = (now_ns, nbytes)
        if len(pending) > self._max_pending:
            pending.popitem(last=False)


def _add(histogram: HistogramLike, nbytes: int, duration_ns: int, l2_name: str) -> None:
    if nbytes > 0 and duration_ns > 0:
        histogram.record(nbytes / duration_ns, {"l2_name": l2_name})  # bytes/ns = GB/s


def _name(batch: EventBatch, cache: dict[int, str], name_id: int) -> str:
    name = cache.get(name_id)
    if name is None:
        name = cache[name_id] = batch.names.name(name_id)
    return name


def _rows_in_ring_order(batch: EventBatch) -> list[tuple[int, ...]]:
    """(head position, etype, timestamp ns, *fields of ``_COLUMNS``) of every L2 task event, in ring order."""
    cells = batch.cells
    is_head = cells["kind"] == layout.CELL_HEAD
    rows: list[tuple[int, ...]] = []
    for etype, fields in _COLUMNS.items():
        heads = np.flatnonzero(is_head & (cells["etype"] == etype))
        if len(heads) == 0:
            continue
        columns = [heads.tolist(), [int(etype)] * len(heads), cells["slots"][heads, 0].tolist()]
        columns += [batch.field_column(etype, name).tolist() for name in fields]
        rows.extend(zip(*columns))
    rows.sort(key=lambda row: row[0])
    return rows
