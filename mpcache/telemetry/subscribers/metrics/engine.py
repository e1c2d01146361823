"""``num_chunks_loaded`` {worker_id, model_name, cache_salt}: chunks delivered to each client worker."""

from __future__ import annotations

from opentelemetry.metrics import Meter

from mpcache.contract.events import EventType as E
from mpcache.telemetry.batch import EventBatch
from mpcache.telemetry.bus import Subscriber
from mpcache.telemetry.otel import create_instrument
from mpcache.telemetry.salts import SaltCap
from mpcache.telemetry.subscribers.metrics._views import grouped_sums


class EngineCountersSubscriber(Subscriber):
    """+retrieved_count per MP_RETRIEVE_END with retrieved_count > 0; worker_id is the event's engine_id."""

    event_types = (E.MP_RETRIEVE_END,)

    def __init__(self, meter: Meter, salt_cap: int) -> None:
        self._loaded = create_instrument(meter, "lmcache_mp.num_chunks_loaded")
        self._cap = SaltCap(salt_cap)

    def on_batch(self, batch: EventBatch) -> None:
        groups = grouped_sums(
            batch, E.MP_RETRIEVE_END, ("engine_id", "model_name", "cache_salt"),
            weight="retrieved_count", only_positive="retrieved_count",
        )
        folded: dict[tuple[str, str, str], int] = {}
        for (worker, model, salt), chunks in groups.items():
            attributes = (worker, model, self._cap(salt))
            folded[attributes] = folded.get(attributes, 0) + chunks
        for (worker, model, salt), chunks in folded.items():
            self._loaded.add(chunks, {"worker_id": worker, "model_name": model, "cache_salt": salt})
