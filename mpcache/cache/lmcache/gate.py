"""Peer identity for the LMCache front end, decided once per connection in ZeroMQ's ZAP handshake step.

ZeroMQ hands its authentication handler (ZAP) no message before the handler answers, but tells it only
the peer's IP for TCP, not its port: the handler cannot tell *which* loopback connection it is asked
about.  So a TCP connection is accepted only when every established loopback connection to the port
that was not accepted before belongs to one allowed uid (read from the kernel's socket table): the
connection being asked about is one of them, whichever it is.  A foreign uid among them refuses the
handshake — possibly an allowed client's, which ZeroMQ then reconnects: a concurrent foreign connect
costs an allowed client a retry, never the reverse — and its connection is shut down so that it cannot
keep blocking others.  IPC peers are named by the kernel (SO_PEERCRED) in the address ZeroMQ passes.
See docs/ARCHITECTURE.md, "Who may talk to a cache process".
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

from mpcache.cache.lmcache import sockets

REMOTE = -1  # the owner of a non-local peer's requests (only with --lmcache-allow-remote)
REFUSAL_LOG_INTERVAL_S = 60.0


class PeerGate:
    """Decides ZAP requests for one front end: ``decide(address)`` → the owner uid, or None to refuse."""

    def __init__(self, allowed_uids: set[int], listen: tuple[str, int] | None, *, allow_remote: bool, log: Any,
                 on_refused: Callable[[], None], clock: Callable[[], float] = time.monotonic,
                 table: Callable[[], list[sockets.TcpEnd]] = sockets.established) -> None:
        self.allowed = frozenset(allowed_uids)
        self._listen = None if listen is None else (sockets.parse_ip(listen[0]), listen[1])
        self._allow_remote = allow_remote
        self._log = log
        self._on_refused = on_refused
        self._clock = clock
        self._table = table
        self._accepted: set[int] = set()  # client-end inodes of connections accepted before
        self._logged_at: dict[int, float] = {}
        self._suppressed: dict[int, int] = {}

    def decide(self, address: str) -> int | None:
        """The uid a new connection's requests belong to, or None (refused)."""
        if address.startswith("localhost:"):  # ipc://: "localhost:uid:gid:pid" from SO_PEERCRED
            uid = int(address.split(":")[1])
            if uid in self.allowed:
                return uid
            self._refused(uid, "ipc")
            return None
        return self._decide_tcp(address)

    def _decide_tcp(self, address: str) -> int | None:
        assert self._listen is not None
        if self._allow_remote and not _is_loopback(address):
            return REMOTE  # the operator accepted the network (--lmcache-allow-remote)
        listen_ip, port = self._listen
        ends = self._table()
        clients = [end for end in ends if end.remote[1] == port and not self._is_server_end(end)
                   and (listen_ip.is_unspecified or end.remote[0] == listen_ip)]
        self._accepted.intersection_update(end.inode for end in clients)
        waiting = sorted((end for end in clients if end.inode not in self._accepted), key=lambda end: end.inode)
        foreign = [end for end in waiting if end.uid not in self.allowed]
        if foreign:
            own = sockets.own_socket_inodes()
            servers = {end.remote: end.inode for end in ends if self._is_server_end(end) and end.inode in own}
            for end in foreign:
                inode = servers.get(end.local)
                if inode is not None:
                    sockets.shutdown_fd(own[inode])
                self._refused(end.uid, "tcp")
            return None
        if not waiting:
            return None  # gone before its handshake finished
        uids = {end.uid for end in waiting}
        if len(uids) > 1:  # two allowed uids at once: which one is asking is unknown; one retries
            return None
        self._accepted.add(waiting[0].inode)
        return waiting[0].uid

    def _is_server_end(self, end: sockets.TcpEnd) -> bool:
        """An accepted connection's end on the listener's address (a wildcard listener holds the port on
        every address, so no client end can have it there)."""
        assert self._listen is not None
        listen_ip, port = self._listen
        return end.local[1] == port and (listen_ip.is_unspecified or end.local[0] == listen_ip)

    def _refused(self, uid: int, transport: str) -> None:
        """Count every refusal; log one line per uid per minute, with how many were not logged."""
        self._on_refused()
        now = self._clock()
        last = self._logged_at.get(uid)
        if last is not None and now - last < REFUSAL_LOG_INTERVAL_S:
            self._suppressed[uid] = self._suppressed.get(uid, 0) + 1
            return
        if len(self._logged_at) >= 4096:
            self._logged_at.clear()
        self._logged_at[uid] = now
        self._log.warning("lmcache.peer_refused", uid=uid, transport=transport,
                          suppressed=self._suppressed.pop(uid, 0),
                          allowed_uids=sorted(self.allowed),
                          fix="run the engine as an allowed user, or start the cache with --lmcache-allow-uid UID")


def _is_loopback(address: str) -> bool:
    try:
        return sockets.parse_ip(address).is_loopback
    except ValueError:
        return False


def default_allowed(extra: list[int]) -> set[int]:
    return {os.geteuid(), *extra}
