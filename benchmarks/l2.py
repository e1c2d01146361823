"""The redis tier on one server and on a Redis Cluster (3 masters, loopback): store and load GB/s and lookup
latency, each against a raw redis-py pipeline moving the same bytes (the floor: ``SET`` / ``GET`` / ``EXISTS``
of the records, no index, no MAC, no thread hand-off), and the hit ratio of a sharded vs an unsharded index
(16 shards vs 1, same server, same capacity, the same Zipf request stream).

Needs ``redis-server`` and ``redis-cli``; the servers are started on free loopback ports in a temporary
directory and killed at the end.
"""

from __future__ import annotations

import os
import shutil
import socket
import statistics
import subprocess
import tempfile
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import redis

from mpcache.cache.l2.base import encode_record, key_digest
from mpcache.cache.l2.redis_adapter import RedisL2Adapter
from mpcache.contract.keys import ChunkKey

MAC_KEY = bytes(range(32))
CHUNK = 256 * 1024
CHUNKS = 256  # 64 MiB per pass
BATCH = 16
LOOKUPS = 400
HIT_CHUNK, HIT_DISTINCT, HIT_REQUESTS, HIT_CAPACITY_CHUNKS = 1024, 4000, 12000, 1000


class RedisMissing(RuntimeError):
    """redis-server or redis-cli is not installed."""


def _free_port() -> int:
    """A free loopback port whose cluster-bus port (+10000) exists too."""
    while True:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        if port + 10000 <= 65535:
            return port


def _start(directory: str, port: int, cluster: bool) -> subprocess.Popen:
    os.makedirs(directory, mode=0o700, exist_ok=True)
    argv = [shutil.which("redis-server") or "redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save",
            "", "--appendonly", "no", "--dir", directory, "--logfile", os.path.join(directory, "log")]
    if cluster:
        argv += ["--cluster-enabled", "yes", "--cluster-config-file", os.path.join(directory, "nodes.conf")]
    process = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            with redis.Redis(port=port, socket_timeout=1) as client:
                client.ping()
            return process
        except redis.ConnectionError:
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                process.wait()
                raise RuntimeError(f"redis-server on port {port} did not start") from None
            time.sleep(0.02)


def _cluster_ready(port: int) -> bool:
    with redis.Redis(port=port, socket_timeout=1) as client:
        return bool(client.cluster("info")["cluster_state"] == "ok")


def _chunks(count: int, size: int, model: str) -> list[tuple[ChunkKey, bytes | memoryview]]:
    rng = np.random.default_rng(7)
    return [(ChunkKey(model, "", index), rng.integers(0, 256, size, dtype=np.uint8).tobytes())
            for index in range(count)]


def _ours(adapter: RedisL2Adapter, chunks: list[tuple[ChunkKey, bytes | memoryview]]) -> dict[str, float]:
    keys = [key for key, _ in chunks]
    started = time.perf_counter()
    for first in range(0, len(chunks), BATCH):
        assert not adapter.submit_store(chunks[first:first + BATCH]).result(60).failed
    stored = time.perf_counter() - started
    buffers = [memoryview(bytearray(CHUNK)) for _ in range(BATCH)]
    started = time.perf_counter()
    for first in range(0, len(keys), BATCH):
        batch = keys[first:first + BATCH]
        assert len(adapter.submit_load(batch, buffers[: len(batch)]).result(60).loaded) == len(batch)
    loaded = time.perf_counter() - started
    latencies = []
    for round_ in range(LOOKUPS):
        batch = keys[(round_ * BATCH) % len(keys):][:BATCH]
        began = time.perf_counter()
        adapter.lookup(batch).result(60)
        latencies.append(time.perf_counter() - began)
    return _numbers(stored, loaded, latencies)


def _floor(client: Any, chunks: list[tuple[ChunkKey, bytes | memoryview]], prefix: str) -> dict[str, float]:
    """The same bytes through a plain pipeline: SET each record, GET it back, EXISTS for lookups."""
    names = [f"{prefix}{{{index % 16}}}c:{key_digest(key)}" for index, (key, _) in enumerate(chunks)]
    records = [encode_record(key, data, MAC_KEY) for key, data in chunks]
    started = time.perf_counter()
    for first in range(0, len(chunks), BATCH):
        pipe = client.pipeline(transaction=False)
        for name, record in zip(names[first:first + BATCH], records[first:first + BATCH]):
            pipe.set(name, record)
        pipe.execute()
    stored = time.perf_counter() - started
    started = time.perf_counter()
    for first in range(0, len(chunks), BATCH):
        pipe = client.pipeline(transaction=False)
        for name in names[first:first + BATCH]:
            pipe.get(name)
        assert all(pipe.execute())
    loaded = time.perf_counter() - started
    latencies = []
    for round_ in range(LOOKUPS):
        began = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for name in names[(round_ * BATCH) % len(names):][:BATCH]:
            pipe.exists(name)
        pipe.execute()
        latencies.append(time.perf_counter() - began)
    return _numbers(stored, loaded, latencies)


