"""A cache process: serves clients on its Unix socket from one selectors loop.

Single-threaded: requests are handled one at a time to completion, and the
eviction loop, the heartbeat and prefetch-job expiry run as timers of the same
loop, so nothing here takes a lock (the publisher is built with
``threadsafe=False``).  Every shared-memory segment was created by the
supervisor; this process only attaches (its event ring, its L1 pool, the gauge
board) and, per client, the KV buffer the client created and registered.

Request flow and the events each step publishes (``spec/EVENTS.md``):

* the first operation naming a request id → ``MP_REQUEST_START``;
  ``end_session`` → ``MP_REQUEST_END`` (and releases unconsumed read locks);
* ``store``: ``MP_STORE_SUBMITTED``, ``MP_STORE_START``, L1 write reservation
  (``L1_WRITE_RESERVED`` / inline ``L1_KEYS_EVICTED`` / ``L1_ALLOCATION_FAILED``),
  the copy client buffer → L1, ``L1_WRITE_FINISHED``, ``MP_STORE_END``,
  ``SM_WRITE_FINISHED``;
* ``lookup_prefetch``: ``MP_LOOKUP_PREFETCH_START``, read locks on the
  contiguous L1 prefix (``L1_READ_RESERVED``), a prefetch job;
  the first ``query_prefetch_status`` of that job → ``MP_LOOKUP_PREFETCH_END``;
* with ``--l2`` adapters: a committed store also submits one L2 store task per
  adapter (:mod:`mpcache.cache.storage`), and a lookup whose prefix runs past
  L1 hands the rest to the prefetch controller (:mod:`mpcache.cache.prefetch`);
  such a job is not done (``query_prefetch_status`` says ``done`` False, a
  retrieve is refused) until its L2 lookup and loads finished.  Adapter threads
  only queue their completions and write to the wake socket; the loop handles
  them (and publishes every L2 event) in ``_poll_l2``.  At shutdown in-flight
  L2 tasks are waited for (bounded) before the adapters close;
* ``retrieve``: ``MP_RETRIEVE_SUBMITTED``, ``MP_RETRIEVE_START``, the copy
  L1 → client buffer (``L1_READ_FAILED`` if a locked chunk is unreadable),
  ``L1_READ_FINISHED``, ``MP_RETRIEVE_END``, ``SM_READ_PREFETCHED_FINISHED``.
  A ``timeout_s`` that passes before the copy is done raises
  :class:`~mpcache.timeouts.MpcacheTimeoutError` (``TIMEOUT_RAISED``); the
  END event then carries zeros and the job keeps its locks, so the client may
  retry or end the session.
* the copies of store/retrieve go through the buffer's ``transfer``
  (:mod:`mpcache.cache.transfer`): shared memory (device ``cpu``), or a GPU
  buffer shared by CUDA IPC (``register_cuda_buffer``, device ``cuda:N``)
  whose START/END are published after the copy, stamped where its stream
  reached them;
* ``report_block_allocations`` → ``MP_VLLM_BLOCK_ALLOCATION`` (L0 shadow
  monitoring, :mod:`mpcache.cache.blocks`); ``end_session`` of a request that
  owns sampled blocks also publishes ``MP_VLLM_END_SESSION``.

Started by the supervisor (``parent_pid``), the process stops by itself when it
is reparented: a supervisor that died without stopping it cannot restart it,
clean up after it or ever stop it.

Prefetch jobs live until ``end_session`` of their request.  A job still
unretrieved ``job_ttl_s`` after its lookup was abandoned: it releases its read
locks and stays one more ``job_ttl_s`` as a tombstone, so that a late retrieve
reads whatever is still in L1 — chunks evicted meanwhile are what
``L1_READ_FAILED`` (not_found) reports — and an expired job never publishes
``MP_LOOKUP_PREFETCH_END``.  At most ``max_jobs`` exist, the oldest giving way.
``active_prefetch_jobs`` counts the jobs that hold read locks.
"""

from __future__ import annotations

import os
import selectors
import signal
import socket
import stat
import struct
import time
from collections import OrderedDict
from typing import Callable

import numpy as np
import structlog

from mpcache import protocol
from mpcache.cache import transfer
from mpcache.cache.blend import BlendModule
from mpcache.cache.blocks import BlockReporter
from mpcache.cache.l1 import L1Manager
from mpcache.cache.prefetch import PrefetchController, PrefetchOutcome
from mpcache.cache.storage import StorageManager, build_adapters
from mpcache.config import Config
from mpcache.errors import ConfigError, LayoutMismatchError, ProtocolError, RequestError
from mpcache.events import EventType
from mpcache.publish import Publisher
from mpcache.shm import layout
from mpcache.shm.gauges import GaugeSlot
from mpcache.shm.intern import Interner
from mpcache.shm.ring import RingWriter, read_geometry
from mpcache.shm.segment import SHM_DIR, Segment
from mpcache.timeouts import Deadline, MpcacheTimeoutError, register_publisher, registered_publisher

