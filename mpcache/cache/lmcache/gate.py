"""Who may talk to the LMCache front end, decided once per connection as it is accepted, before a byte is
sent to it: the peer's uid from the kernel — ``SO_PEERCRED`` for ``ipc://``, the kernel's owner of the
peer's socket for ``tcp://`` (TCP never tells a server who its peer is; :mod:`.sockdiag` asks for that one
socket) — against the allowed uids.  A refused connection
is closed unanswered; every refusal is counted, and logged at most once a minute per uid.  A TCP peer
that closed its end before it could be identified (a health probe's connect-and-close: its closed end
has no owner any more) is closed too, but counted apart and not logged: it was never refused, and an
alert on refusals must not fire on a load balancer's probes.  See docs/SECURITY.md.
"""

from __future__ import annotations

import os
import socket
import struct
import time
from collections.abc import Callable
from typing import Any

from mpcache.cache.lmcache import sockdiag

REMOTE = -1  # the owner of a non-local peer's requests (only with --lmcache-allow-remote)
UNKNOWN_UID = -3  # a peer whose socket was gone, had no file any more, or could not be looked up
REFUSAL_LOG_INTERVAL_S = 60.0
_PEERCRED = struct.Struct("3i")  # struct ucred: pid, uid, gid
# Linux's TCP states (include/net/tcp_states.h), tcp_info's first byte: the peer sent its FIN (CLOSE_WAIT), or
# its RST (CLOSE); this end has not closed, so no other state means the peer is gone.
_TCP_CLOSE, _TCP_CLOSE_WAIT = 7, 8


def _closed_by_peer(connection: socket.socket) -> bool:
    """Whether the peer of an accepted TCP connection has closed (or reset) its end."""
    try:
        connection.getpeername()
        state = connection.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
    except OSError:  # ENOTCONN: reset and gone
        return True
    return state in (_TCP_CLOSE, _TCP_CLOSE_WAIT)


class PeerGate:
    """Judges each accepted connection (:meth:`owner`)."""

    def __init__(self, allowed_uids: set[int], *, allow_remote: bool, log: Any, on_refused: Callable[[], None],
                 on_unidentified: Callable[[], None] = lambda: None, clock: Callable[[], float] = time.monotonic,
                 ends: Callable[[sockdiag.End, sockdiag.End], tuple[int, int] | None] | None = None) -> None:
        self.allowed = frozenset(allowed_uids)
        self._allow_remote = allow_remote
        self._log = log
        self._on_refused = on_refused
        self._on_unidentified = on_unidentified
        self._clock = clock
        self._owners: sockdiag.EndOwners | None = None
        if ends is None:
            self._owners = sockdiag.EndOwners(log)
            ends = self._owners.peer_end
        self._ends = ends
        self._logged_at: dict[int, float] = {}
        self._suppressed: dict[int, int] = {}

    def owner(self, connection: socket.socket) -> int | None:
        """The uid the requests of a just-accepted connection belong to (``REMOTE``: another host's, with
        ``allow_remote``), or None: refused (counted and logged), or closed by its peer before it could be
        identified (counted apart)."""
        return self.owners([connection])[0]

    def owners(self, connections: list[socket.socket]) -> list[int | None]:
        """:meth:`owner` of each connection accepted together."""
        return [self._judge(connection) for connection in connections]

    def close(self) -> None:
        if self._owners is not None:
            self._owners.close()

    def _judge(self, connection: socket.socket) -> int | None:
        error = None
        if connection.family == socket.AF_UNIX:
            transport = "ipc"
            try:
                _pid, uid, _gid = _PEERCRED.unpack(
                    connection.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _PEERCRED.size))
            except OSError as exc:
                uid, error = UNKNOWN_UID, exc.strerror
        else:
            transport = "tcp"
            try:
                uid = self.tcp_owner(connection.getsockname(), connection.getpeername())
            except OSError as exc:  # the peer is gone already, or the kernel could not be asked
                uid, error = UNKNOWN_UID, exc.strerror
        if uid in self.allowed or (uid == REMOTE and transport == "tcp"):
            return uid
        if uid == UNKNOWN_UID and transport == "tcp" and _closed_by_peer(connection):
            self._on_unidentified()
        else:
            self._refused(uid, transport, error)
        return None

    def tcp_owner(self, local: tuple[Any, ...], peer: tuple[Any, ...]) -> int:
        """The uid owning the other end of the TCP connection from ``peer`` to ``local`` (addresses as the
        socket reports them; ``ends`` finds that end's owner and inode: :mod:`.sockdiag`'s by default),
        ``REMOTE``, or ``UNKNOWN_UID``.  The peer's socket is found in any state: one
        that half-closed or closed before it was judged is still a local peer, never another host's."""
        local_end, peer_end = sockdiag.end(local), sockdiag.end(peer)
        found = self._ends(local_end, peer_end)
        if found is not None:
            uid, inode = found
            return uid if inode else UNKNOWN_UID  # a closed end's owner is not known
        if self._allow_remote and not peer_end[0].is_loopback:
            return REMOTE  # no such socket on this host: another host (the operator accepted the network)
        return UNKNOWN_UID

    def _refused(self, uid: int, transport: str, error: str | None) -> None:
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
        extra = {} if error is None else {"error": error}
        self._log.warning("lmcache.peer_refused", uid=uid, transport=transport,
                          suppressed=self._suppressed.pop(uid, 0), allowed_uids=sorted(self.allowed),
                          fix=_fix(uid), **extra)


def _fix(uid: int) -> str:
    """What to do about a refused peer: an engine of another uid sees only that the server does not answer."""
    if uid < 0:
        return "run the engine on this host as an allowed user, or start the cache with --lmcache-allow-uid UID"
    return (f"run the engine as uid {os.geteuid()} (the cache's: it can then map the shared-memory pool), or start "
            f"the cache with --lmcache-allow-uid {uid}")