def _numbers(stored: float, loaded: float, latencies: list[float]) -> dict[str, float]:
    total = CHUNKS * CHUNK
    ordered = sorted(latencies)
    return {"store_GBps": total / stored / 1e9, "load_GBps": total / loaded / 1e9,
            "lookup_p50_us": ordered[len(ordered) // 2] * 1e6, "lookup_p99_us": ordered[int(len(ordered) * 0.99)] * 1e6}


def _hit_ratio(url: str, shards: int) -> float:
    """Hits over lookups of a Zipf request stream (lookup; on a miss, store) against ``shards`` index shards."""
    rng = np.random.default_rng(11)
    requests = np.minimum(rng.zipf(1.1, HIT_REQUESTS), HIT_DISTINCT) - 1
    payload = bytes(HIT_CHUNK)
    adapter = RedisL2Adapter(url, HIT_CAPACITY_CHUNKS * HIT_CHUNK, mac_key=MAC_KEY, shards=shards,
                             key_prefix=f"bench:hits:{shards}:")
    try:
        hits = 0
        for request in requests:
            key = ChunkKey("m", "", int(request))
            if adapter.lookup([key]).result(60)[0]:
                hits += 1
            else:
                adapter.submit_store([(key, payload)]).result(60)
        return hits / len(requests)
    finally:
        adapter.close()


def _once(progress: Callable[[str], None]) -> dict[str, Any]:
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        raise RedisMissing("redis-server and redis-cli are needed (apt-get install redis-server)")
    directory = tempfile.mkdtemp(prefix="mpcache-bench-l2-")
    processes = []
    try:
        single = _free_port()
        processes.append(_start(os.path.join(directory, "single"), single, cluster=False))
        ports = [_free_port() for _ in range(3)]
        for port in ports:
            processes.append(_start(os.path.join(directory, f"node{port}"), port, cluster=True))
        subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in ports), "--cluster-yes"],
                       capture_output=True, check=True, timeout=60)
        deadline = time.monotonic() + 30
        while not all(_cluster_ready(p) for p in ports):
            if time.monotonic() > deadline:
                raise RuntimeError("the benchmark's cluster did not become ready")
            time.sleep(0.05)
        result: dict[str, Any] = {}
        for name, url, cluster in (("single", f"redis://127.0.0.1:{single}/0", False),
                                   ("cluster", f"redis://127.0.0.1:{ports[0]}/0", True)):
            progress(f"l2: {name}")
            chunks = _chunks(CHUNKS, CHUNK, f"bench-{name}")
            adapter = RedisL2Adapter(url, 4 * CHUNKS * CHUNK, mac_key=MAC_KEY, cluster=cluster,
                                     key_prefix=f"bench:{name}:")
            try:
                ours = _ours(adapter, chunks)
            finally:
                adapter.close()
            raw = redis.RedisCluster.from_url(url) if cluster else redis.Redis.from_url(url)
            try:
                floor = _floor(raw, chunks, f"bench:floor:{name}:")
            finally:
                raw.close()
            result[name] = {"ours": ours, "floor": floor,
                            "ratio": {k: round(ours[k] / floor[k], 3) for k in ours}}
        progress("l2: hit ratio, sharded vs unsharded index")
        url = f"redis://127.0.0.1:{single}/0"
        result["hit_ratio"] = {"unsharded": _hit_ratio(url, 1), "sharded_16": _hit_ratio(url, 16)}
        return result
    finally:
        for process in processes:
            process.kill()
            process.wait()
        shutil.rmtree(directory, ignore_errors=True)


def run(repetitions: int = 3, progress: Callable[[str], None] = lambda _message: None) -> dict[str, Any]:
    """Medians over ``repetitions`` runs (each on fresh servers)."""
    runs = [_once(progress) for _ in range(max(1, repetitions))]
    out: dict[str, Any] = {}
    for name in ("single", "cluster"):
        out[name] = {part: {k: round(statistics.median(r[name][part][k] for r in runs), 3)
                            for k in runs[0][name][part]} for part in ("ours", "floor", "ratio")}
    out["hit_ratio"] = {k: round(statistics.median(r["hit_ratio"][k] for r in runs), 4)
                        for k in runs[0]["hit_ratio"]}
    out["hit_ratio_sharded_over_unsharded"] = round(out["hit_ratio"]["sharded_16"] / out["hit_ratio"]["unsharded"], 4)
    return out