_MP_REQUEST_START = EventType.MP_REQUEST_START
_MP_REQUEST_END = EventType.MP_REQUEST_END
_MP_STORE_SUBMITTED = EventType.MP_STORE_SUBMITTED
_MP_RETRIEVE_SUBMITTED = EventType.MP_RETRIEVE_SUBMITTED
_MP_STORE_START = EventType.MP_STORE_START
_MP_STORE_END = EventType.MP_STORE_END
_MP_RETRIEVE_START = EventType.MP_RETRIEVE_START
_MP_RETRIEVE_END = EventType.MP_RETRIEVE_END
_MP_LOOKUP_PREFETCH_START = EventType.MP_LOOKUP_PREFETCH_START
_MP_LOOKUP_PREFETCH_END = EventType.MP_LOOKUP_PREFETCH_END
_SM_WRITE_FINISHED = EventType.SM_WRITE_FINISHED
_SM_READ_PREFETCHED_FINISHED = EventType.SM_READ_PREFETCHED_FINISHED

DEVICE = "cpu"
RECV_BYTES = 256 * 1024
SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes including the terminating NUL
MAX_BUFFERS_PER_CONNECTION = 64
MAX_BUFFER_BYTES = 1 << 40
OUTBUF_PAUSE_BYTES = 1 << 20  # stop reading a client's requests while this much of its replies is unsent
_PEERCRED = struct.Struct("3i")


class _Buffer:
    """A client's registered KV buffer, attached by name."""

    __slots__ = ("segment", "blocks", "num_blocks", "block_bytes", "path", "needed", "transfer")

    def __init__(self, segment: Segment, num_blocks: int, block_bytes: int) -> None:
        self.segment = segment
        self.num_blocks = num_blocks
        self.block_bytes = block_bytes
        self.needed = num_blocks * block_bytes
        self.blocks = np.ndarray((num_blocks, block_bytes), dtype=np.uint8, buffer=segment.buf)
        self.path = os.path.join(SHM_DIR, segment.name.lstrip("/"))
        self.transfer = transfer.CpuTransfer(self.blocks)

    def check_intact(self) -> None:
        """Refuse a buffer whose object was removed or shrunk since registration (the
        mapping of a shrunk object would fault on access)."""
        try:
            size = os.stat(self.path).st_size
        except OSError:
            raise RequestError(f"buffer {self.segment.name} no longer exists") from None
        if size < self.needed:
            raise RequestError(f"buffer {self.segment.name} shrank to {size} bytes, needs {self.needed}")

    def close(self) -> None:
        self.blocks = self.transfer = None
        _close_segment(self.segment)


class _Conn:
    __slots__ = ("sock", "inbuf", "outbuf", "buffers", "closing", "paused", "peer_pid", "events")

    def __init__(self, sock: socket.socket, peer_pid: int) -> None:
        self.sock = sock
        self.inbuf = bytearray()
        self.outbuf = bytearray()
        self.buffers: dict[int, _Buffer] = {}
        self.closing = False
        self.paused = False  # requests held back until the client reads its replies
        self.peer_pid = peer_pid
        self.events = selectors.EVENT_READ


class _Job:
    __slots__ = ("job_id", "request_id", "model", "salt", "hashes", "found", "created", "reported", "locked",
                 "expired", "retrieved", "pending", "l1_hits", "l2_hits", "l2_landed")

    def __init__(self, job_id: int, request_id: str, model: str, salt: str, hashes: list[int], found: int,
                 created: float) -> None:
        self.job_id = job_id
        self.request_id = request_id
        self.model = model
        self.salt = salt
        self.hashes = hashes
        self.found = found
        self.created = created
        self.reported = False  # MP_LOOKUP_PREFETCH_END published
        self.locked = found > 0  # holds read locks on hashes[:found] (until retrieve / release)
        self.expired = False  # outlived the TTL: locks released, kept one more TTL for a late retrieve
        self.retrieved = False
        self.pending = False  # an L2 prefetch is still looking up / loading the chunks after hashes[:found]
        self.l1_hits = found  # chunks of hashes[:found] that were in L1 when the job needed them
        self.l2_hits = 0  # chunks of hashes[:found] loaded from L2
        self.l2_landed = 0  # chunks this job's L2 prefetch wrote into L1 (contiguous or not)


class _ErrorLog:
    """At most ``per_second`` client-error lines a second; the next line says how many were dropped."""

    def __init__(self, log, per_second: int = 10, clock: Callable[[], float] = time.monotonic) -> None:
        self._log = log
        self._per_second = per_second
        self._clock = clock
        self._window = 0.0
        self._count = 0
        self._suppressed = 0

    def __call__(self, op: str, error_type: str, message: str) -> None:
        now = self._clock()
        if now - self._window >= 1.0:
            self._window = now
            self._count = 0
        if self._count >= self._per_second:
            self._suppressed += 1
            return
        self._count += 1
        extra = {"suppressed": self._suppressed} if self._suppressed else {}
        self._suppressed = 0
        self._log.warning("client.error", op=op, error_type=error_type, error=message, **extra)


