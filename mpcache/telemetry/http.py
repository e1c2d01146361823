"""The telemetry process's HTTP endpoint (``/metrics``): one asyncio thread, bounded whatever clients do.

Any local user can connect, so nothing a client does costs more than a bounded amount: connections
are read without a thread each, a request must arrive within ``read_timeout_s`` and fit in
``MAX_REQUEST_BYTES``, at most ``max_connections`` are open (a new one evicts the oldest that has not
finished sending its request), and requests that arrive while an answer is being built share it.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

Route = Callable[[], tuple[int, bytes, str]]  # () -> (status, body, content type)

DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_READ_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 8192
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error",
            503: "Service Unavailable"}
_TEXT = "text/plain; charset=utf-8"


def metrics_route(registry: CollectorRegistry, before: Sequence[Callable[[], object]] = ()) -> Route:
    """The ``/metrics`` route over ``registry``; each of ``before`` is called first, in order, on every
    scrape (the telemetry process flushes its buffered instruments there)."""

    def route() -> tuple[int, bytes, str]:
        for hook in before:
            hook()
        return 200, generate_latest(registry), CONTENT_TYPE_LATEST

    return route


class MetricsHTTPServer:
    """Serves ``routes`` on ``address`` from its own thread; construct (binds), :meth:`start`, :meth:`close`."""

    def __init__(self, address: tuple[str, int], routes: dict[str, Route], log: Any, *,
                 max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> None:
        self.routes = routes
        self._log = log
        self._max_connections = max_connections
        self._read_timeout_s = read_timeout_s
        self.evicted = 0  # connections closed to make room for a new one
        self._reading: OrderedDict[int, asyncio.StreamWriter] = OrderedDict()  # still sending their request
        self._open = 0
        self._next_id = 0
        family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self._socket = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._socket.bind(address)
            self._socket.listen(128)
            self._socket.setblocking(False)
        except BaseException:
            self._socket.close()
            raise
        self.server_port: int = self._socket.getsockname()[1]
        self._collector = ThreadPoolExecutor(max_workers=1, thread_name_prefix="metrics-collect")
        self._inflight: dict[str, asyncio.Future[tuple[int, bytes, str]]] = {}  # path -> the answer being built
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name="metrics-http", daemon=True)
        self._started = threading.Event()

    def start(self) -> None:
        self._thread.start()
        self._started.wait(10)

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5)
        self._socket.close()
        self._collector.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        server = self._loop.run_until_complete(asyncio.start_server(self._handle, sock=self._socket,
                                                                    limit=MAX_REQUEST_BYTES))
        self._started.set()
        try:
            self._loop.run_forever()
        finally:
            server.close()
            pending = asyncio.all_tasks(self._loop)
            for task in pending:
                task.cancel()
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            self._loop.close()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn_id = self._next_id
        self._next_id += 1
        if self._open >= self._max_connections and self._reading:
            _, oldest = self._reading.popitem(last=False)  # the slowest sender gives way
            oldest.close()
            self.evicted += 1
        self._open += 1
        self._reading[conn_id] = writer
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._read_timeout_s)
            except (asyncio.TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
                return
            finally:
                self._reading.pop(conn_id, None)
            status, body, content_type = await self._answer(head)
            writer.write(b"HTTP/1.0 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                         % (status, _REASONS.get(status, "").encode(), content_type.encode(), len(body)))
            if not head.startswith(b"HEAD "):
                writer.write(body)
            await asyncio.wait_for(writer.drain(), self._read_timeout_s)
        except (asyncio.TimeoutError, ConnectionError):
            pass
        except asyncio.CancelledError:
            # close() cancels handlers still answering; ending normally keeps Python 3.11's stream callback
            # from logging the cancelled task's CancelledError as an asyncio error
            pass
        finally:
            self._open -= 1
            writer.close()

    async def _answer(self, head: bytes) -> tuple[int, bytes, str]:
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return 400, b"bad request\n", _TEXT
        if parts[0] not in (b"GET", b"HEAD"):
            return 405, b"only GET\n", _TEXT
        path = parts[1].split(b"?", 1)[0].decode("latin-1")
        route = self.routes.get(path)
        if route is None:
            return 404, b"not found: try /metrics\n", _TEXT
        answer = self._inflight.get(path)
        if answer is None:  # requests that arrive while it is being built share it
            answer = self._inflight[path] = self._loop.run_in_executor(self._collector, route)

            def forget(_: object, path: str = path) -> None:
                self._inflight.pop(path, None)

            answer.add_done_callback(forget)
        try:
            return await asyncio.shield(answer)
        except Exception:  # noqa: BLE001 - one failed collection must not take the endpoint down
            self._log.exception("http.route_failed", path=parts[1][:64].decode("latin-1"))
            return 500, b"collection failed\n", _TEXT
