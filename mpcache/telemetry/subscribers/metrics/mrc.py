"""Miss-ratio curves and miss reasons (``docs/MRC.md``): feeds the sampled lookups and stores of each batch
to the service's :class:`~mpcache.telemetry.mrc.curves.CurveSet` in ring order, exports
``mpcache_mrc_hit_ratio`` at collection time and the miss-reason counters per batch, and decays the
curves once a second.  Per batch the work is O(records) column reads plus O(1) per sampled key.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterable

from opentelemetry.metrics import CallbackOptions, Meter, Observation

from mpcache.config import Config
from mpcache.contract.events import EventType
from mpcache.telemetry.batch import EventBatch, group_sums
from mpcache.telemetry.bus import Subscriber
from mpcache.telemetry.mrc.curves import CurveSet
from mpcache.telemetry.otel import create_instrument
from mpcache.telemetry.subscribers.metrics._views import sampled_rows

_LOOKUP, _STORE = EventType.MRC_LOOKUP_SAMPLED, EventType.MRC_STORE_SAMPLED
_LOOKUP_FIELDS = ("model_name", "cache_salt", "ranks", "requested", "sampled_l1_hits", "sampled_l2_hits",
                  "sampled_after_gap")


class MissRatioSubscriber(Subscriber):
    """``mpcache.mrc_hit_ratio``, ``mpcache.lookup_miss`` and ``mpcache.l1_evicted_reused``."""

    event_types = (_LOOKUP, _STORE)

    def __init__(self, meter: Meter, config: Config, clock=time.monotonic) -> None:
        self.curves = CurveSet(config.mrc_sample_rate, config.mrc_max_keys, config.tier_capacities())
        self._half_life_s = config.mrc_half_life_s
        self._clock = clock
        self._decayed_at = clock()
        create_instrument(meter, "mpcache.mrc_hit_ratio", [self._hit_ratios])
        self._misses = create_instrument(meter, "mpcache.lookup_miss")
        self._regret = create_instrument(meter, "mpcache.l1_evicted_reused")

    def on_batch(self, batch: EventBatch) -> None:
        if not batch.etypes_present & {_LOOKUP, _STORE}:
            return
        name = batch.names.name
        etypes, _, columns = batch.table(self.event_types, (*_LOOKUP_FIELDS, "object_bytes"))
        heads = batch.heads_of(self.event_types).tolist()
        rows_by_head: dict[int, list[tuple[int, str, str]]] = {}
        for row in sampled_rows(batch, self.event_types):
            rows_by_head.setdefault(row.head, []).append((row.chunk_hash, row.cache_salt, row.model_name))
        curves = self.curves
        with curves.lock:
            for index, head in enumerate(heads):
                if etypes[index] == _LOOKUP:
                    rows = rows_by_head.get(head)
                    if rows:
                        curves.lookup(name(columns["model_name"][index]), name(columns["cache_salt"][index]),
                                      columns["ranks"][index] or 1, rows, columns["sampled_l1_hits"][index],
                                      columns["sampled_l2_hits"][index], columns["sampled_after_gap"][index])
                elif head in rows_by_head:
                    curves.store(name(columns["model_name"][index]), columns["object_bytes"][index],
                                 rows_by_head[head])
            self._expect(batch, curves)
            misses, regret = curves.take_counts()
        for (reason, model, salt), value in misses.items():
            self._misses.add(value, {"reason": reason, "model_name": model, "cache_salt": salt})
        for (model, salt), value in regret.items():
            self._regret.add(value, {"model_name": model, "cache_salt": salt})

    def _expect(self, batch: EventBatch, curves: CurveSet) -> None:
        """Every lookup access of the batch, sampled or not, at the current rate (SHARDS' correction)."""
        models, salts = batch.field_column(_LOOKUP, "model_name"), batch.field_column(_LOOKUP, "cache_salt")
        if len(models):
            requested = batch.field_column(_LOOKUP, "requested")
            name = batch.names.name
            for (model, salt), (total,) in group_sums((models, salts), (requested,)).items():
                curves.expect(name(model), name(salt), total)

    def on_tick(self, now_ns: int) -> None:
        now = self._clock()
        if self._half_life_s > 0 and now > self._decayed_at:
            with self.curves.lock:
                self.curves.decay(0.5 ** ((now - self._decayed_at) / self._half_life_s))
        self._decayed_at = now

    def _hit_ratios(self, _options: CallbackOptions) -> Iterable[Observation]:
        with self.curves.lock:
            points = self.curves.gauge_points()
        return [Observation(value, attributes) for value, attributes in points]


def mrc_document(curves: CurveSet) -> dict:
    """The ``GET /mrc`` answer: the sampling state and every curve with its points."""
    with curves.lock:
        return {"sample_rate": curves.rate, "configured_sample_rate": curves.configured_rate,
                "tracked_keys": curves.tracked_keys, "max_keys": curves.max_keys, "curves": curves.curves()}


def mrc_routes(subscribers: Iterable[Subscriber]) -> dict:
    """``/mrc`` over the miss-ratio subscriber among ``subscribers`` (none without one)."""
    for subscriber in subscribers:
        if isinstance(subscriber, MissRatioSubscriber):
            return {"/mrc": lambda curves=subscriber.curves: (200, json.dumps(mrc_document(curves)).encode(),
                                                              "application/json")}
    return {}
