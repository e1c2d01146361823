"""OTLP metrics over the wire: ``bin/start-cache --demo`` pushing to receivers in the test process.

The receivers (tests/support/otlp_receiver.py, on 127.0.0.1, port 0): opentelemetry-proto's ``MetricsService``
over gRPC, and ``POST /v1/metrics`` over HTTP.  Each keeps every ``ExportMetricsServiceRequest`` it decodes,
so the assertions are on what actually went over the wire.
"""

from __future__ import annotations

import csv
import os
import socket

import pytest
from opentelemetry.proto.metrics.v1 import metrics_pb2
from support.otlp_receiver import OtlpReceiver
from support.service import REPO

from mpcache.telemetry import metric_table

pytestmark = pytest.mark.slow

TSV = os.path.join(REPO, "spec", "metrics.tsv")  # the specification's table
INSTANCE_ID = "otlp-e2e-instance"
WAIT_S = 45.0
# OTel names of metrics.tsv that the demo cannot make move; every other row must go over the wire.
# (Observable gauges that report only adapters with work in flight are waited for: over a 1 s export
# interval with two L2 tiers busy they are caught non-empty.)
NOT_PRODUCED_BY_DEMO: frozenset[str] = frozenset()
CUMULATIVE = metrics_pb2.AggregationTemporality.AGGREGATION_TEMPORALITY_CUMULATIVE


def tsv_rows() -> list[dict[str, str]]:
    """metrics.tsv's rows as dicts (otel_name, prometheus_name, instrument, ...)."""
    with open(TSV, newline="") as f:
        return list(csv.DictReader(f, delimiter="\t"))


def expected_names() -> set[str]:
    return {row["otel_name"] for row in tsv_rows()} - NOT_PRODUCED_BY_DEMO


def demo_flags(tmp_path, endpoint: str | None = None, protocol: str | None = None) -> list[str]:
    """The demo with two L2 tiers; OTLP flags only when given (else the OTEL_* environment decides)."""
    fs = '{"type": "fs", "path": "%s", "capacity_gb": 0.008}' % (tmp_path / "l2fs")
    mock = '{"type": "mock", "capacity_gb": 0.05, "failure_rate": 0.1, "seed": 3, "latency_ms": 5}'
    otlp = [] if endpoint is None else [
        "--otlp-endpoint", endpoint, "--otlp-protocol", protocol, "--otlp-interval", "1"]
    return ["--demo", "--workers", "2", "--duration", "60", "--instance-id", INSTANCE_ID, *otlp,
            "--metrics-sample-rate", "0.2", "--l2", fs, "--l2", mock]


def points_key(point) -> tuple:
    return tuple(sorted((kv.key, kv.value.string_value or str(kv.value.int_value)) for kv in point.attributes))


def check_wire_format(collected: OtlpReceiver, resource: dict[str, str] | None = None) -> None:
    """Resource, counter and histogram shape of everything received (see the test docstrings)."""
    specs = {row["otel_name"]: row for row in tsv_rows()}
    received = collected.metrics()
    expected_resource = resource or {"service.instance.id": INSTANCE_ID, "service.name": "mpcache",
                                     "host.name": socket.gethostname()}
    assert {tuple(sorted(expected_resource.items()))} == {tuple(sorted(r.items())) for r, _ in received}

    bad_counters, went_down, bad_histograms = [], [], []
    last: dict[tuple, float] = {}
    checked: dict[str, set[str]] = {"counter": set(), "histogram": set()}
    for _, metric in received:
        spec = specs.get(metric.name)
        if spec is None:
            continue
        if spec["instrument"] in ("counter", "observable_counter"):
            checked["counter"].add(metric.name)
            if (metric.WhichOneof("data"), metric.sum.is_monotonic,
                    metric.sum.aggregation_temporality) != ("sum", True, CUMULATIVE):
                bad_counters.append(metric.name)
                continue
            for point in metric.sum.data_points:
                value = point.as_double if point.HasField("as_double") else point.as_int
                key = (metric.name, points_key(point))
                if value < last.get(key, 0):
                    went_down.append((key, last[key], value))
                last[key] = value
        elif spec["instrument"] == "histogram":
            checked["histogram"].add(metric.name)
            bounds = tuple(metric_table.BY_NAME[metric.name].buckets)
            if (metric.WhichOneof("data"), metric.histogram.aggregation_temporality) != ("histogram", CUMULATIVE):
                bad_histograms.append(metric.name)
            bad_histograms += [(metric.name, tuple(p.explicit_bounds)) for p in metric.histogram.data_points
                               if tuple(p.explicit_bounds) != bounds or len(p.bucket_counts) != len(bounds) + 1]
    assert ([], [], []) == (bad_counters, went_down, bad_histograms)
    kinds = {"counter": "counter", "observable_counter": "counter", "histogram": "histogram"}
    expected = {"counter": set(), "histogram": set()}
    for name, spec in specs.items():
        if spec["instrument"] in kinds and name not in NOT_PRODUCED_BY_DEMO:
            expected[kinds[spec["instrument"]]].add(name)
    assert expected == checked  # nothing above passed vacuously


def test_every_demo_metric_goes_over_otlp_grpc_with_resource_and_shapes(start_service, otlp_receiver, tmp_path):
    """Pushing to an OTLP/gRPC receiver every second, the demo (fs + mock L2) sends every OTel metric of
    metrics.tsv (none exempted), every ResourceMetrics carries service.instance.id = --instance-id and host.name,
    every counter is a monotonic cumulative Sum whose per-attribute values never go down between
    exports, and every histogram carries its metric_table's explicit bucket bounds."""
    collected = otlp_receiver("grpc")
    service = start_service(*demo_flags(tmp_path, collected.endpoint, "grpc"))
    expected = expected_names()
    collected.wait(lambda got: expected <= got.names(), WAIT_S)
    received = collected.names()
    assert set() == expected - received
    assert 0 == service.stop()
    check_wire_format(collected)
    assert 3 <= len(collected.requests)


def test_otel_environment_alone_exports_over_http_protobuf_with_its_resource(start_service, otlp_receiver, tmp_path,
                                                                            monkeypatch):
    """With only OTEL_EXPORTER_OTLP_ENDPOINT (a bare http://host:port), OTEL_EXPORTER_OTLP_PROTOCOL=http/protobuf,
    OTEL_METRIC_EXPORT_INTERVAL, OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES set and no OTLP flag, exports
    are protobuf POSTs to /v1/metrics carrying every OTel metric of metrics.tsv under that resource (and
    service.instance.id = --instance-id), cumulative monotonic counters and the explicit bucket bounds."""
    collected = otlp_receiver("http")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collected.endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "http/protobuf")
    monkeypatch.setenv("OTEL_METRIC_EXPORT_INTERVAL", "1000")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "kv-cache-staging")
    monkeypatch.setenv("OTEL_RESOURCE_ATTRIBUTES", "deployment.environment=staging,k8s.cluster.name=eu-1")
    service = start_service(*demo_flags(tmp_path))
    expected = expected_names()
    collected.wait(lambda got: expected <= got.names(), WAIT_S)
    received = collected.names()
    assert set() == expected - received
    assert 0 == service.stop()
    assert {("/v1/metrics", "application/x-protobuf")} == set(collected.seen)
    check_wire_format(collected, {"service.instance.id": INSTANCE_ID, "service.name": "kv-cache-staging",
                                  "deployment.environment": "staging", "k8s.cluster.name": "eu-1",
                                  "host.name": socket.gethostname()})
