"""The OTLP exporters of both signals, metric points and spans, built one way: ``--otlp-protocol`` picks gRPC or
HTTP, an HTTP endpoint without a path gets the signal's standard one, and the export timeout is what the standard
environment variables say (``OTEL_EXPORTER_OTLP_TIMEOUT`` or the signal's own), else the caller's bound.
"""

from __future__ import annotations

import importlib
import os
from typing import Any
from urllib.parse import urlsplit

from mpcache.config import Config

METRICS, TRACES = "metrics", "traces"
EXPORT_TIMEOUT_S = 10.0  # the bound where no environment variable sets one (the SDK's own default)

# signal → (the standard OTLP/HTTP path, the exporter's module under opentelemetry.exporter.otlp.proto.{grpc,http},
# its class)
_SIGNALS = {
    METRICS: ("/v1/metrics", "metric_exporter", "OTLPMetricExporter"),
    TRACES: ("/v1/traces", "trace_exporter", "OTLPSpanExporter"),
}


def build_exporter(config: Config, signal: str, bound_s: float = EXPORT_TIMEOUT_S) -> Any:
    """The OTLP exporter of ``signal`` for ``config.otlp_protocol`` and ``config.otlp_endpoint``.

    gRPC takes ``host:port`` or ``http(s)://host:port`` (plain text unless https); HTTP takes a URL, and a bare
    ``http://host:4318`` gets the signal's standard path (``/v1/metrics``, ``/v1/traces``).
    """
    endpoint = config.otlp_endpoint
    if not endpoint:
        raise ValueError(f"OTLP {signal} need config.otlp_endpoint (--otlp-endpoint)")
    path, module, name = _SIGNALS[signal]
    grpc = config.otlp_protocol == "grpc"
    transport = "grpc" if grpc else "http"
    exporter = getattr(importlib.import_module(f"opentelemetry.exporter.otlp.proto.{transport}.{module}"), name)
    timeout_s = export_timeout_s(signal, bound_s)
    if grpc:
        return exporter(endpoint=endpoint, insecure=not endpoint.startswith("https://"), timeout=timeout_s)
    if urlsplit(endpoint).path in ("", "/"):
        endpoint = endpoint.rstrip("/") + path
    return exporter(endpoint=endpoint, timeout=timeout_s)


def export_timeout_s(signal: str, bound_s: float = EXPORT_TIMEOUT_S) -> float | None:
    """None where ``OTEL_EXPORTER_OTLP_TIMEOUT`` or ``OTEL_EXPORTER_OTLP_<SIGNAL>_TIMEOUT`` is set (the exporter
    reads it then), else ``bound_s``."""
    if any(name in os.environ for name in ("OTEL_EXPORTER_OTLP_TIMEOUT",
                                           f"OTEL_EXPORTER_OTLP_{signal.upper()}_TIMEOUT")):
        return None
    return bound_s
