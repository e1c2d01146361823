"""Cache operations per second with telemetry off, through the rings, and with the in-process bus
(``python -m benchmarks.service none|ring|inprocess``, interleaved in one run), and the cache processes'
CPU per operation in each mode (from the start of the clients to their end, warm-up included).
"""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import psutil

from benchmarks import service as bench_service
from benchmarks.children import kill_running, stop

MODES = ("none", "ring", "inprocess")
CLIENTS = 2
SECONDS = 8.0
WARMUP_S = 1.5
CHUNKS_PER_REQUEST = 8
TARGET_RINGS_OVER_OFF = 0.97


def client_loop(socket_path: str, seconds: float, warmup_s: float, seed: int) -> None:
    """Run in a client process: print the operations per second after the warm-up, and all operations."""
    import numpy as np

    from mpcache.client import CacheClient

    rng = np.random.default_rng(seed)
    with CacheClient(socket_path) as client:
        buffer = client.register_buffer(CHUNKS_PER_REQUEST, 64 * 1024)
        blocks = buffer.blocks
        assert blocks is not None  # registered until the with block ends
        blocks[:] = rng.integers(0, 255, size=blocks.shape, dtype=np.uint8)
        ops, total, n = 0, 0, 0
        start = time.monotonic()
        counting_from = start + warmup_s
        while time.monotonic() - start < seconds:
            n += 1
            prefix = int(rng.integers(0, 200)) if n % 2 else 10**9 + n  # half repeat, half new
            hashes = [(seed << 48) ^ (prefix << 8) ^ i for i in range(CHUNKS_PER_REQUEST)]
            request = f"bench-{seed}-{n}"
            job = client.lookup_prefetch(request_id=request, model_name="llama-3-8b", cache_salt="tenant-a",
                                         chunk_hashes=hashes)
            found = client.wait_prefetch(job, timeout_s=10).found_count
            done = 1
            if found:
                client.retrieve(buffer, request_id=request, job_id=job, block_ids=range(found))
                done += 1
            if found < CHUNKS_PER_REQUEST:
                client.store(buffer, request_id=request, model_name="llama-3-8b", cache_salt="tenant-a",
                             chunk_hashes=hashes[found:], block_ids=range(found, CHUNKS_PER_REQUEST))
                done += 1
            client.end_session(request)
            total += done
            if time.monotonic() >= counting_from:
                ops += done
        print(ops / (seconds - warmup_s), total, flush=True)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cache_cpu_s(service: subprocess.Popen) -> float:
    """CPU seconds the service's cache processes (not its telemetry process) have used."""
    total = 0.0
    for pid in bench_service.child_pids(service.pid).get("cache", []):
        times = psutil.Process(pid).cpu_times()
        total += times.user + times.system
    return total


def _one_run(mode: str) -> tuple[float, float]:
    """Start the service in ``mode``, drive it with the clients: (operations per second after the warm-up,
    the cache processes' CPU µs per operation over the clients' whole run)."""
    with tempfile.TemporaryDirectory(prefix="mpcache-bench-") as tmp:
        runtime = os.path.join(tmp, "run")
        service = subprocess.Popen(
            bench_service.argv(mode, "--workers", str(CLIENTS), "--prometheus-port", str(_free_port()),
                               "--runtime-dir", runtime, "--l1-size", "64MiB", "--log-level", "warning"),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=bench_service.env(),
        )
        clients: list[subprocess.Popen] = []
        try:
            sockets = [os.path.join(runtime, f"cache{i}.sock") for i in range(CLIENTS)]
            deadline = time.monotonic() + 30
            while not all(os.path.exists(path) for path in sockets):
                if time.monotonic() > deadline or service.poll() is not None:
                    raise RuntimeError(f"the service ({mode}) did not start")
                time.sleep(0.05)
            cpu_before = _cache_cpu_s(service)
            clients += [
                subprocess.Popen(
                    [sys.executable, "-c", f"from benchmarks.e2e import client_loop; "
                     f"client_loop({path!r}, {SECONDS}, {WARMUP_S}, {i + 1})"],
                    stdout=subprocess.PIPE, text=True,
                )
                for i, path in enumerate(sockets)
            ]
            rate, operations = 0.0, 0
            for client in clients:
                out, _ = client.communicate(timeout=SECONDS + 60)
                if client.returncode != 0:
                    raise RuntimeError(f"a benchmark client exited {client.returncode}")
                client_rate, client_operations = out.split()
                rate += float(client_rate)
                operations += int(client_operations)
            cpu_s = _cache_cpu_s(service) - cpu_before
            return rate, (cpu_s * 1e6 / operations if operations else 0.0)
        finally:
            kill_running(clients)
            stop(service)


def run(repetitions: int = 3, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    progress(f"e2e: {CLIENTS} cache processes x {CLIENTS} clients, {SECONDS:.0f} s per run, modes {MODES}, "
             f"{repetitions} repetitions (interleaved)")
    samples: dict[str, list[float]] = {mode: [] for mode in MODES}
    cpu_us: dict[str, list[float]] = {mode: [] for mode in MODES}
    for rep in range(repetitions):
        for mode in MODES:
            rate, us = _one_run(mode)
            samples[mode].append(rate)
            cpu_us[mode].append(us)
            progress(f"  repetition {rep + 1}: {mode:9s} {rate:8.0f} ops/s, cache processes {us:6.1f} µs CPU per op")
    off, rings, inprocess = (statistics.median(samples[m]) for m in MODES)
    return {
        "benchmark": "e2e",
        "seconds_per_run": SECONDS,
        "repetitions": repetitions,
        "off_ops_per_s": round(off, 1),
        "rings_ops_per_s": round(rings, 1),
        "inprocess_ops_per_s": round(inprocess, 1),
        "rings_over_off": round(rings / off, 3),
        "inprocess_over_off": round(inprocess / off, 3),
        "target_rings_over_off": TARGET_RINGS_OVER_OFF,
        "targets_met": {"rings_over_off": rings / off >= TARGET_RINGS_OVER_OFF,
                        "rings_ahead_of_inprocess": rings > inprocess},
        "samples_ops_per_s": {m: [round(x, 1) for x in samples[m]] for m in MODES},
        "cache_cpu_us_per_op": {m: round(statistics.median(cpu_us[m]), 1) for m in MODES},
        "samples_cache_cpu_us_per_op": {m: [round(x, 1) for x in cpu_us[m]] for m in MODES},
    }
