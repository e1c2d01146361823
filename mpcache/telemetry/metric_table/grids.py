"""The histograms' explicit bucket boundaries (each grid is shared by the histograms of one kind)."""

from __future__ import annotations

from mpcache.contract import request_times

# Seconds-scale lifecycle buckets.  300 s is an edge because the L1
# evict→reuse gap is capped there ("not reused within 5 minutes" is recorded
# as exactly 300 s); without the edge those samples smear into (250, 500] and
# quantiles interpolate up to 500 s.
LIFECYCLE_SECONDS_BUCKETS = (
    0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 180.0, 240.0,
    300.0, 600.0, 1800.0, 3600.0, 14400.0, 86400.0,
)
# GB/s: from a slow network adapter to host↔GPU copies over PCIe 5 / NVLink-C2C.
THROUGHPUT_GBS_BUCKETS = (
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 12.0, 16.0, 24.0, 32.0, 48.0, 64.0, 100.0, 200.0, 400.0,
)
# Chunk accesses of one cache_salt between two accesses of the same chunk.
REUSE_GAP_OBJECTS_BUCKETS = (
    1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1_000.0, 2_000.0, 5_000.0, 10_000.0, 20_000.0,
    50_000.0, 100_000.0, 200_000.0, 500_000.0, 1_000_000.0, 10_000_000.0,
)
# The LMCache front end's service time: the grid the cache process counts requests in.
REQUEST_SECONDS_BUCKETS = request_times.BUCKETS_S

# What docs/METRICS.md says of each grid.
GRID_TITLES = {
    LIFECYCLE_SECONDS_BUCKETS: "seconds (lifecycle; 300 s, the evict→reuse cap, is an edge)",
    THROUGHPUT_GBS_BUCKETS: "GB/s (throughput)",
    REUSE_GAP_OBJECTS_BUCKETS: "chunks (reuse gap in accesses)",
    REQUEST_SECONDS_BUCKETS: "seconds (request service time)",
}
