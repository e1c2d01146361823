"""The ``lmcache_blend.*`` counters of cache blending, unlabelled, exported as 0 from start-up.

Per metric, its source (``spec/metrics.tsv``): requests are counted on the
START events; the lookup token and chunk counts are sums over CB_LOOKUP_END
(so the hit rate's numerator and denominator come from the same events), and
``lookup_no_gpu_context_errors`` counts the CB_LOOKUP_END events whose
``no_gpu_context`` is true; retrieved chunks are summed over
CB_RETRIEVE_START (``num_chunks``, what was asked for); failures count the END
events whose ``success`` is false; stored chunks are summed over the END
events (``stored_chunks``); ``fingerprints_registered`` and ``chunks_evicted``
sum their events' ``num_chunks``.

Everything is a column sum over the batch (no decoding), one ``add`` per
metric per batch, none when the batch adds nothing.
"""

from __future__ import annotations

import numpy as np
from opentelemetry.metrics import Meter

from mpcache.contract.events import EventType as E
from mpcache.telemetry.batch import EventBatch
from mpcache.telemetry.bus import Subscriber
from mpcache.telemetry.otel import create_instrument

_COUNT = "count"  # +1 per event
_SUM = "sum"  # + the field
_FALSE = "false"  # +1 per event whose bool field is false
_TRUE = "true"  # +1 per event whose bool field is true

# metric -> (source event type, how, field)
_SOURCES: dict[str, tuple[E, str, str | None]] = {
    "lmcache_blend.lookup_requests": (E.CB_LOOKUP_START, _COUNT, None),
    "lmcache_blend.lookup_requested_tokens": (E.CB_LOOKUP_END, _SUM, "requested_tokens"),
    "lmcache_blend.lookup_hit_tokens": (E.CB_LOOKUP_END, _SUM, "hit_tokens"),
    "lmcache_blend.lookup_fingerprint_hits": (E.CB_LOOKUP_END, _SUM, "fingerprint_hits"),
    "lmcache_blend.lookup_storage_hits": (E.CB_LOOKUP_END, _SUM, "storage_hits"),
    "lmcache_blend.lookup_stale_chunks": (E.CB_LOOKUP_END, _SUM, "stale_chunks"),
    "lmcache_blend.lookup_no_gpu_context_errors": (E.CB_LOOKUP_END, _TRUE, "no_gpu_context"),
    "lmcache_blend.retrieve_requests": (E.CB_RETRIEVE_START, _COUNT, None),
    "lmcache_blend.retrieve_chunks": (E.CB_RETRIEVE_START, _SUM, "num_chunks"),
    "lmcache_blend.retrieve_failures": (E.CB_RETRIEVE_END, _FALSE, "success"),
    "lmcache_blend.store_pre_computed_requests": (E.CB_STORE_PRE_COMPUTED_START, _COUNT, None),
    "lmcache_blend.store_pre_computed_chunks": (E.CB_STORE_PRE_COMPUTED_END, _SUM, "stored_chunks"),
    "lmcache_blend.store_pre_computed_failures": (E.CB_STORE_PRE_COMPUTED_END, _FALSE, "success"),
    "lmcache_blend.store_final_requests": (E.CB_STORE_FINAL_START, _COUNT, None),
    "lmcache_blend.store_final_chunks": (E.CB_STORE_FINAL_END, _SUM, "stored_chunks"),
    "lmcache_blend.store_final_failures": (E.CB_STORE_FINAL_END, _FALSE, "success"),
    "lmcache_blend.fingerprints_registered": (E.CB_FINGERPRINTS_REGISTERED, _SUM, "num_chunks"),
    "lmcache_blend.chunks_evicted": (E.CB_CHUNKS_EVICTED, _SUM, "num_chunks"),
}


class BlendMetricsSubscriber(Subscriber):
    event_types = tuple(dict.fromkeys(etype for etype, _, _ in _SOURCES.values()))

    def __init__(self, meter: Meter) -> None:
        self._counters = [(create_instrument(meter, name), source) for name, source in _SOURCES.items()]
        for counter, _ in self._counters:
            counter.add(0)

    def on_batch(self, batch: EventBatch) -> None:
        present = batch.etypes_present
        for counter, (etype, how, field) in self._counters:
            if int(etype) not in present:
                continue
            if how == _COUNT:
                total = batch.count((etype,))
            else:
                column = batch.field_column(etype, field)
                if how == _SUM:
                    total = int(column.sum())
                elif how == _TRUE:
                    total = int(np.count_nonzero(column))
                else:
                    total = int(np.count_nonzero(column == 0))
            if total:
                counter.add(total)
