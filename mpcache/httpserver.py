"""The service's HTTP listeners: one asyncio thread each, bounded whatever clients do.

The supervisor's front (the public port: health answered by itself, everything else forwarded) and the
telemetry process's private endpoint (``/metrics`` on a Unix socket in the runtime dir) are both this server.
Any local user can connect to the public one, so nothing a client does costs more than a bounded amount:
connections are read without a thread each, a request must arrive within ``read_timeout_s`` and fit in
``MAX_REQUEST_BYTES``, at most ``max_connections`` are open (a new one evicts the oldest that has not finished
sending its request), and requests that arrive while an answer is being built share it.
"""

from __future__ import annotations

import asyncio
import contextlib
import http.client
import ipaddress
import os
import socket
import stat
import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

Route = Callable[[], tuple[int, bytes, str]]  # () -> (status, body, content type), run on the collector thread
Forward = Callable[[bytes], Awaitable[tuple[int, bytes, str]]]  # request head -> answer, awaited on the loop

DEFAULT_MAX_CONNECTIONS = 256
DEFAULT_READ_TIMEOUT_S = 5.0
MAX_REQUEST_BYTES = 8192
DISCARD_BYTES = 1 << 20  # read past a refused request head at most, so that the refusal is not lost in a reset
_REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 405: "Method Not Allowed", 408: "Request Timeout",
            431: "Request Header Fields Too Large", 500: "Internal Server Error", 502: "Bad Gateway",
            503: "Service Unavailable", 504: "Gateway Timeout"}
TEXT = "text/plain; charset=utf-8"
NOT_FOUND = b"not found: try "  # then the routes served, comma-separated


class BoundedHTTPServer:
    """Serves ``routes`` on ``address`` (host and port, or a Unix socket's path) from its own thread; a path
    with no route goes to ``forward`` when given, else is a 404.  Construct (binds: connections wait in the
    backlog), :meth:`start` (answers them), :meth:`close`."""

    def __init__(self, address: tuple[str, int] | str, routes: dict[str, Route], log: Any, *,
                 forward: Forward | None = None, max_connections: int = DEFAULT_MAX_CONNECTIONS,
                 read_timeout_s: float = DEFAULT_READ_TIMEOUT_S) -> None:
        self.routes = routes
        self._forward = forward
        self._log = log
        self._max_connections = max_connections
        self._read_timeout_s = read_timeout_s
        self.evicted = 0  # connections closed to make room for a new one
        self._reading: OrderedDict[int, asyncio.StreamWriter] = OrderedDict()  # still sending their request
        self._open = 0
        self._next_id = 0
        if isinstance(address, str):
            self._socket = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            _remove_stale_socket(address)  # a killed predecessor's
        else:
            self._socket = socket.socket(socket.AF_INET6 if ":" in address[0] else socket.AF_INET, socket.SOCK_STREAM)
            self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            self._socket.bind(address)
            if isinstance(address, str):
                os.chmod(address, 0o600)  # in the 0700 runtime dir already: the service's uid alone
            self._socket.listen(128)
            self._socket.setblocking(False)
        except BaseException:
            self._socket.close()
            raise
        self.server_port: int = 0 if isinstance(address, str) else self._socket.getsockname()[1]
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
            head = b""
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._read_timeout_s)
            except asyncio.LimitOverrunError:
                status, content_type = 431, TEXT
                body = f"a request head is {MAX_REQUEST_BYTES} bytes at most\n".encode()
            except asyncio.TimeoutError:
                status, content_type = 408, TEXT
                body = f"no whole request head within {self._read_timeout_s:g} s (it ends with CRLF CRLF)\n".encode()
            except (asyncio.IncompleteReadError, ConnectionError):  # the client left
                return
            finally:
                self._reading.pop(conn_id, None)
            if head:
                status, body, content_type = await self._answer(head)
            allow = b"Allow: GET, HEAD\r\n" if status == 405 else b""
            writer.write(b"HTTP/1.0 %d %s\r\nContent-Type: %s\r\nContent-Length: %d\r\n%sConnection: close\r\n\r\n"
                         % (status, _REASONS.get(status, "").encode(), content_type.encode(), len(body), allow))
            if not is_head(head):
                writer.write(body)
            await asyncio.wait_for(writer.drain(), self._read_timeout_s)
            if status == 431:  # its client may still be sending: closing on unread bytes resets the connection
                await self._discard(reader, writer)
        except (asyncio.TimeoutError, ConnectionError):
            pass
        except asyncio.CancelledError:
            # close() cancels handlers still answering; ending normally keeps Python 3.11's stream callback
            # from logging the cancelled task's CancelledError as an asyncio error
            pass
        finally:
            self._open -= 1
            writer.close()

    async def _discard(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read and drop what the client still sends, up to DISCARD_BYTES within the read timeout, once the answer
        is out and our side is shut (its FIN tells the client to stop): a close with unread bytes would reset the
        connection, and the client lose the answer."""
        if writer.can_write_eof():
            writer.write_eof()
        deadline, left = self._loop.time() + self._read_timeout_s, DISCARD_BYTES
        with contextlib.suppress(asyncio.TimeoutError, ConnectionError):
            while left > 0 and (chunk := await asyncio.wait_for(reader.read(min(left, 1 << 16)),
                                                                max(0.0, deadline - self._loop.time()))):
                left -= len(chunk)

    async def _answer(self, head: bytes) -> tuple[int, bytes, str]:
        parts = head.split(b"\r\n", 1)[0].split()
        if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
            return 400, b"bad request\n", TEXT
        if parts[0] not in (b"GET", b"HEAD"):
            return 405, b"only GET and HEAD\n", TEXT
        path = parts[1].split(b"?", 1)[0].decode("latin-1")
        route = self.routes.get(path)
        if route is None and self._forward is not None:
            status, body, content_type = await self._forward(head)
            if status == 404 and body.startswith(NOT_FOUND):  # the other end's routes: ours are asked here too
                body = _not_found([*self.routes, *body[len(NOT_FOUND):].decode("latin-1").strip().split(", ")])
            return status, body, content_type
        if route is None:
            return 404, _not_found(self.routes), TEXT
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
            return 500, b"collection failed\n", TEXT


def _remove_stale_socket(path: str) -> None:
    """Unlink the socket file at ``path`` (a killed listener's), nothing else that may be there."""
    with contextlib.suppress(FileNotFoundError):
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)


def _not_found(routes: Iterable[str]) -> bytes:
    return NOT_FOUND + f"{', '.join(sorted(set(routes) - {''}))}\n".encode()


def is_head(head: bytes) -> bool:
    """Whether a request head asks with the HEAD method (its first word, as :meth:`BoundedHTTPServer._answer`
    splits the request line)."""
    return head.split(None, 1)[:1] == [b"HEAD"]


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address."""
    try:
        infos = socket.getaddrinfo(host, None)
    except socket.gaierror:
        return False
    return all(ipaddress.ip_address(str(info[4][0]).split("%")[0]).is_loopback for info in infos)


def get_unix(path: str, url_path: str, timeout_s: float = 10.0) -> tuple[int, bytes]:
    """(status, body) of ``GET url_path`` from the listener on the Unix socket ``path`` (the telemetry process's
    endpoint, read without the supervisor's front: a benchmark's, a test's); OSError when nothing answers."""
    connection = http.client.HTTPConnection("localhost", timeout=timeout_s)
    connection.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    connection.sock.settimeout(timeout_s)
    try:
        connection.sock.connect(path)
        connection.request("GET", url_path)
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()
