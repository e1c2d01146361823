"""OpenTelemetry set-up of the telemetry process: one MeterProvider, Prometheus pull in its own registry
and OTLP push; instruments are created from :mod:`mpcache.telemetry.metric_table`.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import structlog
from opentelemetry.exporter.prometheus import PrometheusMetricReader
from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import (
    MetricReader,
    PeriodicExportingMetricReader,
)
from opentelemetry.sdk.resources import HOST_NAME as HOST_NAME_KEY
from opentelemetry.sdk.resources import SERVICE_INSTANCE_ID as SERVICE_INSTANCE_ID_KEY
from opentelemetry.sdk.resources import SERVICE_NAME as SERVICE_NAME_KEY
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from prometheus_client import CollectorRegistry, ProcessCollector

from mpcache import __version__
from mpcache.config import Config
from mpcache.httpserver import BoundedHTTPServer, Route
from mpcache.shm.ring import PUBLISH_PATH
from mpcache.telemetry import metric_table, otlp
from mpcache.telemetry.buffered import MeterLike
from mpcache.telemetry.endpoint import endpoint_url, metrics_route, open_endpoint

SERVICE_NAME = "mpcache"
METER_SERVICE = "mpcache.service"  # the exporter's own instrument (build info), beside the subscribers' meter
_SHUTDOWN_TIMEOUT_MS = 10_000

ObservableCallback = Callable[[CallbackOptions], Iterable[Observation]]


@dataclass
class MetricsExport:
    """The MeterProvider and its ways out; :meth:`start` builds it, :meth:`shutdown` takes it all down."""

    meter_provider: MeterProvider
    registry: CollectorRegistry
    prometheus_host: str
    prometheus_port: int  # the port actually bound (config port 0 → a free one; 0 with no HTTP endpoint)
    otlp_reader: PeriodicExportingMetricReader | None
    _http_server: BoundedHTTPServer | None  # a listener of its own, closed by shutdown()
    _endpoint: BoundedHTTPServer | None  # where /metrics is served (its own or the telemetry process's)
    # called before every collection: each /metrics request's and each OTLP export's (the pump's catch-up)
    before_collect: list[Callable[[], object]]

    @classmethod
    def start(cls, config: Config, endpoint: BoundedHTTPServer | None = None) -> MetricsExport:
        """Build the MeterProvider with its readers and serve ``/metrics``: on ``endpoint``, the telemetry
        process's listener (which it keeps), else on a listener of its own (none with ``config.no_http``)."""
        registry = CollectorRegistry(auto_describe=True)
        ProcessCollector(registry=registry)  # process_* of the telemetry process, Prometheus's convention
        # No otel_scope_* labels: every series carries exactly the attributes metrics.tsv lists.
        readers: list[MetricReader] = []
        if not config.no_http:
            readers.append(PrometheusMetricReader(registry=registry, scope_info_enabled=False))
        otlp_reader = None
        before_collect: list[Callable[[], object]] = []
        if config.otlp_endpoint:
            bound_s = min(otlp.EXPORT_TIMEOUT_S, config.otlp_interval_s)  # an export ends before the next is due
            otlp_reader = PeriodicExportingMetricReader(
                otlp.build_exporter(config, otlp.METRICS, bound_s),
                export_interval_millis=config.otlp_interval_s * 1000,
                export_timeout_millis=bound_s * 1000,
            )
            readers.append(otlp_reader)
        provider = MeterProvider(resource=build_resource(config), metric_readers=readers)
        if otlp_reader is not None:  # its first export comes after an interval (0.1 s at least)
            _catching_up(otlp_reader, before_collect)
        create_instrument(provider.get_meter(METER_SERVICE), "mpcache.build_info",
                          [lambda options: [Observation(1, {"version": __version__, "publish_path": PUBLISH_PATH})]])
        owned = endpoint is None
        if owned:
            try:
                endpoint = open_endpoint(config, structlog.get_logger("mpcache.telemetry"))
            except BaseException:
                provider.shutdown()
                raise
        if endpoint is not None:
            endpoint.routes["/metrics"] = metrics_route(registry, before_collect)
        return cls(provider, registry, config.prometheus_host, endpoint.server_port if endpoint else 0, otlp_reader,
                   endpoint if owned else None, endpoint, before_collect)

    def add_routes(self, routes: dict[str, Route]) -> None:
        """Serve more paths next to ``/metrics``; nothing without an HTTP endpoint."""
        if self._endpoint is not None:
            self._endpoint.routes.update(routes)

    @property
    def metrics_url(self) -> str | None:
        return endpoint_url(self._endpoint, self.prometheus_host)

    def shutdown(self) -> None:
        """Final collection and OTLP export, then close its own listener (if it opened one)."""
        try:
            self.meter_provider.shutdown(timeout_millis=_SHUTDOWN_TIMEOUT_MS)
        finally:
            if self._http_server is not None:
                self._http_server.close()


def _catching_up(reader: MetricReader, before_collect: list[Callable[[], object]]) -> None:
    """Every collection of ``reader`` (each OTLP export, the last one at shutdown included) first runs the hooks
    of ``before_collect``, as a scrape does: an export holds every record published before it, and the bus
    flushes (and checkpoints) for it then rather than on a timer of its own.  ``MetricReader.collect`` is final:
    the hook wraps the provider's collection callback it calls (set when the provider was built)."""
    collect = reader._collect
    if collect is None:
        return

    def catching_up(*args: Any, **kwargs: Any) -> Any:
        for hook in before_collect:
            hook()
        return collect(*args, **kwargs)

    reader._collect = catching_up


def build_resource(config: Config) -> Resource:
    """service.name "mpcache" unless ``OTEL_SERVICE_NAME`` says otherwise, host.name (this host's name unless
    ``OTEL_RESOURCE_ATTRIBUTES`` gives one), the attributes of ``OTEL_RESOURCE_ATTRIBUTES`` (the SDK's own
    detector), and always the configured service.instance.id: what tells the hosts of a fleet apart."""
    from_environment = OTELResourceDetector().detect()
    return (Resource({SERVICE_NAME_KEY: SERVICE_NAME, HOST_NAME_KEY: socket.gethostname()}).merge(from_environment)
            .merge(Resource({SERVICE_INSTANCE_ID_KEY: config.instance_id})))


def create_instrument(meter: MeterLike, otel_name: str, callbacks: Iterable[ObservableCallback] = ()) -> Any:
    """The instrument described by ``otel_name``'s row of the metric table (an SDK meter's or a buffered one's).

    Observable instruments need ``callbacks``; the others must not get any.
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
