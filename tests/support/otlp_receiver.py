"""An OTLP receiver in the test process: metrics over gRPC or HTTP, traces over gRPC, on 127.0.0.1:<port 0>.

It keeps every export request it decodes, so the assertions are on what actually went over the wire, and
lets a test block on a condition over them with a deadline (a ``threading.Condition``, no polling).
"""

from __future__ import annotations

import gzip
import http.server
import threading
import time
from collections.abc import Callable
from concurrent import futures
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.metrics.v1 import metrics_pb2


class OtlpReceiver:
    """``OtlpReceiver("grpc" | "http", signal="metrics" | "traces")``; :attr:`endpoint` is what the exporter
    is given (``host:port`` for gRPC, ``http://host:port`` for HTTP); :meth:`close` stops it."""

    def __init__(self, protocol: str = "grpc", signal: str = "metrics") -> None:
        if (protocol, signal) not in {("grpc", "metrics"), ("http", "metrics"), ("grpc", "traces")}:
            raise ValueError(f"no OTLP receiver for {signal} over {protocol}")
        self.protocol, self.signal = protocol, signal
        self.requests: list[Any] = []
        self.seen: list[tuple[str, str]] = []  # (path, content-type) of every HTTP POST
        self._changed = threading.Condition()
        self._close: Callable[[], None]
        if protocol == "grpc":
            self._serve_grpc()
        else:
            self._serve_http()

    def _serve_grpc(self) -> None:
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        receiver = self
        if self.signal == "metrics":
            class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
                def Export(self, request, context):  # the gRPC method name
                    receiver._add(request)
                    return metrics_service_pb2.ExportMetricsServiceResponse()

            metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
        else:
            class Traces(trace_service_pb2_grpc.TraceServiceServicer):
                def Export(self, request, context):  # the gRPC method name
                    receiver._add(request)
                    return trace_service_pb2.ExportTraceServiceResponse()

            trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        self.endpoint = f"127.0.0.1:{port}"
        self._close = lambda: server.stop(grace=None)

    def _serve_http(self) -> None:
        receiver = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # http.server's method name
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                if self.headers.get("Content-Encoding") == "gzip":
                    body = gzip.decompress(body)
                with receiver._changed:
                    receiver.seen.append((self.path, self.headers.get("Content-Type", "")))
                receiver._add(metrics_service_pb2.ExportMetricsServiceRequest.FromString(body))
                reply = metrics_service_pb2.ExportMetricsServiceResponse().SerializeToString()
                self.send_response(200)
                self.send_header("Content-Type", "application/x-protobuf")
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, *args) -> None:  # quiet
                pass

        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        thread = threading.Thread(target=server.serve_forever, daemon=True)
        thread.start()
        self.endpoint = f"http://127.0.0.1:{server.server_address[1]}"

        def close() -> None:
            server.shutdown()
            server.server_close()
            thread.join(5)

        self._close = close

    def close(self) -> None:
        self._close()

    def _add(self, request: Any) -> None:
        with self._changed:
            self.requests.append(request)
            self._changed.notify_all()

    # -- what arrived ---------------------------------------------------------------------------------

    def received(self) -> list[Any]:
        with self._changed:
            return list(self.requests)

    def metrics(self) -> list[tuple[dict[str, str], metrics_pb2.Metric]]:
        """(resource attributes, metric) for every metric of every request, in arrival order."""
        out = []
        for request in self.received():
            for resource_metrics in request.resource_metrics:
                resource = {kv.key: kv.value.string_value for kv in resource_metrics.resource.attributes}
                for scope_metrics in resource_metrics.scope_metrics:
                    out.extend((resource, metric) for metric in scope_metrics.metrics)
        return out

    def names(self) -> set[str]:
        return {metric.name for _, metric in self.metrics()}

    def spans(self) -> list[tuple[dict[str, str], Any]]:
        """(resource attributes, span) for every span received so far."""
        out = []
        for request in self.received():
            for resource_spans in request.resource_spans:
                resource = {kv.key: kv.value.string_value for kv in resource_spans.resource.attributes}
                for scope_spans in resource_spans.scope_spans:
                    out.extend((resource, span) for span in scope_spans.spans)
        return out

    def wait(self, condition: Callable[[OtlpReceiver], bool], timeout_s: float) -> bool:
        """Block until ``condition(self)`` holds (re-checked at each arrival) or ``timeout_s`` passed; whether
        it held.  The caller asserts on what arrived, so a failure shows it."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while not condition(self):
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._changed.wait(left)
            return True
