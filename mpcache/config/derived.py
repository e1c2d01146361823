"""Defaults that depend on other settings or on OpenTelemetry's own variables: the demo's (which show more,
sooner), OTEL_EXPORTER_OTLP_* and OTEL_METRIC_EXPORT_INTERVAL for the OTLP settings not given, and
OTEL_SDK_DISABLED. Each is a :data:`~mpcache.config.setting.Derivation`.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping
from typing import Any

from mpcache.config.setting import Derivation
from mpcache.errors import ConfigError

_MIB = 2**20
DEMO_L1_SIZE, DEMO_L1_SIZE_WITH_L2 = 32 * _MIB, 8 * _MIB  # the demo's L1: small, so that it evicts
DEMO_PREFETCH_JOB_TTL_S = 3.0
DEMO_METRICS_SAMPLE_RATE = 0.1
L1_POLICIES = ("adaptive", "lru", "arc")  # --l1-policy: the orders mpcache.eviction.order builds
OTLP_PROTOCOLS = ("grpc", "http/protobuf", "http")


def new_instance_id(value: Any, explicit: bool, values: Mapping[str, Any],
                    environ: Mapping[str, str]) -> tuple[Any, str] | None:
    return None if value else (str(uuid.uuid4()), "default: a new UUID4 per start")


def demo_l1_size(value: Any, explicit: bool, values: Mapping[str, Any],
                 environ: Mapping[str, str]) -> tuple[Any, str] | None:
    """The demo's L1 is small so that it evicts; smaller still with L2, so that prefetches come from L2."""
    if explicit or not values["demo"]:
        return None
    return (DEMO_L1_SIZE_WITH_L2, "default with --demo and --l2") if values["l2"] else (DEMO_L1_SIZE,
                                                                                     "default with --demo")


def with_demo(demo_default: float) -> Derivation:
    def derive(value: Any, explicit: bool, values: Mapping[str, Any],
               environ: Mapping[str, str]) -> tuple[Any, str] | None:
        return None if explicit or not values["demo"] else (demo_default, "default with --demo")
    return derive


def _otel_variable(what: str, environ: Mapping[str, str]) -> tuple[str, str] | None:
    """OTEL_EXPORTER_OTLP_METRICS_<what>, else OTEL_EXPORTER_OTLP_<what>: (value, name), or None."""
    for name in (f"OTEL_EXPORTER_OTLP_METRICS_{what}", f"OTEL_EXPORTER_OTLP_{what}"):
        if environ.get(name, "").strip():
            return environ[name].strip(), name
    return None


def otlp_endpoint(value: Any, explicit: bool, values: Mapping[str, Any],
                  environ: Mapping[str, str]) -> tuple[Any, str] | None:
    found = None if explicit else _otel_variable("ENDPOINT", environ)
    return (found[0], f"environment {found[1]}") if found else None


def otlp_protocol(value: Any, explicit: bool, values: Mapping[str, Any],
                  environ: Mapping[str, str]) -> tuple[Any, str] | None:
    found = None if explicit else _otel_variable("PROTOCOL", environ)
    if found and found[0] not in OTLP_PROTOCOLS:
        raise ConfigError(f"{found[1]}: expected grpc or http/protobuf, got {found[0]!r}")
    return (found[0], f"environment {found[1]}") if found else None


def otlp_interval(value: Any, explicit: bool, values: Mapping[str, Any],
                  environ: Mapping[str, str]) -> tuple[Any, str] | None:
    text = environ.get("OTEL_METRIC_EXPORT_INTERVAL", "").strip()
    if explicit or not text:
        return None
    try:
        milliseconds = float(text)
    except ValueError:
        raise ConfigError(f"OTEL_METRIC_EXPORT_INTERVAL: expected milliseconds, got {text!r}") from None
    if not milliseconds > 0:
        raise ConfigError(f"OTEL_METRIC_EXPORT_INTERVAL: expected milliseconds > 0, got {text!r}")
    return milliseconds / 1000, "environment OTEL_METRIC_EXPORT_INTERVAL (ms)"


def otel_sdk_disabled(value: Any, explicit: bool, values: Mapping[str, Any],
                      environ: Mapping[str, str]) -> tuple[Any, str] | None:
    """OTEL_SDK_DISABLED=true: no metrics subscribers or exporters, as --disable-metrics (whatever that says);
    /healthz and /ready still answer."""
    if not value and environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return True, "environment OTEL_SDK_DISABLED"
    return None
