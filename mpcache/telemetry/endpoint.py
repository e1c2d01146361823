"""The telemetry process's HTTP endpoint: ``/metrics`` (and the miss-ratio routes) on a Unix socket in the runtime
dir, ``<runtime dir>/telemetry.sock``, which the supervisor's front forwards the public port's requests to
(``--no-http``: none).  A listener of its own on ``--prometheus-host``/``--prometheus-port`` serves an
exporter run outside the service (a benchmark).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from mpcache.config import Config
from mpcache.httpserver import TEXT, BoundedHTTPServer, Route, is_loopback

METRICS_OFF = (404, b"metrics export is off (--disable-metrics or OTEL_SDK_DISABLED=true); /healthz and /ready "
               b"still answer\n", TEXT)


def private_endpoint(config: Config, log: Any) -> BoundedHTTPServer | None:
    """Bind (not start: requests wait until every route is in place) the endpoint the supervisor forwards to;
    None with ``--no-http``."""
    if config.no_http:
        return None
    return BoundedHTTPServer(config.telemetry_socket_path(), {}, log)


def open_endpoint(config: Config, log: Any) -> BoundedHTTPServer | None:
    """Bind and start a listener on ``--prometheus-host``/``--prometheus-port``; None with ``--no-http``."""
    if config.no_http:
        return None
    server = BoundedHTTPServer((config.prometheus_host, config.prometheus_port), {}, log)
    if not is_loopback(config.prometheus_host):
        log.warning("metrics.public_bind", address=config.prometheus_host, port=server.server_port,
                    hint="/metrics is reachable from other hosts; bind 127.0.0.1 unless a scraper elsewhere "
                         "needs it and a firewall guards the port")
    server.start()
    return server


def metrics_route(registry: CollectorRegistry, before: Sequence[Callable[[], object]] = ()) -> Route:
    """The ``/metrics`` route over ``registry``; each of ``before`` is called first, in order, on every
    scrape (the telemetry process flushes its buffered instruments there)."""

    def route() -> tuple[int, bytes, str]:
        for hook in before:
            hook()
        return 200, generate_latest(registry), CONTENT_TYPE_LATEST

    return route


def metrics_off_route() -> Route:
    """``/metrics`` with metrics export off: one line saying why, not an empty page that scrapes as healthy."""
    return lambda: METRICS_OFF


def endpoint_url(server: BoundedHTTPServer | None, host: str, path: str = "/metrics") -> str | None:
    if server is None:
        return None
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{server.server_port}{path}"
