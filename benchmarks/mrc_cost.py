"""What the miss-ratio curves cost (``python -m benchmarks mrc``): the cache process's CPU per request at
the default sample rate against rate 0 in interleaved pairs, the sampling calls alone as a share of it, and
the telemetry memory of a curve set filled to its bounds.
"""

from __future__ import annotations

import os
import statistics
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.mrc_traces import CHUNK_BYTES, Request, exact_distances, median_reuse_bytes, replay
from mpcache.config import Config

COST_CHUNK_BYTES = 64 * 1024  # the e2e benchmark's objects: the request shape the sampling cost is measured at


def sampling_cost(requests: list[Request], repetitions: int, progress: Callable[[str], None]) -> dict[str, Any]:
    """Cache-process CPU per request at the default rate over rate 0, interleaved pairs (median ratio), at the
    e2e benchmark's objects (64 KiB); and the publishing calls alone (:func:`_sampler_us`) as a share of the
    CPU per request at rate 0, at those objects and at the accuracy runs' 4 KiB ones (the smallest request
    the cache process serves).  The pairs swing with this machine's load far more than 1 %; the calls' own
    cost does not."""
    distances = exact_distances(requests)
    l1 = median_reuse_bytes(distances)
    l1_e2e = l1 // CHUNK_BYTES * COST_CHUNK_BYTES
    ratios, off_us = [], []
    for repetition in range(repetitions):
        on = replay(requests, l1_e2e, 0.01, COST_CHUNK_BYTES)["cache_cpu_s"]
        off = replay(requests, l1_e2e, 0.0, COST_CHUNK_BYTES)["cache_cpu_s"]
        ratios.append(on / off)
        off_us.append(off / len(requests) * 1e6)
        progress(f"mrc: sampling cost, pair {repetition + 1}: {on / len(requests) * 1e6:.0f} vs "
                 f"{off_us[-1]:.0f} µs CPU per request")
    small_us = replay(requests, l1, 0.0)["cache_cpu_s"] / len(requests) * 1e6
    calls = _sampler_us(requests, _found_at(requests, distances, l1), repetitions)
    return {"cpu_on_over_off": round(statistics.median(ratios), 4), "pairs": [round(r, 4) for r in ratios],
            "sampler_us_per_request": round(calls, 2), "cpu_us_per_request_off": round(statistics.median(off_us), 1),
            "sampler_share": round(calls / statistics.median(off_us), 4),
            "cpu_us_per_request_off_4k": round(small_us, 1), "sampler_share_4k": round(calls / small_us, 4)}


def _found_at(requests: list[Request], distances: list[float], capacity: int) -> list[int]:
    """Per request, the chunks an LRU cache of ``capacity`` bytes finds: its keys up to the first one whose reuse
    distance does not fit (what a prefix lookup of the replay finds, within the watermark's few per cent)."""
    out, position = [], 0
    for _, _, hashes in requests:
        fits = [distance <= capacity for distance in distances[position : position + len(hashes)]]
        out.append(fits.index(False) if False in fits else len(hashes))
        position += len(hashes)
    return out


def _sampler_us(requests: list[Request], found: list[int], repetitions: int) -> float:
    """Thread CPU µs per request of the cache process's sampling calls alone (one lookup event finding
    ``found[i]`` chunks, one store event of the rest, at the default settings) on a real ring, median over
    ``repetitions``."""
    from mpcache.cache.mrc.accesses import AccessSampler
    from mpcache.shm import layout
    from mpcache.shm.intern import Interner
    from mpcache.shm.publish import Publisher
    from mpcache.shm.ring import RingWriter, format_event_segment
    from mpcache.shm.ring_reader import RingReader
    from mpcache.shm.segment import Segment, shm_name

    class NothingHeld:  # L1's answer for the chunks past a lookup's gap: a dictionary lookup that misses
        entry_of = staticmethod(dict[tuple[str, str, int], None]().get)
        contains = staticmethod(set().__contains__)

    capacity = 1 << 16
    segment = Segment.create(shm_name(os.getpid(), os.urandom(6).hex(), "mrc"), layout.event_segment_size(capacity, 64))
    Segment.unlink(segment.name)  # mapped here only: nothing is left in /dev/shm, even if this run is killed
    try:
        format_event_segment(segment, capacity, 64)
        defaults = Config(instance_id="b", supervisor_pid=0, runtime_dir="/x")
        sampler = AccessSampler(Publisher(RingWriter(segment), Interner(segment.buf, 64)), defaults.mrc_sample_rate,
                                defaults.mrc_exact_chunks)
        reader, held, samples = RingReader(segment), NothingHeld(), []
        for _ in range(repetitions):
            start = time.thread_time_ns()
            for (model, salt, hashes), hits in zip(requests, found):
                sampler.lookup(held, model, salt, hashes, 1, hits, hits)  # type: ignore[arg-type]
                sampler.store(model, salt, hashes[hits:], CHUNK_BYTES)
            samples.append((time.thread_time_ns() - start) / len(requests) / 1000)
            while reader.read_batch().size:
                pass
        return statistics.median(samples)
    finally:
        segment.close()


def curve_memory(max_keys: int, policy: str = "lru") -> int:
    """Bytes a curve set modelling ``policy`` holds filled to its bounds: ``max_keys`` tracked keys, as many
    forgotten ones as it remembers (the tiers are small enough that most keys fall below the deepest point), 50
    tenants' curves, and for an order other than LRU its miniatures full."""
    from mpcache.telemetry.mrc.curves import HEAD, MISS, SAMPLED, CurveSet

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    curves = CurveSet(1.0, max_keys, {"l1": 2**19, "l1_l2": 2**20}, policy=policy)
    rng = np.random.default_rng(1)
    for batch in range(max(40, 5 * max_keys // 1024)):
        rows = [(int(h), f"t{batch % 50}", "m") for h in rng.integers(0, 2**63, size=1024)]
        curves.store("m", 4096, rows)
        accesses = [(row, HEAD if i < 4 else SAMPLED, MISS, 1) for i, row in enumerate(rows)]
        curves.lookup("m", f"t{batch % 50}", 1, accesses)
    size = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert curves.tracked_keys <= max_keys
    return size
