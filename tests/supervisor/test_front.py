"""The supervisor's HTTP front on a real port, over a real gauge board, with the supervisor's state and
telemetry's socket played by the test: what each health route answers, and what a forwarded request gets
when telemetry answers, is absent, hangs or answers garbage."""

from __future__ import annotations

import json
import os
import re
import socket
import threading
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from mpcache.config import Config
from mpcache.shm import layout
from mpcache.shm.gauges import GaugeSlot, TelemetryBeat, format_gauge_board
from mpcache.shm.segment import Segment
from mpcache.supervisor import front as front_module
from mpcache.supervisor.front import Front, SupervisorState
from mpcache.supervisor.runtime import SegmentLock

REPO = Path(__file__).resolve().parents[2]
NOW_NS = 1_700_000_000_000_000_000
TELEMETRY_PID = 4242


class _Log:
    def warning(self, *args, **kwargs) -> None:
        pass

    def exception(self, *args, **kwargs) -> None:
        raise AssertionError("no route should fail here")


@dataclass
class Served:
    front: Front
    board: Segment
    config: Config
    state: list[SupervisorState]  # what the supervisor says; the test replaces [0]
    now: list[float]  # the front's monotonic clock

    def get(self, path: str) -> tuple[int, str, str]:
        url = f"http://127.0.0.1:{self.front.server.server_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=10) as response:
                return response.status, response.headers["Content-Type"], response.read().decode()
        except urllib.error.HTTPError as error:
            return error.code, error.headers["Content-Type"], error.read().decode()

    def json(self, path: str) -> tuple[int, dict]:
        status, _, body = self.get(path)
        return status, json.loads(body)


@pytest.fixture
def served(tmp_path) -> Iterator[Served]:
    """A front over a 2-slot board: cache[0] heartbeats now, cache[1] never did; telemetry runs and beats."""
    config = Config(instance_id=uuid.uuid4().hex[:8], supervisor_pid=os.getpid(), runtime_dir=str(tmp_path),
                    prometheus_port=0, workers=2)
    board = Segment.create(config.gauge_board_name(), layout.gauge_board_size(2))
    lock = SegmentLock(config.gauge_board_name())  # as a supervisor holds it: no start-cache sweeps it meanwhile
    format_gauge_board(board, 2)
    GaugeSlot(board, 0, clock_ns=lambda: NOW_NS).heartbeat(pid=11)
    TelemetryBeat(board, clock_ns=lambda: NOW_NS - 500_000_000).beat(TELEMETRY_PID)
    state = [SupervisorState(loop_at=100.0, stopping=False, telemetry_state="running",
                             telemetry_pid=TELEMETRY_PID, telemetry_restarts=1)]
    now = [100.5]
    front = Front(config, _Log(), lambda: state[0], clock=lambda: now[0], clock_ns=lambda: NOW_NS)
    front.start()
    try:
        yield Served(front, board, config, state, now)
    finally:
        front.close()
        board.close()
        Segment.unlink(config.gauge_board_name())
        lock.release()


def test_healthz_is_the_supervisors_loop_and_carries_telemetrys_state(served):
    ok = served.json("/healthz")
    served.now[0] = 106.0  # the loop has not run for 6 s
    stalled = served.json("/healthz")
    served.state[0] = replace(served.state[0], stopping=True)
    stopping = served.json("/healthz")

    assert (200, {"status": "ok", "telemetry": {"state": "running", "pid": TELEMETRY_PID, "restarts": 1,
                                                "heartbeat_age_s": 0.5}}) == ok
    assert (503, "stalled", 6.0) == (stalled[0], stalled[1]["status"], stalled[1]["loop_silent_s"])
    assert (200, "stopping") == (stopping[0], stopping[1]["status"])


def test_ready_names_every_cache_process_that_is_not_serving_and_is_503_while_stopping(served):
    one_missing = served.json("/ready")
    GaugeSlot(served.board, 1, clock_ns=lambda: NOW_NS).heartbeat(pid=12)
    all_serving = served.json("/ready")
    served.state[0] = replace(served.state[0], stopping=True)
    stopping = served.json("/ready")

    assert (503, False, 1, ["cache[1]"]) == (one_missing[0], one_missing[1]["ready"], one_missing[1]["serving"],
                                            one_missing[1]["not_serving"])
    assert (200, True, 2, [], "running") == (all_serving[0], all_serving[1]["ready"], all_serving[1]["serving"],
                                             all_serving[1]["not_serving"], all_serving[1]["telemetry"]["state"])
    assert (503, True) == (stopping[0], stopping[1]["stopping"])


def test_telemetry_is_200_only_while_it_runs_and_its_own_heartbeat_is_fresh(served):
    running = served.json("/telemetry")
    TelemetryBeat(served.board, clock_ns=lambda: NOW_NS - 6 * 10**9).beat(TELEMETRY_PID)
    silent = served.json("/telemetry")
    served.state[0] = replace(served.state[0], telemetry_state="restarting", telemetry_pid=None)
    restarting = served.json("/telemetry")

    assert (200, 0.5) == (running[0], running[1]["heartbeat_age_s"])
    assert (503, 6.0) == (silent[0], silent[1]["heartbeat_age_s"])
    assert (503, "restarting", None, None) == (restarting[0], restarting[1]["state"], restarting[1]["pid"],
                                               restarting[1]["heartbeat_age_s"])


