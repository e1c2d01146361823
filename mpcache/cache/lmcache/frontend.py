"""The LMCache front end of a cache process: LMCache's MP protocol on a ZeroMQ ROUTER endpoint
(:mod:`.router`, ZMTP spoken in this process) served from the process's selectors loop.

Every request gets a reply — the operation's result or its failure value; an operation mpcache does
not serve is answered with its failure value and one warning per client naming the fix.  What each operation
takes, how it fails and which handler serves it is its row in :mod:`.operations`.
``wait_prefetch_status`` is answered when the prefetch finishes or its timeout passes, never by
blocking the loop.  No connection is served before its peer is known (:mod:`.gate`, as it is
accepted); every frame is bounded (size, decoded objects) and one pass over the backlog is bounded in
time, so the loop's timers (the heartbeat above all) run between messages.
"""

from __future__ import annotations

import os
import selectors
import time
import traceback
from typing import Any

from mpcache.cache.client_errors import ErrorLog, RateLimit
from mpcache.cache.context import CacheContext
from mpcache.cache.lmcache import inline, wire
from mpcache.cache.lmcache.capacity import Capacity
from mpcache.cache.lmcache.engine import EngineDriven
from mpcache.cache.lmcache.gate import PeerGate
from mpcache.cache.lmcache.handlers import LMCacheHandlers, Subscribe, Wait
from mpcache.cache.lmcache.kvevents import KVEventStreams
from mpcache.cache.lmcache.operations import OperationFrames
from mpcache.cache.lmcache.router import Gone, Router
from mpcache.cache.lmcache.timing import RequestTimes
from mpcache.contract import protocol
from mpcache.errors import ProtocolError, RequestError
from mpcache.shm import layout

MAX_WAITERS = 4096
INVALID = "invalid"  # the op a reply to a request naming no known operation is timed under
_WAIT = "wait_prefetch_status"
MAX_WARNED_CLIENTS = 4096
MAX_ARGUMENTS = 8  # frames after the operation; LMCache's largest request has 5
MAX_FRAMES = 64  # a message of more frames drops its connection; up to here it is answered as invalid
PASS_BUDGET_S = 0.05  # one pass over the backlog stops after this, so the loop's timers run between messages


class _Waiter:
    __slots__ = ("prefix", "request_id", "deadline", "received_ns")

    def __init__(self, prefix: list[bytes], request_id: str, deadline: float, received_ns: int) -> None:
        self.prefix = prefix
        self.request_id = request_id
        self.deadline = deadline
        self.received_ns = received_ns


