"""What an inference engine links: a blocking client for one cache process.

KV bytes move only through shared memory: :meth:`CacheClient.register_buffer`
creates a 0600 POSIX shared-memory object named after this process's pid
(``shm_name(os.getpid(), …, "kv<n>")``, so leftovers of a dead client can be
found) and hands its name to the server, which attaches it.  Requests then
name blocks of that buffer by index; the socket carries only small msgpack
messages (see :mod:`mpcache.contract.protocol`).

A typical request::

    with CacheClient(config.socket_path(0)) as client:
        kv = client.register_buffer(num_blocks=64, block_bytes=config.chunk_bytes)
        hashes = chunk_hashes(tokens, config.chunk_size_tokens)
        client.store(kv, "req-1", "llama", "", hashes, list(range(len(hashes))))
        job = client.lookup_prefetch("req-2", "llama", "", hashes)
        found = client.wait_prefetch(job)["found_count"]
        client.retrieve(kv, "req-2", job, list(range(found)))
        client.end_session("req-2")

Errors: a request the server refuses raises :class:`~mpcache.errors.RequestError`
(or :class:`~mpcache.errors.ProtocolError` for a malformed one), a server-side
timeout :class:`CacheTimeoutError` (a ``TimeoutError``), a lost connection
``ConnectionError``.  Not thread-safe: use one client per thread.
"""

from __future__ import annotations

import itertools
import os
import secrets
import socket
import time
from collections.abc import Sequence

from mpcache.client.buffers import KVBuffer, RegisteredBuffer
from mpcache.contract import protocol
from mpcache.errors import ProtocolError, RequestError
from mpcache.shm.segment import Segment, shm_name


class CacheTimeoutError(RequestError, TimeoutError):
    """The server gave up on an operation at its deadline (it published TIMEOUT_RAISED)."""


