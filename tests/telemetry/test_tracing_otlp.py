"""Tracing over the wire: spans exported by the real OTLP/gRPC exporter, decoded by a receiver in the test.

The receiver (tests/support/otlp_receiver.py) is a grpc server on 127.0.0.1 (port 0) implementing
opentelemetry-proto's ``TraceService``; it keeps every ``ExportTraceServiceRequest`` it gets, so the
assertions are on what actually went over the wire.
"""

from __future__ import annotations

import socket
from dataclasses import replace

from mpcache.contract.events import EventType as E
from mpcache.telemetry.subscribers.tracing import build_tracing_subscribers
from mpcache.telemetry.tracing import TracingExport

T0 = 1_700_000_000 * 10**9
MS = 10**6
WAIT_S = 10.0


def test_spans_reach_a_real_otlp_grpc_receiver_with_ids_times_and_resource(config, pipeline, otlp_receiver):
    """A request with a store, exported through the BatchSpanProcessor and the OTLP/gRPC exporter, arrives
    as a ``request`` root and an ``mp.store`` child of the same trace: parent id = the root's span id,
    start/end exactly the event timestamps, and the Resource carrying service.name, host.name and
    service.instance.id."""
    servicer = otlp_receiver("grpc", "traces")
    export = TracingExport.start(replace(config, enable_tracing=True, otlp_endpoint=servicer.endpoint,
                                         otlp_protocol="grpc"))
    try:
        pipeline.subscribe(*build_tracing_subscribers(config, export.tracer_provider))
        publish = pipeline.publish
        publish(E.MP_REQUEST_START, session_id="req-7", timestamp_ns=T0)
        publish(E.MP_STORE_SUBMITTED, ("cpu",), session_id="req-7", timestamp_ns=T0 + 1 * MS)
        publish(E.MP_STORE_START, ("cpu", 3, "llama"), session_id="req-7", timestamp_ns=T0 + 2 * MS)
        publish(E.MP_STORE_END, ("cpu", 3, "llama", 4, 4 * 4096, 1024), session_id="req-7",
                timestamp_ns=T0 + 12 * MS)
        publish(E.MP_REQUEST_END, session_id="req-7", timestamp_ns=T0 + 20 * MS)
        pipeline.deliver()
        assert export.force_flush()
        servicer.wait(lambda got: len(got.spans()) >= 2, WAIT_S)
        received = servicer.spans()
    finally:
        export.shutdown()
    by_name = {span.name: (resource, span) for resource, span in received}
    assert ["mp.store", "request"] == sorted(span.name for _, span in received)
    resource, root = by_name["request"]
    _, child = by_name["mp.store"]
    assert ({"service.name": "mpcache", "host.name": socket.gethostname(), "service.instance.id": "test-instance"},
            b"") == (resource, root.parent_span_id)
    assert (root.trace_id, root.span_id, T0 + 2 * MS, T0 + 12 * MS) == (
        child.trace_id, child.parent_span_id, child.start_time_unix_nano, child.end_time_unix_nano)
    assert (T0, T0 + 20 * MS, 8, 16) == (root.start_time_unix_nano, root.end_time_unix_nano, len(root.span_id),
                                         len(root.trace_id))
    stored = {kv.key: kv.value for kv in child.attributes}
    assert (4, "cpu", 3) == (stored["stored_count"].int_value, stored["device"].string_value,
                             stored["engine_id"].int_value)
