"""/healthz and /ready of a running service: ready while every cache process serves, 503 while a killed one
restarts, ready again after; /healthz 200 while telemetry drains."""

from __future__ import annotations

import os
import signal
import urllib.error
import urllib.request

import pytest
from support.waiting import wait_for


def _status(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


@pytest.mark.slow
def test_ready_turns_503_while_a_killed_cache_process_restarts(start_service):
    service = start_service("--workers", "2")
    wait_for(lambda: _status(service.port, "/ready")[0] == 200, 30, "/ready to be 200")
    assert (200, "ok\n") == _status(service.port, "/healthz")
    assert (200, "ready: 2 cache processes serving\n") == _status(service.port, "/ready")
    cache1 = [line["pid"] for line in service.log_lines()
              if line.get("event") == "child.started" and line.get("child_role") == "cache" and line.get("index") == 1]
    os.kill(cache1[-1], signal.SIGKILL)
    assert (503, "not ready: cache[1] not serving\n") == wait_for(
        lambda: (s := _status(service.port, "/ready"))[0] == 503 and s, 10, "/ready to be 503")
    wait_for(lambda: _status(service.port, "/ready")[0] == 200, 30, "/ready after the restart")
    restarts = wait_for(lambda: service.scrape().by_label("mpcache_child_restarts_total", "role") or None, 30,
                        "the restart counter")
    assert {"cache": 1.0, "telemetry": 0.0} == restarts
    assert (2.0, 2.0) == (service.scrape().total("mpcache_cache_processes"),
                          service.scrape().total("mpcache_cache_processes_ready"))
    assert 0 == service.stop()


@pytest.mark.slow
def test_metrics_carry_build_info_readiness_and_process_series(start_service):
    import importlib.metadata

    from mpcache.shm.ring import PUBLISH_PATH

    service = start_service("--workers", "2")
    wait_for(lambda: service.scrape().total("mpcache_cache_processes_ready") == 2, 30, "two ready cache processes")
    scrape = service.scrape()
    assert [({"version": importlib.metadata.version("mpcache"), "publish_path": PUBLISH_PATH}, 1.0)] == \
        scrape.samples["mpcache_build_info"]
    assert scrape.total("process_resident_memory_bytes") > 0
    assert 0 == service.stop()


@pytest.mark.slow
def test_no_http_serves_nothing_on_the_port(start_service):
    """--no-http: OTLP-only deployments listen on no port at all (the telemetry process still runs)."""
    import socket

    service = start_service("--workers", "1", "--no-http")
    wait_for(lambda: any(line.get("event") == "telemetry.started" for line in service.log_lines()), 30,
             "telemetry.started")
    started = [line for line in service.log_lines() if line.get("event") == "telemetry.started"][-1]
    assert started["metrics_url"] is None
    with socket.socket() as probe, pytest.raises(ConnectionRefusedError):
        probe.connect(("127.0.0.1", service.port))
    assert 0 == service.stop()


@pytest.mark.slow
@pytest.mark.parametrize("how", ["--disable-metrics", "OTEL_SDK_DISABLED=true"])
def test_health_answers_with_metrics_export_off(start_service, monkeypatch, how):
    """Metrics off is not health off: a container with OTEL_SDK_DISABLED=true must pass its own health check."""
    if how.startswith("OTEL_"):
        monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
        service = start_service("--workers", "2")
    else:
        service = start_service("--workers", "2", how)
    assert (200, "ready: 2 cache processes serving\n") == wait_for(
        lambda: (s := _status(service.port, "/ready"))[0] == 200 and s, 30, "/ready to be 200")
    assert (200, "ok\n") == _status(service.port, "/healthz")
    status, body = _status(service.port, "/metrics")
    assert 404 == status and body.startswith("metrics export is off")
    started = service.lines("telemetry.started")[-1]
    assert started["metrics_url"] is None
    assert f"http://127.0.0.1:{service.port}/healthz" == started["health_url"]
    assert 0 == service.stop()


@pytest.mark.slow
def test_metrics_answer_from_the_first_moment_health_does(start_service):
    """/healthz and /ready are routed only once /metrics is: a probe that passes means a scrape does too
    (a listener opened early answered /ready while /metrics still said export was off)."""
    service = start_service("--workers", "1")

    def first_answer() -> tuple[int, str] | None:
        try:
            answer = _status(service.port, "/healthz")
        except OSError:  # not listening yet
            return None
        return answer if answer[0] != 404 else None  # 200, or 503 before the pump's first poll
    wait_for(first_answer, 30, "/healthz to be routed", interval_s=0.005)
    status, body = _status(service.port, "/metrics")
    assert (200, True) == (status, "mpcache_build_info" in body)
    assert 0 == service.stop()