class CacheClient:
    """One connection to one cache process."""

    def __init__(self, socket_path: str, connect_timeout_s: float = 5.0) -> None:
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._sock.settimeout(connect_timeout_s)
            self._sock.connect(socket_path)
            self._sock.settimeout(None)
        except BaseException:
            self._sock.close()
            raise
        self._ids = itertools.count(1)
        self._rbuf = bytearray()
        self._buffers: dict[int, RegisteredBuffer] = {}
        self._tag = secrets.token_hex(4)
        self._buffer_seq = itertools.count()
        self._closed = False

    # -- plumbing -------------------------------------------------------------------

    def call(self, op: str, **args) -> dict:
        """Send one request and wait for its reply; raise on an error reply."""
        if self._closed:
            raise ConnectionError("the client is closed")
        request_id = next(self._ids)
        frame = protocol.encode_frame({"op": op, "id": request_id, **args})
        self._sock.sendall(frame)
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
            return reply
        message = str(reply.get("error", "error reply without a message"))
        error_type = reply.get("error_type")
        if error_type == "timeout":
            raise CacheTimeoutError(message)
        if error_type == "protocol":
            raise ProtocolError(message)
        raise RequestError(message)

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
        while len(self._rbuf) < size:
            data = self._sock.recv(max(65536, size - len(self._rbuf)))
            if not data:
                raise ConnectionError("the cache process closed the connection")
            self._rbuf += data

    # -- API ------------------------------------------------------------------------

    def ping(self) -> dict:
        return self.call("ping")

    def register_buffer(self, num_blocks: int, block_bytes: int) -> KVBuffer:
        """Create a (num_blocks × block_bytes) shared-memory buffer and register it with the server."""
        name = shm_name(os.getpid(), self._tag, f"kv{next(self._buffer_seq)}")
        segment = Segment.create(name, num_blocks * block_bytes)
        try:
            reply = self.call("register_buffer", shm_name=name, num_blocks=num_blocks, block_bytes=block_bytes)
        except BaseException:
            segment.close()
            Segment.unlink(name)
            raise
        buffer = KVBuffer(self, segment, reply["buffer_id"], num_blocks, block_bytes)
        self._buffers[buffer.buffer_id] = buffer
        return buffer

    def unregister_buffer(self, buffer: RegisteredBuffer) -> None:
        """Detach the server and remove the buffer (a no-op for one already removed)."""
        if self._buffers.pop(buffer.buffer_id, None) is None:
            return
        try:
            if not self._closed:
                self.call("unregister_buffer", buffer_id=buffer.buffer_id)
        finally:
            buffer._release()

    def store(self, buffer: KVBuffer, request_id: str, model_name: str, cache_salt: str,
              chunk_hashes: Sequence[int], block_ids: Sequence[int], engine_id: int = 0) -> int:
        """Copy block ``block_ids[i]`` into L1 as chunk ``chunk_hashes[i]``; returns chunks newly stored."""
        reply = self.call("store", buffer_id=buffer.buffer_id, request_id=request_id, model_name=model_name,
                          cache_salt=cache_salt, chunk_hashes=list(chunk_hashes), block_ids=list(block_ids),
                          engine_id=engine_id)
        return reply["stored_count"]

    def lookup_prefetch(self, request_id: str, model_name: str, cache_salt: str, chunk_hashes: Sequence[int]) -> int:
        """Find and read-lock the cached prefix of ``chunk_hashes``; returns a prefetch job id."""
        reply = self.call("lookup_prefetch", request_id=request_id, model_name=model_name, cache_salt=cache_salt,
                          chunk_hashes=list(chunk_hashes))
        return reply["job_id"]

    def query_prefetch_status(self, job_id: int) -> dict:
        """``{"done", "found_count", "requested_count", "hit_tokens", "l1_hit_tokens", "l2_hit_tokens",
        "l2_loaded_count", "expired"}`` of a prefetch job; never blocks.

        With L2 adapters configured a job is not done while chunks are still being looked up in or
        loaded from L2 (``done`` False; ``found_count`` is the L1 prefix so far): poll again, or use
        :meth:`wait_prefetch`.  The first read of a *done* job's result publishes
        MP_LOOKUP_PREFETCH_END (``l1_hit_tokens + l2_hit_tokens == hit_tokens``).  An expired job
        (not retrieved within the server's job TTL) has released its read locks: a retrieve still
        copies what remains in L1."""
        return self.call("query_prefetch_status", job_id=job_id)

    def wait_prefetch(self, job_id: int, timeout_s: float = 10.0) -> dict:
        """Poll :meth:`query_prefetch_status` (short backoff, 50 µs growing to 5 ms) until the job is
        done; returns that status.  ``TimeoutError`` if it is not done after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        pause = 50e-6
        while True:
            status = self.query_prefetch_status(job_id)
            if status["done"]:
                return status
            if time.monotonic() >= deadline:
                raise TimeoutError(f"prefetch job {job_id} not done after {timeout_s} s")
            time.sleep(pause)
            pause = min(pause * 2, 5e-3)

    def retrieve(self, buffer: KVBuffer, request_id: str, job_id: int, block_ids: Sequence[int],
                 engine_id: int = 0, timeout_s: float | None = None) -> int:
        """Copy the job's first ``len(block_ids)`` found chunks into those blocks; returns chunks copied."""
        reply = self.call("retrieve", buffer_id=buffer.buffer_id, request_id=request_id, job_id=job_id,
                          block_ids=list(block_ids), engine_id=engine_id, timeout_s=timeout_s)
        return reply["retrieved_count"]

    def end_session(self, request_id: str) -> bool:
        """The request is finished: release what it still holds.  False if the server never saw it."""
        return self.call("end_session", request_id=request_id)["known"]

    def report_block_allocations(self, instance_id: int, model_name: str,
                                 records: Sequence[tuple[str, Sequence[int], Sequence[int]]]) -> dict:
        """One scheduler step's newly allocated L0 blocks: records of (request id, new block ids, new token ids).

        Returns ``{"record_count", "block_count", "sampled_count", "event_count"}``.  End each request
        with :meth:`end_session` on this same cache process (see :mod:`mpcache.cache.blocks`)."""
        return self.call("report_block_allocations", instance_id=instance_id, model_name=model_name,
                         records=[[rid, list(blocks), list(tokens)] for rid, blocks, tokens in records])

    def register_cuda_buffer(self, num_blocks: int, block_bytes: int, device_index: int = 0):
        """A (num_blocks × block_bytes) GPU buffer shared with the server by CUDA IPC (needs cupy and a
        CUDA device here and in the cache process); see :mod:`mpcache.client.cuda`."""
        from mpcache.client.cuda import register_cuda_buffer

        buffer = register_cuda_buffer(self, num_blocks, block_bytes, device_index)
        self._buffers[buffer.buffer_id] = buffer
        return buffer

    # -- cache blending (mpcache.cache.blend) -------------------------------------------

    def cb_store_pre_computed(self, buffer: KVBuffer, request_id: str, model_name: str, cache_salt: str,
                              tokens: Sequence[int], block_ids: Sequence[int], engine_id: int = 0) -> dict:
        """Store chunks computed independently of their context (block ``block_ids[i]`` holds whole chunk i of
        ``tokens``) and index their fingerprints.  ``{"stored_count", "skipped_count", "failed_count",
        "registered_count", "replaced_count"}`` (replaced: stale entries the new objects took over)."""
        return self.call("cb_store_pre_computed", buffer_id=buffer.buffer_id, request_id=request_id,
                         model_name=model_name, cache_salt=cache_salt, tokens=[int(t) for t in tokens],
                         block_ids=list(block_ids), engine_id=engine_id)

    def cb_store_final(self, buffer: KVBuffer, request_id: str, model_name: str, cache_salt: str,
                       tokens: Sequence[int], block_ids: Sequence[int], engine_id: int = 0) -> dict:
        """Store the whole chunks of a finished request under their prefix-chained keys and index their
        fingerprints; same reply as :meth:`cb_store_pre_computed`."""
        return self.call("cb_store_final", buffer_id=buffer.buffer_id, request_id=request_id, model_name=model_name,
                         cache_salt=cache_salt, tokens=[int(t) for t in tokens], block_ids=list(block_ids),
                         engine_id=engine_id)

    def cb_lookup(self, request_id: str, model_name: str, cache_salt: str, tokens: Sequence[int]) -> dict:
        """Per whole chunk of ``tokens`` a status (``chunks``: mpcache.contract.blending MISS / PREFIX_HIT /
        FINGERPRINT_HIT / STALE), ``lookup_id`` (None without hits), ``no_gpu_context`` (this client has no
        registered buffer), and the counts ``requested_tokens``, ``hit_tokens``, ``prefix_hits``,
        ``fingerprint_hits``, ``storage_hits``, ``stale_chunks``."""
        return self.call("cb_lookup", request_id=request_id, model_name=model_name, cache_salt=cache_salt,
                         tokens=[int(t) for t in tokens])

    def cb_retrieve(self, buffer: KVBuffer | int, request_id: str, lookup_id: int, chunk_indices: Sequence[int],
                    block_ids: Sequence[int], engine_id: int = 0, worker_id: int = -1) -> dict:
        """Copy hit chunk ``chunk_indices[i]`` of a lookup into block ``block_ids[i]``;
        ``{"retrieved_count", "failed_count"}`` (failed: evicted since the lookup).  ``buffer`` may be a
        raw buffer id."""
        buffer_id = buffer if isinstance(buffer, int) else buffer.buffer_id
        return self.call("cb_retrieve", buffer_id=buffer_id, request_id=request_id, lookup_id=lookup_id,
                         chunk_indices=list(chunk_indices), block_ids=list(block_ids), engine_id=engine_id,
                         worker_id=worker_id)

    def close(self) -> None:
        """Unregister and remove every buffer of this client, then disconnect (idempotent)."""
        if self._closed:
            return
        for buffer in list(self._buffers.values()):
            try:
                self.unregister_buffer(buffer)
            except (OSError, ConnectionError, RequestError, ProtocolError):
                buffer._release()
        self._buffers.clear()
        self._closed = True
        self._sock.close()

    def __enter__(self) -> CacheClient:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
