"""The miss-ratio benchmark's traces and their truth (``python -m benchmarks mrc``): the demo's, a KV-shaped
and a long-prompt workload as chunk-hash requests; an exact LRU stack-distance computation of a trace,
written here independently of ``mpcache.telemetry.mrc``; and a trace's replay through a real one-process
service, as an engine does (lookup, store what missed, end).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from typing import Any

import numpy as np
import psutil

from benchmarks.children import stop
from mpcache.client import CacheClient
from mpcache.config import Config
from mpcache.contract.keys import chunk_hashes
from mpcache.demo.run import Workload

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
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


def replay(requests: list[Request], l1_bytes: int, rate: float, chunk_bytes: int = CHUNK_BYTES,
           policy: str = "lru") -> dict[str, Any]:
    """Run ``requests`` against a fresh one-process service (``--l1-policy policy``: LRU, which the curves
    model, unless told) as an engine does (lookup; the prefix found is released; the rest is stored); returns
    the measured hit ratio, each request's prefix found (``found``), the cache process's CPU seconds and the
    ``/mrc`` document once every sampled lookup has arrived."""
    with tempfile.TemporaryDirectory(prefix="mpcache-bench-mrc-") as tmp, \
            open(os.path.join(tmp, "service.log"), "w+", encoding="utf-8") as log:
        runtime, port = os.path.join(tmp, "run"), _free_port()
        service = subprocess.Popen(
            [sys.executable, os.path.join(REPO, "bin", "start-cache"), "--workers", "1", "--chunk-bytes",
             str(chunk_bytes), "--chunk-size", str(CHUNK_TOKENS), "--l1-size", str(l1_bytes), "--l1-policy", policy,
             "--mrc-sample-rate", str(rate), "--mrc-half-life", "0", "--prometheus-port", str(port), "--runtime-dir",
             runtime, "--log-level", "warning"], stdout=subprocess.DEVNULL, stderr=log)
        try:
            path = os.path.join(runtime, "cache0.sock")
            deadline = time.monotonic() + 60
            while not os.path.exists(path):
                if time.monotonic() > deadline or service.poll() is not None:
                    raise RuntimeError("the benchmark's service did not start")
                time.sleep(0.05)
            cache = next(p for p in psutil.Process(service.pid).children(recursive=True)
                         if "mpcache.cache" in " ".join(p.cmdline()))
            try:
                return _engine_steps(CacheClient(path), cache, requests, chunk_bytes, rate, port)
            except Exception as exc:
                status = _exit_status(service)
                stop(service)  # its log then holds every child's exit
                raise RuntimeError(f"the replay through the service failed ({exc}); the service {status}, its "
                                   f"log ends:\n{_tail(log)}") from exc
        finally:
            stop(service)


def _exit_status(service: subprocess.Popen) -> str:
    status = service.poll()
    return "still runs" if status is None else f"exited {status}"


def _tail(log: Any, lines: int = 20) -> str:
    """The last ``lines`` of the service's log (warnings and errors: why a cache process went away)."""
    log.flush()
    log.seek(0)
    return "".join(log.readlines()[-lines:]) or "(empty)"


def _engine_steps(client: CacheClient, cache: psutil.Process, requests: list[Request], chunk_bytes: int,
                  rate: float, port: int) -> dict[str, Any]:
    """The requests as an engine sends them: lookup; the rest stored; end."""
    buffer = client.register_buffer(max(len(hashes) for _, _, hashes in requests), chunk_bytes)
    asked = found_total = 0
    founds = []
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
        founds.append(found)
    cpu = sum(cache.cpu_times()[:2]) - cpu_before
    document = _settled_mrc(port) if rate > 0 else {}
    client.close()
    return {"hit_ratio": found_total / asked, "found": founds, "cache_cpu_s": cpu, "mrc": document}


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
