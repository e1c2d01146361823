"""Each LMCache request's service time (receipt to reply sent), counted per operation in the grid of
:mod:`mpcache.contract.request_times` and published as one LMCACHE_REQUEST_TIMES event per operation
at most once a second (:meth:`RequestTimes.tick`, each heartbeat): a few list updates per request, no event.
"""

from __future__ import annotations

from bisect import bisect_left

from mpcache.contract.events import EventType
from mpcache.contract.request_times import BUCKETS_NS
from mpcache.shm.publish import EventPublisher

_TIMES = EventType.LMCACHE_REQUEST_TIMES
_COUNT, _SUM, _MIN, _MAX, _FIRST_BUCKET = range(5)
FLUSH_INTERVAL_NS = 1_000_000_000  # what a scrape sees is at most this old


class RequestTimes:
    """Per operation name: [count, sum_ns, min_ns, max_ns, bucket counts…] since the last flush."""

    def __init__(self, publisher: EventPublisher) -> None:
        self._publisher = publisher
        self._ops: dict[str, list[int]] = {}
        self._flushed_ns = 0

    def record(self, op: str, elapsed_ns: int) -> None:
        row = self._ops.get(op)
        if row is None:
            row = self._ops[op] = [0, 0, elapsed_ns, elapsed_ns] + [0] * (len(BUCKETS_NS) + 1)
        row[_COUNT] += 1
        row[_SUM] += elapsed_ns
        if elapsed_ns < row[_MIN]:
            row[_MIN] = elapsed_ns
        if elapsed_ns > row[_MAX]:
            row[_MAX] = elapsed_ns
        row[_FIRST_BUCKET + bisect_left(BUCKETS_NS, elapsed_ns)] += 1

    def tick(self, now_ns: int) -> None:
        """Flush when the last flush is ``FLUSH_INTERVAL_NS`` old."""
        if now_ns - self._flushed_ns >= FLUSH_INTERVAL_NS:
            self._flushed_ns = now_ns
            self.flush()

    def flush(self) -> None:
        """Publish what was counted, one event per operation, and start again."""
        ops, self._ops = self._ops, {}
        for op, row in ops.items():
            self._publisher.emit(_TIMES, (op, *row))
