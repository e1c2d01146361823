"""Shutdown order and the final drain.

On SIGTERM the supervisor stops the cache processes first and the telemetry process last, so that
telemetry drains what the cache processes published up to their exit and exports it a final time.  The
final export is an OTLP push (``MetricsExport.shutdown``), received here by a MetricsService on a free
port; with ``--otlp-interval 3600`` it is the only export, so everything asserted went over the wire at
shutdown.
"""

from __future__ import annotations

import json
import signal
import threading
from concurrent import futures

import grpc
import numpy as np
import pytest
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from service_control import CHUNK, SMALL

from mpcache.client import CacheClient

pytestmark = pytest.mark.slow

MODEL = "org/drain-model"
L2_LATENCY_MS = 3000  # every mock L2 store task sleeps this long: still in flight at SIGTERM


class Receiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    """Keeps every ExportMetricsServiceRequest it is sent."""

    def __init__(self) -> None:
        self.requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self._lock = threading.Lock()

    def Export(self, request, context):
        with self._lock:
            self.requests.append(request)
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def values(self, request, name: str) -> dict[tuple, float]:
        """``name``'s Sum data points in ``request``: {sorted attribute items: value}."""
        out = {}
        for resource_metrics in request.resource_metrics:
            for scope_metrics in resource_metrics.scope_metrics:
                for metric in scope_metrics.metrics:
                    if metric.name == name:
                        for point in metric.sum.data_points:
                            key = tuple(sorted((kv.key, kv.value.string_value) for kv in point.attributes))
                            out[key] = point.as_double if point.HasField("as_double") else point.as_int
        return out


@pytest.fixture
def receiver():
    received = Receiver()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(received, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    yield received, f"127.0.0.1:{port}"
    server.stop(grace=None)


def test_events_published_up_to_the_cache_processes_exit_reach_the_final_otlp_export(controlled_services, receiver):
    """A client stores 3 requests of 4 chunks (one cache_salt each) and SIGTERM follows at once, while
    the 3 L2 store tasks those stores submitted are still in flight (a mock tier sleeping 3 s per task:
    /metrics shows them in flight and none completed at that moment).  The cache process finishes them
    while it stops, publishing their L2_STORE_COMPLETED events after the SIGTERM; the supervisor exits 0,
    and the one OTLP export — the final one — counts every chunk the client was told was stored
    (``lmcache_mp.l1_write`` per cache_salt = the ``stored_count`` replies) and every L2 task
    (3 submitted, 3 completed, 12 chunks completed).  The log shows the order: the cache process exited
    before the telemetry process, which reported no dropped events.

    Stopping telemetry before the cache processes fails this test: telemetry would export before the
    completions were published, with ``lmcache_mp.l2_store_completed`` missing."""
    received, endpoint = receiver
    mock = json.dumps({"type": "mock", "capacity_gb": 0.01, "latency_ms": L2_LATENCY_MS})
    service = controlled_services("--workers", "1", *SMALL, "--l2", mock, "--otlp-endpoint", endpoint,
                       "--otlp-interval", "3600")
    service.ready(1)
    salts = ("drain-a", "drain-b", "drain-c")
    stored = {}
    with CacheClient(service.socket(0)) as client:
        kv = client.register_buffer(4, CHUNK)
        kv.blocks[:] = np.random.default_rng(1).integers(0, 256, kv.blocks.shape)
        for n, salt in enumerate(salts):
            stored[salt] = float(client.store(kv, request_id=f"drain-{n}", model_name=MODEL, cache_salt=salt,
                                              chunk_hashes=[100 + 4 * n + i for i in range(4)],
                                              block_ids=[0, 1, 2, 3]).stored)
        del kv
    at_sigterm = service.scrape()
    service.process.send_signal(signal.SIGTERM)
    status = service.process.wait(60)

    assert {salt: 4.0 for salt in salts} == stored
    # the L2 work was still in flight when SIGTERM was sent: only the final drain can deliver its completion
    assert 3.0 == at_sigterm.total("lmcache_mp_num_inflight_l2_stores")
    assert 0.0 == at_sigterm.total("lmcache_mp_l2_store_completed_requests_total")
    assert 0 == status
    assert 1 == len(received.requests), "with --otlp-interval 3600 only the final export is sent"
    [final] = received.requests
    assert {(("cache_salt", s),): v for s, v in stored.items()} == received.values(final, "lmcache_mp.l1_write")
    assert 3 == sum(received.values(final, "lmcache_mp.l2_store_submitted").values())
    assert {(("l2_name", "mock"),): 3} == received.values(final, "lmcache_mp.l2_store_completed")
    assert 12 == sum(received.values(final, "lmcache_mp.l2_store_completed_objects").values())
    exits = [(line["child_role"], line["exit_status"]) for line in service.lines("child.exited")]
    assert [("cache", 0), ("telemetry", 0)] == exits
    assert [0] == [line["dropped_events"] for line in service.lines("telemetry.stopped")]
    assert [] == service.shm_entries()
