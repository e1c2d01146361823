"""Telemetry throughput: events per second through the metrics subscribers, on the event stream of real
requests, against the in-process design's per-event OpenTelemetry calls on the same stream.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from typing import Any

from benchmarks.children import kill_running
from benchmarks.reference import ReferenceMetrics, RefEvent
from mpcache.config import Config
from mpcache.contract.events import EventType as E
from mpcache.shm import layout
from mpcache.shm.ring import format_event_segment
from mpcache.shm.segment import Segment

PRODUCERS = 2
REQUESTS_PER_PRODUCER = 40_000  # x 16 events
EVENTS_PER_REQUEST = 16
RING_CELLS = 1 << 21
TARGET_EVENTS_PER_S = 1_000_000
TARGET_RATIO = 6.0
SALTS = ("tenant-a", "tenant-b", "tenant-c")
MODELS = ("llama-3-8b", "qwen-2-7b")


def request_emitter(segment: Segment, seed: int) -> tuple[Callable[[int], int], int]:
    """(publish(n) → events dropped, events per request): one cache request's events into ``segment``'s ring."""
    from mpcache.shm.intern import Interner
    from mpcache.shm.publish import Publisher
    from mpcache.shm.ring import RingWriter, read_geometry

    publisher = Publisher(RingWriter(segment), Interner(segment.buf, read_geometry(segment).intern_capacity))
    emit, emit_salted = publisher.emit, publisher.emit_salted

    def publish_request(n: int) -> int:
        salt, model = SALTS[(n + seed) % 3], MODELS[(n + seed) % 2]
        session = f"req-{seed}-{n}"
        chunks, hits = 16, (n * 7 + seed) % 17
        ok = (
            emit(E.MP_REQUEST_START, session_id=session),
            emit(E.MP_LOOKUP_PREFETCH_START, session_id=session),
            emit_salted(E.L1_READ_RESERVED, salt, model, hits),
            emit(E.MP_LOOKUP_PREFETCH_END,
                 (model, salt, hits, chunks * 256, hits * 256, hits * 256, 0, "", chunks * 256, hits * 256, hits, 0),
                 session_id=session),
            emit(E.MP_RETRIEVE_SUBMITTED, ("cpu",), session_id=session),
            emit(E.MP_RETRIEVE_START, ("cpu", seed, model), session_id=session),
            emit_salted(E.L1_READ_FINISHED, salt, model, hits),
            emit(E.MP_RETRIEVE_END, ("cpu", seed, model, salt, hits, hits << 16, hits * 256), session_id=session),
            emit(E.SM_READ_PREFETCHED_FINISHED, (0,), salt_counts={(salt, model): hits}),
            emit(E.MP_STORE_SUBMITTED, ("cpu",), session_id=session),
            emit(E.MP_STORE_START, ("cpu", seed, model), session_id=session),
            emit_salted(E.L1_WRITE_RESERVED, salt, model, chunks - hits),
            emit_salted(E.L1_WRITE_FINISHED, salt, model, chunks - hits),
            emit(E.MP_STORE_END, ("cpu", seed, model, chunks - hits, (chunks - hits) << 16, (chunks - hits) * 256),
                 session_id=session),
            emit(E.SM_WRITE_FINISHED, (0,), salt_counts={(salt, model): chunks - hits}),
            emit(E.MP_REQUEST_END, session_id=session),
        )
        return ok.count(False)

    return publish_request, EVENTS_PER_REQUEST


def produce(ring_name: str, requests: int, seed: int) -> None:
    """Run in a producer process: publish ``requests`` requests' worth of events; print the drops."""
    segment = Segment.attach(ring_name, layout.HEADER_SIZE)
    publish_request, _ = request_emitter(segment, seed)
    print(sum(publish_request(n) for n in range(requests)), flush=True)


def _fill_rings(config: Config) -> int:
    """Start the producers, wait for them; returns records dropped (0 unless the rings are too small)."""
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", f"from benchmarks.drain import produce; "
             f"produce({config.ring_name(i)!r}, {REQUESTS_PER_PRODUCER}, {i})"],
            stdout=subprocess.PIPE, text=True,
        )
        for i in range(config.workers)
    ]
    dropped = 0
    try:
        for proc in procs:
            out, _ = proc.communicate(timeout=600)
            if proc.returncode != 0:
                raise RuntimeError(f"producer exited {proc.returncode}")
            dropped += int(out.strip() or 0)
    finally:
        kill_running(procs)
    return dropped


