"""``l0_l1_store_throughput`` / ``l0_l1_load_throughput`` {engine_id, device, model_name} in GB/s.

START and END pair on (session_id, device, engine_id), separately per direction: one
request of a tensor-parallel client copies on several devices under one
request id.  An END without its START, with ≤ 0 bytes or with a duration ≤ 0
records nothing.  A START whose END never comes is forgotten after
``pending_ttl_s`` (expired in :meth:`on_tick`, oldest first) or when more than
``max_pending`` are waiting.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

from mpcache.contract.events import EventType as E
from mpcache.telemetry import statecheck
from mpcache.telemetry.batch import EventBatch
from mpcache.telemetry.buffered import MeterLike
from mpcache.telemetry.bus import Subscriber
from mpcache.telemetry.cardinality import DEFAULT_SERIES_CAP, SeriesCap
from mpcache.telemetry.histograms import record_many
from mpcache.telemetry.otel import create_instrument

DEFAULT_PENDING_TTL_S = 60.0
DEFAULT_MAX_PENDING = 65_536

_STARTS = {E.MP_STORE_START: "store", E.MP_RETRIEVE_START: "load"}
_ENDS = {E.MP_STORE_END: "store", E.MP_RETRIEVE_END: "load"}
_START_IDS = {int(etype): direction for etype, direction in _STARTS.items()}
_END_IDS = {int(etype): direction for etype, direction in _ENDS.items()}


class L0L1ThroughputSubscriber(Subscriber):
    event_types = (E.MP_STORE_START, E.MP_STORE_END, E.MP_RETRIEVE_START, E.MP_RETRIEVE_END)

    def __init__(
        self, meter: MeterLike, *, pending_ttl_s: float = DEFAULT_PENDING_TTL_S, max_pending: int = DEFAULT_MAX_PENDING,
        series_cap: int = DEFAULT_SERIES_CAP,
    ) -> None:
        self._series = SeriesCap(("engine_id", "device", "model_name"), series_cap)
        histograms = {
            "store": create_instrument(meter, "lmcache_mp.l0_l1_store_throughput"),
            "load": create_instrument(meter, "lmcache_mp.l0_l1_load_throughput"),
        }
        # a buffered meter's histograms take a series' rates in one call; an SDK meter's (tests) fold them in
        self._record: dict[str, Callable[[dict[str, str], list[float]], None]] = {
            direction: getattr(histogram, "record_many", None) or functools.partial(record_many, histogram)
            for direction, histogram in histograms.items()
        }
        self._ttl_ns = int(pending_ttl_s * 1e9)
        self._max_pending = max_pending
        # (direction, session id bytes, device name id, engine id, producer) -> START timestamp ns; insertion
        # order ≈ time order.  Device ids are per producer's name table, hence the producer in the key; the
        # engine tells apart the workers of one request that copy on devices of the same name (MLA ranks).
        self._pending: dict[tuple[str, bytes, int, int, int], int] = {}

    @property
    def pending(self) -> int:
        return len(self._pending)

    def on_batch(self, batch: EventBatch) -> None:
        """Columns, not decoded events: this runs for four of every ~16 events a request publishes.  The
        rates are gathered per series and recorded with one call each."""
        etypes, timestamps, columns = batch.table(self.event_types,
                                                  ("device", "engine_id", "model_name", "total_bytes"))
        sessions = batch.session_ids(batch.heads_of(self.event_types))
        pending, producer, max_pending = self._pending, batch.producer, self._max_pending
        rates: dict[tuple[str, int, int, int], list[float]] = {}  # (direction, engine, device id, model id)
        for etype, ts, session, device, engine, model, nbytes in zip(
            etypes, timestamps, sessions, columns["device"], columns["engine_id"], columns["model_name"],
            columns["total_bytes"],
        ):
            direction = _START_IDS.get(etype)
            if direction is not None:
                pending[(direction, session, device, engine, producer)] = ts
                if len(pending) > max_pending:
                    del pending[next(iter(pending))]
                continue
            direction = _END_IDS[etype]
            started_ns = pending.pop((direction, session, device, engine, producer), None)
            if started_ns is None or nbytes <= 0 or ts <= started_ns:
                continue
            series = rates.get((direction, engine, device, model))
            if series is None:
                rates[(direction, engine, device, model)] = [nbytes / (ts - started_ns)]  # bytes/ns = GB/s
            else:
                series.append(nbytes / (ts - started_ns))
        name = batch.names.name
        attributes: dict[tuple[int, int, int], dict[str, str]] = {}  # (engine, device id, model id) -> attributes
        for (direction, engine, device, model), values in rates.items():  # series capped in order of first END
            attrs = attributes.get((engine, device, model))
            if attrs is None:
                capped = self._series((str(engine), name(device), name(model)))
                attrs = attributes[(engine, device, model)] = dict(zip(("engine_id", "device", "model_name"), capped))
            self._record[direction](attrs, values)

    def save_state(self) -> object:
        """The STARTs waiting for their END, oldest first, and the attribute sets admitted."""
        return {"pending": list(self._pending.items()), "series": self._series.save_state()}

    def load_state(self, state: object) -> Callable[[], None]:
        saved = statecheck.fields(state, pending="l", series="l")
        pending = dict(statecheck.entries(saved["pending"], "sbiii", "i"))
        if len(pending) > self._max_pending or not {key[0] for key in pending} <= set(_STARTS.values()):
            raise ValueError("not the pending STARTs of this subscriber")
        series = self._series.load_state(saved["series"])

        def adopt() -> None:
            self._pending = pending
            series()
        return adopt

    def on_tick(self, now_ns: int) -> None:
        pending = self._pending
        while pending:
            key, started_ns = next(iter(pending.items()))
            if started_ns + self._ttl_ns > now_ns:
                break
            del pending[key]
