"""Anomaly counters: L1 allocation and read failures, timeouts.

Failure events are rare (they should stay near zero), and their counts are
grouped by a fixed field *and* by model_name from salt_counts, which no
column-wise aggregate covers; so they are decoded one by one and summed per
attribute set before the single ``add`` per set per batch.
"""

from __future__ import annotations

from collections import Counter

from opentelemetry.metrics import Meter

from mpcache.contract.events import EventType as E
from mpcache.telemetry.batch import EventBatch
from mpcache.telemetry.bus import Subscriber
from mpcache.telemetry.otel import create_instrument
from mpcache.telemetry.subscribers.metrics._views import grouped_sums


class L1FailuresSubscriber(Subscriber):
    """``l1_allocation_failure`` {during, model_name} and ``l1_read_failure`` {during, reason, model_name}."""

    event_types = (E.L1_ALLOCATION_FAILED, E.L1_READ_FAILED)

    def __init__(self, meter: Meter) -> None:
        self._allocation = create_instrument(meter, "lmcache_mp.l1_allocation_failure")
        self._read = create_instrument(meter, "lmcache_mp.l1_read_failure")

    def on_batch(self, batch: EventBatch) -> None:
        allocation: Counter[tuple[str, str]] = Counter()
        read: Counter[tuple[str, str, str]] = Counter()
        for event in batch.events(self.event_types):
            during = event.fields["during"]
            for _salt, model, count in event.salt_counts:
                if event.etype is E.L1_ALLOCATION_FAILED:
                    allocation[during, model] += count
                else:
                    read[during, event.fields["reason"], model] += count
        for (during, model), count in allocation.items():
            self._allocation.add(count, {"during": during, "model_name": model})
        for (during, reason, model), count in read.items():
            self._read.add(count, {"during": during, "reason": reason, "model_name": model})


class TimeoutsSubscriber(Subscriber):
    """``timeouts`` {exception_type}: +1 per TIMEOUT_RAISED."""

    event_types = (E.TIMEOUT_RAISED,)

    def __init__(self, meter: Meter) -> None:
        self._timeouts = create_instrument(meter, "lmcache_mp.timeouts")

    def on_batch(self, batch: EventBatch) -> None:
        for (exception_type,), count in grouped_sums(batch, E.TIMEOUT_RAISED, ("exception_type",)).items():
            self._timeouts.add(count, {"exception_type": exception_type})
