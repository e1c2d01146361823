"""``mpcache.lmcache.request`` {op} in seconds: LMCache requests' service times, receipt to reply sent.

The cache process counts them in the histogram's own grid (:mod:`mpcache.contract.request_times`) and
publishes one LMCACHE_REQUEST_TIMES event per operation and heartbeat; each event's counts, sum and
extremes are added to the histogram as they are (:func:`mpcache.telemetry.histograms.record_buckets`), those
of one operation merged until the buffered meter's flush.  The events are read from cell columns, not decoded.
An event whose numbers do not add up (counts that do not sum to ``count``, negative values, min above
max) is dropped and counted in :attr:`LMCacheRequestTimesSubscriber.rejected`; at most ``MAX_OPS`` op
values are kept apart.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from mpcache.contract.events import SCHEMAS
from mpcache.contract.events import EventType as E
from mpcache.contract.request_times import BUCKET_FIELDS, BUCKETS_S, SUMMARY_FIELDS
from mpcache.telemetry import statecheck
from mpcache.telemetry.batch import EventBatch
from mpcache.telemetry.buffered import MeterLike
from mpcache.telemetry.bus import Subscriber
from mpcache.telemetry.cardinality import OVERFLOW_SALT
from mpcache.telemetry.histograms import record_buckets
from mpcache.telemetry.otel import create_instrument

_COLUMNS = [SCHEMAS[E.LMCACHE_REQUEST_TIMES].field_names.index(field)
            for field in ("op", *SUMMARY_FIELDS, *BUCKET_FIELDS)]
MAX_OPS = 64  # LMCache's protocol has 35 operations; a name past this many is reported as __overflow__


class LMCacheRequestTimesSubscriber(Subscriber):
    event_types = (E.LMCACHE_REQUEST_TIMES,)

    def __init__(self, meter: MeterLike) -> None:
        histogram: Any = create_instrument(meter, "mpcache.lmcache.request")
        # a buffered meter's merges the counts per op until its flush; an SDK meter's (tests) takes them as they come
        buffered = getattr(histogram, "record_buckets", None)
        self._record: Callable[..., None] = buffered or functools.partial(record_buckets, histogram)
        self._ops: set[str] = set()
        self.rejected = 0

    def save_state(self) -> object:
        """The op values kept apart, and the events dropped."""
        return {"ops": list(self._ops), "rejected": self.rejected}

    def load_state(self, state: object) -> Callable[[], None]:
        saved = statecheck.fields(state, ops="l", rejected="i")
        ops = set(statecheck.items(saved["ops"], "s", MAX_OPS))

        def adopt() -> None:
            self._ops, self.rejected = ops, saved["rejected"]
        return adopt

    def on_batch(self, batch: EventBatch) -> None:
        name = batch.names.name
        rows = batch.fixed_fields(E.LMCACHE_REQUEST_TIMES)[:, _COLUMNS].tolist()
        for op_id, count, total, low, high, *counts in rows:
            if count < 1 or sum(counts) != count or min(counts) < 0 or not 0 <= low <= high or total < 0:
                self.rejected += 1
                continue
            op = name(op_id)
            if op not in self._ops:
                if len(self._ops) >= MAX_OPS:
                    op = OVERFLOW_SALT
                else:
                    self._ops.add(op)
            self._record({"op": op}, BUCKETS_S, counts, total / 1e9, low / 1e9, high / 1e9)
