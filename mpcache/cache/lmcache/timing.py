"""Each LMCache request's service time (receipt to reply sent), counted per operation in the grid of
:mod:`mpcache.contract.request_times` and published as one LMCACHE_REQUEST_TIMES event per operation
when :meth:`RequestTimes.flush` is called (each heartbeat): a few list updates per request, no event.
"""

from __future__ import annotations

from bisect import bisect_left

from mpcache.contract.events import EventType
from mpcache.contract.request_times import BUCKETS_NS
from mpcache.shm.publish import EventPublisher

_TIMES = EventType.LMCACHE_REQUEST_TIMES
_COUNT, _SUM, _MIN, _MAX, _FIRST_BUCKET = range(5)


class RequestTimes:
    """Per operation name: [count, sum_ns, min_ns, max_ns, bucket counts…] since the last flush."""

    def __init__(self, publisher: EventPublisher) -> None:
        self._publisher = publisher
        self._ops: dict[str, list[int]] = {}

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

    def flush(self) -> None:
        """Publish what was counted, one event per operation, and start again."""
        ops, self._ops = self._ops, {}
        for op, row in ops.items():
            self._publisher.emit(_TIMES, (op, *row))
