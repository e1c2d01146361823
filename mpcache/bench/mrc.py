"""Miss-ratio curves against the truth: two deterministic workloads through the real service (the demo's,
and a KV-shaped synthetic one), each

* replayed offline by an exact LRU stack-distance computation written here (a Fenwick tree of distinct
  keys over access times, independent of ``mpcache.telemetry.mrc``), against the service's online curve
  at the default sample rate: mean absolute error over the points;
* re-run with L1 at ½× and 2×: the hit ratio the 1× curve predicted there against the one measured
  (prefix lookups, the watermark eviction loop and all);
* the same traces fed straight to the telemetry's curve code at rates 0.01, 0.1 and 1 (and with 4 or no exact
  head chunks), and a third, long-prompt trace whose accesses lie mostly past the exact chunks: the error
  that sampling alone costs;
* sampling's cost: the cache process's CPU per request at the default rate against ``--mrc-sample-rate 0``,
  in interleaved pairs; and the telemetry memory of a curve set filled to ``--mrc-max-keys``.
"""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import tracemalloc
import urllib.request
from collections.abc import Callable
from typing import Any

import numpy as np
import psutil

from mpcache.bench.children import stop
from mpcache.client import CacheClient
from mpcache.config import Config
from mpcache.contract.keys import chunk_hashes
from mpcache.demo.run import Workload
from mpcache.report import hit_ratio_at

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHUNK_BYTES = 4096  # small objects: many keys through the real service in little time
CHUNK_TOKENS = 16
MAX_CHUNKS = 32
Request = tuple[str, str, list[int]]  # (model_name, cache_salt, chunk hashes)


# -- workloads ---------------------------------------------------------------------------------------------------


def demo_requests(count: int, seed: int = 7) -> list[Request]:
    """The demo's prompts (``mpcache.demo.run.Workload``): per-model system prompts, Zipf documents, fresh
    questions."""
    config = Config(instance_id="bench", supervisor_pid=0, runtime_dir="/nonexistent",
                    chunk_size_tokens=CHUNK_TOKENS)
    workload = Workload(config, seed)
    out = []
    for _ in range(count):
        tenant, model, tokens = workload.next_prompt()
        out.append((model, tenant, chunk_hashes(tokens, CHUNK_TOKENS)[:MAX_CHUNKS]))
    return out


def kv_requests(count: int, seed: int = 3) -> list[Request]:
    """KV-shaped traffic: three tenants; Zipf-popular shared system prompts and documents; multi-turn
    conversations that extend their own prefix by a turn each time they come back."""
    rng = np.random.default_rng(seed)
    tenants = ("tenant-a", "tenant-b", "tenant-c")
    systems = [rng.integers(0, 32000, size=int(rng.integers(2, 5)) * CHUNK_TOKENS) for _ in range(12)]
    documents = [rng.integers(0, 32000, size=int(rng.integers(2, 9)) * CHUNK_TOKENS) for _ in range(3000)]
    conversations: list[tuple[str, np.ndarray]] = []
    out = []
    for _ in range(count):
        if conversations and rng.random() < 0.45:  # a conversation comes back, the recent ones more often
            index = len(conversations) - 1 - min(int(rng.zipf(1.3)) - 1, len(conversations) - 1)
            tenant, tokens = conversations[index]
            tokens = np.concatenate((tokens, rng.integers(0, 32000, size=int(rng.integers(1, 3)) * CHUNK_TOKENS)))
            if len(tokens) // CHUNK_TOKENS > MAX_CHUNKS:
                del conversations[index]
                continue
            conversations[index] = (tenant, tokens)
        else:
            tenant = tenants[int(rng.integers(len(tenants)))]
            system = systems[min(int(rng.zipf(1.5)) - 1, len(systems) - 1)]
            parts = [system]
            if rng.random() < 0.6:
                parts.append(documents[min(int(rng.zipf(1.1)) - 1, len(documents) - 1)])
            parts.append(rng.integers(0, 32000, size=CHUNK_TOKENS))
            tokens = np.concatenate(parts)
            conversations.append((tenant, tokens))
            if len(conversations) > 2000:
                conversations.pop(0)
        out.append(("kv-model", tenant, chunk_hashes(tokens, CHUNK_TOKENS)[:MAX_CHUNKS]))
    return out


