"""L2 counters: store tasks, prefetch lookups and loads, evictions, prefetch failures.

Everything but ``l2_prefetch_failure`` is a column-wise aggregate of the batch
(salt_counts per cache_salt, event counts or field sums, per l2_name where the
table says so), one ``add`` per (metric, attribute set) per batch.  Failures
are rare and grouped by a fixed field *and* by model_name from salt_counts, so
they are decoded one by one, as the L1 failure counters are.

The unlabelled counters, and the l2_name counters of every configured adapter
type, are exported as 0 from start-up, so a dashboard sees the series before
the first L2 task.
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

from opentelemetry.metrics import Meter

from mpcache.contract.events import EventType as E
from mpcache.telemetry.batch import EventBatch
from mpcache.telemetry.bus import Subscriber
from mpcache.telemetry.otel import create_instrument
from mpcache.telemetry.salts import SaltCap
from mpcache.telemetry.subscribers.metrics._views import grouped_sums, per_salt

# cache_salt counters: metric -> event types whose salt_counts it sums
_PER_SALT = {
    "lmcache_mp.l2_store_submitted_objects": (E.L2_STORE_SUBMITTED,),
    "lmcache_mp.l2_store_completed_objects": (E.L2_STORE_COMPLETED,),
    "lmcache_mp.l2_prefetch_lookup_objects": (E.L2_PREFETCH_LOOKUP_SUBMITTED,),
    "lmcache_mp.l2_prefetch_load_submitted_objects": (E.L2_PREFETCH_LOAD_SUBMITTED,),
    "lmcache_mp.l2_prefetch_load_completed": (E.L2_PREFETCH_LOAD_COMPLETED,),
    "lmcache_mp.l2_evicted": (E.L2_KEYS_EVICTED,),
}
# unlabelled counters: metric -> (event type, field summed or None for +1 per event)
_UNLABELLED = {
    "lmcache_mp.l2_store_submitted": (E.L2_STORE_SUBMITTED, None),
    "lmcache_mp.l2_prefetch_lookup": (E.L2_PREFETCH_LOOKUP_SUBMITTED, None),
    "lmcache_mp.l2_prefetch_hit": (E.L2_PREFETCH_LOOKUP_COMPLETED, "prefix_hit_count"),
    "lmcache_mp.l2_prefetch_load_submitted": (E.L2_PREFETCH_LOAD_SUBMITTED, "adapter_count"),
}
# l2_name counters: metric -> event type counted (+1 per event)
_PER_ADAPTER_TYPE = {
    "lmcache_mp.l2_store_completed": E.L2_STORE_COMPLETED,
    "lmcache_mp.l2_load_completed": E.L2_LOAD_TASK_COMPLETED,
}


class L2CountersSubscriber(Subscriber):
    """Every L2 counter except the prefetch failures (see :class:`L2FailuresSubscriber`)."""

    event_types = (
        E.L2_STORE_SUBMITTED, E.L2_STORE_COMPLETED, E.L2_PREFETCH_LOOKUP_SUBMITTED, E.L2_PREFETCH_LOOKUP_COMPLETED,
        E.L2_PREFETCH_LOAD_SUBMITTED, E.L2_LOAD_TASK_COMPLETED, E.L2_PREFETCH_LOAD_COMPLETED, E.L2_KEYS_EVICTED,
    )

    def __init__(self, meter: Meter, salt_cap: int, l2_names: Sequence[str] = ()) -> None:
        """``l2_names``: the configured adapters' type names, exported as 0 until they complete a task."""
        self._per_salt = [
            (create_instrument(meter, name), etypes, SaltCap(salt_cap)) for name, etypes in _PER_SALT.items()
        ]
        self._unlabelled = [(create_instrument(meter, name), etype, weight)
                            for name, (etype, weight) in _UNLABELLED.items()]
        self._per_adapter_type = [(create_instrument(meter, name), etype) for name, etype in _PER_ADAPTER_TYPE.items()]
        for counter, _, _ in self._unlabelled:
            counter.add(0)
        for counter, _ in self._per_adapter_type:
            for l2_name in dict.fromkeys(l2_names):
                counter.add(0, {"l2_name": l2_name})

    def on_batch(self, batch: EventBatch) -> None:
        for counter, etypes, cap in self._per_salt:
            for salt, count in per_salt(batch.salt_totals(etypes), cap).items():
                counter.add(count, {"cache_salt": salt})
        for counter, etype, weight in self._unlabelled:
            total = grouped_sums(batch, etype, (), weight=weight).get((), 0)
            if total:
                counter.add(total)
        for counter, etype in self._per_adapter_type:
            for (l2_name,), count in grouped_sums(batch, etype, ("l2_name",)).items():
                counter.add(count, {"l2_name": l2_name})


class L2FailuresSubscriber(Subscriber):
    """``l2_prefetch_failure`` {reason, model_name}: chunks per (reason, model) of L2_PREFETCH_FAILED."""

    event_types = (E.L2_PREFETCH_FAILED,)

    def __init__(self, meter: Meter) -> None:
        self._failures = create_instrument(meter, "lmcache_mp.l2_prefetch_failure")

    def on_batch(self, batch: EventBatch) -> None:
        failures: Counter[tuple[str, str]] = Counter()
        for event in batch.events(self.event_types):
            reason = event.fields["reason"]
            for _salt, model, count in event.salt_counts:
                failures[reason, model] += count
        for (reason, model), count in failures.items():
            if count:
                self._failures.add(count, {"reason": reason, "model_name": model})
