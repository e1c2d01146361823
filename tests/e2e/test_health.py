"""/healthz, /ready and /telemetry of a running service, answered by the supervisor's front: ready while every
cache process serves, 503 while a killed one restarts, ready again after; 200 throughout while telemetry is
stopped for 60 s, killed by the watchdog and restarted, and never a 404, with every count exact afterwards;
/metrics forwarded to telemetry."""

from __future__ import annotations

import collections
import json
import os
import signal
import time
import urllib.error
import urllib.request
from datetime import datetime

import pytest
from support.lmcache_client import OPS, LMClient, key, registration
from support.service import gone
from support.waiting import wait_for

from mpcache.cache.lmcache.handlers import OPERATIONS
from mpcache.supervisor.restart import TELEMETRY_POLICY
from mpcache.supervisor.watch import WATCH_INTERVAL_S
from mpcache.telemetry import pump


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


STOPPED_S = 60.0  # how long the telemetry process is held SIGSTOPped (issue 35)
PROBE_PERIOD_S = 0.1  # the probes' and the lookups' period while it is
LOOKUP_TOKENS, LMCACHE_CHUNK = 1024, 256
LMCACHE_OBJECT = 2 * 2 * LMCACHE_CHUNK * 64 * 2  # lmcache_client.registration(): 2 layers, hidden 64, fp16


class Lookups:
    """One hand-framed LMCache client per cache process, each lookup 1,024 tokens of a prompt nobody stored, and
    the tally of what was sent (requests per operation), kept here, never read from the service."""

    def __init__(self, runtime_dir, workers: int) -> None:
        self._clients = [LMClient(f"ipc://{runtime_dir}/lmcache{worker}.ipc") for worker in range(workers)]
        self.sent: collections.Counter[str] = collections.Counter()
        self.lookups = 0
        for instance, client in enumerate(self._clients):
            self._call(client, "register", registration(instance + 1))

    def _call(self, client: LMClient, op: str, *args: object) -> object:
        self.sent[op] += 1  # a request sent is a request the service times, answered or not
        return client.call(op, *args)

    def one(self) -> None:
        """A lookup, its status query and its end, on the next cache process in turn."""
        client = self._clients[self.lookups % len(self._clients)]
        request = f"r{self.lookups}"
        tokens = list(range(self.lookups * LOOKUP_TOKENS, (self.lookups + 1) * LOOKUP_TOKENS))
        self.lookups += 1
        self._call(client, "lookup", key(tokens, request), 1)
        self._call(client, "query_prefetch_status", request)
        self._call(client, "end_session", request)

    def expected(self) -> dict[tuple[str, str], float]:
        """(series, op) -> value: the tokens asked for, and every request's service time counted once."""
        names = {row.wire_id: row.name for row in OPERATIONS.values()}
        out = {("lmcache_mp_lookup_requested_tokens_total", ""): float(LOOKUP_TOKENS * self.lookups),
               ("lmcache_mp_lookup_hit_tokens_total", ""): 0.0,
               ("lmcache_mp_event_bus_dropped_events_total", ""): 0.0}
        out |= {("mpcache_lmcache_request_seconds_count", names[OPS[op]]): float(n) for op, n in self.sent.items()}
        return out

    def close(self) -> None:
        for client in self._clients:
            client.close()


def _counted(scrape, expected: dict[tuple[str, str], float]) -> dict[tuple[str, str], float]:
    return {(name, op): scrape.total(name, **({"op": op} if op else {})) for name, op in expected}


