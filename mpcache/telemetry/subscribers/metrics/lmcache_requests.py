"""``mpcache.lmcache.request`` {op} in seconds: LMCache requests' service times, receipt to reply sent.

The cache process counts them in the histogram's own grid (:mod:`mpcache.contract.request_times`) and
publishes one LMCACHE_REQUEST_TIMES event per operation and heartbeat; each event's counts, sum and
extremes are added to the histogram as they are (:func:`mpcache.telemetry.histograms.record_buckets`).
An event whose numbers do not add up (counts that do not sum to ``count``, negative values, min above
max) is dropped and counted in :attr:`LMCacheRequestTimesSubscriber.rejected`; at most ``MAX_OPS`` op
values are kept apart.
"""

from __future__ import annotations

from typing import Any

from mpcache.contract.events import EventType as E
from mpcache.contract.request_times import BUCKET_FIELDS, BUCKETS_S
from mpcache.telemetry.batch import EventBatch
from mpcache.telemetry.buffered import MeterLike
from mpcache.telemetry.bus import Subscriber
from mpcache.telemetry.histograms import record_buckets
from mpcache.telemetry.otel import create_instrument
from mpcache.telemetry.salts import OVERFLOW_SALT

MAX_OPS = 64  # LMCache's protocol has 35 operations; a name past this many is reported as __overflow__


class LMCacheRequestTimesSubscriber(Subscriber):
    event_types = (E.LMCACHE_REQUEST_TIMES,)

    def __init__(self, meter: MeterLike) -> None:
        histogram: Any = create_instrument(meter, "mpcache.lmcache.request")
        self._histogram = getattr(histogram, "unbuffered", histogram)  # counts are added as they come
        self._ops: set[str] = set()
        self.rejected = 0

    def on_batch(self, batch: EventBatch) -> None:
        for event in batch.events(self.event_types):
            fields = event.fields
            counts = [fields[name] for name in BUCKET_FIELDS]
            count, total, low, high = fields["count"], fields["sum_ns"], fields["min_ns"], fields["max_ns"]
            if count < 1 or sum(counts) != count or min(counts) < 0 or not 0 <= low <= high or total < 0:
                self.rejected += 1
                continue
            op = str(fields["op"])
            if op not in self._ops:
                if len(self._ops) >= MAX_OPS:
                    op = OVERFLOW_SALT
                else:
                    self._ops.add(op)
            record_buckets(self._histogram, {"op": op}, BUCKETS_S, counts, total / 1e9, low / 1e9, high / 1e9)