class LMCacheFrontEnd:
    """Binds ``urls`` (tcp:// or ipc://) and serves LMCache's MP protocol against ``ctx``."""

    def __init__(self, ctx: CacheContext, urls: list[str], selector: selectors.BaseSelector) -> None:
        self._ctx = ctx
        self._log = ctx.log
        config = ctx.config
        self.engine = EngineDriven(ctx, pending_ttl_s=config.prefetch_job_ttl_s)
        self._times = RequestTimes(ctx.publisher)
        self._sent_ns = 0  # when the last reply was handed to the socket
        errors = ErrorLog(ctx.log)
        self._failure_log = RateLimit()
        self._client: bytes | None = None  # the identity of the client whose request is in hand
        self._client_error = lambda op, kind, message: errors(op, kind, message, client=self._client)
        self._own_uid = os.geteuid()
        self.gate = PeerGate({self._own_uid, *config.lmcache_allow_uids}, allow_remote=config.lmcache_allow_remote,
                             log=ctx.log, on_refused=lambda: ctx.gauges.add(layout.G_LMCACHE_REFUSED, 1),
                             on_unidentified=lambda: ctx.gauges.add(layout.G_LMCACHE_UNIDENTIFIED, 1))
        # with one possible owner no message needs its peer's uid; with several, each connection has its own
        one_owner = len(self.gate.allowed) == 1 and not config.lmcache_allow_remote
        self._warned: dict[bytes, set[str]] = {}
        inline_frame = inline.frame_bytes(ctx.l1.capacity_bytes)
        self.capacity = Capacity(ctx, self.engine.registrations)
        self.streams = KVEventStreams(ctx.l1.feed, ctx.l1, self._stream_send, self.capacity.of,
                                      ctx.storage.held)
        self._handlers = LMCacheHandlers(ctx, self.engine, self.streams, one_owner=one_owner,
                                         warn_once=self._warn_once,
                                         widen=lambda client: self._router.widen(client, inline_frame))
        self._operation = OperationFrames()
        self._waiters: list[_Waiter] = []
        self._backlog = False
        self._router = Router(urls, selector, self.gate, max_frame=wire.frame_cap(config.lmcache_max_tokens),
                              max_frames=MAX_FRAMES,
                              report=lambda message, client: errors("connection", "transport", message, client))
        self.urls = list(urls)

    def close(self) -> None:
        self._times.flush()
        self.streams.close()
        self.engine.close()
        self._router.close()
        self.gate.close()

    # -- the loop's hooks ---------------------------------------------------------------------

    def service(self) -> None:
        """Answer finished waits, then the requests that have arrived, for at most ``PASS_BUDGET_S``, then accept
        new connections (call after each loop pass; :meth:`next_deadline` says when more is left)."""
        router = self._router
        if self._waiters:
            self._answer_waiters()
        deadline = time.monotonic() + PASS_BUDGET_S
        self._backlog = False
        while (message := router.receive()) is not None:
            frames, owner = message
            received_ns = time.monotonic_ns()
            op = self._handle(frames, owner, received_ns)
            if op is not None:
                self._times.record(op, self._sent_ns - received_ns)
            if time.monotonic() >= deadline:
                self._backlog = True
                break
        self._backlog = self._backlog or router.backlogged
        router.accept_waiting()
        self.streams.pump()  # what this pass (or the other front end's, before it) changed in L1

    def next_deadline(self) -> float | None:
        self._router.expire()  # handshakes past their deadline, paused listeners (nothing to do, mostly)
        if self._backlog:
            return time.monotonic()
        deadlines = [waiter.deadline for waiter in self._waiters]
        router_deadline = self._router.next_deadline()
        if router_deadline is not None:
            deadlines.append(router_deadline)
        return min(deadlines, default=None)

    def tick(self) -> None:
        """Heartbeat work: publish the service times counted (once a second) and what each model takes of the
        tiers, report the KV event feed, abandon prepared transfers past their deadline."""
        self._times.tick(time.monotonic_ns())
        self.capacity.publish()
        self.streams.report(self._ctx.gauges)
        expired = self.engine.expire()
        if expired:
            self._log.warning("lmcache.transfers_abandoned", count=expired,
                              after_s=self._ctx.config.prefetch_job_ttl_s)

    # -- requests ------------------------------------------------------------------------------

    def _handle(self, frames: list[bytes], owner: int, received_ns: int) -> str | None:
        """Answer one request; the operation its reply was for (``INVALID`` for none known), None when no reply
        was sent now."""
        self._client = frames[0] if frames else None
        if len(frames) < 3:
            self._client_error("?", "protocol", f"a request of {len(frames)} frames has no operation; dropped")
            return None
        if len(frames) > 3 + MAX_ARGUMENTS:
            self._client_error("?", "protocol", f"a request of {len(frames)} frames; at most {MAX_ARGUMENTS} "
                               "arguments are accepted")
            self._send(frames[:3])
            return INVALID
        identity, uid, op_frame, payloads = frames[0], frames[1], frames[2], frames[3:]
        prefix = [identity, uid, op_frame]
        if op_frame == b"":  # a stream's credit or cancel
            self.streams.control(identity, uid, payloads[0] if len(payloads) == 1 else b"")
            return None
        try:
            operation = self._operation(op_frame)
        except ProtocolError as exc:
            self._client_error("?", "protocol", str(exc))
            self._send(prefix)
            return INVALID
        name = operation.name
        self._ctx.sessions.expire()
        if operation.unsupported is not None:
            self._warn_once(identity, name, "lmcache.unsupported_operation", operation.unsupported)
            self._reply(prefix, operation.failure)
            return name
        handlers = self._handlers
        handlers.client = identity
        try:
            fewest, most = operation.arguments
            if not fewest <= len(payloads) <= most:
                expected = fewest if fewest == most else f"{fewest} to {most}"
                raise ProtocolError(f"expected {expected} arguments, got {len(payloads)}")
            decode = handlers.decode
            if operation.keyed:  # the key stays a frame: its token list is read straight into int64s
                args = [payloads[0], *[decode(payload) for payload in payloads[1:]]]
            else:
                args = [decode(payload) for payload in payloads]
            result = operation.handler(handlers, args, owner)  # type: ignore[misc]
        except (ProtocolError, RequestError) as exc:
            self._client_error(name, "request" if isinstance(exc, RequestError) else "protocol", str(exc))
            result = operation.failure
        except Exception as exc:  # noqa: BLE001 - a bug in one request must not stop the server
            self._internal_error(name, exc)
            result = operation.failure
        finally:
            self._ctx.update_gauges()
        if type(result) is Subscribe:
            self.streams.subscribe(prefix, result.instance_id, result.model_name, result.cursor, result.max_events)
            self.streams.pump()  # its first batch, at once
            return name
        if type(result) is Wait:
            if len(self._waiters) < MAX_WAITERS:
                self._waiters.append(_Waiter(prefix, result.request_id, time.monotonic() + result.timeout,
                                             received_ns))
                return None  # timed when answered
            result = self.engine.prefetch_status(result.request_id)
        self._reply(prefix, result)
        return name

    def _internal_error(self, op: str, exc: Exception) -> None:
        """A handler failed on something no validator caught (a bug): one error line naming where, rate-limited
        apart from client errors, so that a flood neither fills the log nor hides the bug."""
        extra = self._failure_log.allow(self._client, op)
        if extra is None:
            return
        frame = traceback.extract_tb(exc.__traceback__)[-1] if exc.__traceback__ else None
        where = f"{frame.filename}:{frame.lineno}" if frame else ""
        self._log.error("lmcache.request_failed", op=op, error_type=type(exc).__name__,
                        error=protocol.bounded(str(exc)), at=where, **extra)

    def _reply(self, prefix: list[bytes], result: Any) -> None:
        self._send(prefix if result is None else prefix + [wire.encode(result)])

    def _send(self, frames: list[bytes]) -> None:
        """Send a reply; its service time ends here, before the client can have it (``_sent_ns``)."""
        self._sent_ns = time.monotonic_ns()
        try:
            self._router.send(frames)
        except Gone:
            self._client_error("reply", "transport", "reply dropped: the client's connection has closed")

    def _stream_send(self, prefix: list[bytes], batch: Any) -> bool:
        """A stream's batch (None: the reply that ends it); False when its connection has closed."""
        self._sent_ns = time.monotonic_ns()
        try:
            self._router.send(prefix if batch is None else prefix + [wire.encode(batch)])
        except Gone:
            return False
        return True

    def _warn_once(self, identity: bytes, name: str, event: str, fix: str) -> None:
        """One warning per client and operation."""
        warned = self._warned.get(identity)
        if warned is None:
            if len(self._warned) >= MAX_WARNED_CLIENTS:  # started over before this client's entry, not after
                self._warned.clear()
            warned = self._warned[identity] = set()
        if name in warned:
            return
        warned.add(name)
        self._log.warning(event, op=name, client=identity.hex()[:32], fix=fix)

    def _answer_waiters(self) -> None:
        now = time.monotonic()
        waiting = []
        for waiter in self._waiters:
            if not self.engine.is_pending(waiter.request_id):
                self._reply(waiter.prefix, self.engine.prefetch_status(waiter.request_id))
            elif now >= waiter.deadline:
                self._send(waiter.prefix)  # None: the wait timed out
            else:
                waiting.append(waiter)
                continue
            self._times.record(_WAIT, self._sent_ns - waiter.received_ns)
        self._waiters = waiting