def _drain_once(config: Config) -> tuple[float, int]:
    """Fill fresh rings, then time the telemetry pipeline draining them: (seconds, records)."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from mpcache.telemetry.bus import (
        TELEMETRY_FLUSH_INTERVAL_S,
        EventBus,
    )
    from mpcache.telemetry.pump import Pump, RingSource
    from mpcache.telemetry.subscribers.metrics import build_metrics_subscribers

    segments = []
    try:
        for i in range(config.workers):
            segment = Segment.create(config.ring_name(i), layout.event_segment_size(RING_CELLS, 256))
            format_event_segment(segment, RING_CELLS, 256)
            segments.append(segment)
        dropped = _fill_rings(config)
        if dropped:
            raise RuntimeError(f"{dropped} events dropped while filling: rings too small")
        reader = InMemoryMetricReader()
        provider = MeterProvider(metric_readers=[reader])
        bus = EventBus(flush_interval_s=TELEMETRY_FLUSH_INTERVAL_S)  # as in the telemetry process
        pump = Pump([RingSource.attach(i, config.ring_name(i)) for i in range(config.workers)], bus)
        build_metrics_subscribers(config, provider, pump=pump, bus=bus, gauge_reader=None)
        start = time.perf_counter()
        pump.drain()
        bus.flush()
        elapsed = time.perf_counter() - start
        reader.get_metrics_data()  # the values exist (and collecting is not part of the drain)
        delivered = bus.records_delivered
        provider.shutdown()
        return elapsed, delivered
    finally:
        for segment in segments:
            segment.close()
            Segment.unlink(segment.name)


def _reference_rate(events: int) -> float:
    """The in-process design's drain of the same stream: per event, one instrument call per metric it feeds."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    metrics = ReferenceMetrics(provider.get_meter("reference"))
    s, m = "tenant-a", "llama-3-8b"
    request: list[tuple[E, dict[str, Any]]] = [
        (E.MP_REQUEST_START, {}), (E.MP_LOOKUP_PREFETCH_START, {}),
        (E.L1_READ_RESERVED, {"key_count_per_salt": {s: 7}}),
        (E.MP_LOOKUP_PREFETCH_END, {"model_name": m, "cache_salt": s, "requested_tokens": 4096,
                                    "hit_tokens": 1792, "l1_hit_tokens": 1792, "l2_hit_tokens": 0,
                                    "prompt_tokens": 4096, "request_hit_tokens": 1792,
                                    "l1_hit_keys": 7, "l2_hit_keys": 0}),
        (E.MP_RETRIEVE_SUBMITTED, {"device": "cpu"}),
        (E.MP_RETRIEVE_START, {"device": "cpu", "engine_id": 0, "model_name": m}),
        (E.L1_READ_FINISHED, {"key_count_per_salt": {s: 7}}),
        (E.MP_RETRIEVE_END, {"device": "cpu", "engine_id": 0, "model_name": m, "cache_salt": s,
                             "retrieved_count": 7, "total_bytes": 7 << 16}),
        (E.SM_READ_PREFETCHED_FINISHED, {"key_count_per_salt": {s: 7}}),
        (E.MP_STORE_SUBMITTED, {"device": "cpu"}),
        (E.MP_STORE_START, {"device": "cpu", "engine_id": 0, "model_name": m}),
        (E.L1_WRITE_RESERVED, {"key_count_per_salt": {s: 9}}),
        (E.L1_WRITE_FINISHED, {"key_count_per_salt": {s: 9}}),
        (E.MP_STORE_END, {"device": "cpu", "engine_id": 0, "model_name": m, "total_bytes": 9 << 16}),
        (E.SM_WRITE_FINISHED, {"key_count_per_salt": {s: 9}}),
        (E.MP_REQUEST_END, {}),
    ]
    n_requests = max(1, events // len(request))
    start = time.perf_counter()
    for n in range(n_requests):
        session = f"req-{n}"
        for i, (etype, meta) in enumerate(request):
            metrics.handle(RefEvent(etype, n + i * 1e-6, meta, session))
    elapsed = time.perf_counter() - start
    provider.shutdown()
    return n_requests * len(request) / elapsed


def run(repetitions: int = 3, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    config = Config(instance_id=uuid.uuid4().hex, supervisor_pid=os.getpid(), runtime_dir="/tmp",
                    workers=PRODUCERS, ring_capacity_cells=RING_CELLS)
    total = PRODUCERS * REQUESTS_PER_PRODUCER * EVENTS_PER_REQUEST
    progress(f"drain: {PRODUCERS} producers x {REQUESTS_PER_PRODUCER} requests x {EVENTS_PER_REQUEST} events, "
             f"{repetitions} repetitions")
    ours, reference = [], []
    for rep in range(repetitions):
        elapsed, delivered = _drain_once(config)
        if delivered != total:
            raise RuntimeError(f"drained {delivered} records, expected {total}")
        ours.append(delivered / elapsed)
        reference.append(_reference_rate(200_000))
        progress(f"  repetition {rep + 1}: ours {ours[-1]:,.0f} events/s, reference {reference[-1]:,.0f} events/s")
    events_per_s = statistics.median(ours)
    reference_per_s = statistics.median(reference)
    return {
        "benchmark": "drain",
        "events_per_repetition": total,
        "repetitions": repetitions,
        "events_per_s": round(events_per_s),
        "reference_events_per_s": round(reference_per_s),
        "ratio": round(events_per_s / reference_per_s, 2),
        "target_events_per_s": TARGET_EVENTS_PER_S,
        "target_ratio": TARGET_RATIO,
        "targets_met": {"events_per_s": events_per_s >= TARGET_EVENTS_PER_S,
                        "ratio": events_per_s / reference_per_s >= TARGET_RATIO},
        "samples": {"events_per_s": [round(x) for x in ours], "reference_events_per_s": [round(x) for x in reference]},
    }
