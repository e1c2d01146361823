"""Server-side service times of LMCache requests, aggregated in the cache process: the bucket grid and the
fields of the LMCACHE_REQUEST_TIMES event that carries one operation's counts to the telemetry process.

A cache process times every LMCache request from its receipt to its reply sent, counts it in the bucket
of this grid it falls in (OTel's explicit buckets: bucket i holds ``edge[i-1] < t <= edge[i]``) and
publishes, per operation, one event per heartbeat with what it counted since: one event instead of one
per request, so the isolation promise holds at any request rate.
"""

from __future__ import annotations

# seconds: from a cached lookup (tens of µs) to a request that waits on the loop (a second)
BUCKETS_S: tuple[float, ...] = (0.00005, 0.0001, 0.00025, 0.0005, 0.00075, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                                0.1, 0.25, 1.0)
BUCKETS_NS: tuple[int, ...] = tuple(round(edge * 1e9) for edge in BUCKETS_S)
BUCKET_FIELDS: tuple[str, ...] = tuple(f"bucket_{i:02d}" for i in range(len(BUCKETS_S) + 1))  # the last: > 1 s
SUMMARY_FIELDS: tuple[str, ...] = ("count", "sum_ns", "min_ns", "max_ns")
