"""One request payload (and the file descriptors that came with it) in, one reply out: decode, validate,
run the operation, turn failures into one-line error replies (and a caught timeout into TIMEOUT_RAISED),
close the descriptors.  Transport-free.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from mpcache.cache.buffers import Peer
from mpcache.cache.client_errors import ErrorLog
from mpcache.cache.context import CacheContext
from mpcache.cache.native.ops.registry import Operation
from mpcache.cache.timeouts import MpcacheTimeoutError, publish_timeout
from mpcache.contract import protocol
from mpcache.errors import ProtocolError, RequestError


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
