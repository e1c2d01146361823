"""ZeroMQ's two side channels of the LMCache front end's ROUTER: the ZAP handler, which must answer a
connection's handshake before ZeroMQ delivers any of its messages, and the socket monitor, whose
``ACCEPTED`` events name each connection's descriptor.  Both feed the :class:`~.gate.PeerGate`; answers
it cannot give yet are held (the handler is a ROUTER, so an answer can wait) and asked again each pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import zmq
from zmq.utils.monitor import recv_monitor_message

from mpcache.cache.lmcache.gate import HOLD, REMOTE, PeerGate, descriptor_addresses

HANDSHAKE_TIMEOUT_MS = 5000  # a connection that does not finish its ZMTP handshake is dropped
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_DOMAIN = b"mpcache"
_POLLIN = int(zmq.POLLIN)


class Handshakes:
    """The ZAP handler and the monitor of ``router`` (call before it binds: no handshake goes unchecked)."""

    def __init__(self, context: zmq.Context, router: zmq.Socket, gate: PeerGate,
                 report: Callable[[str], None]) -> None:
        self._gate = gate
        self._report = report
        self._router = router
        self._zap = context.socket(zmq.ROUTER)
        self._zap.setsockopt(zmq.LINGER, 0)
        self._zap.bind(ZAP_ENDPOINT)
        router.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
        router.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_TIMEOUT_MS)
        self._monitor = router.get_monitor_socket(zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED)
        self.fds = [int(self._zap.getsockopt(zmq.FD)), int(self._monitor.getsockopt(zmq.FD))]
        self._held: list[tuple[float, list[bytes]]] = []  # ZAP requests not answered yet, oldest first

    @property
    def waiting(self) -> bool:
        return bool(self._held)

    def close(self) -> None:
        self._router.disable_monitor()
        self._monitor.close(linger=0)
        self._zap.close(linger=0)

    def service(self) -> None:
        """Handle what the monitor and the ZAP handler hold, again while either still has some (answering
        on the ZAP socket can consume the edge of its edge-triggered descriptor)."""
        while True:
            self._pass()
            pending = int(self._zap.getsockopt(zmq.EVENTS)) | int(self._monitor.getsockopt(zmq.EVENTS))
            if self._held or not pending & _POLLIN:
                return

    def _pass(self) -> None:
        """Connections accepted and gone (the monitor), then ZAP requests, answered in order once decidable:
        ``[routing id, b"", version, request id, domain, address, routing id, mechanism, …]``."""
        monitor, gate = self._monitor, self._gate
        while int(monitor.getsockopt(zmq.EVENTS)) & _POLLIN:
            event = recv_monitor_message(monitor, zmq.NOBLOCK)
            fd = int(event["value"])
            if event["event"] == zmq.EVENT_ACCEPTED:
                addresses = descriptor_addresses(fd)
                if addresses is not None:
                    try:
                        gate.accepted(fd, *addresses)
                    except OSError as exc:  # the socket table could not be read: not admitted
                        gate.refuse_unchecked(fd)
                        self._report(f"peer check failed: {exc}")
            else:
                gate.disconnected(fd)
        zap = self._zap
        now = time.monotonic()
        while int(zap.getsockopt(zmq.EVENTS)) & _POLLIN:
            self._held.append((now, zap.recv_multipart(zmq.NOBLOCK)))
        horizon = now - HANDSHAKE_TIMEOUT_MS / 1000 - 1.0  # ZeroMQ has dropped those handshakes by now
        while self._held:
            received_at, request = self._held[0]
            if received_at < horizon:
                self._held.pop(0)
                continue
            owner: int | None = None
            if len(request) >= 8 and request[2] == b"1.0" and request[4] == ZAP_DOMAIN and request[7] == b"NULL":
                try:
                    owner = gate.decide(request[5].decode("ascii", "replace"))
                except ValueError as exc:  # an ipc:// address not in libzmq's form
                    self._report(f"peer check failed: {exc}")
            if owner == HOLD:
                return
            self._held.pop(0)
            if len(request) < 4:
                continue  # not from libzmq: nothing to answer
            if owner is None:
                status, user = [b"400", b"peer not allowed"], b""
            else:
                status, user = [b"200", b"OK"], b"remote" if owner == REMOTE else str(owner).encode()
            zap.send_multipart([request[0], request[1], b"1.0", request[3], *status, user, b""])
