"""What modelling the configured ``--l1-policy`` costs the telemetry process (``python -m benchmarks mrc_policy``):
the sampled records the curves take per second, and the memory they hold, with LRU's one-pass curves against
the miniature simulations of ``arc`` and ``adaptive``, on the same KV-shaped stream, in interleaved
repetitions (median), at the default sample rate and at 0.1.
"""

from __future__ import annotations

import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from benchmarks.mrc_traces import CHUNK_BYTES, Request, exact_distances, kv_requests, median_reuse_bytes
from mpcache.config import Config
from mpcache.contract.keys import SAMPLE_MODULUS

REQUESTS = 20_000
POLICIES = ("lru", "arc", "adaptive")


def _events(requests: list[Request], rate: float, exact_chunks: int) -> list[tuple[str, str, list, list]]:
    """Per request, what its lookup and store events carry: the first ``exact_chunks`` keys and the hash-sampled
    rest (the producers ship only those), then the store's hash-sampled keys."""
    from mpcache.telemetry.mrc.curves import HEAD, MISS, SAMPLED

    out = []
    threshold = rate * SAMPLE_MODULUS
    for model, salt, hashes in requests:
        rows = [(h, salt, model) for h in hashes]
        sampled = [row for row in rows if row[0] % SAMPLE_MODULUS < threshold]
        lookup = [(row, HEAD, MISS, 1) for row in rows[:exact_chunks]] + [
            (row, SAMPLED, MISS, 1) for row in sampled if row not in rows[:exact_chunks]]
        out.append((model, salt, lookup, sampled))
    return out


def _feed(events: list[tuple[str, str, list, list]], rate: float, max_keys: int, capacity: int,
          policy: str) -> tuple[float, int]:
    """(seconds of CPU, records fed) for one curve set taking the whole stream."""
    from mpcache.telemetry.mrc.curves import CurveSet

    curves = CurveSet(rate, max_keys, {"l1": capacity}, policy=policy)
    start = time.process_time()
    for model, salt, lookup, stored in events:
        curves.lookup(model, salt, 1, lookup)
        curves.store(model, CHUNK_BYTES, stored)
    return time.process_time() - start, sum(len(lookup) + len(stored) for _, _, lookup, stored in events)


def _memory(events: list[tuple[str, str, list, list]], rate: float, max_keys: int, capacity: int,
            policy: str) -> int:
    tracemalloc.start()
    try:
        from mpcache.telemetry.mrc.curves import CurveSet

        before = tracemalloc.get_traced_memory()[0]
        curves = CurveSet(rate, max_keys, {"l1": capacity}, policy=policy)
        for model, salt, lookup, stored in events:
            curves.lookup(model, salt, 1, lookup)
            curves.store(model, CHUNK_BYTES, stored)
        return tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()


def run(repetitions: int = 3, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    config = Config(instance_id="bench", supervisor_pid=0, runtime_dir="/nonexistent")
    requests = kv_requests(REQUESTS)
    capacity = median_reuse_bytes(exact_distances(requests))
    result: dict[str, Any] = {"benchmark": "mrc_policy", "requests": REQUESTS, "l1_bytes": capacity,
                              "max_keys": config.mrc_max_keys, "repetitions": repetitions}
    for rate in (config.mrc_sample_rate, 0.1):
        events = _events(requests, rate, config.mrc_exact_chunks)
        rates: dict[str, list[float]] = {policy: [] for policy in POLICIES}
        for repetition in range(repetitions):
            for policy in POLICIES:
                seconds, records = _feed(events, rate, config.mrc_max_keys, capacity, policy)
                rates[policy].append(records / seconds)
            progress(f"mrc_policy: rate {rate:g}, repetition {repetition + 1}: " + ", ".join(
                f"{policy} {values[-1]:,.0f} records/s" for policy, values in rates.items()))
        median = {policy: statistics.median(values) for policy, values in rates.items()}
        result[f"rate {rate:g}"] = {
            "records_per_s": {policy: round(value) for policy, value in median.items()},
            "over_lru": {policy: round(value / median["lru"], 3) for policy, value in median.items()},
            "bytes_held": {policy: _memory(events, rate, config.mrc_max_keys, capacity, policy)
                           for policy in POLICIES}}
    return result
