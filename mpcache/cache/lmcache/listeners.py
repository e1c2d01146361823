"""The LMCache front end's listening sockets, from its ``tcp://`` and ``ipc://`` urls."""

from __future__ import annotations

import os
import socket
import stat

from mpcache.errors import ConfigError

# TCP_DEFER_ACCEPT: a connection is queued for accept() once its client has sent something (a ZMTP client sends
# its greeting at once), so a flood of connects that never speak, or reset at once, costs this process nothing
DEFER_ACCEPT_S = 10


def listen(url: str) -> tuple[socket.socket, str | None]:
    """A non-blocking socket listening on ``url`` and, for ``ipc://``, the path it made (ConfigError, one line,
    when it cannot).  The backlog is ``SOMAXCONN``: a connect flood fills a short queue, and an allowed
    client's SYN that finds it full waits a second to be sent again.  A TCP connection is accepted once its
    client has spoken (``DEFER_ACCEPT_S``)."""
    path = None
    try:
        if url.startswith("ipc://"):
            path = url[len("ipc://"):]
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            _remove_stale_socket(path)
            listener.bind(path)
            os.chmod(path, 0o600)  # in the 0700 runtime directory; the peer check decides who is served
        elif url.startswith("tcp://"):
            host, _, port = url[len("tcp://"):].rpartition(":")
            family, kind, proto, _, address = socket.getaddrinfo(
                host.strip("[]"), int(port), type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0]
            listener = socket.socket(family, kind, proto)
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.setsockopt(socket.IPPROTO_TCP, socket.TCP_DEFER_ACCEPT, DEFER_ACCEPT_S)
            listener.bind(address)
        else:
            raise ConfigError(f"{url}: only tcp:// and ipc:// are served")
        listener.listen(socket.SOMAXCONN)
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(f"--lmcache-port/--lmcache-ipc: cannot listen on {url}: {reason}") from None
    listener.setblocking(False)
    return listener, path


def _remove_stale_socket(path: str) -> None:
    """A socket file left at ``path`` by a cache process that did not close (our own runtime directory)."""
    try:
        if stat.S_ISSOCK(os.lstat(path).st_mode):
            os.unlink(path)
    except FileNotFoundError:
        pass
