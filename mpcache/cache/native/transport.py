"""The cache's own front end: a 0600 Unix socket (same uid only), length-prefixed msgpack frames and the
file descriptors sent with them (SCM_RIGHTS), one selectors loop, and back-pressure on clients that do not
read their replies.

Descriptors belong to the frame holding the last byte received with them: on a stream socket the kernel
hands them over with the first byte of the ``sendmsg`` that carried them and ends that read within its
bytes, so a client that sends each frame with descriptors in one ``sendmsg`` of its own gets them attached
to that frame.  Every descriptor received is closed once its frame is answered (the dispatcher does that),
or when its connection closes.
"""

from __future__ import annotations

import array
import errno
import os
import selectors
import socket
import stat
import struct
import time
from collections.abc import Callable
from typing import Any

from mpcache.cache.buffers import BufferBudget, Peer
from mpcache.contract import protocol
from mpcache.errors import ConfigError

RECV_BYTES = 256 * 1024  # read at most this much per wake-up, into one buffer the transport reuses
SOCKET_PATH_MAX = 107  # sun_path holds 108 bytes including the terminating NUL
OUTBUF_PAUSE_BYTES = 1 << 20  # stop reading a client's requests while this much of its replies is unsent
MAX_CONNECTIONS = 1024  # per cache process; more are accepted and closed at once
PARTIAL_FRAME_TIMEOUT_S = 10.0  # a frame begun and not finished within this is a stalled (or hostile) client
MAX_FDS_PER_FRAME = 4  # more file descriptors with one frame close the connection
_FD_BYTES = array.array("i").itemsize
_ANCILLARY_BYTES = socket.CMSG_SPACE(MAX_FDS_PER_FRAME * _FD_BYTES)
_PEERCRED = struct.Struct("3i")

Dispatch = Callable[[Peer, bytes, list[int]], dict]
ClientError = Callable[[str, str, str], None]


class _Connection:
    __slots__ = ("sock", "inbuf", "offset", "fds", "outbuf", "closing", "paused", "peer", "events",
                 "partial_since", "heard_at")

    def __init__(self, sock: socket.socket, peer: Peer, now: float) -> None:
        self.sock = sock
        self.inbuf = bytearray()
        self.offset = 0  # stream offset of inbuf[0], a frame's start
        self.fds: dict[int, list[int]] = {}  # descriptors received, by the stream offset of their frame
        self.outbuf = bytearray()
        self.closing = False
        self.paused = False  # requests held back until the client reads its replies
        self.peer = peer
        self.events = selectors.EVENT_READ
        self.partial_since = 0.0  # monotonic time the unfinished frame in inbuf began (0: none)
        self.heard_at = now  # monotonic time its client last sent anything (or connected)


