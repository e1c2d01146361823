"""Producer cost of publishing one typical event, three ways in one run: the ring, an in-process bus with
a drain thread, and ``multiprocessing.Queue``, against the Python floor of one ``pack_into``.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
import uuid
from collections.abc import Callable
from typing import Any

from benchmarks.reference import InProcessBus, RefEvent
from mpcache.contract.events import EventType
from mpcache.shm import layout
from mpcache.shm.intern import Interner
from mpcache.shm.publish import Publisher
from mpcache.shm.ring import COMPILED_PUBLISH, RingWriter, format_event_segment
from mpcache.shm.ring_reader import RingReader, read_counters
from mpcache.shm.segment import Segment, shm_name

_L1_WRITE_FINISHED = EventType.L1_WRITE_FINISHED
EVENTS_PER_REPETITION = 100_000
TARGET_RING_NS = 400
TARGET_VS_INPROCESS = 3.0
TARGET_VS_MP_QUEUE = 10.0


def _drain(reader: RingReader) -> None:
    while reader.read_batch().size:
        pass


def _ring_ns(n: int, repetitions: int) -> dict[str, list[float]]:
    """ns per event for each way of publishing into a ring, one sample per repetition each."""
    capacity = 1 << 18
    name = shm_name(os.getpid(), uuid.uuid4().hex, "bench")
    segment = Segment.create(name, layout.event_segment_size(capacity, 64))
    try:
        format_event_segment(segment, capacity, 64)
        publisher = Publisher(RingWriter(segment), Interner(segment.buf, 64))
        reader = RingReader(segment)
        emit = publisher.salted_emitter(_L1_WRITE_FINISHED)
        record = publisher._one_cell[_L1_WRITE_FINISHED]
        emit_salted = publisher.emit_salted
        salt, model = publisher.name_id("tenant-a"), publisher.name_id("llama-3-8b")
        # The floor writes the same bytes into a private buffer of the same size, so the ring stays valid.
        buf, cells = memoryview(bytearray(segment.size)), layout.cells_offset(64)
        words = buf[: layout.HEADER_SIZE].cast("Q")
        clock = time.time_ns
        samples: dict[str, list[float]] = {"ring": [], "ring_by_name": [], "floor": []}
        for _ in range(repetitions):
            start = time.perf_counter_ns()
            for i in range(n):
                record.pack_into(buf, cells + ((i & (capacity - 1)) << 6), i, 1, 4, 1, clock(), salt, model, 16)
                words[8] = i
            samples["floor"].append((time.perf_counter_ns() - start) / n)
            _drain(reader)
            start = time.perf_counter_ns()
            for _ in range(n):
                emit(salt, model, 16)
            samples["ring"].append((time.perf_counter_ns() - start) / n)
            _drain(reader)
            start = time.perf_counter_ns()
            for _ in range(n):
                emit_salted(_L1_WRITE_FINISHED, "tenant-a", "llama-3-8b", 16)
            samples["ring_by_name"].append((time.perf_counter_ns() - start) / n)
        _drain(reader)
        if read_counters(segment).dropped:
            raise RuntimeError("the ring overflowed during the benchmark: the numbers would include drops")
        return samples
    finally:
        segment.close()
        Segment.unlink(name)


def _inprocess_ns(n: int, repetitions: int) -> tuple[list[float], int]:
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    provider = MeterProvider(metric_readers=[InMemoryMetricReader()])
    counter = provider.get_meter("bench").create_counter("lmcache_mp.l1_write", unit="chunks")

    def handle(event: RefEvent) -> None:
        for salt, count in event.metadata["key_count_per_salt"].items():
            counter.add(count, {"cache_salt": salt})

    bus = InProcessBus(handle)
    samples = []
    try:
        for _ in range(repetitions):
            start = time.perf_counter_ns()
            for _ in range(n):
                bus.publish(RefEvent(_L1_WRITE_FINISHED, metadata={"key_count_per_salt": {"tenant-a": 16}}))
            samples.append((time.perf_counter_ns() - start) / n)
            deadline = time.monotonic() + 60
            while bus.pending() and time.monotonic() < deadline:
                time.sleep(0.01)
    finally:
        bus.close()
        provider.shutdown()
    return samples, bus.dropped


def _consume(queue: multiprocessing.Queue, done: multiprocessing.Queue, n: int, repetitions: int) -> None:
    for _ in range(repetitions):
        for _ in range(n):
            queue.get()
        done.put(n)


def _mp_queue_ns(n: int, repetitions: int) -> list[float]:
    ctx = multiprocessing.get_context("spawn")
    queue: multiprocessing.Queue = ctx.Queue()
    done: multiprocessing.Queue = ctx.Queue()
    consumer = ctx.Process(target=_consume, args=(queue, done, n, repetitions), daemon=True)
    consumer.start()
    samples = []
    try:
        for _ in range(repetitions):
            start = time.perf_counter_ns()
            for _ in range(n):
                queue.put((int(_L1_WRITE_FINISHED), time.time_ns(), "tenant-a", "llama-3-8b", 16))
            done.get(timeout=120)
            samples.append((time.perf_counter_ns() - start) / n)
    finally:
        consumer.join(timeout=10)
        if consumer.is_alive():
            consumer.kill()
    return samples


def run(repetitions: int = 5, progress: Callable[[str], None] = lambda _: None,
        events: int = EVENTS_PER_REPETITION) -> dict[str, Any]:
    repetitions = max(5, repetitions)
    progress(f"publish: {events} events x {repetitions} repetitions per way")
    samples = _ring_ns(events, repetitions)
    ring = samples["ring"]
    path = "compiled" if COMPILED_PUBLISH else "python"
    progress(f"  ring          median {statistics.median(ring):8.0f} ns/event ({path} writer; by name "
             f"{statistics.median(samples['ring_by_name']):.0f}; "
             f"Python floor {statistics.median(samples['floor']):.0f})")
    inprocess, dropped = _inprocess_ns(events, repetitions)
    progress(f"  in-process    median {statistics.median(inprocess):8.0f} ns/event "
             f"({dropped} dropped by its bounded queue)")
    mp_queue = _mp_queue_ns(events // 4, repetitions)
    progress(f"  mp.Queue      median {statistics.median(mp_queue):8.0f} ns/event")
    ring_ns = statistics.median(ring)
    inprocess_ns = statistics.median(inprocess)
    mp_queue_ns = statistics.median(mp_queue)
    return {
        "benchmark": "publish",
        "event": "L1_WRITE_FINISHED, one cache_salt group",
        "events_per_repetition": events,
        "repetitions": repetitions,
        "publish_path": path,
        "ring_ns": round(ring_ns, 1),
        "ring_by_name_ns": round(statistics.median(samples["ring_by_name"]), 1),
        "floor_ns": round(statistics.median(samples["floor"]), 1),
        "inprocess_bus_ns": round(inprocess_ns, 1),
        "mp_queue_ns": round(mp_queue_ns, 1),
        "inprocess_bus_dropped": dropped,
        "ratio_inprocess_over_ring": round(inprocess_ns / ring_ns, 2),
        "ratio_mp_queue_over_ring": round(mp_queue_ns / ring_ns, 2),
        "target_ring_ns": TARGET_RING_NS,
        "target_ratio_inprocess": TARGET_VS_INPROCESS,
        "target_ratio_mp_queue": TARGET_VS_MP_QUEUE,
        "targets_met": {
            "ring_ns": ring_ns <= TARGET_RING_NS,
            "ratio_inprocess": inprocess_ns / ring_ns >= TARGET_VS_INPROCESS,
            "ratio_mp_queue": mp_queue_ns / ring_ns >= TARGET_VS_MP_QUEUE,
        },
        "samples_ns": {**{way: [round(s) for s in values] for way, values in samples.items() if way != "floor"},
                       "inprocess_bus": [round(s) for s in inprocess], "mp_queue": [round(s) for s in mp_queue]},
    }