def test_runbook_is_an_html_page_with_a_section_per_alert(served):
    """/runbook answers whatever telemetry does, with an id for every alert of the shipped rules: the target
    of their default runbook_url, http://<instance>/runbook#<alert, lower case>."""
    alerts = re.findall(r"- alert: (\S+)", (REPO / "deploy" / "prometheus" / "alerts.yml").read_text())
    served.state[0] = replace(served.state[0], telemetry_state="restarting", telemetry_pid=None)
    status, content_type, body = served.get("/runbook")

    assert (200, "text/html; charset=utf-8") == (status, content_type)
    assert len(alerts) >= 10
    assert [] == [alert for alert in alerts if f'id="{alert.lower()}"' not in body]


def _telemetry_socket(served: Served, answer: bytes | None,
                      received: list[bytes] | None = None) -> tuple[socket.socket, threading.Thread]:
    """A listener on telemetry's socket path: each connection gets ``answer`` and is closed (None: it is
    read and never answered); what each sent is appended to ``received``."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(served.config.telemetry_socket_path())
    listener.listen(8)
    held = []
    received = [] if received is None else received

    def serve() -> None:
        while True:
            try:
                connection, _ = listener.accept()
            except OSError:
                return
            received.append(connection.recv(8192))
            if answer is None:
                held.append(connection)
                continue
            connection.sendall(answer)
            connection.close()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return listener, thread


def test_other_paths_are_telemetrys_answer_relayed(served):
    listener, _ = _telemetry_socket(served, b"HTTP/1.0 200 OK\r\nContent-Type: text/plain; version=0.0.4\r\n"
                                            b"Content-Length: 16\r\nConnection: close\r\n\r\nmetric_total 1.0\n")
    try:
        assert (200, "text/plain; version=0.0.4", "metric_total 1.0\n") == served.get("/metrics")
    finally:
        listener.close()


def test_a_head_request_is_forwarded_as_a_get_and_says_the_length_a_get_would_have(served):
    """The front asks telemetry for the body (a HEAD forwarded as such came back with no body, and the front's
    answer said Content-Length: 0); the client gets the head alone, with the body's length."""
    body = b"metric_total 1.0\n"
    received: list[bytes] = []
    listener, _ = _telemetry_socket(served, b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\nContent-Length: %d\r\n"
                                            b"Connection: close\r\n\r\n%s" % (len(body), body), received)
    try:
        with socket.create_connection(("127.0.0.1", served.front.server.server_port), timeout=10) as sock:
            sock.sendall(b"HEAD /metrics HTTP/1.0\r\n\r\n")
            answer = b""
            while chunk := sock.recv(4096):
                answer += chunk
    finally:
        listener.close()
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert [b"GET /metrics HTTP/1.0\r\n\r\n"] == received
    assert (b"HTTP/1.0 200 OK", b"Content-Length: %d" % len(body), b"") == (
        head.split(b"\r\n")[0], next(line for line in head.split(b"\r\n") if line.startswith(b"Content-Length")),
        rest)


def test_a_forwarded_request_is_503_without_telemetry_504_when_it_hangs_and_502_for_garbage(served, monkeypatch):
    monkeypatch.setattr(front_module, "FORWARD_TIMEOUT_S", 0.5)
    absent = served.get("/metrics")
    listener, _ = _telemetry_socket(served, None)
    hung: list[tuple[int, str, str]] = []
    scrape = threading.Thread(target=lambda: hung.append(served.get("/metrics")))
    scrape.start()
    healthz_meanwhile = served.json("/healthz")[0]  # the front's loop is not held by the pending forward
    scrape.join()
    listener.close()
    os.unlink(served.config.telemetry_socket_path())
    listener, _ = _telemetry_socket(served, b"not http at all")
    garbage = served.get("/metrics")
    listener.close()

    assert (503, True) == (absent[0], absent[2].startswith("the telemetry process is not serving (running:"))
    assert [(504, "the telemetry process did not answer within 0.5 s\n")] == [(hung[0][0], hung[0][2])]
    assert 200 == healthz_meanwhile
    assert (502, "the telemetry process answered something that is not HTTP\n") == (garbage[0], garbage[2])


def test_a_path_neither_serves_is_a_404_naming_the_routes_of_both(served):
    """Telemetry's 404 names its own routes; the front adds its own, which the same port serves (it named
    telemetry's alone)."""
    body = b"not found: try /metrics, /mrc\n"
    listener, _ = _telemetry_socket(served, b"HTTP/1.0 404 Not Found\r\nContent-Type: text/plain\r\nContent-Length: "
                                            b"%d\r\nConnection: close\r\n\r\n%s" % (len(body), body))
    try:
        status, _, answer = served.get("/nope")
    finally:
        listener.close()
    assert (404, "not found: try /healthz, /metrics, /mrc, /ready, /runbook, /telemetry\n") == (status, answer)
