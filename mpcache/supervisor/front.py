"""The service's HTTP front, served by the supervisor on ``--prometheus-host``:``--prometheus-port``.

Liveness and readiness are answered here, by the process that outlives every child, so that they hold while
telemetry hangs, restarts or is off, and never 404 (the routes exist from the bind on); every other path
(``/metrics``, the miss-ratio curves) is forwarded to the telemetry process's private endpoint,
``<runtime dir>/telemetry.sock``, which builds it.  Each answer is one JSON object:

* ``/healthz`` (liveness): 200 while the supervisor's loop runs (it restarts whatever child fails), 503 once
  it has not run for :data:`STALL_AFTER_S`;
* ``/ready`` (readiness): 200 while every cache process's heartbeat is fresher than
  :data:`READY_STALE_AFTER_S` (as ``mpcache_cache_processes_ready``), 503 naming the ones that are not;
* ``/telemetry``: 200 while the telemetry process runs and heartbeats, 503 otherwise (starting, restarting,
  unresponsive, off): for operators and monitoring, not for probes — the cache serves without it;
* ``/runbook``: what to do when each alert fires (:mod:`mpcache.supervisor.runbook`), an HTML page, where the
  alert rules' ``runbook_url`` points by default.

The first two carry telemetry's state too (``"telemetry"``).  A forwarded request that telemetry cannot answer
(restarting: nothing listens; stopped: nothing answers within :data:`FORWARD_TIMEOUT_S`) is a 503 or 504
saying so.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mpcache.config import Config
from mpcache.httpserver import TEXT, BoundedHTTPServer, is_head, is_loopback
from mpcache.shm import layout
from mpcache.shm.boardfile import BoardFile, FileBeat, slot_offset
from mpcache.supervisor.runbook import packaged, page

STALL_AFTER_S = 5.0  # the loop wakes every 0.1 s
READY_STALE_AFTER_S = 2.0  # a cache process heartbeats every 0.5 s
CONNECT_TIMEOUT_S = 1.0
FORWARD_TIMEOUT_S = 10.0  # Prometheus's default scrape timeout
MAX_RESPONSE_BYTES = 256 * 2**20
_JSON = "application/json"


@dataclass(frozen=True)
class SupervisorState:
    """What the front needs of the supervisor's loop (read from the front's thread)."""

    loop_at: float  # when the loop last ran (monotonic)
    stopping: bool
    telemetry_state: str  # its child's state, "off" when the run has no telemetry process
    telemetry_pid: int | None
    telemetry_restarts: int


class Front:
    """Binds at construction (a taken port fails here, before any child starts); :meth:`start`, :meth:`close`."""

    def __init__(self, config: Config, log: Any, state: Callable[[], SupervisorState], *,
                 clock: Callable[[], float] = time.monotonic, clock_ns: Callable[[], int] = time.time_ns) -> None:
        self._state = state
        self._clock = clock
        self._clock_ns = clock_ns
        self._telemetry_socket = config.telemetry_socket_path()
        self._board = BoardFile(config.gauge_board_name(), config.workers)  # read, never mapped: no SIGBUS here
        self._beat = FileBeat(self._board)
        runbook = (200, page(packaged()), "text/html; charset=utf-8")
        routes = {"/healthz": self.healthz, "/ready": self.ready, "/telemetry": self.telemetry,
                  "/runbook": lambda: runbook}
        try:
            self.server = BoundedHTTPServer((config.prometheus_host, config.prometheus_port), routes, log,
                                            forward=self.forward)
        except BaseException:
            self._release()
            raise
        if not is_loopback(config.prometheus_host):
            log.warning("metrics.public_bind", address=config.prometheus_host, port=self.server.server_port,
                        hint="/metrics, /healthz and /ready are reachable from other hosts; bind 127.0.0.1 unless a "
                             "scraper elsewhere needs it and a firewall guards the port")

    def start(self) -> None:
        self.server.start()

    def close(self) -> None:
        self.server.close()
        self._release()

    def _release(self) -> None:
        self._board.close()

    def _live_slots(self) -> set[int]:
        """Cache processes whose heartbeat is recent."""
        now, stale = self._clock_ns(), int(READY_STALE_AFTER_S * 1e9)
        beats = [self._board.read(slot_offset(worker, layout.G_HEARTBEAT)) for worker in range(self._board.n_slots)]
        return {worker for worker, beat in enumerate(beats) if beat > 0 and now - beat <= stale}

    # -- routes (the server's collector thread) -------------------------------------------------------------

    def _telemetry(self, state: SupervisorState) -> dict[str, Any]:
        beat = self._beat.heartbeat if state.telemetry_pid is not None and self._beat.pid == state.telemetry_pid else 0
        return {"state": state.telemetry_state, "pid": state.telemetry_pid, "restarts": state.telemetry_restarts,
                "heartbeat_age_s": round((self._clock_ns() - beat) / 1e9, 3) if beat else None}

    def healthz(self) -> tuple[int, bytes, str]:
        state = self._state()
        silent = self._clock() - state.loop_at
        if state.stopping:
            status = "stopping"
        elif silent > STALL_AFTER_S:
            return _answer(503, status="stalled", loop_silent_s=round(silent, 1), telemetry=self._telemetry(state))
        else:
            status = "ok"
        return _answer(200, status=status, telemetry=self._telemetry(state))

    def ready(self) -> tuple[int, bytes, str]:
        state = self._state()
        live = self._live_slots()
        missing = [f"cache[{worker}]" for worker in range(self._board.n_slots) if worker not in live]
        ready = not missing and not state.stopping
        return _answer(200 if ready else 503, ready=ready, cache_processes=self._board.n_slots,
                       serving=len(live), not_serving=missing, stopping=state.stopping,
                       telemetry=self._telemetry(state))

    def telemetry(self) -> tuple[int, bytes, str]:
        report = self._telemetry(self._state())
        age = report["heartbeat_age_s"]
        running = report["state"] == "running" and age is not None and age <= STALL_AFTER_S
        return _answer(200 if running else 503, **report)

    # -- everything else: telemetry's (the server's event loop) ---------------------------------------------

    async def forward(self, head: bytes) -> tuple[int, bytes, str]:
        """``head`` sent to telemetry's endpoint, its answer returned; 503 or 504 when it cannot answer."""
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_unix_connection(self._telemetry_socket),
                                                    CONNECT_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError) as exc:
            return 503, (f"the telemetry process is not serving ({self._state().telemetry_state}: {exc}); "
                         "the cache serves on, and this answers again once telemetry is back\n").encode(), TEXT
        try:
            # a HEAD asked as a GET: the answer's Content-Length is then the body's, which HEAD is to say
            writer.write(b"GET" + head.lstrip()[len(b"HEAD"):] if is_head(head) else head)
            response = await asyncio.wait_for(_read_to_end(reader), FORWARD_TIMEOUT_S)
        except asyncio.TimeoutError:
            return 504, f"the telemetry process did not answer within {FORWARD_TIMEOUT_S:g} s\n".encode(), TEXT
        except (OSError, ValueError) as exc:
            return 502, f"the telemetry process's answer was cut short: {exc}\n".encode(), TEXT
        finally:
            writer.close()
        return _parse(response)


async def _read_to_end(reader: asyncio.StreamReader) -> bytes:
    """Everything until EOF; ValueError past :data:`MAX_RESPONSE_BYTES`."""
    chunks, size = [], 0
    while chunk := await reader.read(2**16):
        size += len(chunk)
        if size > MAX_RESPONSE_BYTES:
            raise ValueError(f"more than {MAX_RESPONSE_BYTES} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def _parse(response: bytes) -> tuple[int, bytes, str]:
    """Status, body and content type of an HTTP/1.0 answer (a 502 when it is not one)."""
    head, separator, body = response.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if not separator or len(parts) < 2 or not parts[0].startswith("HTTP/") or not parts[1].isdigit():
        return 502, b"the telemetry process answered something that is not HTTP\n", TEXT
    content_type = next((line.split(":", 1)[1].strip() for line in lines[1:]
                         if line.lower().startswith("content-type:")), TEXT)
    return int(parts[1]), body, content_type


def _answer(code: int, **fields: Any) -> tuple[int, bytes, str]:
    return code, (json.dumps(fields) + "\n").encode(), _JSON
