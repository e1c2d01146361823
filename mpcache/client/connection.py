"""The client's socket to one cache process: connecting, telling which listener answered, noticing that the
cache process closed it, and the errors a call raises when the connection fails.

A connection the cache process closed while it was idle (``--idle-timeout``) is connected again at the next
call, before anything of it is sent: when the same process answers (the same listening socket:
:func:`listener_identity`), buffers are registered again (new ids, which calls already made with the old ones
are given) and the call goes ahead; ``CacheClient.generation`` stays (the process's ids are all still good).
A different process is a restart (:class:`CacheConnectionLost`).
"""

from __future__ import annotations

import os
import socket
import struct

from mpcache.errors import RequestError


class CacheTimeoutError(RequestError, TimeoutError):
    """The server gave up on an operation at its deadline (it published TIMEOUT_RAISED)."""


class CacheConnectionLost(ConnectionError):
    """The connection broke while ``op`` was in flight; the operation was not retried.

    ``reconnected``: the client is connected again, its buffers registered anew (each has a new
    ``buffer_id``)."""

    def __init__(self, message: str, op: str, reconnected: bool) -> None:
        super().__init__(message)
        self.op = op
        self.reconnected = reconnected


RECONNECT_FIRST_PAUSE_S = 0.05
RECONNECT_MAX_PAUSE_S = 1.0


_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid


def listener_identity(sock: socket.socket, path: str) -> tuple[int, ...] | None:
    """Which listening socket a connection reached: the serving process's pid and the socket file's device,
    inode and change time.  A restarted cache process binds a new socket file; its pid alone would not say
    so (0 seen from another PID namespace, unchanged for a cache process restarted in-process); None if the
    file cannot be read."""
    pid = _PEERCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))[0]
    try:
        info = os.stat(path)
    except OSError:
        return None
    return pid, info.st_dev, info.st_ino, info.st_ctime_ns


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed this connection while no call was in flight (it has nothing to say
    unasked, so any pending byte means it is still open)."""
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:  # reset
        return True


def connect(path: str, timeout_s: float) -> socket.socket:
    """A blocking connection to the Unix socket ``path``, made within ``timeout_s``."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout_s)
        sock.connect(path)
        sock.settimeout(None)
    except BaseException:
        sock.close()
        raise
    return sock
