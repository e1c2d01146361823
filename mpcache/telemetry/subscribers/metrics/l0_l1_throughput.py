"""``l0_l1_store_throughput`` / ``l0_l1_load_throughput`` {engine_id, device, model_name} in GB/s.

START and END pair on (session_id, device), separately per direction: one
request of a tensor-parallel client copies on several devices under one
request id.  An END without its START, with ≤ 0 bytes or with a duration ≤ 0
records nothing.  A START whose END never comes is forgotten after
``pending_ttl_s`` (expired in :meth:`on_tick`, oldest first) or when more than
``max_pending`` are waiting.
"""

from __future__ import annotations

from collections import OrderedDict

from opentelemetry.metrics import Meter

from mpcache.events import EventType as E
from mpcache.telemetry.batch import EventBatch
from mpcache.telemetry.bus import Subscriber
from mpcache.telemetry.otel import create_instrument

DEFAULT_PENDING_TTL_S = 60.0
DEFAULT_MAX_PENDING = 65_536

_STARTS = {E.MP_STORE_START: "store", E.MP_RETRIEVE_START: "load"}
_ENDS = {E.MP_STORE_END: "store", E.MP_RETRIEVE_END: "load"}


class L0L1ThroughputSubscriber(Subscriber):
    event_types = (E.MP_STORE_START, E.MP_STORE_END, E.MP_RETRIEVE_START, E.MP_RETRIEVE_END)

    def __init__(
        self, meter: Meter, *, pending_ttl_s: float = DEFAULT_PENDING_TTL_S, max_pending: int = DEFAULT_MAX_PENDING
    ) -> None:
        self._histograms = {
            "store": create_instrument(meter, "lmcache_mp.l0_l1_store_throughput"),
            "load": create_instrument(meter, "lmcache_mp.l0_l1_load_throughput"),
        }
        self._ttl_ns = int(pending_ttl_s * 1e9)
        self._max_pending = max_pending
        # (direction, session_id, device) -> START timestamp ns; insertion order ≈ time order
        self._pending: OrderedDict[tuple[str, str, str], int] = OrderedDict()

    @property
    def pending(self) -> int:
        return len(self._pending)

    def on_batch(self, batch: EventBatch) -> None:
        for event in batch.events(self.event_types):
            direction = _STARTS.get(event.etype)
            if direction is not None:
                key = (direction, event.session_id, event.fields["device"])
                self._pending.pop(key, None)
                self._pending[key] = event.timestamp_ns
                if len(self._pending) > self._max_pending:
                    self._pending.popitem(last=False)
                continue
            direction = _ENDS[event.etype]
            started_ns = self._pending.pop((direction, event.session_id, event.fields["device"]), None)
            if started_ns is None:
                continue
            nbytes, duration_ns = event.fields["total_bytes"], event.timestamp_ns - started_ns
            if nbytes <= 0 or duration_ns <= 0:
                continue
            attributes = {
                "engine_id": str(event.fields["engine_id"]),
                "device": event.fields["device"],
                "model_name": event.fields["model_name"],
            }
            self._histograms[direction].record(nbytes / duration_ns, attributes)  # bytes/ns = GB/s

    def on_tick(self, now_ns: int) -> None:
        pending = self._pending
        while pending:
            key, started_ns = next(iter(pending.items()))
            if started_ns + self._ttl_ns > now_ns:
                break
            del pending[key]
