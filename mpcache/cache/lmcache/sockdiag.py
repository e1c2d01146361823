"""The owner of one TCP socket end, asked of the kernel by its address pair: one ``NETLINK_SOCK_DIAG`` request,
which the kernel answers from its connection hash, so the peer check costs the same however many sockets the
host has (reading ``/proc/net/tcp`` cost a pass over all of them, and a local user can make that long).

Where the kernel cannot answer (no ``inet_diag``: a kernel built without it, a sandbox that forbids netlink),
:class:`EndOwners` falls back to the socket table, saying so once in the log.
"""

from __future__ import annotations

import errno
import ipaddress
import itertools
import os
import socket
import struct
from typing import Any

from mpcache.cache.lmcache import sockets

NETLINK_SOCK_DIAG = 4
SOCK_DIAG_BY_FAMILY = 20
NLM_F_REQUEST = 1
NLMSG_ERROR = 2
_HEADER = struct.Struct("=IHHII")  # struct nlmsghdr: length, type, flags, sequence, port id
_REQUEST = struct.Struct("=BBBxI")  # inet_diag_req_v2 before its socket id: family, protocol, extensions, states
_PORTS = struct.Struct(">HH")  # the socket id's source and destination ports, network order
_TAIL = struct.Struct("=III")  # the socket id's interface and cookie (INET_DIAG_NOCOOKIE: any socket)
_NOCOOKIE = 0xFFFFFFFF
_ANSWER = struct.Struct("=II")  # inet_diag_msg's uid and inode, at offset 64 of the message
_ANSWER_OFFSET = _HEADER.size + 64
_ERROR = struct.Struct("=i")
_ALL_STATES = 0xFFFFFFFF
REPLY_BYTES = 4096

End = tuple[sockets.IPAddress, int]


def _packed(ip: sockets.IPAddress) -> bytes:
    return ip.packed.ljust(16, b"\0")


class SockDiag:
    """One netlink socket asking for one TCP end at a time (:meth:`owner`)."""

    def __init__(self) -> None:
        self._sock = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, NETLINK_SOCK_DIAG)
        self._sock.settimeout(1.0)  # the kernel answers while the request is sent; this only bounds a surprise
        self._sequence = itertools.count(1)

    def owner(self, local: End, remote: End) -> tuple[int, int] | None:
        """``(uid, inode)`` of the TCP socket whose own address is ``local`` and whose peer's is ``remote``
        (inode 0: no file any more, its owner not known), or None: no such socket.  OSError when the kernel
        cannot be asked."""
        if local[0].version != remote[0].version:
            return None
        family = socket.AF_INET if local[0].version == 4 else socket.AF_INET6
        sequence = next(self._sequence) & 0xFFFFFFFF
        body = (_REQUEST.pack(family, socket.IPPROTO_TCP, 0, _ALL_STATES) + _PORTS.pack(local[1], remote[1])
                + _packed(local[0]) + _packed(remote[0]) + _TAIL.pack(0, _NOCOOKIE, _NOCOOKIE))
        self._sock.send(_HEADER.pack(_HEADER.size + len(body), SOCK_DIAG_BY_FAMILY, NLM_F_REQUEST, sequence, 0)
                        + body)
        while True:
            reply = self._sock.recv(REPLY_BYTES)
            if len(reply) < _HEADER.size + _ERROR.size:
                raise OSError(f"sock_diag: a reply of {len(reply)} bytes")
            _length, kind, _flags, answered, _port = _HEADER.unpack_from(reply)
            if answered != sequence:
                continue  # a reply to a request that gave up waiting
            if kind == NLMSG_ERROR:
                error = -_ERROR.unpack_from(reply, _HEADER.size)[0]
                if error == 0:
                    continue  # an acknowledgement, not an answer
                if error == errno.ENOENT:
                    return None
                raise OSError(error, f"sock_diag: {os.strerror(error)}")
            if kind != SOCK_DIAG_BY_FAMILY or len(reply) < _ANSWER_OFFSET + _ANSWER.size:
                raise OSError(f"sock_diag: an unexpected reply (type {kind}, {len(reply)} bytes)")
            uid, inode = _ANSWER.unpack_from(reply, _ANSWER_OFFSET)
            return uid, inode

    def close(self) -> None:
        self._sock.close()


class EndOwners:
    """Who owns the other end of an accepted TCP connection (:meth:`peer_end`): asked of the kernel with
    :class:`SockDiag`, or, where the kernel cannot be asked, read from the socket table (its cost grows with
    the table).  Before the first question it checks that the kernel answers for a socket certain to exist:
    a listening socket of this process's own."""

    def __init__(self, log: Any = None) -> None:
        self._log = log
        self._diag: SockDiag | None = None
        self._checked = False

    def _kernel(self) -> SockDiag | None:
        if self._checked:
            return self._diag
        self._checked = True
        reason = None
        probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            probe.bind(("127.0.0.1", 0))
            probe.listen(1)
            self._diag = SockDiag()
            found = self._diag.owner(end(probe.getsockname()), (ipaddress.IPv4Address(0), 0))
            if found != (os.geteuid(), os.fstat(probe.fileno()).st_ino):
                reason = f"asked for a listening socket of this process's, the kernel answered {found}"
        except OSError as exc:
            reason = exc.strerror or str(exc)
        finally:
            probe.close()
        if reason is not None:
            if self._diag is not None:
                self._diag.close()
                self._diag = None
            if self._log is not None:
                self._log.warning("lmcache.peer_check_slow", reason=f"sock_diag: {reason}",
                                  fix="load the kernel's inet_diag and tcp_diag modules; meanwhile each TCP peer "
                                      "is looked up in /proc/net/tcp, whose cost grows with the host's sockets")
        return self._diag

    def peer_end(self, local: End, peer: End) -> tuple[int, int] | None:
        """``(uid, inode)`` of the socket at ``peer`` connected to ``local`` (this process's accepted end), or
        None when there is none."""
        diag = self._kernel()
        if diag is not None:
            return diag.owner(peer, local)
        for end in sockets.ends(local[1]):
            if end.local == peer and end.remote == local:
                return end.uid, end.inode
        return None

    def close(self) -> None:
        if self._diag is not None:
            self._diag.close()
            self._diag = None


def end(address: tuple[Any, ...]) -> End:
    """An address as a socket reports it (``("::ffff:127.0.0.1", port, …)``) as an end: IPv4-mapped unmapped."""
    return sockets.parse_ip(address[0]), address[1]

