"""OpenTelemetry set-up of the telemetry process: one MeterProvider, two ways out.

* Prometheus pull: a ``PrometheusMetricReader`` registered in its own
  ``CollectorRegistry`` (never prometheus_client's global one, so nothing else
  in the process leaks into ``/metrics`` and tests can run side by side),
  served by prometheus_client's HTTP server on
  ``config.prometheus_host:config.prometheus_port``.  Port 0 binds a free
  port; :attr:`MetricsExport.prometheus_port` is the port actually bound.
* OTLP push (gRPC or HTTP per ``config.otlp_protocol``) every
  ``config.otlp_interval_s`` when ``config.otlp_endpoint`` is set.

Both run at once when an endpoint is given.  The provider is not installed
globally: subscribers receive it explicitly.  Instruments are created from
:mod:`mpcache.telemetry.metric_table` by :func:`create_instrument`, so name,
unit, description and bucket boundaries live in one place.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit
from wsgiref.simple_server import WSGIServer

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricExporter,
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import Resource
from prometheus_client import CollectorRegistry, start_http_server

from mpcache.config import Config
from mpcache.telemetry import metric_table
from mpcache.telemetry.buffered import MeterLike

SERVICE_NAME = "mpcache"
HTTP_METRICS_PATH = "/v1/metrics"
_SHUTDOWN_TIMEOUT_MS = 10_000

ObservableCallback = Callable[[CallbackOptions], Iterable[Observation]]


@dataclass
class MetricsExport:
    """The MeterProvider and its ways out; :meth:`start` builds it, :meth:`shutdown` takes it all down."""

    meter_provider: MeterProvider
    registry: CollectorRegistry
    prometheus_host: str
    prometheus_port: int  # the port actually bound (config port 0 → a free one)
    otlp_reader: PeriodicExportingMetricReader | None
    _http_server: WSGIServer
    _http_thread: threading.Thread

    @classmethod
    def start(cls, config: Config) -> MetricsExport:
        """Build the MeterProvider with its readers and start serving ``/metrics``."""
        registry = CollectorRegistry(auto_describe=True)
        # No otel_scope_* labels: every series carries exactly the attributes metrics.tsv lists.
        readers: list[MetricReader] = [PrometheusMetricReader(registry=registry, scope_info_enabled=False)]
        otlp_reader = None
        if config.otlp_endpoint:
            otlp_reader = PeriodicExportingMetricReader(
                build_otlp_exporter(config),
                export_interval_millis=config.otlp_interval_s * 1000,
                export_timeout_millis=min(10.0, config.otlp_interval_s) * 1000,
            )
            readers.append(otlp_reader)
        provider = MeterProvider(resource=build_resource(config), metric_readers=readers)
        try:
            server, thread = start_http_server(config.prometheus_port, addr=config.prometheus_host, registry=registry)
        except BaseException:
            provider.shutdown()
            raise
        return cls(provider, registry, config.prometheus_host, server.server_port, otlp_reader, server, thread)

    @property
    def metrics_url(self) -> str:
        host = f"[{self.prometheus_host}]" if ":" in self.prometheus_host else self.prometheus_host
        return f"http://{host}:{self.prometheus_port}/metrics"

    def shutdown(self) -> None:
        """Final collection and OTLP export, then stop serving ``/metrics``."""
        try:
            self.meter_provider.shutdown(timeout_millis=_SHUTDOWN_TIMEOUT_MS)
        finally:
            self._http_server.shutdown()
            self._http_server.server_close()
            self._http_thread.join(timeout=5)


def build_resource(config: Config) -> Resource:
    """Only the two attributes mpcache promises; built directly so that no
    ``OTEL_*`` environment variable changes them behind the configuration."""
    return Resource({"service.name": SERVICE_NAME, "service.instance.id": config.instance_id})


def build_otlp_exporter(config: Config) -> MetricExporter:
    """The OTLP metric exporter for ``config.otlp_protocol`` and ``config.otlp_endpoint``.

    gRPC takes ``host:port`` or ``http(s)://host:port`` (plain text unless
    https).  HTTP takes a URL; a bare ``http://host:4318`` gets the standard
    ``/v1/metrics`` path.
    """
    endpoint = config.otlp_endpoint
    timeout_s = min(10.0, config.otlp_interval_s)
    if config.otlp_protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import (
            OTLPMetricExporter as GrpcExporter,
        )

        return GrpcExporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"), timeout=timeout_s)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import (
        OTLPMetricExporter as HttpExporter,
    )

    if urlsplit(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + HTTP_METRICS_PATH
    return HttpExporter(endpoint=endpoint, timeout=timeout_s)


def create_instrument(meter: MeterLike, otel_name: str, callbacks: Iterable[ObservableCallback] = ()) -> Any:
    """The instrument described by ``otel_name``'s row of the metric table.

    Observable instruments need ``callbacks``; the others must not get any.  The
    result is typed ``Any``: which instrument it is (a :class:`CounterLike`, a
    :class:`HistogramLike` or an observable one) follows the row, at run time.
    """
    spec = metric_table.BY_NAME[otel_name]
    common = {"name": spec.otel_name, "unit": spec.unit, "description": spec.meaning}
    callbacks = list(callbacks)
    observable = spec.instrument in (metric_table.OBSERVABLE_GAUGE, metric_table.OBSERVABLE_COUNTER)
    if observable != bool(callbacks):
        raise ValueError(f"{otel_name} is a {spec.instrument}: callbacks {'required' if observable else 'not allowed'}")
    if spec.instrument == metric_table.COUNTER:
        return meter.create_counter(**common)
    if spec.instrument == metric_table.HISTOGRAM:
        return meter.create_histogram(**common, explicit_bucket_boundaries_advisory=list(spec.buckets or ()))
    if spec.instrument == metric_table.OBSERVABLE_GAUGE:
        return meter.create_observable_gauge(**common, callbacks=callbacks)
    return meter.create_observable_counter(**common, callbacks=callbacks)
