"""Checks of a configuration before anything is created: what a child would otherwise fail on at start,
again and again, is one ConfigError naming the flag instead.
"""

from __future__ import annotations

import os
import socket
import urllib.parse

from mpcache.config import Config
from mpcache.errors import ConfigError


def check_endpoints(config: Config) -> None:
    """Addresses the telemetry process would otherwise fail on at start (restart loop) or at export time."""
    if not config.no_http:  # the listener serves /healthz and /ready even with metrics off
        try:
            socket.getaddrinfo(config.prometheus_host, config.prometheus_port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise ConfigError(f"--prometheus-host: cannot resolve {config.prometheus_host!r} "
                              f"({exc.strerror})") from None
        if config.prometheus_port:  # taken, telemetry could only fail (and restart) in vain
            _check_port_free("--prometheus-port", config.prometheus_host, config.prometheus_port)
    for worker in range(config.workers if config.lmcache_port else 0):
        _check_port_free("--lmcache-port", config.lmcache_host, config.lmcache_port + worker)
    check_otlp_endpoint(config)


def check_otlp_endpoint(config: Config) -> None:
    """An endpoint the OTLP exporter could not use (the form only: nothing is resolved or connected)."""
    if config.otlp_endpoint:
        endpoint = config.otlp_endpoint if "://" in config.otlp_endpoint else f"http://{config.otlp_endpoint}"
        parts = urllib.parse.urlsplit(endpoint)
        try:
            port = parts.port
        except ValueError:
            port = None
        if parts.scheme not in ("http", "https") or not parts.hostname or (config.otlp_protocol == "grpc" and not port):
            shown = "(hidden: it holds user information)" if "@" in config.otlp_endpoint else repr(config.otlp_endpoint)
            raise ConfigError(f"--otlp-endpoint: expected host:port or http(s)://host:port[/path], got {shown}")
        if "@" in parts.netloc:  # logged at start and by every failed export, and no host name to gRPC
            raise ConfigError("--otlp-endpoint: user information in the URL is not supported (it would be logged); "
                              "give credentials as headers in OTEL_EXPORTER_OTLP_HEADERS")


def _check_port_free(flag: str, host: str, port: int) -> None:
    """A port a child will listen on must be free now: otherwise it would fail and be restarted in vain.

    The probe sets SO_REUSEADDR like the listeners do, so connections of an earlier run still in
    TIME_WAIT do not count as taken; a socket listening there does."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise ConfigError(f"{flag}: cannot resolve {host!r} ({exc.strerror})") from None
    family, kind, proto, _, address = infos[0]
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            raise ConfigError(f"{flag}: port {port} on {host} is not available ({exc.strerror})") from None


def check_socket_path_length(config: Config) -> None:
    """Refuse a runtime dir too long for the cache processes' socket paths up front (each would fail to
    start and be restarted until the supervisor gives up): the longest is the staging name
    ``.cache<worker>.<pid>`` (pid <= 2**22), and sun_path holds 107 bytes."""
    longest = os.path.join(config.runtime_dir, f".cache{config.workers - 1}.{2**22}")
    if len(os.fsencode(longest)) > 107:
        raise ConfigError(f"--runtime-dir: too long for Unix socket paths under it ({len(os.fsencode(longest))} "
                          "bytes, at most 107)")
