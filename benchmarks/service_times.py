"""Server-side service times for the lmcache benchmark: ``mpcache_lmcache_request_seconds`` read from a
cache's /metrics before and after a run, and each operation's quantiles over the difference (interpolated
within a bucket, as Prometheus' ``histogram_quantile`` does).
"""

from __future__ import annotations

import time
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

NAME = "mpcache_lmcache_request_seconds"
SETTLE_S = 0.7  # more than a heartbeat (the cache process publishes its counts once a heartbeat)
SETTLE_TIMEOUT_S = 10.0

Buckets = dict[str, dict[float, float]]  # op → {upper edge (inf last): cumulative count}


def scrape(port: int) -> Buckets:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    out: Buckets = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == NAME + "_bucket":
                out.setdefault(sample.labels["op"], {})[float(sample.labels["le"])] = sample.value
    return out


def settled(port: int, start_timeout_s: float = 60.0) -> Buckets:
    """A scrape once two in a row, a heartbeat apart, agree (everything published has been exported); waits
    up to ``start_timeout_s`` for the endpoint (the telemetry process starts after the cache is accepting)."""
    started = time.monotonic()
    while True:
        try:
            last = scrape(port)
            break
        except OSError:
            if time.monotonic() - started > start_timeout_s:
                raise
            time.sleep(0.2)
    deadline = time.monotonic() + SETTLE_TIMEOUT_S
    while time.monotonic() < deadline:
        time.sleep(SETTLE_S)
        now = scrape(port)
        if now == last:
            return now
        last = now
    return last


def difference(after: Buckets, before: Buckets) -> Buckets:
    return {op: {edge: count - before.get(op, {}).get(edge, 0.0) for edge, count in edges.items()}
            for op, edges in after.items()}


def quantile(buckets: dict[float, float], q: float) -> float | None:
    """The q-quantile in seconds of one operation's cumulative buckets; None without samples; the highest
    finite edge when it falls in the +Inf bucket."""
    edges = sorted(buckets)
    total = buckets[edges[-1]] if edges else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for edge in edges:
        count = buckets[edge]
        if count >= rank:
            if edge == float("inf"):
                return lower
            return lower + (edge - lower) * ((rank - below) / (count - below) if count > below else 1.0)
        lower, below = edge, count
    return lower


def summary(buckets: Buckets) -> dict[str, dict[str, float]]:
    """Per operation with samples: count, p50 and p99 in ms."""
    out = {}
    for op, edges in sorted(buckets.items()):
        p50, p99 = quantile(edges, 0.5), quantile(edges, 0.99)
        if p50 is not None and p99 is not None:
            out[op] = {"count": max(edges.values()), "p50_ms": round(p50 * 1000, 3), "p99_ms": round(p99 * 1000, 3)}
    return out
