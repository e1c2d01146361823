"""Soak: two producers at a fixed event rate against the real telemetry process; reports drops, drain
lag and the telemetry process's anonymous resident memory (``RssAnon``: plain RSS counts ring pages).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from typing import Any

import psutil

from benchmarks.children import kill_running, stop
from mpcache.config import Config
from mpcache.shm import layout
from mpcache.shm.ring_reader import RingReader, read_counters
from mpcache.shm.segment import Segment
from mpcache.supervisor.provision import create_segments, unlink_segments

RATE_PER_PRODUCER = 250_000
PRODUCERS = 2
TARGET_LAG_P99_S = 0.05


def paced_produce(ring_name: str, rate: int, seconds: float, seed: int) -> None:
    """Run in a producer process: publish ``rate`` events/s for ``seconds``; print events published."""
    from benchmarks.drain import request_emitter

    segment = Segment.attach(ring_name, layout.HEADER_SIZE)
    publish_request, events_per_request = request_emitter(segment, seed)
    tick = 0.01
    per_tick = max(1, int(rate * tick / events_per_request))
    start = time.monotonic()
    published, n = 0, 0
    while time.monotonic() - start < seconds:
        for _ in range(per_tick):
            publish_request(n)
            n += 1
        published += per_tick * events_per_request
        next_tick = start + (published / rate)
        delay = next_tick - time.monotonic()
        if delay > 0:
            time.sleep(delay)
    print(published, flush=True)


def _private_mb(process: psutil.Process) -> float:
    """Anonymous resident memory in MiB (the Python heap and friends; no shared or file pages)."""
    with open(f"/proc/{process.pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) / 1024
    return process.memory_info().rss / 2**20


def run(repetitions: int = 1, progress: Callable[[str], None] = lambda _: None, seconds: float = 60.0,
        rate: int = RATE_PER_PRODUCER) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="mpcache-soak-") as runtime:
        config = Config(instance_id=uuid.uuid4().hex, supervisor_pid=os.getpid(), runtime_dir=runtime,
                        workers=PRODUCERS, ring_capacity_cells=1 << 20, l1_size_bytes=1 << 16, chunk_bytes=1 << 16,
                        prometheus_port=0, disable_logging=True, log_level="warning")
        create_segments(config)
        config_path = os.path.join(runtime, "config.json")
        with open(config_path, "w", encoding="utf-8") as handle:
            handle.write(config.to_json())
        telemetry = subprocess.Popen([sys.executable, "-m", "mpcache.telemetry", "--config", config_path],
                                     stderr=subprocess.DEVNULL)
        producers: list[subprocess.Popen] = []
        try:
            rings = [Segment.attach(config.ring_name(i), layout.HEADER_SIZE) for i in range(PRODUCERS)]
            readers = [RingReader(ring) for ring in rings]  # read-only use: oldest pending timestamp
            telemetry_ps = psutil.Process(telemetry.pid)
            time.sleep(2.0)  # let the telemetry process import and settle before the first RSS sample
            rss_start = _private_mb(telemetry_ps)
            progress(f"soak: {PRODUCERS} producers x {rate:,} events/s for {seconds:.0f} s; "
                     f"telemetry anonymous memory at start {rss_start:.1f} MiB")
            producers += [
                subprocess.Popen([sys.executable, "-c", f"from benchmarks.soak import paced_produce; "
                                  f"paced_produce({config.ring_name(i)!r}, {rate}, {seconds}, {i})"],
                                 stdout=subprocess.PIPE, text=True)
                for i in range(PRODUCERS)
            ]
            lags, rss = [], []
            started = time.monotonic()
            while any(p.poll() is None for p in producers):
                now = time.time_ns()
                oldest = [ts for r in readers if (ts := r.oldest_pending_timestamp_ns()) is not None]
                lags.append(max(0.0, (now - min(oldest)) / 1e9) if oldest else 0.0)
                rss.append(_private_mb(telemetry_ps))
                if len(rss) % 100 == 0:
                    progress(f"  {time.monotonic() - started:5.1f} s: lag {lags[-1] * 1000:6.1f} ms, "
                             f"anonymous memory {rss[-1]:.1f} MiB")
                time.sleep(0.1)
            published = sum(int(p.communicate(timeout=30)[0].strip() or 0) for p in producers)
            deadline = time.monotonic() + 60
            while any(r.pending_cells() for r in readers) and time.monotonic() < deadline:
                time.sleep(0.05)
            counters = [read_counters(ring) for ring in rings]
            drops = sum(c.dropped + c.torn + c.malformed for c in counters)
        finally:
            kill_running(producers)
            stop(telemetry)
            unlink_segments(config)
    lags_sorted = sorted(lags)
    p99 = lags_sorted[min(len(lags_sorted) - 1, int(0.99 * len(lags_sorted)))] if lags_sorted else 0.0
    return {
        "benchmark": "soak",
        "seconds": seconds,
        "producers": PRODUCERS,
        "rate_per_producer": rate,
        "events_published": published,
        "achieved_events_per_s": round(published / seconds),
        "drops": drops,
        "lag_p50_s": round(statistics.median(lags), 4) if lags else 0.0,
        "lag_p99_s": round(p99, 4),
        "lag_max_s": round(max(lags), 4) if lags else 0.0,
        "rss_start_mb": round(rss_start, 1),
        "rss_end_mb": round(rss[-1] if rss else rss_start, 1),
        "rss_max_mb": round(max(rss) if rss else rss_start, 1),
        "targets_met": {"drops": drops == 0, "lag_p99_s": p99 < TARGET_LAG_P99_S,
                        "rss_flat": (rss[-1] if rss else rss_start) <= rss_start * 1.2 + 5},
    }
