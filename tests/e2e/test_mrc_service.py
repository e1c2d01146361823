"""Miss-ratio curves and miss reasons of a running service at ``--mrc-sample-rate 1`` (every access, exact):
a scripted workload whose LRU behaviour and miss reasons are known by construction, ``GET /mrc`` against
byte-capacity LRU caches simulated by the test, ``mpcache-report`` on the live endpoint, and a telemetry
process killed and restarted without counting anything twice."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from collections import OrderedDict

import pytest
from support.waiting import wait_for

from mpcache.client import CacheClient

CHUNK = 64 * 1024
L1_CHUNKS = 64
MODEL, SALT = "llama", "tenant-a"
# no decay: the curves are compared with exact LRU to 6 decimals, and a 3600 s half-life applied between the
# pump's batches (1 s apart) moves them by ~1e-6; L1 evicts in LRU order, the cache the curves model
FLAGS = ("--workers", "1", "--l1-size", str(L1_CHUNKS * CHUNK), "--l1-policy", "lru", "--mrc-sample-rate", "1",
         "--mrc-half-life", "0")
pytestmark = pytest.mark.slow


def mrc(port: int) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/mrc", timeout=5) as response:
        return json.loads(response.read())


def overall(port: int) -> dict:
    return next(c for c in mrc(port)["curves"]
                if c["tier"] == "l1" and (c["model_name"], c["cache_salt"]) == ("*", "*"))


class Engine:
    """Drives one cache process as an engine does: a lookup of a request's chunks, then a store of all of
    them; records the trace (op, chunks) the test's LRU oracle replays."""

    def __init__(self, socket_path: str) -> None:
        self.client = CacheClient(socket_path)
        self.buffer = self.client.register_buffer(8, CHUNK)
        self.trace: list[tuple[str, list[int]]] = []
        self.requests = 0

    def lookup(self, chunks: list[int], store: bool = True) -> int:
        self.requests += 1
        request = f"r{self.requests}"
        job = self.client.lookup_prefetch(request_id=request, model_name=MODEL, cache_salt=SALT, chunk_hashes=chunks)
        found = self.client.query_prefetch_status(job).found_count
        self.trace.append(("lookup", chunks))
        if store:
            self.store(chunks, request)
        self.client.end_session(request)
        return found

    def store(self, chunks: list[int], request: str = "") -> None:
        for start in range(0, len(chunks), 8):
            batch = chunks[start : start + 8]
            self.client.store(self.buffer, request_id=request or f"s{start}", model_name=MODEL, cache_salt=SALT,
                              chunk_hashes=batch, block_ids=range(len(batch)))
            self.trace.append(("store", batch))


