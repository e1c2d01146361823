"""``/metrics`` scrape time with 1,000 distinct cache_salt values and 4 L2 adapters, through a real ring,
the real subscribers and the real Prometheus endpoint.
"""

from __future__ import annotations

import os
import statistics
import time
import urllib.request
import uuid
from collections.abc import Callable
from typing import Any

from mpcache.config import Config
from mpcache.contract.events import EventType as E
from mpcache.shm import layout
from mpcache.shm.intern import Interner
from mpcache.shm.publish import Publisher
from mpcache.shm.ring import RingWriter, format_event_segment
from mpcache.shm.segment import Segment

SALTS = 1000
ADAPTERS = ({"type": "fs"}, {"type": "mock"}, {"type": "redis"}, {"type": "mock"})
MODELS = ("llama-3-8b", "qwen-2-7b")


def _publish(publisher: Publisher) -> None:
    for i in range(SALTS):
        salt, model = f"tenant-{i:04d}", MODELS[i % 2]
        publisher.emit_salted(E.L1_WRITE_FINISHED, salt, model, 8)
        publisher.emit_salted(E.L1_READ_FINISHED, salt, model, 4)
        publisher.emit_salted(E.L1_KEYS_EVICTED, salt, model, 2)
        publisher.emit(E.SM_WRITE_FINISHED, (0,), salt_counts={(salt, model): 8})
        publisher.emit(E.MP_LOOKUP_PREFETCH_END, (model, salt, 4, 2048, 1024, 768, 256, ""), session_id=f"r{i}")
        publisher.emit(E.MP_RETRIEVE_END, ("cpu", 0, model, salt, 4, 4 << 16, 1024), session_id=f"r{i}")
        for index, spec in enumerate(ADAPTERS):
            publisher.emit(E.L2_STORE_SUBMITTED, (index, i, spec["type"], 8, 8 << 16), salt_counts={(salt, model): 8})
            publisher.emit(E.L2_STORE_COMPLETED, (index, i, spec["type"], 8 << 16, 8, 0),
                           salt_counts={(salt, model): 8})
            publisher.emit(E.L2_KEYS_EVICTED, (index, spec["type"], 1), salt_counts={(salt, model): 1})
        publisher.emit(E.L2_PREFETCH_LOAD_COMPLETED, (i, 2, 0), salt_counts={(salt, model): 2})
        publisher.emit(E.L1_ALLOCATION_FAILED, ("l1_store",), salt_counts={(salt, model): 1})


def run(repetitions: int = 3, progress: Callable[[str], None] = lambda _: None) -> dict[str, Any]:
    from mpcache.telemetry.bus import EventBus
    from mpcache.telemetry.otel import MetricsExport
    from mpcache.telemetry.pump import Pump, RingSource
    from mpcache.telemetry.subscribers.metrics import build_metrics_subscribers

    config = Config(instance_id=uuid.uuid4().hex, supervisor_pid=os.getpid(), runtime_dir="/tmp", workers=1,
                    prometheus_port=0, cache_salt_cap=SALTS + 10, l2=[dict(spec) for spec in ADAPTERS],
                    ring_capacity_cells=1 << 18)
    segment = Segment.create(config.ring_name(0), layout.event_segment_size(1 << 18, 4096))
    export = None
    try:
        format_event_segment(segment, 1 << 18, 4096)
        _publish(Publisher(RingWriter(segment), Interner(segment.buf, 4096)))
        export = MetricsExport.start(config)
        bus = EventBus()
        pump = Pump([RingSource.attach(0, config.ring_name(0))], bus)
        build_metrics_subscribers(config, export.meter_provider, pump=pump, bus=bus, gauge_reader=None)
        pump.drain()
        bus.flush()
        url = export.metrics_url
        assert url is not None  # the benchmark config serves /metrics
        samples, size = [], 0
        for _ in range(repetitions * 10):
            start = time.perf_counter()
            with urllib.request.urlopen(url, timeout=60) as response:
                size = len(response.read())
            samples.append(time.perf_counter() - start)
        progress(f"scrape: {SALTS} cache_salts x {len(ADAPTERS)} adapters: "
                 f"median {statistics.median(samples) * 1000:.1f} ms, {size / 1024:.0f} KiB")
    finally:
        if export is not None:
            export.shutdown()
        segment.close()
        Segment.unlink(segment.name)
    return {
        "benchmark": "scrape",
        "cache_salts": SALTS,
        "adapters": len(ADAPTERS),
        "scrapes": len(samples),
        "scrape_s": round(statistics.median(samples), 4),
        "scrape_max_s": round(max(samples), 4),
        "page_bytes": size,
    }