def long_requests(count: int, seed: int = 5, documents: int = 300) -> list[Request]:
    """Long prompts (retrieval over long documents): one system prompt, one of 300 Zipf-popular documents of
    20–60 chunks, a fresh question.  Most accesses lie past the exact head chunks, so the 1 % sampling of the
    rest decides the error here: replayed only, to show where the default rate stops being enough."""
    rng = np.random.default_rng(seed)
    system = rng.integers(0, 32000, size=2 * CHUNK_TOKENS)
    docs = [rng.integers(0, 32000, size=int(rng.integers(20, 61)) * CHUNK_TOKENS) for _ in range(documents)]
    out = []
    for _ in range(count):
        doc = docs[min(int(rng.zipf(1.2)) - 1, documents - 1)]
        tokens = np.concatenate((system, doc, rng.integers(0, 32000, size=CHUNK_TOKENS)))
        out.append(("long-model", "tenant-a", chunk_hashes(tokens, CHUNK_TOKENS)))
    return out


def share_past(requests: list[Request], chunks: int) -> float:
    """The share of lookup accesses past a lookup's first ``chunks`` chunks (the hash-sampled stratum)."""
    total = sum(len(hashes) for _, _, hashes in requests)
    return round(sum(max(0, len(hashes) - chunks) for _, _, hashes in requests) / total, 4)


# -- the oracle ---------------------------------------------------------------------------------------------------


def exact_distances(requests: list[Request]) -> list[float]:
    """Per lookup access: the bytes an LRU cache needs to hit it (distinct objects touched since its previous
    access, plus itself, × CHUNK_BYTES), or inf for a first access.  Every key of a request is judged against
    the state before the request; then all of them are touched, in order (the lookup's hits, the store of
    the rest)."""
    total = sum(len(hashes) for _, _, hashes in requests)
    tree = [0] * (total + 2)
    last: dict[tuple[str, str, int], int] = {}
    live = 0
    now = 0
    out: list[float] = []

    def add(position: int, delta: int) -> None:
        while position <= total + 1:
            tree[position] += delta
            position += position & -position

    def prefix(position: int) -> int:
        acc = 0
        while position > 0:
            acc += tree[position]
            position -= position & -position
        return acc

    for model, salt, hashes in requests:
        keys = [(model, salt, h) for h in hashes]
        for key in keys:
            seen = last.get(key)
            out.append(float("inf") if seen is None else (live - prefix(seen) + 1) * CHUNK_BYTES)
        for key in keys:
            seen = last.get(key)
            if seen is not None:
                add(seen, -1)
            else:
                live += 1
            now += 1
            last[key] = now
            add(now, 1)
    return out


def exact_curve(distances: list[float], capacities: list[int]) -> list[float]:
    ordered = np.sort(np.asarray(distances))
    return [float(np.searchsorted(ordered, capacity, side="right")) / len(ordered) for capacity in capacities]


