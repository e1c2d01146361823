"""Lookup hit-rate counters {model_name, cache_salt} from MP_LOOKUP_PREFETCH_END.

``lookup_requested`` and ``lookup_hit`` advance together (same event), so their
ratio is the token hit rate; ``lookup_hit_l1`` + ``lookup_hit_l2`` split the hit.
"""

from __future__ import annotations

from opentelemetry.metrics import Meter

from mpcache.contract.events import EventType as E
from mpcache.telemetry.batch import EventBatch
from mpcache.telemetry.bus import Subscriber
from mpcache.telemetry.otel import create_instrument
from mpcache.telemetry.salts import SaltCap

_FIELDS = {
    "lmcache_mp.lookup_requested": "requested_tokens",
    "lmcache_mp.lookup_hit": "hit_tokens",
    "lmcache_mp.lookup_hit_l1": "l1_hit_tokens",
    "lmcache_mp.lookup_hit_l2": "l2_hit_tokens",
}


class LookupSubscriber(Subscriber):
    event_types = (E.MP_LOOKUP_PREFETCH_END,)

    def __init__(self, meter: Meter, salt_cap: int) -> None:
        self._counters = [(create_instrument(meter, name), SaltCap(salt_cap)) for name in _FIELDS]

    def on_batch(self, batch: EventBatch) -> None:
        groups = batch.group_sum(E.MP_LOOKUP_PREFETCH_END, ("model_name", "cache_salt"), tuple(_FIELDS.values()))
        for index, (counter, cap) in enumerate(self._counters):
            folded: dict[tuple[str, str], int] = {}
            for (model, salt), sums in groups.items():
                attributes = (model, cap(salt))
                folded[attributes] = folded.get(attributes, 0) + sums[index]
            for (model, salt), tokens in folded.items():
                counter.add(tokens, {"model_name": model, "cache_salt": salt})