@pytest.mark.slow
def test_kill_stop_of_telemetry_for_60_s_keeps_probes_200_the_caches_and_every_count(start_service):
    """Telemetry is SIGSTOPped for 60 s while 1,024-token LMCache lookups keep coming: /healthz and /ready,
    polled every 0.1 s throughout, answer 200 every time and never 404; the watchdog kills the stopped process
    once the configured --telemetry-hang-timeout has passed (plus the supervisor's two looks, and slack for a
    loaded machine) and starts the next one after its first backoff; /telemetry answers 503 meanwhile and 200
    once the new one heartbeats; the cache processes keep their pids; and afterwards /metrics counts exactly
    what was sent — the lookups' tokens and every request's service time, before, during and after the stop —
    with one telemetry restart."""
    service = start_service("--workers", "2", "--lmcache-ipc", "--chunk-bytes", str(LMCACHE_OBJECT),
                            "--l1-size", "8MiB")
    service.ready(2)
    hang_timeout_s = service.config().telemetry_hang_timeout_s
    wait_for(lambda: _status(service.port, "/telemetry")[0] == 200, 30, "telemetry to heartbeat")
    caches = service.pids("cache", None)
    [victim] = service.pids("telemetry")
    lookups = Lookups(service.runtime_dir, 2)
    probes: list[tuple[str, int, str]] = []
    telemetry_answers: list[tuple[float, int, int | None]] = []  # (seconds after the stop, status, pid)
    try:
        for _ in range(200):
            lookups.one()
        before = lookups.expected()
        wait_for(lambda: _counted(service.scrape(), before) == before, 30, "the lookups before the stop on /metrics")
        os.kill(victim, signal.SIGSTOP)
        stopped_at = time.time()
        while (elapsed := time.time() - stopped_at) < STOPPED_S:
            lookups.one()
            for path in ("/healthz", "/ready"):
                status, body = _json(service.port, path)
                probes.append((path, status, body["telemetry"]["state"]))
            status, report = _json(service.port, "/telemetry")
            telemetry_answers.append((elapsed, status, report["pid"]))
            time.sleep(PROBE_PERIOD_S)  # the probes' period, as a kubelet's; nothing waits on a condition here
        victim_gone = gone(victim)
        if not victim_gone:
            os.kill(victim, signal.SIGCONT)  # kill -CONT after the 60 s, as an operator would
        for _ in range(200):
            lookups.one()
        expected = lookups.expected()
        counted: dict[tuple[str, str], float] = {}

        def all_counted():
            scrape = service.scrape()
            counted.update(_counted(scrape, expected))
            return scrape if counted == expected else None

        try:
            scrape = wait_for(all_counted, 60, "/metrics to count every lookup")
        except AssertionError:
            assert expected == counted  # which series are off, and by how much
    finally:
        lookups.close()
    [unresponsive] = service.lines("telemetry.unresponsive")
    killed_after = _seconds(unresponsive["timestamp"]) - stopped_at
    [_, successor] = service.lines("child.started", child_role="telemetry")
    spawned_after = _seconds(successor["timestamp"]) - stopped_at
    serving_again = min(elapsed for elapsed, status, pid in telemetry_answers if status == 200 and pid != victim)
    print(f"telemetry SIGSTOPped for {STOPPED_S:g} s: killed after {killed_after:.2f} s, started again after "
          f"{spawned_after:.2f} s, serving after {serving_again:.2f} s; {len(probes)} probes, "
          f"{lookups.lookups} lookups")

    assert (True, [], 2 * len(telemetry_answers)) == (
        victim_gone, [probe for probe in probes if probe[1] != 200], len(probes))
    assert {"running", "unresponsive", "restarting", "starting"} >= {state for _, _, state in probes}
    # the watchdog's bound: silent for the timeout from the last beat it saw (the supervisor looks every 0.1 s),
    # then the first restart's backoff; slack that only a watchdog which does not fire in time gets near (a
    # loaded machine delays the supervisor's looks by far less), well inside the stop
    kill_bound_s = hang_timeout_s + 2 * WATCH_INTERVAL_S
    slack_s = 10.0
    assert 0 < killed_after - hang_timeout_s + pump.MAX_SLEEP_S and killed_after < kill_bound_s + slack_s
    assert spawned_after < kill_bound_s + TELEMETRY_POLICY.backoff_initial_s + WATCH_INTERVAL_S + slack_s
    assert 503 in {status for _, status, _ in telemetry_answers} and {200, 503} >= {
        status for _, status, _ in telemetry_answers}
    assert caches == service.pids("cache", None)
    assert {"cache": 0.0, "telemetry": 1.0} == scrape.by_label("mpcache_child_restarts_total", "role")
    assert 0 == scrape.total("mpcache_telemetry_checkpoint_refused_total")
    assert 0 == service.stop()


def _seconds(timestamp: str) -> float:
    """A log line's ISO timestamp as seconds since the epoch."""
    return datetime.fromisoformat(timestamp.replace("Z", "+00:00")).timestamp()
