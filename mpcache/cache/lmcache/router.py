"""The LMCache front end's ZeroMQ ROUTER endpoint, served from the cache process's selectors loop.

It listens on ``tcp://`` and ``ipc://`` urls, admits each connection through the :class:`~.gate.PeerGate`
before sending it a byte, speaks ZMTP with it (:mod:`.zmtp`), and hands over whole messages as libzmq's
ROUTER would — the connection's routing id first — with the uid they belong to.  Replies go back by
routing id.  Bounded: at most ``MAX_CONNECTIONS``; a handshake finishes within ``HANDSHAKE_TIMEOUT_S``;
a connection's input is not read past one frame cap ahead of the front end (TCP then holds the client
back); replies a client does not read are held up to ``MAX_UNSENT_BYTES`` (or what it may send), then it is
dropped.  A connection that breaks the protocol or a bound is closed with one error line naming why.
"""

from __future__ import annotations

import collections
import os
import secrets
import selectors
import socket
import struct
import time
from collections.abc import Callable

from mpcache.cache.lmcache import listeners, zmtp
from mpcache.cache.lmcache.gate import PeerGate

MAX_CONNECTIONS = 1024
HANDSHAKE_TIMEOUT_S = 5.0  # a connection that has not finished its ZMTP handshake by then is dropped
MAX_UNSENT_BYTES = 16 << 20
RECV_BYTES = 256 << 10  # read at most this much per wake-up, into one buffer the router reuses
ACCEPTS_PER_WAKE = 64  # per loop pass, after the open connections' messages (:meth:`Router.accept_waiting`)
COMMANDS_PER_CALL = 256  # commands (PING) one receive() answers; a buffer full of them waits for the next calls
ACCEPT_PAUSE_S = 1.0  # after accept() fails for want of descriptors, before the listener is watched again
_READ, _WRITE = selectors.EVENT_READ, selectors.EVENT_WRITE
_RESET = struct.pack("ii", 1, 0)  # SO_LINGER on, 0 s: close() resets the connection


class Gone(Exception):
    """The connection a reply was for has closed."""


class _Connection:
    __slots__ = ("sock", "fd", "routing_id", "owner", "reader", "unsent", "deadline", "greeted", "events",
                 "queued", "closed", "read_ahead", "ended")

    def __init__(self, sock: socket.socket, routing_id: bytes, owner: int, reader: zmtp.FrameReader,
                 deadline: float, read_ahead: int) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.routing_id = routing_id
        self.owner = owner
        self.reader = reader
        self.unsent = bytearray()
        self.deadline = deadline  # of the handshake; 0 once it is done
        self.greeted = False
        self.events = 0  # what the selector watches it for
        self.queued = False  # in the ready queue
        self.closed = False
        self.read_ahead = read_ahead
        self.ended = False  # the peer closed it: what it sent before is still handed over, then it is closed


