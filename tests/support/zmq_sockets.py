"""ZeroMQ sockets for tests, each bounded: a send or receive that waits longer than its timeout raises
``zmq.Again`` and closing never lingers, so a peer that is gone fails a test instead of hanging it.  (A libzmq
DEALER whose handshake failed drops its pipe and never reconnects: a send without ``SNDTIMEO`` then waits
forever for a peer that never comes.)"""

from __future__ import annotations

import zmq

TIMEOUT_MS = 5000


def bounded(socket: zmq.Socket, timeout_ms: int = TIMEOUT_MS) -> zmq.Socket:
    """``socket`` with send and receive timeouts of ``timeout_ms`` and no linger at close."""
    socket.setsockopt(zmq.SNDTIMEO, timeout_ms)
    socket.setsockopt(zmq.RCVTIMEO, timeout_ms)
    socket.setsockopt(zmq.LINGER, 0)
    return socket


def dealer(context: zmq.Context | None = None, timeout_ms: int = TIMEOUT_MS) -> zmq.Socket:
    """A bounded DEALER of ``context`` (default: the process's shared one)."""
    return bounded((context or zmq.Context.instance()).socket(zmq.DEALER), timeout_ms)