def median_reuse_bytes(distances: list[float]) -> int:
    """The median finite reuse distance, in whole chunks: the L1 size that puts a workload mid-curve."""
    finite = sorted(d for d in distances if d != float("inf"))
    return int(finite[len(finite) // 2]) // CHUNK_BYTES * CHUNK_BYTES


# -- the service --------------------------------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def replay(requests: list[Request], l1_bytes: int, rate: float) -> dict[str, Any]:
    """Run ``requests`` against a fresh one-process service as an engine does (lookup; the prefix found is
    released; the rest is stored); returns the measured hit ratio, the cache process's CPU seconds and
    the ``/mrc`` document once every sampled lookup has arrived."""
    with tempfile.TemporaryDirectory(prefix="mpcache-bench-mrc-") as tmp:
        runtime, port = os.path.join(tmp, "run"), _free_port()
        service = subprocess.Popen(
            [sys.executable, os.path.join(REPO, "bin", "start-cache"), "--workers", "1", "--chunk-bytes",
             str(CHUNK_BYTES), "--chunk-size", str(CHUNK_TOKENS), "--l1-size", str(l1_bytes), "--mrc-sample-rate",
             str(rate), "--mrc-half-life", "0", "--prometheus-port", str(port), "--runtime-dir", runtime,
             "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            path = os.path.join(runtime, "cache0.sock")
            deadline = time.monotonic() + 60
            while not os.path.exists(path):
                if time.monotonic() > deadline or service.poll() is not None:
                    raise RuntimeError("the benchmark's service did not start")
                time.sleep(0.05)
            cache = next(p for p in psutil.Process(service.pid).children(recursive=True)
                         if "mpcache.cache" in " ".join(p.cmdline()))
            client = CacheClient(path)
            buffer = client.register_buffer(MAX_CHUNKS, CHUNK_BYTES)
            asked = found_total = 0
            cpu_before = sum(cache.cpu_times()[:2])
            for number, (model, salt, hashes) in enumerate(requests):
                request_id = f"b{number}"
                job = client.lookup_prefetch(request_id=request_id, model_name=model, cache_salt=salt,
                                             chunk_hashes=hashes)
                found = client.query_prefetch_status(job).found_count
                if found < len(hashes):
                    client.store(buffer, request_id=request_id, model_name=model, cache_salt=salt,
                                 chunk_hashes=hashes[found:], block_ids=range(len(hashes) - found))
                client.end_session(request_id)
                asked, found_total = asked + len(hashes), found_total + found
            cpu = sum(cache.cpu_times()[:2]) - cpu_before
            document = _settled_mrc(port) if rate > 0 else {}
            client.close()
            return {"hit_ratio": found_total / asked, "cache_cpu_s": cpu, "mrc": document}
        finally:
            stop(service)


def _settled_mrc(port: int) -> dict[str, Any]:
    """``/mrc`` once its sample count stops growing (the telemetry process has drained the ring)."""
    previous, deadline = -1, time.monotonic() + 60
    while time.monotonic() < deadline:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/mrc", timeout=10) as response:
            document = json.loads(response.read())
        count = sum(c["sampled_accesses"] for c in document["curves"])
        if count == previous:
            return document
        previous = count
        time.sleep(0.5)
    raise RuntimeError("the telemetry process did not settle")


def _overall(document: dict[str, Any]) -> dict[str, Any]:
    return next(c for c in document["curves"] if c["tier"] == "l1" and c["model_name"] == "*")


# -- the benchmark -------------------------------------------------------------------------------------------------


def _one_workload(name: str, requests: list[Request], rate: float, watermark: float,
                  progress: Callable[[str], None]) -> dict[str, Any]:
    distances = exact_distances(requests)
    l1 = median_reuse_bytes(distances)
    progress(f"mrc: {name}: {len(requests)} requests, {len(distances)} lookup accesses, L1 {l1 >> 10} KiB")
    runs = {factor: replay(requests, int(l1 * factor) // CHUNK_BYTES * CHUNK_BYTES, rate) for factor in (1, 0.5, 2)}
    curve = _overall(runs[1]["mrc"])
    capacities = [point["capacity_bytes"] for point in curve["points"]]
    exact = exact_curve(distances, capacities)
    online = [point["hit_ratio"] for point in curve["points"]]
    configured = curve["capacity_bytes"]  # the allocator's capacity may sit a slab below --l1-size

    def predicted(factor: float, effective: float = 1.0) -> float:
        return float(hit_ratio_at(curve["points"], configured * factor * effective) or 0.0)

    out: dict[str, Any] = {
        "requests": len(requests), "lookup_accesses": len(distances), "l1_bytes": l1,
        "sample_rate": runs[1]["mrc"]["sample_rate"], "sampled_accesses": curve["sampled_accesses"],
        "mae_online_vs_exact": round(float(np.mean(np.abs(np.subtract(online, exact)))), 4),
        "max_error_online_vs_exact": round(float(np.max(np.abs(np.subtract(online, exact)))), 4),
    }
    for factor, label in ((0.5, "half"), (2, "double")):
        measured = runs[factor]["hit_ratio"]
        out[f"{label}_measured"] = round(measured, 4)
        out[f"{label}_predicted"] = round(predicted(factor), 4)
        out[f"{label}_error"] = round(abs(predicted(factor) - measured), 4)
        out[f"{label}_predicted_at_watermark"] = round(predicted(factor, watermark), 4)
        out[f"{label}_error_at_watermark"] = round(abs(predicted(factor, watermark) - measured), 4)
    out["one_measured"] = round(runs[1]["hit_ratio"], 4)
    out["one_predicted"] = round(predicted(1), 4)
    exact_points = [{"capacity_bytes": c, "hit_ratio": h} for c, h in zip(capacities, exact)]
    for factor, label in ((0.5, "half"), (1, "one"), (2, "double")):  # what an exact curve would predict
        out[f"{label}_exact"] = round(float(hit_ratio_at(exact_points, configured * factor) or 0.0), 4)
    return out


def replay_mae(requests: list[Request], rate: float, exact_chunks: int, max_keys: int) -> float:
    """The curve the telemetry process would build from ``requests`` sampled at ``rate`` (fed straight to a
    :class:`~mpcache.telemetry.mrc.curves.CurveSet`, no service) against the exact one: mean absolute error."""
    from mpcache.contract.keys import SAMPLE_MODULUS
    from mpcache.telemetry.mrc.curves import HEAD, MISS, POINT_RATIOS, SAMPLED, CurveSet

    distances = exact_distances(requests)
    finite = sorted(d for d in distances if d != float("inf"))
    capacity = int(finite[len(finite) // 2])  # not rounded to whole chunks: the replay has no slabs
    curves = CurveSet(rate, max_keys, {"l1": capacity})
    threshold = rate * SAMPLE_MODULUS
    for model, salt, hashes in requests:
        rows = [(h, salt, model) for h in hashes]
        sampled = [row for row in rows[exact_chunks:] if row[0] % SAMPLE_MODULUS < threshold]
        curves.lookup(model, salt, 1, [(row, HEAD, MISS, 1) for row in rows[:exact_chunks]]
                      + [(row, SAMPLED, MISS, 1) for row in sampled])
        curves.store(model, CHUNK_BYTES, [row for row in rows if row[0] % SAMPLE_MODULUS < threshold])
    [curve] = [c for c in curves.curves() if c["model_name"] == "*"]
    exact = exact_curve(distances, [round(capacity * ratio) for ratio in POINT_RATIOS])
    return round(float(np.mean(np.abs(np.subtract([p["hit_ratio"] for p in curve["points"]], exact)))), 4)


def _sampling_cost(requests: list[Request], repetitions: int, progress: Callable[[str], None]) -> dict[str, Any]:
    """Cache-process CPU per request at the default rate over rate 0, interleaved pairs (median ratio), and
    the publishing calls alone (:func:`_sampler_us`) as a share of the CPU per request at rate 0: the pairs
    swing with this machine's load far more than 1 %, the calls' own cost does not."""
    l1 = median_reuse_bytes(exact_distances(requests))
    ratios, off_us = [], []
    for repetition in range(repetitions):
        on = replay(requests, l1, 0.01)["cache_cpu_s"]
        off = replay(requests, l1, 0.0)["cache_cpu_s"]
        ratios.append(on / off)
        off_us.append(off / len(requests) * 1e6)
        progress(f"mrc: sampling cost, pair {repetition + 1}: {on / len(requests) * 1e6:.0f} vs "
                 f"{off_us[-1]:.0f} µs CPU per request")
    calls = _sampler_us(requests, repetitions)
    return {"cpu_on_over_off": round(statistics.median(ratios), 4), "pairs": [round(r, 4) for r in ratios],
            "sampler_us_per_request": round(calls, 2), "cpu_us_per_request_off": round(statistics.median(off_us), 1),
            "sampler_share": round(calls / statistics.median(off_us), 4)}


def _sampler_us(requests: list[Request], repetitions: int) -> float:
    """Thread CPU µs per request of the cache process's sampling calls alone (one lookup event, one store event
    of what it missed, at the default settings) on a real ring, median over ``repetitions``."""
    from mpcache.cache.accesses import AccessSampler
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
    try:
        format_event_segment(segment, capacity, 64)
        defaults = Config(instance_id="b", supervisor_pid=0, runtime_dir="/x")
        sampler = AccessSampler(Publisher(RingWriter(segment), Interner(segment.buf, 64)), defaults.mrc_sample_rate,
                                defaults.mrc_exact_chunks)
        reader, held, samples = RingReader(segment), NothingHeld(), []
        for _ in range(repetitions):
            start = time.thread_time_ns()
            for model, salt, hashes in requests:
                found = len(hashes) // 2
                sampler.lookup(held, model, salt, hashes, 1, found, found)  # type: ignore[arg-type]
                sampler.store(model, salt, hashes[found:], CHUNK_BYTES)
            samples.append((time.thread_time_ns() - start) / len(requests) / 1000)
            while reader.read_batch().size:
                pass
        return statistics.median(samples)
    finally:
        segment.close()


def _curve_memory(max_keys: int = 8192) -> int:
    """Bytes a curve set holds filled to its bounds: ``max_keys`` tracked keys, as many forgotten ones as it
    remembers (the tiers are small enough that most keys fall below the deepest point), 50 tenants' curves."""
    from mpcache.telemetry.mrc.curves import HEAD, MISS, SAMPLED, CurveSet

    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    curves = CurveSet(1.0, max_keys, {"l1": 2**19, "l1_l2": 2**20})
    rng = np.random.default_rng(1)
    for batch in range(40):
        rows = [(int(h), f"t{batch % 50}", "m") for h in rng.integers(0, 2**63, size=1024)]
        curves.store("m", 4096, rows)
        accesses = [(row, HEAD if i < 4 else SAMPLED, MISS, 1) for i, row in enumerate(rows)]
        curves.lookup("m", f"t{batch % 50}", 1, accesses)
    size = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert curves.tracked_keys <= max_keys
    return size


def run(repetitions: int = 3, progress: Callable[[str], None] = lambda _: None,
        requests: int = 40_000) -> dict[str, Any]:
    defaults = Config(instance_id="b", supervisor_pid=0, runtime_dir="/x")
    rate, watermark, exact, max_keys = 0.01, defaults.l1_watermark, defaults.mrc_exact_chunks, defaults.mrc_max_keys
    workloads = {"demo": demo_requests(requests), "kv": kv_requests(requests)}
    results: dict[str, Any] = {name: _one_workload(name, reqs, rate, watermark, progress)
                               for name, reqs in workloads.items()}
    replayed = workloads | {"long (replay only)": long_requests(requests // 2)}
    results["replay_mae_by_rate"] = {
        name: {"share of accesses past the exact chunks": share_past(reqs, exact)} | {
            f"{rate:g}": replay_mae(reqs, rate, exact, max_keys) for rate in (0.01, 0.1, 1.0)} | {
            f"0.01 with {chunks} exact chunks": replay_mae(reqs, 0.01, chunks, max_keys) for chunks in (4, 0)}
        for name, reqs in replayed.items()}
    progress(f"mrc: replayed MAE by rate {results['replay_mae_by_rate']}")
    results["sampling_cost"] = _sampling_cost(workloads["kv"][: requests // 4], repetitions, progress)
    results["curve_set_bytes_at_max_keys"] = _curve_memory()
    results["targets_met"] = {
        "MAE ≤ 0.01": all(results[n]["mae_online_vs_exact"] <= 0.01 for n in workloads),
        "prediction within 0.02": all(results[n][f"{x}_error"] <= 0.02 for n in workloads for x in ("half", "double")),
        "sampling ≤ +1 % CPU": results["sampling_cost"]["sampler_share"] <= 0.01,
    }
    return results
