"""The LMCache front end of a cache process: a ZeroMQ ROUTER socket served from the process's selectors loop.

ZeroMQ's file descriptor is edge-triggered, so the socket is drained while it reports POLLIN, both
when the descriptor turns readable and after every pass of the loop (a send can consume the edge).
Every request gets a reply — the operation's result or its failure value; an operation mpcache does
not serve is answered as LMCache's server would, with one warning per client naming the fix.
``wait_prefetch_status`` is answered when the prefetch finishes or its timeout passes, never by
blocking the loop.
"""

from __future__ import annotations

import os
import selectors
import time
from collections.abc import Callable
from typing import Any

import zmq

from mpcache.cache.context import CacheContext
from mpcache.cache.dispatch import ErrorLog
from mpcache.cache.lmcache import wire
from mpcache.cache.lmcache.engine import EngineDriven
from mpcache.contract import protocol
from mpcache.errors import ConfigError, ProtocolError, RequestError

MAX_MESSAGE_BYTES = 64 << 20  # a request of a million tokens is about 5 MiB
MAX_WAITERS = 4096
MAX_WARNED_CLIENTS = 4096
_SERVED_MODE = '"lmcache.mp.mp_transfer_mode": "engine_driven"'
_UNSUPPORTED = {
    "register_kv_cache": f"lmcache_driven transfer (CUDA IPC handles) is not supported; set {_SERVED_MODE}",
    "unregister_kv_cache": f"lmcache_driven transfer is not supported; set {_SERVED_MODE}",
    "store": f"lmcache_driven store is not supported; set {_SERVED_MODE}",
    "retrieve": f"lmcache_driven retrieve is not supported; set {_SERVED_MODE}",
    "register_q_cache": "query caches are not supported", "unregister_q_cache": "query caches are not supported",
    "store_q": "query caches are not supported",
    "subscribe_kv_events": "KV event streams are not supported",
    "server_module_call": "server modules are not supported",
}
for _name in wire.OPERATION_NAMES:
    if _name.startswith("cb_"):
        _UNSUPPORTED[_name] = "cache blending over the LMCache protocol is not supported (use mpcache's cb_* ops)"
    elif _name.startswith("p2p_"):
        _UNSUPPORTED[_name] = "peer-to-peer transfer is not supported"


class _Waiter:
    __slots__ = ("prefix", "request_id", "deadline")

    def __init__(self, prefix: list[bytes], request_id: str, deadline: float) -> None:
        self.prefix = prefix
        self.request_id = request_id
        self.deadline = deadline