def lru_hit_ratio(trace: list[tuple[str, list[int]]], capacity: int) -> float:
    """Lookup hits of a byte LRU cache of ``capacity`` (CHUNK-byte objects) replaying ``trace`` under the
    curve's model (docs/MRC.md): each key of a lookup is judged against the cache before the lookup, then all
    of them are touched, the misses inserted as the engine's store would; a store touches or inserts."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = lookups = 0

    def touch(chunk: int) -> None:
        if chunk in cache:
            cache.move_to_end(chunk)
        elif CHUNK <= capacity:
            while len(cache) * CHUNK + CHUNK > capacity:
                cache.popitem(last=False)
            cache[chunk] = None

    for op, chunks in trace:
        if op == "lookup":
            lookups += len(chunks)
            hits += sum(chunk in cache for chunk in chunks)
        for chunk in chunks:
            touch(chunk)
    return hits / lookups


def test_exact_curve_and_miss_reasons_at_rate_one(start_service):
    service = start_service(*FLAGS)
    socket_path = str(service.runtime_dir / "cache0.sock")
    wait_for(lambda: os.path.exists(socket_path) and mrc(service.port), 60, "the service and /mrc")
    engine = Engine(socket_path)
    engine.store(list(range(1, 101)))  # 100 chunks into a 64-chunk L1: 1..36 are gone whatever else happens
    evicted = [engine.lookup([chunk], store=False) for chunk in range(1, 21)]  # stored, then evicted
    gap = engine.lookup([5000, 99, 100], store=False)  # 5000 never stored; 99 and 100 held after the gap
    cold = engine.lookup([6000], store=False)
    assert ([0] * 20, 0, 0) == (evicted, gap, cold)
    wait_for(lambda: overall(service.port)["sampled_accesses"] == 24, 30, "the scripted lookups in /mrc")
    reasons = service.scrape().by_label("mpcache_lookup_miss_chunks_total", "reason")
    assert {"cold": 2.0, "evicted": 20.0, "after_gap": 2.0} == reasons
    assert 20.0 == service.scrape().total("mpcache_l1_evicted_reused_chunks_total", model_name=MODEL)

    missed, found = 0, 0
    for round_ in range(30):  # a reuse pattern over 4 × L1, looked up then stored, as engines do
        chunks = [1000 + (round_ * 7 + i * 13) % 256 for i in range(8)]
        hits = engine.lookup(chunks)
        missed, found = missed + len(chunks) - hits, found + hits
    lookups = sum(len(chunks) for op, chunks in engine.trace if op == "lookup")
    curve = wait_for(lambda: (c := overall(service.port))["sampled_accesses"] == lookups and c, 30,
                     f"{lookups} sampled lookups in /mrc")
    expected = [round(lru_hit_ratio(engine.trace, point["capacity_bytes"]), 6) for point in curve["points"]]
    assert expected == [point["hit_ratio"] for point in curve["points"]]
    assert expected[0] < expected[-1]  # the curve is not flat: the check can fail
    # cold: every lookup access of a chunk never stored before (5000 and 6000, and each round's chunks the first
    # time they are asked for); the other misses were stored before
    stored: set[int] = set()
    never_stored = 0
    for op, chunks in engine.trace:
        if op == "lookup":
            never_stored += sum(chunk not in stored for chunk in chunks)
        else:
            stored.update(chunks)
    scrape = service.scrape()
    reasons = scrape.by_label("mpcache_lookup_miss_chunks_total", "reason")
    assert (never_stored, 24.0 + missed - never_stored) == (
        reasons["cold"], reasons["evicted"] + reasons["after_gap"])
    # measured: what the lookups found (the client's own counts: 20 + 3 + 1 scripted lookups found nothing)
    assert round(found / lookups, 6) == curve["measured_hit_ratio"]
    assert curve["points"][8]["hit_ratio"] == pytest.approx(scrape.total(
        "mpcache_mrc_hit_ratio", tier="l1", model_name="*", cache_salt="*", capacity_ratio="1"), abs=1e-6)

    report = subprocess.run([sys.executable, "-m", "mpcache.tools.report", "--url", f"http://127.0.0.1:{service.port}"],
                            capture_output=True, text=True, timeout=30, check=True).stdout
    [row] = [cells for line in report.splitlines() if (cells := line.split())[:3] == ["l1", "*", "*"]]
    assert (["l1", "*", "*", "4.0", "MiB", "4.0", "MiB", str(lookups), f"{found / lookups:.3f}",
             f"{curve['points'][8]['hit_ratio']:.3f}"]) == row[:10]
    assert 0 == service.stop()


def test_a_restarted_telemetry_process_goes_on_from_the_curves_of_the_killed_one(start_service):
    """The curves survive the kill: the new process loads the old one's checkpoint and reads the ring again
    from where it covers, so its curves hold the 20 lookups the old one had seen and the 5 published after —
    none twice, none lost."""
    service = start_service(*FLAGS)
    socket_path = str(service.runtime_dir / "cache0.sock")
    wait_for(lambda: os.path.exists(socket_path) and mrc(service.port), 60, "the service and /mrc")
    engine = Engine(socket_path)
    for chunk in range(10):
        engine.lookup([chunk, chunk + 1])
    wait_for(lambda: overall(service.port)["sampled_accesses"] == 20, 30, "the first 20 sampled lookups")
    [old] = service.pids("telemetry")
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: [p for p in service.pids("telemetry") if p != old], 30, "a new telemetry process")
    for chunk in range(5):
        engine.lookup([chunk])
    assert 25 == wait_for(lambda: overall(service.port)["sampled_accesses"] == 25 and 25, 30, "5 new sampled lookups")
    assert 0 == service.stop()
