"""What an inference engine links: a blocking client for one cache process.

KV bytes move only through shared memory (or CUDA IPC): a client registers a buffer of blocks once (a
sealed memfd whose descriptor travels with the request), then names blocks by index; the socket carries
small msgpack messages (``docs/PROTOCOL.md``).  Refusals raise :class:`~mpcache.errors.RequestError`
(:class:`~mpcache.errors.ProtocolError` for a malformed request, :class:`CacheTimeoutError` at a
server-side deadline).  Not thread-safe.

Reconnection: when the connection breaks during an operation (the cache process was killed, crashed or restarted),
the client reconnects to the same socket path — retrying with backoff (50 ms doubling to 1 s) for up to
``reconnect_timeout_s`` while the supervisor restarts the process — registers every buffer again (their
``buffer_id`` changes; their blocks stay where they are) and then raises :class:`CacheConnectionLost` naming the
operation that was in flight: it is not retried, because it may or may not have taken effect.  The next call works
on the new connection.  Ids the old process handed out (prefetch jobs, blend lookups) mean nothing to the new one:
:attr:`CacheClient.generation` counts reconnections, so a caller can tell.  If it cannot reconnect in time (or the
runtime dir is gone: the service stopped), :class:`CacheConnectionLost` says so, and the next call tries again.  A
connection closed while idle is taken up quietly (:mod:`mpcache.client.connection`).
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket
import time
from collections.abc import Sequence
from typing import Any

from mpcache.client.buffers import BlockBuffer, KVBuffer, RegisteredBuffer
from mpcache.client.connection import (
    RECONNECT_FIRST_PAUSE_S,
    RECONNECT_MAX_PAUSE_S,
    CacheConnectionLost,
    CacheTimeoutError,
    closed_by_server,
    connect,
    listener_identity,
)
from mpcache.client.cuda import CudaKVBuffer, register_cuda_buffer
from mpcache.client.results import (
    BlendLookup,
    BlendStoreResult,
    BlockReport,
    PrefetchStatus,
    RetrieveResult,
    ServerInfo,
    StoreResult,
    from_reply,
)
from mpcache.contract import protocol
from mpcache.errors import ProtocolError, RequestError

# One scheduler step's record: (request id, its newly allocated block ids, those blocks' token ids).
BlockRecord = tuple[str, Sequence[int], Sequence[int]]


class CacheClient:
    """One connection to one cache process (re-established after the process restarts)."""

    def __init__(self, socket_path: str, connect_timeout_s: float = 5.0, reconnect_timeout_s: float = 10.0) -> None:
        self._socket_path = socket_path
        self._connect_timeout_s = connect_timeout_s
        self._reconnect_timeout_s = reconnect_timeout_s
        self._sock: socket.socket | None = self._connect()
        self._ids = itertools.count(1)
        self._rbuf = bytearray()
        self._buffers: dict[int, RegisteredBuffer] = {}
        self._tag = secrets.token_hex(4)
        self._buffer_seq = itertools.count()
        self._closed = False
        self._closing = False
        self.generation = 0  # reconnections so far; ids from an earlier generation's process are gone
        self.refused_buffers: list[str] = []  # buffers a new process would not register again, and why
        self._renamed: dict[int, int] = {}  # the last reconnection's buffer ids: old → new

    # -- plumbing -------------------------------------------------------------------

    def _connect(self) -> socket.socket:
        """A new connection; notes which listening socket serves it."""
        sock = connect(self._socket_path, self._connect_timeout_s)
        self._listener = listener_identity(sock, self._socket_path)
        return sock

    def call(self, op: str, **args: Any) -> dict[str, Any]:
        """Send one request and wait for its reply; raise on an error reply.

        A broken connection raises :class:`CacheConnectionLost` after reconnecting (see the module)."""
        return self._call(op, args, [])

    def _call(self, op: str, args: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        """:meth:`call`, with ``fds`` sent alongside the request (SCM_RIGHTS)."""
        if self._closed:
            raise ConnectionError("the client is closed")
        if self._ensure_open(op) and "buffer_id" in args:  # named by its id on the connection before
            args = {**args, "buffer_id": self._renamed.get(args["buffer_id"], args["buffer_id"])}
        try:
            reply, ok = self._exchange(op, args, fds)
        except (ConnectionError, OSError) as exc:
            if isinstance(exc, TimeoutError) or self._closing:
                raise
            self._reconnect(op, exc)
            raise AssertionError("unreachable") from None
        return self._result(reply, ok)

    def _ensure_open(self, op: str) -> bool:
        """Connect again, before anything of ``op`` is sent, if the connection is gone (lost earlier, or closed
        by the cache process: quietly if the same process answers again); True if it did."""
        if self._sock is not None and closed_by_server(self._sock):
            self._reconnect(op, ConnectionResetError("closed by the cache process"), same=self._listener)
            return True
        if self._sock is not None:
            return False
        self._reconnect(op, None, raise_when_back=False)
        return True

    def _exchange(self, op: str, args: dict[str, Any], fds: list[int]) -> tuple[dict[str, Any], bool]:
        """One request on the current socket, ``fds`` sent with its first byte: its reply and whether it
        succeeded (ConnectionError/OSError if the socket breaks)."""
        assert self._sock is not None
        request_id = next(self._ids)
        frame = protocol.encode_frame({"op": op, "id": request_id, **args})
        sent = socket.send_fds(self._sock, [frame], fds) if fds else 0
        if sent < len(frame):
            self._sock.sendall(frame[sent:])
        while True:
            reply = self._read_reply()
            if not isinstance(reply, dict):
                raise ProtocolError(f"reply is not a map: {str(reply)[:200]}")
            answered = reply.get("id")
            if answered == request_id or answered is None:
                break
            if not (type(answered) is int and answered < request_id):
                raise ProtocolError(f"reply answers request {answered!r}, expected {request_id}")
            # a reply to an earlier call that was interrupted before it read it: skip
        if reply.get("ok") is True and answered == request_id:
            del reply["id"], reply["ok"]
            return reply, True
        return reply, False

    @staticmethod
    def _result(reply: dict[str, Any], ok: bool) -> dict[str, Any]:
        if ok:
            return reply
        message = str(reply.get("error", "error reply without a message"))
        error_type = reply.get("error_type")
        if error_type == "timeout":
            raise CacheTimeoutError(message)
        if error_type == "protocol":
            raise ProtocolError(message)
        raise RequestError(message)

    def _drop_socket(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        self._rbuf.clear()

    def _reconnect(self, op: str, cause: BaseException | None, raise_when_back: bool = True,
                   same: tuple[int, ...] | None = None) -> None:
        """Connect again and register every buffer anew, retrying with backoff; then raise
        :class:`CacheConnectionLost` for ``op`` — also once reconnected if ``raise_when_back`` (``op``
        was in flight) unless the listener is ``same`` (the process served before), otherwise return and
        let ``op`` go ahead (a new generation unless the process is the same)."""
        self._drop_socket()
        path = self._socket_path
        what = f"the connection to the cache process at {path} broke ({cause})" if cause else \
            f"not connected to the cache process at {path}"
        deadline = time.monotonic() + self._reconnect_timeout_s
        pause = RECONNECT_FIRST_PAUSE_S
        last: BaseException | None = cause
        while True:
            try:
                self._sock = self._connect()
                self._reregister()
                if same is not None and self._listener == same:
                    return
                self.generation += 1
                if not raise_when_back:
                    return
                raise CacheConnectionLost(
                    f"{op} failed: {what}; reconnected and registered {len(self._buffers)} buffer(s) again "
                    f"(new buffer ids); {op} was not retried", op, reconnected=True) from cause
            except (ConnectionError, OSError) as exc:
                if isinstance(exc, CacheConnectionLost):
                    raise
                self._drop_socket()
                last = exc
            if not os.path.isdir(os.path.dirname(path) or "."):
                reason = "its runtime dir is gone: the service stopped"
                break
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                reason = f"could not reconnect within {self._reconnect_timeout_s:g} s ({last})"
                break
            time.sleep(min(pause, remaining))
            pause = min(2 * pause, RECONNECT_MAX_PAUSE_S)
        raise CacheConnectionLost(f"{op} failed: {what}; {reason}; the next call tries again", op,
                                  reconnected=False) from cause

    def _reregister(self) -> None:
        """Register every buffer with the (new) server again and give each its new id.  One the server
        refuses now is dropped from this client (using it is an "unknown buffer" error) and named in
        :attr:`refused_buffers`."""
        registered: dict[int, RegisteredBuffer] = {}
        self._renamed = {}
        for buffer in self._buffers.values():
            op, args, fds = buffer._registration()
            try:
                new_id = self._result(*self._exchange(op, args, fds))["buffer_id"]
            except (RequestError, ProtocolError) as exc:
                self.refused_buffers.append(f"{op} of buffer {buffer.buffer_id}: {exc}")
                continue
            self._renamed[buffer.buffer_id] = new_id
            buffer.buffer_id = new_id
            registered[new_id] = buffer
        self._buffers = registered

    def _read_reply(self) -> object:
        header = protocol.FRAME_HEADER
        self._fill(header.size)
        (length,) = header.unpack_from(self._rbuf)
        if length > protocol.MAX_FRAME_BYTES:
            raise ProtocolError(f"reply frame of {length} bytes exceeds the limit")
        end = header.size + length
        self._fill(end)
        payload = bytes(self._rbuf[header.size:end])
        del self._rbuf[:end]
        return protocol.decode_payload(payload)

    def _fill(self, size: int) -> None:
        """Receive until at least ``size`` bytes are buffered (usually one recv for a whole reply)."""
        assert self._sock is not None
        while len(self._rbuf) < size:
            data = self._sock.recv(max(65536, size - len(self._rbuf)))
            if not data:
                raise ConnectionError("the cache process closed the connection")
            self._rbuf += data

    # -- API ------------------------------------------------------------------------
    # Every argument after the buffer is keyword-only and named (and defaulted) as the operation's
    # request field; every typed result reads the operation's declared reply fields.

    def ping(self) -> ServerInfo:
        """Which cache process answers (its pid and worker index)."""
        return from_reply(ServerInfo, self.call("ping"))

    def register_buffer(self, num_blocks: int, block_bytes: int) -> KVBuffer:
        """Create a (num_blocks × block_bytes) shared-memory buffer (a sealed memfd) and register it with
        the server."""
        buffer = KVBuffer(self, f"mpcache.{self._tag}.kv{next(self._buffer_seq)}", num_blocks, block_bytes)
        try:
            buffer.buffer_id = self._call(*buffer._registration())["buffer_id"]
        except BaseException:
            buffer._release()
            raise
        self._buffers[buffer.buffer_id] = buffer
        return buffer

    def register_cuda_buffer(self, num_blocks: int, block_bytes: int, device_index: int = 0) -> CudaKVBuffer:
        """A (num_blocks × block_bytes) GPU buffer shared with the server by CUDA IPC (needs cupy and a
        CUDA device here and in the cache process); see :mod:`mpcache.client.cuda`."""
        buffer = register_cuda_buffer(self, num_blocks, block_bytes, device_index)
        self._buffers[buffer.buffer_id] = buffer
        return buffer

    def unregister_buffer(self, buffer: RegisteredBuffer) -> None:
        """Detach the server and remove the buffer (a no-op for one already removed)."""
        if self._buffers.pop(buffer.buffer_id, None) is None:
            return
        try:
            if not self._closed and not self._ensure_open("unregister_buffer"):  # a new connection never had it
                self.call("unregister_buffer", buffer_id=buffer.buffer_id)
        finally:
            buffer._release()

    def store(self, buffer: BlockBuffer | int, *, request_id: str, model_name: str, cache_salt: str = "",
              chunk_hashes: Sequence[int], block_ids: Sequence[int], engine_id: int = 0) -> StoreResult:
        """Copy block ``block_ids[i]`` into L1 (and every L2 tier) as chunk ``chunk_hashes[i]``; chunks
        already cached are skipped, chunks L1 has no room for failed."""
        return from_reply(StoreResult, self.call(
            "store", buffer_id=_buffer_id(buffer), request_id=request_id, model_name=model_name,
            cache_salt=cache_salt, chunk_hashes=list(chunk_hashes), block_ids=list(block_ids), engine_id=engine_id))

    def lookup_prefetch(self, *, request_id: str, model_name: str, cache_salt: str = "",
                        chunk_hashes: Sequence[int]) -> int:
        """Read-lock the cached prefix of ``chunk_hashes`` (loading what L2 holds); returns a prefetch job id."""
        return self.call("lookup_prefetch", request_id=request_id, model_name=model_name, cache_salt=cache_salt,
                         chunk_hashes=list(chunk_hashes))["job_id"]

    def query_prefetch_status(self, job_id: int) -> PrefetchStatus:
        """A prefetch job's progress; never blocks.

        While chunks are still looked up in or loaded from L2, ``done`` is False and ``found_count`` is
        the L1 prefix so far: poll again, or use :meth:`wait_prefetch`.  The first read of a done job
        publishes MP_LOOKUP_PREFETCH_END.  An expired job (not retrieved within the server's job TTL)
        released its read locks: a retrieve still copies what remains in L1."""
        return from_reply(PrefetchStatus, self.call("query_prefetch_status", job_id=job_id))

    def wait_prefetch(self, job_id: int, *, timeout_s: float = 10.0) -> PrefetchStatus:
        """Poll :meth:`query_prefetch_status` (50 µs growing to 5 ms) until the job is done; returns that
        status.  ``TimeoutError`` if it is not done after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        pause = 50e-6
        while True:
            status = self.query_prefetch_status(job_id)
            if status.done:
                return status
            if time.monotonic() >= deadline:
                raise TimeoutError(f"prefetch job {job_id} not done after {timeout_s} s")
            time.sleep(pause)
            pause = min(pause * 2, 5e-3)

    def retrieve(self, buffer: BlockBuffer | int, *, request_id: str, job_id: int, block_ids: Sequence[int],
                 engine_id: int = 0, timeout_s: float | None = None) -> RetrieveResult:
        """Copy the job's first ``len(block_ids)`` found chunks into those blocks (those evicted since
        the lookup fail); :class:`CacheTimeoutError` past ``timeout_s``."""
        return from_reply(RetrieveResult, self.call(
            "retrieve", buffer_id=_buffer_id(buffer), request_id=request_id, job_id=job_id,
            block_ids=list(block_ids), engine_id=engine_id, timeout_s=timeout_s))

    def end_session(self, request_id: str) -> bool:
        """The request is finished: release what it still holds.  False if the server never saw it."""
        return self.call("end_session", request_id=request_id)["known"]

    def report_block_allocations(self, *, instance_id: int, model_name: str,
                                 records: Sequence[BlockRecord]) -> BlockReport:
        """One scheduler step's newly allocated L0 blocks, as (request id, new block ids, new token ids).
        End each request with :meth:`end_session` on this same cache process."""
        return from_reply(BlockReport, self.call(
            "report_block_allocations", instance_id=instance_id, model_name=model_name,
            records=[[rid, list(blocks), list(tokens)] for rid, blocks, tokens in records]))

    # -- cache blending (mpcache.cache.blend) -------------------------------------------

    def cb_store_pre_computed(self, buffer: BlockBuffer | int, *, request_id: str, model_name: str,
                              cache_salt: str = "", tokens: Sequence[int], block_ids: Sequence[int],
                              engine_id: int = 0) -> BlendStoreResult:
        """Store chunks computed independently of their context (block ``block_ids[i]`` holds whole chunk
        i of ``tokens``) and index their fingerprints."""
        return self._cb_store("cb_store_pre_computed", buffer, request_id, model_name, cache_salt, tokens,
                              block_ids, engine_id)

    def cb_store_final(self, buffer: BlockBuffer | int, *, request_id: str, model_name: str, cache_salt: str = "",
                       tokens: Sequence[int], block_ids: Sequence[int], engine_id: int = 0) -> BlendStoreResult:
        """Store the whole chunks of a finished request under their prefix-chained keys and index their
        fingerprints."""
        return self._cb_store("cb_store_final", buffer, request_id, model_name, cache_salt, tokens, block_ids,
                              engine_id)

    def _cb_store(self, op: str, buffer: BlockBuffer | int, request_id: str, model_name: str, cache_salt: str,
                  tokens: Sequence[int], block_ids: Sequence[int], engine_id: int) -> BlendStoreResult:
        return from_reply(BlendStoreResult, self.call(
            op, buffer_id=_buffer_id(buffer), request_id=request_id, model_name=model_name, cache_salt=cache_salt,
            tokens=[int(t) for t in tokens], block_ids=list(block_ids), engine_id=engine_id))

    def cb_lookup(self, *, request_id: str, model_name: str, cache_salt: str = "",
                  tokens: Sequence[int]) -> BlendLookup:
        """Classify each whole chunk of ``tokens``: prefix hit, fingerprint hit confirmed in L1, stale or
        miss (``no_gpu_context`` when this client has no registered buffer)."""
        return from_reply(BlendLookup, self.call("cb_lookup", request_id=request_id, model_name=model_name,
                                                 cache_salt=cache_salt, tokens=[int(t) for t in tokens]))

    def cb_retrieve(self, buffer: BlockBuffer | int, *, request_id: str, lookup_id: int,
                    chunk_indices: Sequence[int], block_ids: Sequence[int], engine_id: int = 0,
                    worker_id: int = -1) -> RetrieveResult:
        """Copy hit chunk ``chunk_indices[i]`` of a lookup into block ``block_ids[i]`` (failed: evicted
        since the lookup)."""
        return from_reply(RetrieveResult, self.call(
            "cb_retrieve", buffer_id=_buffer_id(buffer), request_id=request_id, lookup_id=lookup_id,
            chunk_indices=list(chunk_indices), block_ids=list(block_ids), engine_id=engine_id, worker_id=worker_id))

    def close(self) -> None:
        """Unregister and remove every buffer of this client, then disconnect (idempotent; a client whose
        connection is lost just removes its buffers)."""
        if self._closed:
            return
        self._closing = True  # no reconnecting now
        for buffer in list(self._buffers.values()):
            try:
                if self._sock is None:
                    raise ConnectionError("not connected")
                self.unregister_buffer(buffer)
            except (OSError, ConnectionError, RequestError, ProtocolError):
                self._buffers.pop(buffer.buffer_id, None)
                buffer._release()
        self._buffers.clear()
        self._closed = True
        self._drop_socket()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _buffer_id(buffer: BlockBuffer | int) -> int:
    """A buffer's id; a raw id passes through (to name a buffer the server never gave out, say)."""
    return buffer if isinstance(buffer, int) else buffer.buffer_id