class LMCacheFrontEnd:
    """Binds ``urls`` (tcp:// or ipc://) and serves LMCache's MP protocol against ``ctx``."""

    def __init__(self, ctx: CacheContext, urls: list[str], selector: selectors.BaseSelector) -> None:
        self._ctx = ctx
        self._log = ctx.log
        self.engine = EngineDriven(ctx, pending_ttl_s=ctx.config.prefetch_job_ttl_s)
        self._client_error = ErrorLog(ctx.log)
        self._warned: dict[bytes, set[str]] = {}
        self._waiters: list[_Waiter] = []
        self._ipc_paths: list[str] = []
        self._zmq = zmq.Context(io_threads=1)
        self._socket = self._zmq.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a reply to a vanished client raises, not vanishes
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        try:
            for url in urls:
                self._bind(url)
        except BaseException:
            self.close()
            raise
        self.urls = list(urls)
        self._selector = selector
        self._fd = int(self._socket.getsockopt(zmq.FD))
        selector.register(self._fd, selectors.EVENT_READ, self._on_readable)
        self._handlers: dict[str, Callable[[list[Any]], Any]] = {
            "get_chunk_size": lambda args: ctx.chunk_tokens,
            "get_experimental": lambda args: [],
            "noop": lambda args: "OK",
            "ping": lambda args: self.engine.ping(None if not args or args[0] is None else wire.instance_id(args[0])),
            "register_kv_cache_engine_driven_context": lambda args: self.engine.register(_one(args)),
            "unregister_kv_cache_engine_driven_context":
                lambda args: self.engine.unregister(wire.instance_id(_one(args))),
            "lookup": lambda args: self.engine.lookup(wire.parse_key(_arg(args, 0, 2))),
            "query_prefetch_status": lambda args: self.engine.prefetch_status(_request_id(_one(args))),
            "free_lookup_locks": lambda args: self.engine.free_lookup_locks(wire.parse_key(_arg(args, 0, 2))),
            "end_session": lambda args: self.engine.end_session(_request_id(_one(args))),
            "prepare_store": lambda args: self.engine.prepare_store(*_key_and_instance(args, 2)),
            "commit_store": lambda args: self.engine.commit_store(*_key_and_instance(args, 3), args[2]),
            "prepare_retrieve": lambda args: self.engine.prepare_retrieve(*_key_and_instance(args, 2)),
            "commit_retrieve": lambda args: self.engine.commit_retrieve(*_key_and_instance(args, 2)),
            "clear": lambda args: self._clear(),
            "report_block_allocation": self._report_block_allocation,
        }

    def _bind(self, url: str) -> None:
        try:
            self._socket.bind(url)
        except zmq.ZMQError as exc:
            raise ConfigError(f"--lmcache-port/--lmcache-ipc: cannot listen on {url}: {exc.strerror}") from None
        if url.startswith("ipc://"):
            path = url[len("ipc://"):]
            os.chmod(path, 0o600)  # in the 0700 runtime directory; same-user clients only
            self._ipc_paths.append(path)

    def close(self) -> None:
        if getattr(self, "_selector", None) is not None:
            try:
                self._selector.unregister(self._fd)
            except (KeyError, ValueError):
                pass
        self.engine.close()
        self._socket.close(linger=0)
        self._zmq.term()
        for path in self._ipc_paths:
            try:
                os.unlink(path)
            except OSError:
                pass

    # -- the loop's hooks ---------------------------------------------------------------------

    def _on_readable(self, mask: int) -> None:
        self.service()

    def service(self) -> None:
        """Answer finished waits, then every request that has arrived (call after each loop pass)."""
        if self._waiters:
            self._answer_waiters()
        socket = self._socket
        while int(socket.getsockopt(zmq.EVENTS)) & zmq.POLLIN:
            try:
                frames = socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            self._handle(frames)

    def next_deadline(self) -> float | None:
        return min((waiter.deadline for waiter in self._waiters), default=None)

    def tick(self) -> None:
        """Heartbeat work: abandon prepared transfers past their deadline."""
        expired = self.engine.expire()
        if expired:
            self._log.warning("lmcache.transfers_abandoned", count=expired,
                              after_s=self._ctx.config.prefetch_job_ttl_s)

    # -- requests ------------------------------------------------------------------------------

    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) < 3:
            self._client_error("?", "protocol", f"a request of {len(frames)} frames has no operation; dropped")
            return
        identity, uid, op_frame, payloads = frames[0], frames[1], frames[2], frames[3:]
        prefix = [identity, uid, op_frame]
        if op_frame == b"":  # stream credit or cancel; no stream is ever open here
            return
        try:
            name = wire.operation_name(op_frame)
        except ProtocolError as exc:
            self._client_error("?", "protocol", str(exc))
            self._send(prefix)
            return
        self._ctx.sessions.expire()
        if name in _UNSUPPORTED:
            self._warn_once(identity, name)
            self._reply(prefix, wire.FAILURE.get(name))
            return
        if name == "wait_prefetch_status":
            self._wait(prefix, payloads)
            return
        try:
            result = self._handlers[name]([wire.decode(payload) for payload in payloads])
        except (ProtocolError, RequestError) as exc:
            self._client_error(name, "request" if isinstance(exc, RequestError) else "protocol", str(exc))
            result = wire.FAILURE.get(name)
        except Exception as exc:  # noqa: BLE001 - a bug in one request must not stop the server
            self._log.exception("lmcache.request_failed", op=name, error_type=type(exc).__name__)
            result = wire.FAILURE.get(name)
        finally:
            self._ctx.update_gauges()
        self._reply(prefix, result)

    def _reply(self, prefix: list[bytes], result: Any) -> None:
        self._send(prefix if result is None else prefix + [wire.encode(result)])

    def _send(self, frames: list[bytes]) -> None:
        try:
            self._socket.send_multipart(frames, zmq.NOBLOCK)
        except zmq.ZMQError as exc:  # the client went away, or is not reading its replies
            self._client_error("reply", "transport", f"reply dropped: {exc.strerror}")

    def _warn_once(self, identity: bytes, name: str) -> None:
        warned = self._warned.setdefault(identity, set())
        if name in warned:
            return
        if len(self._warned) > MAX_WARNED_CLIENTS:
            self._warned.clear()
        warned.add(name)
        self._log.warning("lmcache.unsupported_operation", op=name, client=identity.hex()[:32],
                          fix=_UNSUPPORTED[name])

    def _wait(self, prefix: list[bytes], payloads: list[bytes]) -> None:
        try:
            args = [wire.decode(payload) for payload in payloads]
            request_id = _request_id(_arg(args, 0, 2))
            timeout = args[1]
            if type(timeout) not in (int, float) or not 0 <= timeout <= 86400:
                raise ProtocolError("timeout: expected seconds in 0..86400")
        except ProtocolError as exc:
            self._client_error("wait_prefetch_status", "protocol", str(exc))
            self._reply(prefix, 0)
            return
        if not self.engine.is_pending(request_id) or len(self._waiters) >= MAX_WAITERS:
            self._reply(prefix, self.engine.prefetch_status(request_id))
            return
        self._waiters.append(_Waiter(prefix, request_id, time.monotonic() + timeout))

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
        self._waiters = waiting

    def _clear(self) -> None:
        evicted = self._ctx.l1.clear()
        self._log.info("lmcache.clear", evicted=evicted)

    def _report_block_allocation(self, args: list[Any]) -> None:
        self._ctx.l0.report(wire.instance_id(_arg(args, 0, 3)), _model(args[1]), wire.parse_block_records(args[2]))


def _arg(args: list[Any], index: int, count: int) -> Any:
    if len(args) != count:
        raise ProtocolError(f"expected {count} arguments, got {len(args)}")
    return args[index]


def _one(args: list[Any]) -> Any:
    return _arg(args, 0, 1)


def _request_id(value: Any) -> str:
    return protocol.REQUEST_ID(value, "request_id")


def _model(value: Any) -> str:
    return protocol.MODEL(value, "model_name")


def _key_and_instance(args: list[Any], count: int) -> tuple[wire.Key, int]:
    return wire.parse_key(_arg(args, 0, count)), wire.instance_id(args[1])