class UnixTransport:
    """Listens on ``path`` and serves connections from the caller's selector.

    Every selector key it registers carries a callable ``data(mask)``; the loop calls it.
    """

    def __init__(self, path: str, selector: selectors.BaseSelector, dispatch: Dispatch, client_error: ClientError,
                 log: Any, stopping: Callable[[], bool], *, max_connections: int = MAX_CONNECTIONS,
                 partial_frame_timeout_s: float = PARTIAL_FRAME_TIMEOUT_S, idle_timeout_s: float = 0.0,
                 budget: BufferBudget | None = None) -> None:
        """``idle_timeout_s``: close a connection whose client sent nothing for this long and has no reply
        waiting to be read (0: never); ``budget``: what every connection's buffers may hold together."""
        self._budget = BufferBudget() if budget is None else budget
        self.path = path
        self._selector = selector
        self._dispatch = dispatch
        self._client_error = client_error
        self._log = log
        self._stopping = stopping
        self._connections: dict[int, _Connection] = {}
        self._max_connections = max_connections
        self._partial_frame_timeout_s = partial_frame_timeout_s
        self._idle_timeout_s = idle_timeout_s
        # recvmsg_into this, not recvmsg(RECV_BYTES): a fresh 256 KiB bytes per read is an mmap, two page
        # faults and a munmap each time (glibc maps allocations that large)
        self._recv_view = memoryview(bytearray(RECV_BYTES))
        self.shed = 0  # connections closed at accept: over the cap, or no file descriptor left
        self._listener = self._listen(path)
        self._socket_ino = os.lstat(path).st_ino
        self._spare_fd: int | None = os.open(os.devnull, os.O_RDONLY)  # given up to accept-and-close on EMFILE
        selector.register(self._listener, selectors.EVENT_READ, self._on_accept)

    @property
    def connections(self) -> int:
        return len(self._connections)

    @staticmethod
    def _listen(path: str) -> socket.socket:
        directory = os.path.dirname(path) or "."
        staging = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}")
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
        return listener

    def close(self) -> None:
        """Stop listening, hand over queued replies (briefly blocking), drop every connection."""
        try:
            self._selector.unregister(self._listener)
        except (KeyError, ValueError):
            pass
        self._listener.close()
        try:
            if os.lstat(self.path).st_ino == self._socket_ino:
                os.unlink(self.path)
        except OSError:
            pass
        for conn in list(self._connections.values()):
            if conn.outbuf:
                try:
                    conn.sock.settimeout(0.5)
                    conn.sock.sendall(conn.outbuf)
                except OSError:
                    pass
            self._close(conn)
        if self._spare_fd is not None:
            os.close(self._spare_fd)
            self._spare_fd = None

    def _on_accept(self, mask: int) -> None:
        try:
            sock, _ = self._listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            if exc.errno in (errno.EMFILE, errno.ENFILE):
                self._shed_without_descriptor(exc)
                return
            raise
        if len(self._connections) >= self._max_connections:
            sock.close()
            self._shed(f"at most {self._max_connections} connections per cache process")
            return
        try:
            _pid, uid, _gid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
        except OSError:
            sock.close()
            return
        if uid != os.geteuid():  # the 0600 socket already says so; defence in depth
            sock.close()
            return
        sock.setblocking(False)
        conn = _Connection(sock, Peer(self._budget), time.monotonic())
        self._connections[sock.fileno()] = conn
        self._selector.register(sock, selectors.EVENT_READ, lambda mask, conn=conn: self._on_ready(conn, mask))

    def _shed_without_descriptor(self, exc: OSError) -> None:
        """Out of file descriptors: the pending connection would keep the listener readable forever, so use
        the spare descriptor to accept it and close it at once."""
        if self._spare_fd is not None:
            os.close(self._spare_fd)
            self._spare_fd = None
            try:
                sock, _ = self._listener.accept()
                sock.close()
            except OSError:
                pass
            try:
                self._spare_fd = os.open(os.devnull, os.O_RDONLY)
            except OSError:
                pass
        self._shed(f"no file descriptor left ({exc.strerror})")

    def _shed(self, why: str) -> None:
        self.shed += 1
        self._client_error("accept", "resource", f"new connection closed: {why}")

    def expire(self, now: float) -> None:
        """Close connections whose unfinished frame has waited longer than the partial-frame timeout (one
        client error each), and those idle longer than the idle timeout (one line for all of them)."""
        horizon = now - self._partial_frame_timeout_s
        for conn in [c for c in self._connections.values() if 0 < c.partial_since <= horizon]:
            self._client_error("?", "protocol", f"a frame left unfinished for {self._partial_frame_timeout_s:g} s; "
                               "closing the connection")
            self._close(conn)
        if self._idle_timeout_s <= 0:
            return
        quiet_since = now - self._idle_timeout_s
        idle = [c for c in self._connections.values() if c.heard_at <= quiet_since and not c.outbuf]
        for conn in idle:
            self._close(conn)
        if idle:
            self._log.info("connections.idle_closed", count=len(idle), idle_timeout_s=self._idle_timeout_s)

    def _on_ready(self, conn: _Connection, mask: int) -> None:
        try:
            if mask & selectors.EVENT_WRITE:
                self._flush(conn)
            if mask & selectors.EVENT_READ and not conn.closing:
                self._on_readable(conn)
        except Exception:  # noqa: BLE001 - one broken connection must not stop the server
            self._log.exception("connection.failed")
            self._close(conn)

    def _on_readable(self, conn: _Connection) -> None:
        try:
            received, ancillary, flags, _ = conn.sock.recvmsg_into([self._recv_view], _ANCILLARY_BYTES,
                                                                  socket.MSG_CMSG_CLOEXEC)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._close(conn)
            return
        fds = _descriptors(ancillary)
        if not received:
            _close_all(fds)
            self._close(conn)
            return
        conn.heard_at = time.monotonic()
        conn.inbuf += self._recv_view[:received]
        if fds or flags & socket.MSG_CTRUNC:
            held = conn.fds.setdefault(conn.offset + _start_of_last_frame(conn.inbuf), [])
            held += fds
            if flags & socket.MSG_CTRUNC or len(held) > MAX_FDS_PER_FRAME:
                self._refuse_stream(conn, f"more than {MAX_FDS_PER_FRAME} file descriptors with one frame; closing")
                self._flush(conn)
                return
        self._process(conn)

    def _refuse_stream(self, conn: _Connection, message: str) -> None:
        """Answer ``message`` (id nil), drop what is unread and close the connection once it is sent."""
        self._client_error("?", "protocol", message)
        conn.outbuf += protocol.encode_frame(protocol.error_reply(None, "protocol", message))
        conn.closing = True
        conn.inbuf.clear()
        _close_held(conn)

    def _process(self, conn: _Connection) -> None:
        """Answer the complete frames received so far, pausing while replies pile up unread."""
        inbuf = conn.inbuf
        header = protocol.FRAME_HEADER
        while len(inbuf) >= header.size and len(conn.outbuf) < OUTBUF_PAUSE_BYTES and not self._stopping():
            (length,) = header.unpack_from(inbuf)
            if length > protocol.MAX_FRAME_BYTES:
                self._refuse_stream(conn, f"frame of {length} bytes exceeds the {protocol.MAX_FRAME_BYTES}-byte "
                                          "limit; closing")
                break
            end = header.size + length
            if len(inbuf) < end:
                break
            payload = bytes(inbuf[header.size:end])
            del inbuf[:end]
            fds = conn.fds.pop(conn.offset, []) if conn.fds else []
            conn.offset += end
            conn.outbuf += protocol.encode_frame(self._dispatch(conn.peer, payload, fds))
        conn.paused = len(conn.outbuf) >= OUTBUF_PAUSE_BYTES
        if not inbuf:
            conn.partial_since = 0.0
        elif not conn.partial_since:
            conn.partial_since = time.monotonic()
        self._flush(conn)

    def _flush(self, conn: _Connection) -> None:
        if conn.outbuf:
            try:
                sent = conn.sock.send(conn.outbuf)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError:
                self._close(conn)
                return
            del conn.outbuf[:sent]
            if conn.paused and len(conn.outbuf) < OUTBUF_PAUSE_BYTES and not conn.closing:
                conn.paused = False
                self._process(conn)  # the frames held back while replies piled up
                return
        if not conn.outbuf and conn.closing:
            self._close(conn)
            return
        reading = not conn.closing and not conn.paused
        wanted = (selectors.EVENT_WRITE if conn.outbuf else 0) | (selectors.EVENT_READ if reading else 0)
        if wanted != conn.events:
            conn.events = wanted
            self._selector.modify(conn.sock, wanted, lambda mask, conn=conn: self._on_ready(conn, mask))

    def _close(self, conn: _Connection) -> None:
        conn.closing = True
        if self._connections.pop(conn.sock.fileno(), None) is None:
            return
        try:
            self._selector.unregister(conn.sock)
        except (KeyError, ValueError):
            pass
        conn.sock.close()
        _close_held(conn)
        conn.peer.close()


def _descriptors(ancillary: list[tuple[int, int, bytes]]) -> list[int]:
    """The file descriptors in ``recvmsg``'s ancillary data."""
    fds = array.array("i")
    for level, kind, data in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % _FD_BYTES])
    return list(fds)


def _start_of_last_frame(inbuf: bytearray) -> int:
    """Where, in ``inbuf`` (which starts at a frame), the frame holding its last byte starts."""
    header = protocol.FRAME_HEADER
    start = 0
    while start + header.size <= len(inbuf):
        end = start + header.size + header.unpack_from(inbuf, start)[0]
        if end >= len(inbuf):
            break
        start = end
    return start


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        os.close(fd)


def _close_held(conn: _Connection) -> None:
    """Close the descriptors of frames this connection will never answer."""
    for fds in conn.fds.values():
        _close_all(fds)
    conn.fds.clear()
