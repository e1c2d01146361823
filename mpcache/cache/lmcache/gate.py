"""Peer identity for the LMCache front end, decided once per connection before ZeroMQ delivers any message.

ZeroMQ reports each accepted TCP connection's descriptor on a socket monitor, and asks an authentication
handler (ZAP) before delivering a connection's first message — but tells that handler only the peer's
IP, not its port, so the handler cannot tell *which* connection it is asked about.  So every accepted
connection is judged on its own (its peer's uid from the kernel's socket table); a foreign one is shut
down at once.  A handshake is answered only when every connection still waiting for its handshake
belongs to one allowed uid — the one asking is among them, whichever it is (an answer to a handshake
whose connection has gone meanwhile reaches nobody); while a foreign connection
is still closing, or two allowed uids wait at once (the younger ones are then shut down: ZeroMQ
reconnects them), the answer is held, never guessed.  A refused handshake is never sent to an allowed
client: ZeroMQ would not reconnect it.  IPC peers are named by the kernel (SO_PEERCRED) in the address
ZeroMQ passes.  See docs/ARCHITECTURE.md, "Who may talk to a cache process".
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mpcache.cache.lmcache import sockets

REMOTE = -1  # the owner of a non-local peer's requests (only with --lmcache-allow-remote)
HOLD = -2  # decide(): not yet; ask again after the next monitor event or pass
UNKNOWN_UID = -3  # a peer whose socket-table entry was gone before it could be read
REFUSAL_LOG_INTERVAL_S = 60.0


@dataclass(slots=True)
class _Waiting:
    uid: int
    accepted_at: float


class PeerGate:
    """Judges accepted connections (:meth:`accepted`, :meth:`disconnected`) and answers handshakes
    (:meth:`decide` → the owner uid, None to refuse, or HOLD)."""

    def __init__(self, allowed_uids: set[int], listen: tuple[str, int] | None, *, allow_remote: bool, log: Any,
                 on_refused: Callable[[], None], handshake_timeout_s: float,
                 clock: Callable[[], float] = time.monotonic,
                 table: Callable[[], list[sockets.TcpEnd]] = sockets.established,
                 shutdown: Callable[[int], None] = sockets.shutdown_fd,
                 answered: Callable[[int], bool] = sockets.past_greeting) -> None:
        self.allowed = frozenset(allowed_uids)
        self._listen = None if listen is None else (sockets.parse_ip(listen[0]), listen[1])
        self._allow_remote = allow_remote
        self._log = log
        self._on_refused = on_refused
        self._horizon_s = handshake_timeout_s + 1.0  # past it, a connection has finished its handshake or is gone
        self._clock = clock
        self._table = table
        self._shutdown = shutdown
        self._answered = answered
        self._waiting: dict[int, _Waiting] = {}  # descriptor → an accepted connection not yet answered
        self._closing: dict[int, float] = {}  # descriptor → when it was shut down (until ZeroMQ reports it gone)
        self._logged_at: dict[int, float] = {}
        self._suppressed: dict[int, int] = {}

    # -- the socket monitor's events ------------------------------------------------------------

    def accepted(self, fd: int, local: tuple[str, int], peer: tuple[str, int]) -> None:
        """A TCP connection ZeroMQ accepted on ``fd`` (its addresses read from the descriptor)."""
        assert self._listen is not None
        local_ip, peer_ip = sockets.parse_ip(local[0]), sockets.parse_ip(peer[0])
        listen_ip, port = self._listen
        if local[1] != port or not (listen_ip.is_unspecified or local_ip == listen_ip):
            return  # not one of ours (a descriptor reused since the event): never touch it
        uid = self._owner((peer_ip, peer[1]), (local_ip, local[1]))
        if uid in self.allowed or uid == REMOTE:
            self._waiting[fd] = _Waiting(uid, self._clock())
            return
        self._close(fd)
        self._refused(uid, "tcp")

    def refuse_unchecked(self, fd: int) -> None:
        """Shut out a connection whose peer could not be checked (fail closed)."""
        self._close(fd)
        self._on_refused()

    def disconnected(self, fd: int) -> None:
        self._waiting.pop(fd, None)
        self._closing.pop(fd, None)

    def _owner(self, peer: tuple[sockets.IPAddress, int], local: tuple[sockets.IPAddress, int]) -> int:
        for end in self._table():
            if end.local == peer and end.remote == local:
                return end.uid
        if self._allow_remote and not peer[0].is_loopback:
            return REMOTE  # no end in this host's table: another host (the operator accepted the network)
        return UNKNOWN_UID

    def _close(self, fd: int) -> None:
        self._waiting.pop(fd, None)
        self._closing[fd] = self._clock()
        self._shutdown(fd)

    # -- handshakes -----------------------------------------------------------------------------

    def decide(self, address: str) -> int | None:
        """The uid a handshaking connection's requests belong to, None (refused), or HOLD."""
        if address.startswith("localhost:"):  # ipc://: "localhost:uid:gid:pid" from SO_PEERCRED
            uid = int(address.split(":")[1])
            if uid in self.allowed:
                return uid
            self._refused(uid, "ipc")
            return None
        self._forget_old()
        if self._closing or not self._waiting:
            return HOLD
        waiting = sorted(self._waiting.items(), key=lambda item: item[1].accepted_at)
        first_uid = waiting[0][1].uid
        others = [fd for fd, entry in waiting if entry.uid != first_uid]
        if others:  # which of two uids is asking is unknown: the younger ones reconnect
            for fd in others:
                self._close(fd)
            return HOLD
        # The asker is one of them, so it is first_uid.  They stay listed until their handshake is answered
        # (seen on the socket), they close, or they pass the handshake timeout.
        return first_uid

    def _forget_old(self) -> None:
        """Connections whose handshake was answered (they sent more than a greeting), or that passed the
        handshake timeout, are not asking any more."""
        horizon = self._clock() - self._horizon_s
        for fd in [fd for fd, entry in self._waiting.items() if entry.accepted_at < horizon or self._answered(fd)]:
            del self._waiting[fd]
        for fd in [fd for fd, since in self._closing.items() if since < horizon]:
            del self._closing[fd]

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
                          suppressed=self._suppressed.pop(uid, 0), allowed_uids=sorted(self.allowed),
                          fix="run the engine as an allowed user, or start the cache with --lmcache-allow-uid UID")


def descriptor_addresses(fd: int) -> tuple[tuple[str, int], tuple[str, int]] | None:
    """(local, peer) address of the TCP socket on ``fd`` (owned by ZeroMQ: read through a duplicate), or
    None when it is not a TCP socket any more."""
    try:
        duplicate = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        if duplicate.family not in (socket.AF_INET, socket.AF_INET6):
            return None
        local, peer = duplicate.getsockname(), duplicate.getpeername()
        return (local[0], local[1]), (peer[0], peer[1])
    except OSError:  # not connected any more
        return None
    finally:
        duplicate.close()
