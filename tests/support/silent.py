"""A TCP listener that accepts connections and never answers: a hung server (a Redis that stopped
responding), closed with everything it accepted when the ``with`` block ends."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def silent_listener(port: int = 0, accepted: list[socket.socket] | None = None) -> Iterator[int]:
    """The port (``port``, or a free one) of a loopback listener that accepts every connection and never sends a
    byte; each connection it accepted is appended to ``accepted`` where one is given."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(128)
    accepted = [] if accepted is None else accepted
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                continue

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(5)
        for connection in accepted:
            connection.close()
        listener.close()