class Router:
    """Binds ``urls``; :meth:`receive` the next message, :meth:`send` a reply.  ``report(message, routing id)``
    names each dropped connection."""

    def __init__(self, urls: list[str], selector: selectors.BaseSelector, gate: PeerGate, *, max_frame: int,
                 max_frames: int, report: Callable[[str, bytes | None], None]) -> None:
        self._selector = selector
        self._gate = gate
        self._max_frame = max_frame
        self._max_frames = max_frames
        self._report = report
        self._listeners: list[socket.socket] = []
        self._ipc_paths: list[str] = []
        self._paused: list[tuple[float, socket.socket]] = []  # listeners not watched until then
        self._waiting: list[socket.socket] = []  # listeners with connections to accept, after this pass's messages
        self._open: dict[bytes, _Connection] = {}  # routing id → a connection past its handshake
        self._handshaking: dict[bytes, _Connection] = {}
        self._ready: collections.deque[_Connection] = collections.deque()  # may hold a whole message
        self._next_id = secrets.randbits(32)
        # recv_into this, not recv(RECV_BYTES): a fresh 256 KiB bytes per read is an mmap, two page faults
        # and a munmap each time (glibc maps allocations that large), ~17 µs per message here
        self._recv_view = memoryview(bytearray(RECV_BYTES))
        try:
            for url in urls:
                self._listen(url)
        except BaseException:
            self.close()
            raise

    def _listen(self, url: str) -> None:
        listener, ipc_path = listeners.listen(url)
        if ipc_path is not None:
            self._ipc_paths.append(ipc_path)
        self._listeners.append(listener)
        self._watch_listener(listener)

    def widen(self, routing_id: bytes, max_frame: int) -> None:
        """Let an open connection send (and leave unread) frames of up to ``max_frame`` bytes: KV objects inline."""
        connection = self._open.get(routing_id)
        if connection is not None and max_frame + RECV_BYTES > connection.read_ahead:
            connection.reader.widen(max_frame)
            connection.read_ahead = max_frame + RECV_BYTES
            self._watch(connection)

    def _watch_listener(self, listener: socket.socket) -> None:
        self._selector.register(listener, _READ, lambda mask: self._waiting.append(listener))

    def close(self) -> None:
        for connection in [*self._open.values(), *self._handshaking.values()]:
            self._close(connection, None)
        for listener in self._listeners:
            try:
                self._selector.unregister(listener)
            except (KeyError, ValueError):
                pass
            listener.close()
        self._listeners.clear()
        for path in self._ipc_paths:
            try:
                os.unlink(path)
            except OSError:
                pass
        self._ipc_paths.clear()

    # -- messages --------------------------------------------------------------------------------

    def receive(self) -> tuple[list[bytes], int] | None:
        """The next whole message, its connection's routing id first, and the uid it belongs to; None when
        no connection holds one (connections take turns, a message each), or after ``COMMANDS_PER_CALL``
        commands (then :attr:`backlogged`)."""
        ready = self._ready
        commands = 0
        while ready:
            connection = ready.popleft()
            if connection.closed:
                continue
            try:
                item = connection.reader.next()
                while isinstance(item, bytes):
                    self._command(connection, item)
                    commands += 1
                    if commands >= COMMANDS_PER_CALL:
                        ready.appendleft(connection)  # its turn goes on at the next call
                        return None
                    item = connection.reader.next()
            except zmtp.ZmtpError as exc:
                self._close(connection, str(exc))
                continue
            if item is None:
                if connection.ended:
                    self._close(connection, None)
                    continue
                connection.queued = False
                self._watch(connection)  # it may have stopped being read while its input waited
                continue
            ready.append(connection)
            item.insert(0, connection.routing_id)
            return item, connection.owner
        return None

    @property
    def backlogged(self) -> bool:
        """Whether the last :meth:`receive` stopped with input left to read (commands it had no time for)."""
        return bool(self._ready)

    def send(self, frames: list[bytes]) -> None:
        """Send ``frames[1:]`` to the connection named by ``frames[0]`` (:class:`Gone` when it has closed)."""
        connection = self._open.get(frames[0])
        if connection is None or connection.ended:
            raise Gone
        self._write(connection, zmtp.encode(frames[1:]))
        if connection.closed:
            raise Gone

    def _command(self, connection: _Connection, body: bytes) -> None:
        name, data = zmtp.split_command(body)
        if name == b"PING":  # ZMTP 3.1 heartbeats (this side says 3.0, so libzmq sends none)
            self._write(connection, zmtp.command(b"PONG", data[2:]))
        elif name == b"ERROR":
            raise zmtp.ZmtpError(f"the peer reported an error: {data[1:].decode('ascii', 'replace')}")

    # -- connections ------------------------------------------------------------------------------

    def accept_waiting(self) -> None:
        """Accept up to ``ACCEPTS_PER_WAKE`` connections on each listener that had some this loop pass: called
        once the open connections' messages are answered, so a flood of new connections (a foreign user's,
        refused) delays the engines already connected by one bounded batch a pass at most."""
        waiting, self._waiting = self._waiting, []
        for listener in dict.fromkeys(waiting):
            if listener.fileno() >= 0 and not any(paused is listener for _, paused in self._paused):
                self._accept(listener)

    def _accept(self, listener: socket.socket) -> None:
        accepted: list[socket.socket] = []
        for _ in range(ACCEPTS_PER_WAKE):
            try:
                sock, _address = listener.accept()
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:  # out of descriptors, most likely: stop watching it for a while
                self._selector.unregister(listener)
                self._paused.append((time.monotonic() + ACCEPT_PAUSE_S, listener))
                self._report(f"accept failed: {exc.strerror}; listening again in {ACCEPT_PAUSE_S:g} s", None)
                break
            accepted.append(sock)
        if accepted:  # judged together: one reading of the socket table
            for sock, owner in zip(accepted, self._gate.owners(accepted), strict=True):
                self._admit(sock, owner)

    def _admit(self, sock: socket.socket, owner: int | None) -> None:
        if owner is None:  # refused, or closed by its peer unidentified, before a byte was sent (the gate counted it)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _RESET)  # a reset: nothing of it is kept
            sock.close()
            return
        if len(self._open) + len(self._handshaking) >= MAX_CONNECTIONS:
            sock.close()
            self._report(f"connection refused: {MAX_CONNECTIONS} connections are open", None)
            return
        sock.setblocking(False)
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._next_id = (self._next_id + 1) & 0xFFFFFFFF
        routing_id = b"\x00" + self._next_id.to_bytes(4, "big")  # libzmq's form of a generated routing id
        connection = _Connection(sock, routing_id, owner, zmtp.FrameReader(self._max_frame, self._max_frames),
                                 time.monotonic() + HANDSHAKE_TIMEOUT_S, self._max_frame + RECV_BYTES)
        self._handshaking[routing_id] = connection
        self._watch(connection)
        self._write(connection, zmtp.GREETING + zmtp.READY)

    def _on_event(self, connection: _Connection, mask: int) -> None:
        if mask & _WRITE:
            self._flush(connection)
        if mask & _READ and not connection.closed:
            self._read(connection)

    def _read(self, connection: _Connection) -> None:
        try:
            received = connection.sock.recv_into(self._recv_view)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:  # a reset, mostly: the peer closed with our replies unread
            self._peer_closed(connection, f"receive failed: {exc.strerror}")
            return
        if not received:
            self._peer_closed(connection, None)
            return
        connection.reader.buffer += self._recv_view[:received]
        if connection.deadline:
            try:
                self._handshake(connection)
            except zmtp.ZmtpError as exc:
                self._close(connection, f"handshake: {exc}")
            return
        if not connection.queued:
            connection.queued = True
            self._ready.append(connection)
        if len(connection.reader.buffer) > connection.read_ahead:
            self._watch(connection)  # held back until the front end has read what is there

    def _peer_closed(self, connection: _Connection, reason: str | None) -> None:
        """The peer closed (or reset) its end: messages that may wait in its input are handed over first, as
        libzmq does (a worker's last requests before it exits), and their replies go nowhere."""
        if connection.queued:
            connection.ended = True
            self._watch(connection)
        else:
            self._close(connection, reason)

    def _handshake(self, connection: _Connection) -> None:
        """The peer's greeting, then its READY; then the connection is open."""
        buffer = connection.reader.buffer
        if not connection.greeted:
            if buffer[0] != 0xFF:
                raise zmtp.ZmtpError("not a ZMTP 3 greeting")
            if len(buffer) < zmtp.GREETING_BYTES:
                return
            zmtp.check_greeting(bytes(buffer[:zmtp.GREETING_BYTES]))
            del buffer[:zmtp.GREETING_BYTES]
            connection.greeted = True
        item = connection.reader.next()
        if item is None:
            return
        if type(item) is not bytes:
            raise zmtp.ZmtpError("a message before the handshake's READY")
        name, data = zmtp.split_command(item)
        if name == b"ERROR":
            raise zmtp.ZmtpError(f"the peer refused it: {data[1:].decode('ascii', 'replace')}")
        if name != b"READY":
            raise zmtp.ZmtpError(f"expected READY, got {name.decode('ascii', 'replace')!r}")
        zmtp.peer_socket_type(data)
        connection.deadline = 0.0
        del self._handshaking[connection.routing_id]
        self._open[connection.routing_id] = connection
        if buffer:
            connection.queued = True
            self._ready.append(connection)

    def _write(self, connection: _Connection, data: bytes) -> None:
        if connection.closed or connection.ended:
            return
        if connection.unsent:
            connection.unsent += data
        else:
            try:
                sent = connection.sock.send(data)
            except (BlockingIOError, InterruptedError):
                sent = 0
            except OSError as exc:
                self._close(connection, f"send failed: {exc.strerror}")
                return
            if sent == len(data):
                return
            connection.unsent += data[sent:]
        most = max(MAX_UNSENT_BYTES, connection.read_ahead)  # as much as it may send, where that is more
        if len(connection.unsent) > most:
            self._close(connection, f"over {most >> 20} MiB of replies unread")
            return
        self._watch(connection)

    def _flush(self, connection: _Connection) -> None:
        try:
            sent = connection.sock.send(connection.unsent)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self._close(connection, f"send failed: {exc.strerror}")
            return
        del connection.unsent[:sent]
        if not connection.unsent:
            self._watch(connection)

    def _watch(self, connection: _Connection) -> None:
        """Watch for what the connection needs: input, unless a frame cap of it waits to be read; output room
        while replies wait."""
        if connection.closed:
            return
        if connection.ended:
            events = 0
        else:
            events = (_READ if len(connection.reader.buffer) <= connection.read_ahead else 0) | (
                _WRITE if connection.unsent else 0)
        if events == connection.events:
            return
        if not connection.events:
            self._selector.register(connection.sock, events, lambda mask: self._on_event(connection, mask))
        elif not events:
            self._selector.unregister(connection.sock)
        else:
            self._selector.modify(connection.sock, events, lambda mask: self._on_event(connection, mask))
        connection.events = events

    def _close(self, connection: _Connection, reason: str | None) -> None:
        if connection.closed:
            return
        connection.closed = True
        if connection.events:
            self._selector.unregister(connection.sock)
            connection.events = 0
        connection.sock.close()
        self._open.pop(connection.routing_id, None)
        self._handshaking.pop(connection.routing_id, None)
        if reason is not None:
            self._report(f"connection dropped: {reason}", connection.routing_id)

    # -- timers ------------------------------------------------------------------------------------

    def next_deadline(self) -> float | None:
        """When :meth:`expire` has work: a handshake's deadline, a paused listener's resumption."""
        if not self._handshaking and not self._paused:
            return None
        return min([c.deadline for c in self._handshaking.values()] + [at for at, _ in self._paused])

    def expire(self) -> None:
        """Drop connections past their handshake's deadline; watch paused listeners again."""
        if not self._handshaking and not self._paused:
            return
        now = time.monotonic()
        for connection in [c for c in self._handshaking.values() if c.deadline <= now]:
            self._close(connection, f"handshake not finished within {HANDSHAKE_TIMEOUT_S:g} s")
        for entry in [entry for entry in self._paused if entry[0] <= now]:
            self._paused.remove(entry)
            self._watch_listener(entry[1])

