"""/healthz, /ready and /telemetry of a running service, answered by the supervisor's front: ready while every
cache process serves, 503 while a killed one restarts, ready again after; 200 throughout while telemetry is
stopped, killed by the watchdog and restarted, and never a 404; /metrics forwarded to telemetry."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request
from datetime import datetime

import pytest
from support.service import SMALL
from support.waiting import wait_for


def _status(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as error:
        return error.code, error.read().decode()


def _json(port: int, path: str) -> tuple[int, dict]:
    status, body = _status(port, path)
    return status, json.loads(body)


@pytest.mark.slow
def test_ready_turns_503_while_a_killed_cache_process_restarts(start_service):
    service = start_service("--workers", "2")
    wait_for(lambda: _status(service.port, "/ready")[0] == 200, 30, "/ready to be 200")
    wait_for(lambda: _status(service.port, "/telemetry")[0] == 200, 30, "telemetry to heartbeat")
    healthz, ready = _json(service.port, "/healthz"), _json(service.port, "/ready")
    assert (200, "ok", "running") == (healthz[0], healthz[1]["status"], healthz[1]["telemetry"]["state"])
    assert (200, True, 2, 2, []) == (ready[0], ready[1]["ready"], ready[1]["cache_processes"], ready[1]["serving"],
                                     ready[1]["not_serving"])
    cache1 = [line["pid"] for line in service.log_lines()
              if line.get("event") == "child.started" and line.get("child_role") == "cache" and line.get("index") == 1]
    os.kill(cache1[-1], signal.SIGKILL)
    status, body = wait_for(lambda: (s := _json(service.port, "/ready"))[0] == 503 and s, 10, "/ready to be 503")
    assert (False, 1, ["cache[1]"]) == (body["ready"], body["serving"], body["not_serving"])
    assert 200 == _status(service.port, "/healthz")[0]  # a cache process restarting is not the service dying
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
def test_every_process_of_the_service_is_on_metrics_with_its_descriptors_against_its_limit(start_service):
    """The supervisor, telemetry and both cache processes each have their CPU, memory, descriptors (in use and
    the limit) and context switches on /metrics, sampled from outside them: cache[0]'s descriptor limit,
    lowered from outside to 3,000, is what /metrics says, and each process's descriptors are what its
    /proc/<pid>/fd holds (within the few that come and go)."""
    import psutil

    service = start_service("--workers", "2")
    wait_for(lambda: service.scrape().total("mpcache_cache_processes_ready") == 2, 30, "two ready cache processes")
    [cache0] = service.pids("cache", 0)
    _, hard = psutil.Process(cache0).rlimit(psutil.RLIMIT_NOFILE)
    psutil.Process(cache0).rlimit(psutil.RLIMIT_NOFILE, (3000, hard))
    scrape = wait_for(lambda: (s := service.scrape()).total("mpcache_process_max_fds", role="cache", worker="0")
                      == 3000 and s, 30, "cache[0]'s new limit on /metrics")
    pids = {("supervisor", ""): service.process.pid, ("telemetry", ""): service.pids("telemetry")[-1],
            ("cache", "0"): cache0, ("cache", "1"): service.pids("cache", 1)[-1]}
    names = ["mpcache_process_cpu_seconds_total", "mpcache_process_resident_memory_bytes", "mpcache_process_open_fds",
             "mpcache_process_max_fds", "mpcache_process_voluntary_context_switches_total",
             "mpcache_process_involuntary_context_switches_total"]
    seen = {name: {(labels["role"], labels.get("worker", "")) for labels, _ in scrape.samples[name]} for name in names}
    open_fds = {(labels["role"], labels.get("worker", "")): value
                for labels, value in scrape.samples["mpcache_process_open_fds"]}

    assert {name: set(pids) for name in names} == seen
    assert [] == [key for key, pid in pids.items() if abs(open_fds[key] - len(os.listdir(f"/proc/{pid}/fd"))) > 8]
    assert 0 == service.stop()


@pytest.mark.slow
def test_no_http_serves_nothing_on_the_port(start_service):
    """--no-http: OTLP-only deployments listen on no port at all (the telemetry process still runs)."""
    import socket

    service = start_service("--workers", "1", "--no-http")
    wait_for(lambda: any(line.get("event") == "telemetry.started" for line in service.log_lines()), 30,
             "telemetry.started")
    started = [line for line in service.log_lines() if line.get("event") == "telemetry.started"][-1]
    assert (None, False) == (started["endpoint"], (service.runtime_dir / "telemetry.sock").exists())
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
    wait_for(lambda: _status(service.port, "/ready")[0] == 200, 30, "/ready to be 200")
    assert (200, "ok") == ((healthz := _json(service.port, "/healthz"))[0], healthz[1]["status"])
    status, body = wait_for(lambda: (s := _status(service.port, "/metrics"))[0] != 503 and s, 30,
                            "telemetry's answer to /metrics")
    assert 404 == status and body.startswith("metrics export is off")
    started = service.lines("telemetry.started")[-1]
    assert (False, str(service.runtime_dir / "telemetry.sock")) == (started["metrics"], started["endpoint"])
    assert 0 == service.stop()


@pytest.mark.slow
def test_no_404_from_the_first_answer_on_and_metrics_once_telemetry_serves(start_service):
    """The front's routes exist from its bind: from the first answer on the port, /healthz and /ready never
    answer 404, and /metrics answers 503 (telemetry not serving yet) until telemetry's own answer, a 200 with
    the service's series (telemetry binds its endpoint first and answers once every route is in)."""
    service = start_service("--workers", "1")
    seen: list[tuple[str, int]] = []

    def metrics_served() -> bool:
        for path in ("/healthz", "/ready", "/metrics"):
            try:
                status, body = _status(service.port, path)
            except OSError:  # not listening yet
                return False
            seen.append((path, status))
        return status == 200 and "mpcache_build_info" in body

    wait_for(metrics_served, 60, "/metrics to be served", interval_s=0.005)
    assert [] == [(path, status) for path, status in seen if status not in (200, 503)]
    assert ("/healthz", 200) in seen
    assert 0 == service.stop()