def _close_segment(segment: Segment) -> None:
    try:
        segment.close()
    except BufferError:  # a view is still referenced somewhere; the mapping goes with it
        pass


class CacheServer:
    """One cache process's state and loop.  Construct (attaches and listens), then :meth:`run`."""

    def __init__(
        self,
        config: Config,
        worker: int,
        *,
        clock: Callable[[], float] = time.monotonic,
        clock_ns: Callable[[], int] = time.time_ns,
        job_ttl_s: float = 60.0,
        max_jobs: int = 4096,
        max_sessions: int = 65536,
        heartbeat_interval_s: float = 0.5,
        parent_pid: int | None = None,
        logger=None,
    ) -> None:
        if not 0 <= worker < config.workers:
            raise ConfigError(f"--worker: expected 0..{config.workers - 1}, got {worker}")
        self.config = config
        self.worker = worker
        self.log = logger if logger is not None else structlog.get_logger("mpcache.cache")
        self._clock = clock
        self._clock_ns = clock_ns  # event timestamps (wall clock, ns)
        self._job_ttl_s = job_ttl_s
        self._max_jobs = max_jobs
        self._max_sessions = max_sessions
        self._heartbeat_interval_s = min(heartbeat_interval_s, 1.0)
        self._parent_pid = parent_pid  # stop when reparented: the supervisor is gone
        self._chunk_tokens = config.chunk_size_tokens
        self._chunk_bytes = config.chunk_bytes
        self._client_error = _ErrorLog(self.log)
        self._stopping = False
        self._closed = False
        self._stop_event_sink = None  # set when a benchmark runs the reference's in-process bus
        self._segments: list[Segment] = []
        self._conns: dict[int, _Conn] = {}
        self._sessions: OrderedDict[str, set[int]] = OrderedDict()  # request id -> its job ids
        self._jobs: OrderedDict[int, _Job] = OrderedDict()  # oldest first
        self._active_jobs = 0
        self._next_job_id = 1
        self._next_buffer_id = 1
        self._listener: socket.socket | None = None
        self._selector = selectors.DefaultSelector()
        self._wake_r, self._wake_w = socket.socketpair()
        self.storage: StorageManager | None = None
        self.prefetch: PrefetchController | None = None
        try:
            self._attach()
            self._listen()
            self._start_l2()
        except BaseException:
            self.close()
            raise
        self._handlers = {
            "ping": self._op_ping,
            "register_buffer": self._op_register_buffer,
            "unregister_buffer": self._op_unregister_buffer,
            "store": self._op_store,
            "lookup_prefetch": self._op_lookup_prefetch,
            "query_prefetch_status": self._op_query_prefetch_status,
            "retrieve": self._op_retrieve,
            "end_session": self._op_end_session,
            "report_block_allocations": self._op_report_block_allocations,
            "register_cuda_buffer": self._op_register_cuda_buffer,
        }
        self.blend = BlendModule(self)  # cache blending: cb_* ops (mpcache.cache.blend)
        self._handlers.update(self.blend.handlers())

    # -- set-up and tear-down ---------------------------------------------------------

    def _attach(self) -> None:
        config, worker = self.config, self.worker
        ring = Segment.attach(config.ring_name(worker), layout.HEADER_SIZE)
        self._segments.append(ring)
        self.publisher = self._make_publisher(ring)
        self.l0 = BlockReporter(self.publisher, config.metrics_sample_rate)
        pool_seg = Segment.attach(config.l1_pool_name(worker), config.l1_slots * config.chunk_bytes)
        self._segments.append(pool_seg)
        pool = np.ndarray((config.l1_slots, config.chunk_bytes), dtype=np.uint8, buffer=pool_seg.buf)
        self.l1 = L1Manager(pool, self.publisher, config.metrics_sample_rate, config.l1_watermark)
        board = Segment.attach(config.gauge_board_name(), layout.gauge_board_size(config.workers))
        self._segments.append(board)
        self.gauges = GaugeSlot(board, worker)
        self.gauges.set(layout.G_L1_CAPACITY, config.l1_slots * config.chunk_bytes)
        self.gauges.set(layout.G_L1_USED, 0)
        self.gauges.set(layout.G_ACTIVE_PREFETCH, 0)
        self.gauges.heartbeat(os.getpid())

    def _make_publisher(self, ring: Segment):
        """The ring publisher — or, when a benchmark asks (``Config.event_sink``), no events at all
        or the reference design's in-process bus (the only case that loads OpenTelemetry here)."""
        sink = self.config.event_sink
        if sink == "none":
            from mpcache.bench.reference import NullPublisher

            return NullPublisher()
        if sink == "inprocess":
            from mpcache.bench.reference import start_inprocess_reference

            publisher, self._stop_event_sink = start_inprocess_reference()
            return publisher
        return Publisher(RingWriter(ring), Interner(ring.buf, read_geometry(ring).intern_capacity),
                         threadsafe=False, clock_ns=self._clock_ns)

    def _start_l2(self) -> None:
        """The storage manager and prefetch controller over the configured L2 adapters (none: both idle)."""
        config = self.config
        names = [config.l2_name(index) for index in range(len(config.l2))]
        self.storage = StorageManager(build_adapters(config, self.worker), names, self.publisher, self.gauges,
                                      self._wake, worker=self.worker, chunk_bytes=self._chunk_bytes, logger=self.log)
        self.prefetch = PrefetchController(self.storage, self.l1, self.publisher, self._prefetch_finished)

    def _wake(self) -> None:
        """Make the loop's select return (any thread; L2 adapter threads call it when a task completes)."""
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (a wake-up is already pending) or closed at shutdown
            pass

    def _poll_l2(self) -> None:
        if self.storage is not None and self.storage.has_completions:
            self.storage.poll()
            self._update_gauges()

    def _listen(self) -> None:
        path = self.socket_path = self.config.socket_path(self.worker)
        directory = os.path.dirname(path) or "."
        staging = os.path.join(directory, f".cache{self.worker}.{os.getpid()}")
        for candidate in (path, staging):
            if len(os.fsencode(candidate)) > SOCKET_PATH_MAX:
                raise ConfigError(f"--runtime-dir: socket path {candidate!r} is longer than {SOCKET_PATH_MAX} bytes")
        os.makedirs(directory, mode=0o700, exist_ok=True)
        for candidate in (path, staging):
            try:
                mode = os.lstat(candidate).st_mode
            except FileNotFoundError:
                continue
            if not stat.S_ISSOCK(mode):
                raise ConfigError(f"--runtime-dir: {candidate} exists and is not a socket")
            os.unlink(candidate)  # left behind by a crashed earlier cache process
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            # Bind under a staging name, restrict it to 0600, listen, and only then
            # give it its public name: the path never exists before it is ready.
            listener.bind(staging)
            os.chmod(staging, 0o600)
            listener.listen(128)
            os.replace(staging, path)
            listener.setblocking(False)
        except BaseException:
            listener.close()
            raise
        self._socket_ino = os.lstat(path).st_ino
        self._listener = listener
        self._selector.register(listener, selectors.EVENT_READ, "accept")
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._selector.register(self._wake_r, selectors.EVENT_READ, "wake")

    def stop(self) -> None:
        """Ask the loop to stop after the request in hand (safe from a signal handler or another thread)."""
        self._stopping = True
        try:
            self._wake_w.send(b"\0")
        except OSError:
            pass

    def _on_signal(self, signum, frame) -> None:  # noqa: ARG002 - signal handler signature
        self.stop()

    def close(self) -> None:
        """Stop accepting, drop every client, zero the heartbeat, detach shared memory (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if self._listener is not None:
            try:
                self._selector.unregister(self._listener)
            except (KeyError, ValueError):
                pass
            self._listener.close()
            try:
                if os.lstat(self.socket_path).st_ino == self._socket_ino:
                    os.unlink(self.socket_path)
            except OSError:
                pass
        for conn in list(self._conns.values()):
            self._send_now(conn)
            self._close_conn(conn)
        if self.storage is not None:  # finish in-flight L2 tasks (publishing their events), then close adapters
            if not self.storage.drain():
                self.log.warning("l2.drain_timeout", inflight=self.storage.inflight)
            self.storage.close()
            self.storage = self.prefetch = None
        for job in list(self._jobs.values()):
            self._drop_job(job)
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        if registered_publisher() is getattr(self, "publisher", None):
            register_publisher(None)
        if self._stop_event_sink is not None:
            self._stop_event_sink()
        if hasattr(self, "gauges"):
            self.gauges.set(layout.G_ACTIVE_PREFETCH, 0)
            self.gauges.set(layout.G_HEARTBEAT, 0)
        # Views into the segments must go before the mappings can be closed.
        self.l1 = self.gauges = self.publisher = self.l0 = None
        for segment in self._segments:
            _close_segment(segment)
        self._segments.clear()

    # -- the loop ---------------------------------------------------------------------

    def run(self, install_signals: bool = False) -> None:
        """Serve until :meth:`stop` (or SIGTERM/SIGINT with ``install_signals``), then :meth:`close`."""
        if install_signals:
            signal.signal(signal.SIGTERM, self._on_signal)
            signal.signal(signal.SIGINT, self._on_signal)
        register_publisher(self.publisher)
        self.log.info("cache.start", pid=os.getpid(), socket=self.socket_path, l1_slots=self.l1.capacity,
                      chunk_bytes=self._chunk_bytes)
        now = time.monotonic()
        next_evict = now + self.config.eviction_interval_s
        next_beat = now + self._heartbeat_interval_s
        select = self._selector.select
        try:
            while not self._stopping:
                timeout = max(0.0, min(next_evict, next_beat) - time.monotonic())
                for key, mask in select(timeout):
                    if key.data == "accept":
                        self._accept()
                    elif key.data == "wake":
                        self._drain_wake()
                        self._poll_l2()
                    else:
                        try:
                            self._on_ready(key.data, mask)
                        except Exception:  # noqa: BLE001 - one broken connection must not stop the server
                            self.log.exception("connection.failed")
                            self._close_conn(key.data)
                    if self._stopping:
                        break
                now = time.monotonic()
                if now >= next_evict and not self._stopping:
                    self.l1.evict_tick()
                    self._update_gauges()
                    next_evict = now + self.config.eviction_interval_s
                if now >= next_beat:
                    if self._parent_pid is not None and os.getppid() != self._parent_pid:
                        self.log.warning("cache.orphaned", parent_pid=self._parent_pid)
                        break
                    self._expire_jobs()
                    if self.storage is not None:
                        self.storage.refresh_usage()
                    self.gauges.heartbeat(os.getpid())
                    next_beat = now + self._heartbeat_interval_s
        finally:
            self.log.info("cache.stop", pid=os.getpid(), clients=len(self._conns))
            self.close()

    def _drain_wake(self) -> None:
        try:
            while self._wake_r.recv(64):
                pass
        except BlockingIOError:
            pass

    def _accept(self) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        try:
            pid, uid, _gid = _PEERCRED.unpack(
                sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        except OSError:
            sock.close()
            return
        if uid != os.geteuid():  # the 0600 socket already says so; defence in depth
            sock.close()
            return
        sock.setblocking(False)
        conn = _Conn(sock, pid)
        self._conns[sock.fileno()] = conn
        self._selector.register(sock, selectors.EVENT_READ, conn)

    def _on_ready(self, conn: _Conn, mask: int) -> None:
        if mask & selectors.EVENT_WRITE:
            self._flush(conn)
        if mask & selectors.EVENT_READ and not conn.closing:
            self._on_readable(conn)

    def _on_readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close_conn(conn)
            return
        if not data:
            self._close_conn(conn)
            return
        conn.inbuf += data
        self._process(conn)

    def _process(self, conn: _Conn) -> None:
        """Answer the complete frames received so far, pausing while replies pile up unread."""
        inbuf = conn.inbuf
        header = protocol.FRAME_HEADER
        while len(inbuf) >= header.size and len(conn.outbuf) < OUTBUF_PAUSE_BYTES and not self._stopping:
            (length,) = header.unpack_from(inbuf)
            if length > protocol.MAX_FRAME_BYTES:
                message = f"frame of {length} bytes exceeds the {protocol.MAX_FRAME_BYTES}-byte limit; closing"
                self._client_error("?", "protocol", message)
                conn.outbuf += protocol.encode_frame(protocol.error_reply(None, "protocol", message))
                conn.closing = True
                inbuf.clear()
                break
            end = header.size + length
            if len(inbuf) < end:
                break
            payload = bytes(inbuf[header.size:end])
            del inbuf[:end]
            conn.outbuf += protocol.encode_frame(self._dispatch(conn, payload))
        conn.paused = len(conn.outbuf) >= OUTBUF_PAUSE_BYTES
        self._flush(conn)

    def _flush(self, conn: _Conn) -> None:
        if conn.outbuf:
            try:
                sent = conn.sock.send(conn.outbuf)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._close_conn(conn)
                return
            del conn.outbuf[:sent]
            if conn.paused and len(conn.outbuf) < OUTBUF_PAUSE_BYTES and not conn.closing:
                conn.paused = False
                self._process(conn)  # the frames held back while replies piled up
                return
        if not conn.outbuf and conn.closing:
            self._close_conn(conn)
            return
        reading = not conn.closing and not conn.paused
        wanted = (selectors.EVENT_WRITE if conn.outbuf else 0) | (selectors.EVENT_READ if reading else 0)
        if wanted != conn.events:
            conn.events = wanted
            self._selector.modify(conn.sock, wanted, conn)

    def _send_now(self, conn: _Conn) -> None:
        """At shutdown: hand over what is queued for this client, briefly blocking."""
        if conn.outbuf:
            try:
                conn.sock.settimeout(0.5)
                conn.sock.sendall(conn.outbuf)
            except OSError:
                pass

    def _close_conn(self, conn: _Conn) -> None:
        conn.closing = True
        if self._conns.pop(conn.sock.fileno(), None) is None:
            return
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        for buffer in conn.buffers.values():
            buffer.close()
        conn.buffers.clear()

    # -- dispatch ---------------------------------------------------------------------

    def _dispatch(self, conn: _Conn, payload: bytes) -> dict:
        """One request → one reply.  Errors become error replies; the loop goes on."""
        message = None
        op = "?"
        try:
            message = protocol.decode_payload(payload)
            request = protocol.parse_request(message)
            op = request.op
            self._expire_jobs()
            reply = self._handlers[op](conn, request.args)
            reply["id"] = request.id
            reply["ok"] = True
            return reply
        except MpcacheTimeoutError as exc:
            error_type, text = "timeout", f"timeout: {exc}"
        except ProtocolError as exc:
            error_type, text = "protocol", str(exc)
        except RequestError as exc:
            error_type, text = "request", str(exc)
        except Exception as exc:  # noqa: BLE001 - a bug in one request must not stop the server
            self.log.exception("request.failed", op=op)
            error_type, text = "internal", f"internal error: {type(exc).__name__}"
        finally:
            if self.gauges is not None:
                self._update_gauges()
        if isinstance(message, dict) and type(message.get("op")) is str:
            op = message["op"][:64]
        self._client_error(op, error_type, text)
        return protocol.error_reply(protocol.message_id(message), error_type, text)

    def _update_gauges(self) -> None:
        self.gauges.set(layout.G_L1_USED, self.l1.used_slots * self._chunk_bytes)
        self.gauges.set(layout.G_ACTIVE_PREFETCH, self._active_jobs)

    # -- sessions and jobs ---------------------------------------------------------------

    def _session(self, request_id: str) -> set[int]:
        """This request's job ids; the first operation of a request publishes MP_REQUEST_START."""
        jobs = self._sessions.get(request_id)
        if jobs is None:
            jobs = self._sessions[request_id] = set()
            self.publisher.emit(_MP_REQUEST_START, session_id=request_id)
            if len(self._sessions) > self._max_sessions:  # abandoned sessions give way, oldest first
                _, old_jobs = self._sessions.popitem(last=False)
                for job_id in old_jobs:
                    job = self._jobs.get(job_id)
                    if job is not None:
                        self._drop_job(job)
        return jobs

    def _job(self, job_id: int) -> _Job:
        job = self._jobs.get(job_id)
        if job is None:
            raise RequestError(f"job_id: unknown or expired prefetch job {job_id}")
        return job

    def _release_locks(self, job: _Job) -> None:
        if job.locked:
            job.locked = False
            self._active_jobs -= 1
            self.l1.release_read(job.model, job.salt, job.hashes[: job.found])

    def _drop_job(self, job: _Job) -> None:
        self._jobs.pop(job.job_id, None)
        self._release_locks(job)
        jobs = self._sessions.get(job.request_id)
        if jobs is not None:
            jobs.discard(job.job_id)

    def _expire_jobs(self) -> None:
        """Jobs older than the TTL were abandoned: they release their locks and stay one more TTL
        as tombstones (a late retrieve reads what is still in L1), then go."""
        jobs = self._jobs
        if not jobs:
            return
        now = self._clock()
        horizon = now - self._job_ttl_s
        while jobs:
            job = next(iter(jobs.values()))
            if job.created > horizon:
                break
            if job.expired:
                self._drop_job(job)
                continue
            self._release_locks(job)
            job.expired = True
            job.created = now
            jobs.move_to_end(job.job_id)

    # -- operations ---------------------------------------------------------------------

    def _buffer(self, conn: _Conn, buffer_id: int, block_ids: list[int]) -> _Buffer:
        buffer = conn.buffers.get(buffer_id)
        if buffer is None:
            raise RequestError(f"buffer_id: unknown buffer {buffer_id} on this connection")
        highest = max(block_ids)
        if highest >= buffer.num_blocks:
            raise RequestError(f"block_ids: block {highest} is outside the buffer's {buffer.num_blocks} blocks")
        buffer.check_intact()
        return buffer

    def _op_ping(self, conn: _Conn, args: dict) -> dict:
        return {"pid": os.getpid(), "worker": self.worker}

    def _op_register_buffer(self, conn: _Conn, args: dict) -> dict:
        name, num_blocks, block_bytes = args["shm_name"], args["num_blocks"], args["block_bytes"]
        owner = int(protocol.KV_SHM_NAME.match(name).group(1))
        if owner != conn.peer_pid:
            raise RequestError(f"shm_name: {name} is not named after the client's pid {conn.peer_pid}")
        if name in self.config.all_segment_names():
            raise RequestError(f"shm_name: {name} is not a client buffer")
        self._check_buffer_limits(conn, num_blocks, block_bytes)
        try:
            segment = Segment.attach(name, num_blocks * block_bytes)
        except LayoutMismatchError as exc:
            raise RequestError(f"shm_name: {exc}") from None
        except OSError as exc:
            raise RequestError(f"shm_name: cannot attach {name}: {exc.strerror}") from None
        buffer_id = self._next_buffer_id
        self._next_buffer_id += 1
        conn.buffers[buffer_id] = _Buffer(segment, num_blocks, block_bytes)
        return {"buffer_id": buffer_id}

    def _op_unregister_buffer(self, conn: _Conn, args: dict) -> dict:
        buffer = conn.buffers.pop(args["buffer_id"], None)
        if buffer is None:
            raise RequestError(f"buffer_id: unknown buffer {args['buffer_id']} on this connection")
        buffer.close()
        return {}

    def _begin_copy(self, buffer: _Buffer, request_id: str, submitted: EventType, start: EventType, engine: int,
                    model: str):
        """Open a copy between a client buffer and L1: the session, SUBMITTED, and START — unless the
        copy runs on a CUDA stream (``stream_timed``), whose START is stamped where the stream got to it.
        Returns the buffer's mover (CPU shared memory or CUDA)."""
        self._session(request_id)
        mover = buffer.transfer
        self.publisher.emit(submitted, (mover.device,), session_id=request_id)
        if not mover.stream_timed:
            self.publisher.emit(start, (mover.device, engine, model), session_id=request_id)
        return mover

    def _op_store(self, conn: _Conn, args: dict) -> dict:
        hashes, block_ids = args["chunk_hashes"], args["block_ids"]
        buffer = self._buffer(conn, args["buffer_id"], block_ids)
        request_id, model, salt, engine = args["request_id"], args["model_name"], args["cache_salt"], args["engine_id"]
        pub = self.publisher
        mover = self._begin_copy(buffer, request_id, _MP_STORE_SUBMITTED, _MP_STORE_START, engine, model)
        device = mover.device
        l1 = self.l1
        reservation = l1.reserve_write(model, salt, hashes)
        committed = [hashes[p] for p in reservation.positions]
        nbytes = buffer.block_bytes
        try:
            timing = mover.to_l1(l1.pool, [(block_ids[p], slot) for p, slot in zip(reservation.positions,
                                                                                    reservation.slots)], nbytes)
        except BaseException:
            l1.abort_write(model, salt, committed)
            pub.emit(_MP_STORE_END, (device, engine, model, 0, 0, 0), session_id=request_id)
            raise
        if timing is not None:  # where the stream reached the copy's start
            pub.emit(_MP_STORE_START, (device, engine, model), session_id=request_id, timestamp_ns=timing.start_ns)
        sampled = l1.commit_write(model, salt, committed, nbytes)
        stored = len(committed)
        pub.emit(_MP_STORE_END, (device, engine, model, stored, stored * nbytes, stored * self._chunk_tokens),
                 session_id=request_id, timestamp_ns=None if timing is None else timing.end_ns)
        pub.emit(_SM_WRITE_FINISHED, (reservation.failed,),
                 salt_counts={(salt, model): stored} if stored else None, sampled=sampled)
        if stored and self.storage.adapters and nbytes == self._chunk_bytes:
            # L2 store tasks get copies: the L1 slots stay readable (and evictable) while adapters write
            pool = l1.pool
            self.storage.store(model, salt, [(hashes[p], pool[slot].tobytes())
                                             for p, slot in zip(reservation.positions, reservation.slots)])
        return {"stored_count": stored, "skipped_count": reservation.present, "failed_count": reservation.failed}

    def _op_lookup_prefetch(self, conn: _Conn, args: dict) -> dict:
        request_id, model, salt, hashes = args["request_id"], args["model_name"], args["cache_salt"], args["chunk_hashes"]
        jobs_of_request = self._session(request_id)
        self.publisher.emit(_MP_LOOKUP_PREFETCH_START, session_id=request_id)
        found = self.l1.lock_prefix(model, salt, hashes)
        job = _Job(self._next_job_id, request_id, model, salt, hashes, found, self._clock())
        self._next_job_id += 1
        self._jobs[job.job_id] = job
        jobs_of_request.add(job.job_id)
        if job.locked:
            self._active_jobs += 1
        if found < len(hashes) and self.prefetch.start(job.job_id, model, salt, hashes[found:], job):
            job.pending = True
        while len(self._jobs) > self._max_jobs:
            self._drop_job(next(iter(self._jobs.values())))
        return {"job_id": job.job_id}

    def _prefetch_finished(self, job: _Job, outcome: PrefetchOutcome) -> None:
        """An L2 prefetch finished: the job's hit grows by the chunks now locked for it (a job dropped or
        expired meanwhile gives them back; they stay in L1 as ordinary cached chunks)."""
        job.pending = False
        job.l2_landed = outcome.landed
        if not outcome.locked:
            return
        if self._jobs.get(job.job_id) is not job or job.expired:
            self.l1.release_read(job.model, job.salt, job.hashes[job.found : job.found + outcome.locked])
            return
        job.found += outcome.locked
        job.l1_hits += outcome.l1_hits
        job.l2_hits += outcome.l2_hits
        if not job.locked:
            job.locked = True
            self._active_jobs += 1

    def _op_query_prefetch_status(self, conn: _Conn, args: dict) -> dict:
        job = self._job(args["job_id"])
        tokens = self._chunk_tokens
        done = not job.pending
        if done and not job.reported and not job.expired:  # an expired job was abandoned: no END
            job.reported = True
            self.publisher.emit(
                _MP_LOOKUP_PREFETCH_END,
                (job.model, job.salt, job.found, len(job.hashes) * tokens, job.found * tokens,
                 job.l1_hits * tokens, job.l2_hits * tokens, ""),
                session_id=job.request_id,
            )
        return {"done": done, "found_count": job.found, "requested_count": len(job.hashes),
                "hit_tokens": job.found * tokens, "l1_hit_tokens": job.l1_hits * tokens,
                "l2_hit_tokens": job.l2_hits * tokens, "l2_loaded_count": job.l2_landed, "expired": job.expired}

    def _op_retrieve(self, conn: _Conn, args: dict) -> dict:
        block_ids, request_id, engine = args["block_ids"], args["request_id"], args["engine_id"]
        buffer = self._buffer(conn, args["buffer_id"], block_ids)
        job = self._job(args["job_id"])
        if job.request_id != request_id:
            raise RequestError(f"job_id: prefetch job {job.job_id} belongs to another request")
        if job.pending:
            raise RequestError(f"job_id: prefetch job {job.job_id} is still loading from L2; wait until "
                               "query_prefetch_status says done")
        if job.retrieved or job.found == 0:
            raise RequestError(f"job_id: prefetch job {job.job_id} found nothing or was already retrieved")
        wanted = len(block_ids)
        if wanted > job.found:
            raise RequestError(f"block_ids: {wanted} blocks, but prefetch job {job.job_id} found {job.found} chunks")
        model, salt = job.model, job.salt
        pub = self.publisher
        mover = self._begin_copy(buffer, request_id, _MP_RETRIEVE_SUBMITTED, _MP_RETRIEVE_START, engine, model)
        device = mover.device
        deadline = Deadline(args["timeout_s"], self._clock)
        l1 = self.l1
        try:
            reads = l1.read(model, salt, job.hashes[:wanted])
            nbytes = buffer.block_bytes
            for _, size in reads:
                if size != nbytes:
                    raise RequestError(f"chunks were stored from {size}-byte blocks; this buffer has {nbytes}-byte blocks")
            timing = mover.from_l1(l1.pool, [(block, slot) for (slot, _), block in zip(reads, block_ids)], nbytes,
                                   lambda: deadline.check("retrieve", session_id=request_id))
        except BaseException:
            pub.emit(_MP_RETRIEVE_END, (device, engine, model, salt, 0, 0, 0), session_id=request_id)
            raise  # the job keeps its locks: the client may retry or end the session
        if timing is not None:  # where the stream reached the copy's start
            pub.emit(_MP_RETRIEVE_START, (device, engine, model), session_id=request_id, timestamp_ns=timing.start_ns)
        retrieved = len(reads)
        locked = job.locked
        sampled = l1.finish_read(model, salt, job.hashes[:retrieved], unlock=locked)
        if locked:
            l1.release_read(model, salt, job.hashes[retrieved : job.found])
            job.locked = False
            self._active_jobs -= 1
        job.retrieved = True
        pub.emit(_MP_RETRIEVE_END,
                 (device, engine, model, salt, retrieved, retrieved * nbytes, retrieved * self._chunk_tokens),
                 session_id=request_id, timestamp_ns=None if timing is None else timing.end_ns)
        pub.emit(_SM_READ_PREFETCHED_FINISHED, (wanted - retrieved,),
                 salt_counts={(salt, model): retrieved} if retrieved else None, sampled=sampled)
        return {"retrieved_count": retrieved, "failed_count": wanted - retrieved}

    def _op_end_session(self, conn: _Conn, args: dict) -> dict:
        request_id = args["request_id"]
        blended = self.blend.end_session(request_id)  # CB_REQUEST_END if it did cb_* ops
        owned_blocks = self.l0.end_session(request_id)  # MP_VLLM_END_SESSION if it owns sampled L0 blocks
        job_ids = self._sessions.pop(request_id, None)
        if job_ids is None:
            return {"known": owned_blocks or blended}
        for job_id in job_ids:
            job = self._jobs.pop(job_id, None)
            if job is not None:
                self._release_locks(job)
        self.publisher.emit(_MP_REQUEST_END, session_id=request_id)
        return {"known": True}

    def _op_report_block_allocations(self, conn: _Conn, args: dict) -> dict:
        """A scheduler step's new L0 blocks → MP_VLLM_BLOCK_ALLOCATION (mpcache.cache.blocks)."""
        return self.l0.report(args["instance_id"], args["model_name"], args["records"])

    def _check_buffer_limits(self, conn: _Conn, num_blocks: int, block_bytes: int) -> None:
        """What every registered buffer, shared memory or CUDA, must respect."""
        if block_bytes > self._chunk_bytes:
            raise RequestError(f"block_bytes: {block_bytes} is larger than the chunk size {self._chunk_bytes}")
        if num_blocks * block_bytes > MAX_BUFFER_BYTES:
            raise RequestError(f"num_blocks × block_bytes is larger than {MAX_BUFFER_BYTES} bytes")
        if len(conn.buffers) >= MAX_BUFFERS_PER_CONNECTION:
            raise RequestError(f"at most {MAX_BUFFERS_PER_CONNECTION} buffers per connection")

    def _op_register_cuda_buffer(self, conn: _Conn, args: dict) -> dict:
        """A client's GPU KV buffer, shared through a CUDA IPC handle (mpcache.cache.transfer)."""
        num_blocks, block_bytes = args["num_blocks"], args["block_bytes"]
        self._check_buffer_limits(conn, num_blocks, block_bytes)
        buffer = transfer.open_cuda_buffer(args["ipc_handle"], args["device_index"], num_blocks, block_bytes,
                                           clock_ns=self._clock_ns)
        buffer_id = self._next_buffer_id
        self._next_buffer_id += 1
        conn.buffers[buffer_id] = buffer
        return {"buffer_id": buffer_id, "device": buffer.transfer.device}
