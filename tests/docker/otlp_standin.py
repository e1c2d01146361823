"""A stand-in for the OpenTelemetry Collector of compose.yaml where its image cannot be pulled: it accepts
OTLP/gRPC exports of metrics and spans on 0.0.0.0:4317 (the command line's --config words are ignored)
and serves what it received on 0.0.0.0:8889/metrics as two counters of data points and spans, so a test
can see that mpcache's push arrived.  Built by tests/docker/Dockerfile.otlp-standin FROM mpcache's image,
whose venv has grpcio and opentelemetry-proto.
"""

from __future__ import annotations

import threading
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

counts = {"otlp_metric_points_received_total": 0, "otlp_spans_received_total": 0}
lock = threading.Lock()


def _add(name: str, amount: int) -> None:
    with lock:
        counts[name] += amount


class Metrics(metrics_service_pb2_grpc.MetricsServiceServicer):
    def Export(self, request, context):
        points = 0
        for resource in request.resource_metrics:
            for scope in resource.scope_metrics:
                for metric in scope.metrics:
                    kind = metric.WhichOneof("data")
                    points += len(getattr(metric, kind).data_points) if kind else 0
        _add("otlp_metric_points_received_total", points)
        return metrics_service_pb2.ExportMetricsServiceResponse()


class Traces(trace_service_pb2_grpc.TraceServiceServicer):
    def Export(self, request, context):
        _add("otlp_spans_received_total", sum(len(scope.spans) for resource in request.resource_spans
                                               for scope in resource.scope_spans))
        return trace_service_pb2.ExportTraceServiceResponse()


class Page(BaseHTTPRequestHandler):
    def do_GET(self):
        with lock:
            body = "".join(f"{name} {value}\n" for name, value in counts.items()).encode()
        self.send_response(200 if self.path == "/metrics" else 404)
        self.send_header("Content-Type", "text/plain; version=0.0.4")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def main() -> None:
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(Metrics(), server)
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Traces(), server)
    server.add_insecure_port("0.0.0.0:4317")
    server.start()
    print("otlp stand-in: OTLP/gRPC on 0.0.0.0:4317, counts on 0.0.0.0:8889/metrics", flush=True)
    ThreadingHTTPServer(("0.0.0.0", 8889), Page).serve_forever()


if __name__ == "__main__":
    main()