TELEMETRY_HANG_TIMEOUT_S = 2.0  # --telemetry-hang-timeout (default 10 s)


@pytest.mark.slow
def test_probes_answer_200_throughout_a_telemetry_hang_and_its_restart(start_service):
    """Telemetry is SIGSTOPped: /healthz and /ready, polled every 50 ms, answer 200 every time — while it is
    stopped, killed by the watchdog (within --telemetry-hang-timeout plus a second) and restarted — and each
    reports telemetry's state; /telemetry answers 503 meanwhile and 200 once the new one heartbeats; the
    cache processes keep their pids; /metrics is telemetry's again afterwards, counting one restart."""
    service = start_service("--workers", "2", "--telemetry-hang-timeout", str(TELEMETRY_HANG_TIMEOUT_S), *SMALL)
    service.ready(2)
    wait_for(lambda: _status(service.port, "/telemetry")[0] == 200, 30, "telemetry to heartbeat")
    caches = service.pids("cache", None)
    [victim] = service.pids("telemetry")
    probes: list[tuple[str, int, str]] = []
    telemetry_answers: list[int] = []

    def probe_until_restarted() -> bool:
        for path in ("/healthz", "/ready"):
            status, body = _json(service.port, path)
            probes.append((path, status, body["telemetry"]["state"]))
        telemetry_status, report = _json(service.port, "/telemetry")
        telemetry_answers.append(telemetry_status)
        return telemetry_status == 200 and report["pid"] != victim

    os.kill(victim, signal.SIGSTOP)
    stopped_at = time.time()
    wait_for(probe_until_restarted, 60, "a new telemetry process to heartbeat", interval_s=0.05)
    back_after = time.time() - stopped_at
    [unresponsive] = service.lines("telemetry.unresponsive")
    killed_after = _seconds(unresponsive["timestamp"]) - stopped_at
    print(f"telemetry SIGSTOPped: killed after {killed_after:.2f} s, serving again after {back_after:.2f} s; "
          f"{len(probes)} probes")

    assert [] == [probe for probe in probes if probe[1] != 200]
    assert {"running", "unresponsive", "restarting", "starting"} >= {state for _, _, state in probes}
    assert 503 in telemetry_answers and {200, 503} >= set(telemetry_answers)
    assert killed_after < TELEMETRY_HANG_TIMEOUT_S + 1.0
    assert caches == service.pids("cache", None)
    assert {"cache": 0.0, "telemetry": 1.0} == wait_for(
        lambda: service.scrape().by_label("mpcache_child_restarts_total", "role"), 30, "/metrics from the new one")
    assert 0 == service.stop()


def _seconds(timestamp: str) -> float:
    """A log line's ISO timestamp as seconds since the epoch."""
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()
