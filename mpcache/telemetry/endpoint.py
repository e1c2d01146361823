"""The telemetry process's HTTP listener, opened before any exporter: ``/healthz`` and ``/ready`` answer
whenever the telemetry process runs, whatever ``--disable-metrics`` or ``OTEL_SDK_DISABLED`` say
(``--no-http`` is the one way to have no listener); ``/metrics`` is added by the metrics export.
"""

from __future__ import annotations

import ipaddress
import socket
from typing import Any

from mpcache.config import Config
from mpcache.telemetry.http import MetricsHTTPServer, Route

_TEXT = "text/plain; charset=utf-8"
METRICS_OFF = (404, b"metrics export is off (--disable-metrics or OTEL_SDK_DISABLED=true); /healthz and /ready "
               b"still answer\n", _TEXT)


def open_endpoint(config: Config, log: Any) -> MetricsHTTPServer | None:
    """Bind and start the listener on ``--prometheus-host``/``--prometheus-port``; None with ``--no-http``."""
    if config.no_http:
        return None
    server = MetricsHTTPServer((config.prometheus_host, config.prometheus_port), {}, log)
    if not is_loopback(config.prometheus_host):
        log.warning("metrics.public_bind", address=config.prometheus_host, port=server.server_port,
                    hint="/metrics, /healthz and /ready are reachable from other hosts; bind 127.0.0.1 unless a "
                         "scraper elsewhere needs it and a firewall guards the port")
    server.start()
    return server


def metrics_off_route() -> Route:
    """``/metrics`` with metrics export off: one line saying why, not an empty page that scrapes as healthy."""
    return lambda: METRICS_OFF


def endpoint_url(server: MetricsHTTPServer | None, host: str, path: str = "/metrics") -> str | None:
    if server is None:
        return None
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{server.server_port}{path}"


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address."""
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)
