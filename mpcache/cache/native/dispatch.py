"""One request payload (and the file descriptors that came with it) in, one reply out: decode, validate,
run the operation, turn failures into one-line error replies (and a caught timeout into TIMEOUT_RAISED),
close the descriptors.  Transport-free.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

from mpcache.cache.buffers import Peer
from mpcache.cache.context import CacheContext
from mpcache.cache.native.ops.registry import Operation
from mpcache.cache.timeouts import MpcacheTimeoutError, publish_timeout
from mpcache.contract import protocol
from mpcache.errors import ProtocolError, RequestError

MAX_TRACKED_CLIENTS = 4096  # clients whose log budget is tracked; more clear the table


class RateLimit:
    """At most ``per_second`` lines a second in all, and per client and kind (an operation) at most
    ``per_client`` lines per ``client_window_s``; :meth:`allow` also says how many were suppressed since."""

    def __init__(self, per_second: int = 10, per_client: int = 1, client_window_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._per_second = per_second
        self._per_client = per_client
        self._client_window_s = client_window_s
        self._clock = clock
        self._window = 0.0
        self._count = 0
        self._suppressed = 0
        self._clients: dict[tuple[bytes, str], list[float]] = {}  # (client, kind) → [window start, lines, suppressed]

    def allow(self, client: bytes | None, kind: str = "") -> dict[str, Any] | None:
        """None: suppress this line; else the fields it carries about earlier suppressed lines."""
        now = self._clock()
        if now - self._window >= 1.0:
            self._window = now
            self._count = 0
        state = None
        if client is not None:
            state = self._clients.get((client, kind))
            if state is None or now - state[0] >= self._client_window_s:
                if state is None and len(self._clients) >= MAX_TRACKED_CLIENTS:
                    self._clients.clear()
                state = self._clients[(client, kind)] = [now, 0, state[2] if state is not None else 0]
            if state[1] >= self._per_client:
                state[2] += 1
                return None
        if self._count >= self._per_second:
            self._suppressed += 1
            return None
        self._count += 1
        suppressed = self._suppressed
        self._suppressed = 0
        extra: dict[str, Any] = {}
        if state is not None:
            state[1] += 1
            extra["client"] = client.hex()[:32] if client else ""
            suppressed += int(state[2])
            state[2] = 0
        if suppressed:
            extra["suppressed"] = suppressed  # lines not logged since the last one (this client's, and any)
        return extra


class ErrorLog:
    """Client errors as ``client.error`` lines, rate-limited (:class:`RateLimit`), at ``level`` (warning;
    debug under ``--demo``, whose clients fail on purpose and count it themselves)."""

    def __init__(self, log: Any, per_second: int = 10, clock: Callable[[], float] = time.monotonic,
                 level: str = "warning") -> None:
        self._emit = getattr(log, level)
        self._limit = RateLimit(per_second, clock=clock)

    def __call__(self, op: str, error_type: str, message: str, client: bytes | None = None) -> None:
        extra = self._limit.allow(client, op)
        if extra is not None:
            self._emit("client.error", op=protocol.bounded(op)[:64], error_type=error_type,
                       error=protocol.bounded(message), **extra)


class Dispatcher:
    """Runs the operations of one table against one cache context."""

    def __init__(self, ctx: CacheContext, operations: Mapping[str, Operation]) -> None:
        self._ctx = ctx
        self._operations = operations
        self._schemas = {name: op.fields for name, op in operations.items()}
        self.client_error = ErrorLog(ctx.log, level="debug" if ctx.config.demo else "warning")

    def __call__(self, peer: Peer, payload: bytes, fds: list[int]) -> dict:
        """One request → one reply; ``fds`` (received with it) are closed before this returns, whatever
        happened: a handler uses its descriptor but never keeps it.  Errors become error replies; the
        loop goes on."""
        try:
            return self._run(peer, payload, fds)
        finally:
            for fd in fds:
                os.close(fd)

    def _run(self, peer: Peer, payload: bytes, fds: list[int]) -> dict:
        ctx = self._ctx
        message = None
        op = "?"
        try:
            message = protocol.decode_payload(payload)
            request = protocol.parse_request(message, self._schemas)
            op = request.op
            operation = self._operations[op]
            args = request.args
            if len(fds) != int(operation.descriptor):
                wanted = "one file descriptor (SCM_RIGHTS) with its frame" if operation.descriptor else \
                    "no file descriptor"
                raise ProtocolError(f"{op}: expects {wanted}, got {len(fds)}")
            if operation.descriptor:
                args["fd"] = fds[0]
            ctx.sessions.expire()
            reply = operation.handler(ctx, peer, args)
            reply["id"] = request.id
            reply["ok"] = True
            return reply
        except MpcacheTimeoutError as exc:
            publish_timeout(ctx.publisher, exc)
            error_type, text = "timeout", f"timeout: {exc}"
        except ProtocolError as exc:
            error_type, text = "protocol", str(exc)
        except RequestError as exc:
            error_type, text = "request", str(exc)
        except Exception as exc:  # a bug in one request must not stop the server
            ctx.log.exception("request.failed", op=op)
            error_type, text = "internal", f"internal error: {type(exc).__name__}"
        finally:
            ctx.update_gauges()
        if isinstance(message, dict) and type(message.get("op")) is str:
            op = message["op"][:64]
        self.client_error(op, error_type, text)
        return protocol.error_reply(protocol.message_id(message), error_type, text)
